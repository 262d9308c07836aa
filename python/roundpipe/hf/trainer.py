"""Hugging Face ``Trainer`` and TRL ``SFTTrainer`` driving RoundPipe.

:class:`RoundPipeTrainer` (a ``transformers.Trainer``) and :class:`RoundPipeSFTTrainer` (a
``trl.SFTTrainer``, in :mod:`roundpipe.hf.sft`) share :class:`RoundPipeTrainerMixin`, which
plugs RoundPipe in as DeepSpeed plugs into Trainer:

- the model is wrapped with :func:`roundpipe.wrap_model_to_roundpipe` before ``Trainer.__init__``
  sees it (``roundpipe_kwargs`` are the wrapper's options, plus ``step_mode``);
- ``training_step`` runs ``forward_backward`` with HF's built-in whole-batch loss and the
  ``num_items_in_batch`` Trainer computed over the accumulation window (and across ranks), or
  with the trainer's own loss (a ``compute_loss`` override, ``compute_loss_func``) called per
  microbatch (:mod:`roundpipe.hf.trainer_loss`);
- the optimizer Trainer holds is :class:`StepProxy`: it shares the param groups and state of the
  real optimizer (built on ``optim_parameters()``; LR schedulers work unchanged) and its
  ``step()`` is ``model.step(real_optimizer, grad_scaler=..., max_grad_norm=...)`` (clipping and
  the fp16 overflow skip inside RoundPipe's step; the logged ``grad_norm`` is RoundPipe's global
  norm);
- accelerate never sees the model or the optimizer: no ``.to()``, autocast, DataParallel/DDP,
  ``torch.amp.GradScaler`` or optimizer-state placement; batches reach the pipeline on the host;
- evaluation computes ``eval_loss`` through the pipeline with the chunked loss (no
  ``batch x seq x vocab`` logits); checkpoints go through :func:`roundpipe.save_checkpoint`
  (full-precision weights, optimizer, grad scaler; scheduler, RNG and trainer state as
  Trainer writes them) and hold what plain Trainer's hold too (the model weights at the
  optimizer copies' precision, ``optimizer.pt`` in torch's format), ``save_model`` goes through
  ``save_pretrained``.

This module imports transformers (its ``Trainer``): ``import roundpipe`` does not import it.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Optional

import torch
from torch import nn

from transformers import Trainer

from ..checkpoint import load_checkpoint, save_checkpoint
from ..grad_scaler import GradScaler
from ..torch_private import init_hook_registries
from ..wrapper import RoundPipe
from . import trainer_loss
from .loss import TokenStats, count_items, token_stats

STEP_MODES = ("sync", "exact", "async")
STATE_DIR = "roundpipe_state"  # inside a Trainer checkpoint folder: roundpipe.save_checkpoint's
_SCHEDULER_NAME = "scheduler.pt"
_OPTIMIZER_NAME = "optimizer.pt"  # plain Trainer's (see _save_optimizer_and_scheduler)
_SHARDED_NOTE = ("RoundPipe: the optimizer state of this checkpoint is sharded over the ranks, "
                 "in roundpipe_state/ only; resume it with RoundPipeTrainer (any world size)")
_DISK_NOTE = ("RoundPipe: the optimizer state of this checkpoint lived on a disk "
              "(optimizer_dir) and is in roundpipe_state/ only, written without holding it in "
              "memory; resume it with RoundPipeTrainer")
_INPUT_KEYS = trainer_loss.MODEL_KEYS + ("labels",)
# what a padding-free collator (TRL's) adds for varlen kernels: the sequence boundaries that
# position_ids already give (transformers' mask functions, roundpipe.hf.packed read them there)
_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")

# TrainingArguments.optim values and the roundpipe.optim class they become
_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_torch_npu_fused",
          "adamw_torch_xla", "adamw_apex_fused")
_SUPPORTED_OPTIM = _ADAMW + ("adafactor", "sgd")

# (argument, reason): cannot combine with RoundPipe; refused before anything is built
_REFUSED = (
    ("deepspeed", "DeepSpeed is another engine for the same job; use one of them"),
    ("fsdp", "FSDP shards the model on the GPUs; RoundPipe keeps it on the host"),
    ("torch_compile", "RoundPipe's pipeline cannot be compiled as a whole; compile the decoder "
                      "layers before wrapping the model (see docs/training.md, torch.compile)"),
    ("use_liger_kernel", "Liger patches the model's forward and loss; RoundPipe computes the "
                         "loss in chunks itself (no full logits)"),
    ("fp16_full_eval", "the model copy keeps the dtype it was wrapped with; choose it with "
                       "fp16=/bf16= (or convert the model before the trainer)"),
    ("bf16_full_eval", "the model copy keeps the dtype it was wrapped with; choose it with "
                       "fp16=/bf16= (or convert the model before the trainer)"),
    ("neftune_noise_alpha", "NEFTune's embedding hook is not supported with RoundPipe"),
    ("label_smoothing_factor", "label smoothing needs the full logits; RoundPipe's loss is "
                               "HF's causal-LM cross-entropy computed in chunks"),
)


def _roundpipe_class(cls: type) -> str:
    """The name of the first of ``cls``'s classes defined by RoundPipe (RoundPipeTrainer,
    RoundPipeSFTTrainer), for messages: what the user constructed, or what it derives from."""
    return next((c.__name__ for c in cls.__mro__ if c.__module__.startswith("roundpipe.")
                 and not c.__name__.startswith("_")), cls.__name__)


def _set(value: Any) -> bool:
    """Whether a TrainingArguments field is switched on (not None/False/0/empty)."""
    return value not in (None, False, 0, 0.0, "", [], {}) and value != "no"


class StepProxy(torch.optim.Optimizer):
    """The optimizer Trainer holds: ``param_groups``, ``state`` and ``defaults`` are those of
    ``real`` (the optimizer over the RoundPipe's optimizer copies), so LR schedulers and
    ``optimizer.param_groups`` reads work unchanged; ``step()`` is RoundPipe's step (see
    :meth:`RoundPipeTrainerMixin._roundpipe_step`), never ``real.step()`` directly.

    Attributes:
        real: the optimizer over ``model.optim_parameters()``.
        step_was_skipped: whether the last step was skipped (fp16 overflow), what accelerate's
            ``optimizer_step_was_skipped`` reads.
    """

    def __init__(self, real: torch.optim.Optimizer, trainer: "RoundPipeTrainerMixin") -> None:
        # not Optimizer.__init__: the groups and the state are the real optimizer's own objects
        self.real = real
        self._trainer = trainer
        self.defaults = real.defaults
        self.param_groups = real.param_groups
        self.state = real.state
        init_hook_registries(self)

    def step(self, closure=None):
        """RoundPipe's step of the accumulated gradients (clipping and loss scale included)."""
        if closure is not None:
            raise TypeError("RoundPipeTrainer's optimizer takes no closure (the pipeline "
                            "computes the loss in training_step)")
        return self._trainer._roundpipe_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: RoundPipe's step clears the gradients it applied."""

    @property
    def step_was_skipped(self) -> bool:
        return self._trainer._step_was_skipped()

    def state_dict(self):
        return self.real.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """The real optimizer's ``load_state_dict``; torch's replaces its ``param_groups`` and
        ``state`` objects, which the proxy then shares again (an LR scheduler stepping the
        proxy's groups would otherwise no longer reach the real optimizer)."""
        self.real.load_state_dict(state_dict)
        self.param_groups = self.real.param_groups
        self.state = self.real.state

    def __repr__(self) -> str:
        return f"StepProxy({self.real!r})"


class _TrainerView:
    """What Trainer's loop holds as its (wrapped) model: the RoundPipe, except that
    ``zero_grad()`` does nothing (RoundPipe's step clears the gradients it applied; the
    wrapper's own ``zero_grad`` would wait for an asynchronous step and undo the overlap)."""

    def __init__(self, model: RoundPipe) -> None:
        self.model = model

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the step cleared the gradients."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["model"], name)


class RoundPipeTrainerMixin:
    """The RoundPipe engine for a ``transformers.Trainer`` subclass (see the module docstring).

    Put it first among the bases: ``class T(RoundPipeTrainerMixin, SomeTrainer, _WrapModel)``
    (as :class:`RoundPipeTrainer` and :class:`roundpipe.hf.RoundPipeSFTTrainer` do).

    ``roundpipe_kwargs`` (a dict, keyword only): the options of
    :func:`roundpipe.wrap_model_to_roundpipe` (``device``, ``num_microbatch``,
    ``layers_per_stage``, ``optim_dtype``, ``loss_chunk_size``, ``shard_optimizer``, ...) and
    ``step_mode``: ``"sync"`` (default; Trainer's semantics exactly), ``"exact"`` (each
    stage's parameters stepped as soon as their gradients are final, during the backward of the
    last call of the accumulation window; the same numbers as ``"sync"``) or ``"async"`` (the
    update runs while the next step's passes run, with the weights one step stale; see
    :meth:`roundpipe.RoundPipe.step`; logging, evaluation and saving wait for the pending step
    first, and with ``fp16`` every step waits for its overflow verdict, which Trainer needs to
    decide whether the scheduler advances).
    """

    # the trainer classes whose compute_loss RoundPipe's training_step replaces by the pipeline's
    # chunked causal-LM loss; an override in any other class is the trainer's own loss
    _rp_builtin_loss: tuple = (Trainer,)

    def __init__(self, *pos: Any, roundpipe_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
        rp_kwargs = dict(roundpipe_kwargs or {})
        if not isinstance(roundpipe_kwargs, (dict, type(None))):
            raise TypeError("RoundPipeTrainer: roundpipe_kwargs must be a dict, got "
                            f"{type(roundpipe_kwargs).__name__}")
        mode = rp_kwargs.pop("step_mode", "sync")
        if mode not in STEP_MODES:
            raise ValueError(f"RoundPipeTrainer: roundpipe_kwargs['step_mode'] must be one of "
                             f"{STEP_MODES}, got {mode!r}")
        for key in ("process_group", "grad_reduction"):
            if key in rp_kwargs:
                raise TypeError(f"RoundPipeTrainer: roundpipe_kwargs[{key!r}] is chosen by the "
                                "trainer (torch.distributed's group Trainer initialised; the "
                                "reduction that matches average_tokens_across_devices)")
        training_args = kwargs.get("args", pos[1] if len(pos) > 1 else None)
        if training_args is not None:
            self._check_arguments(training_args)
        if kwargs.get("model_init") is not None:
            raise ValueError("RoundPipeTrainer: model_init is not supported (Trainer would "
                             "replace the wrapped model by an unwrapped one); pass model=")
        self._rp_kwargs = rp_kwargs
        self._rp_mode = mode
        self._rp_scaler: Optional[GradScaler] = None
        self._rp_norm: Optional[torch.Tensor] = None
        self._rp_loss: Optional[str] = None  # a loss of the trainer's own (_check_after_init)
        super().__init__(*pos, **kwargs)
        if self.args.fp16:
            self._rp_scaler = GradScaler()
        self._check_after_init()

    # --- arguments -----------------------------------------------------------------------------

    @classmethod
    def _check_arguments(cls, args: Any) -> None:
        """Refuses (ValueError naming the argument) what cannot combine with RoundPipe; warns
        and switches off what RoundPipe already does. Runs before the model is wrapped."""
        for name, reason in _REFUSED:
            if _set(getattr(args, name, None)):
                raise ValueError(f"RoundPipeTrainer: {name}={getattr(args, name)!r} is not "
                                 f"supported: {reason}")
        if args.fp16 and args.bf16:
            raise ValueError("RoundPipeTrainer: fp16=True and bf16=True together")
        if args.optim not in _SUPPORTED_OPTIM:
            name = getattr(args.optim, "value", args.optim)  # OptimizerNames is a str enum
            raise ValueError(f"RoundPipeTrainer: optim={name!r} is not supported; "
                             f"supported: {', '.join(_SUPPORTED_OPTIM)} (roundpipe.optim.AdamW, "
                             "Adafactor, SGD), or pass optimizers=(opt, None) with an optimizer "
                             "built on model.optim_parameters()")
        _optimizer_cls_and_kwargs(args)  # optim_args refused here, not at the first step
        on = [n for n in ("activation_checkpointing", "gradient_checkpointing")
              if getattr(args, n, None)]
        if on:
            warnings.warn(f"{_roundpipe_class(cls)}: {'/'.join(on)}=True is switched off: "
                          "RoundPipe already recomputes in the backward pass the stages whose "
                          "saved tensors do not fit its memory budget (its recompute=; HF's "
                          "checkpointing would recompute a second time)", UserWarning, stacklevel=4)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias
                for n in on:
                    setattr(args, n, False)
        if getattr(args, "activation_offloading", False):
            raise ValueError("RoundPipeTrainer: activation_offloading=True is not supported: "
                             "RoundPipe keeps only the stage inputs, on the host, already")

    def _check_after_init(self) -> None:
        """What can only be seen on the built trainer: a loss of its own (a ``compute_loss``
        override or ``compute_loss_func``, see :mod:`roundpipe.hf.trainer_loss`), refused
        for a MoE model whose router auxiliary loss HF adds to the model's loss."""
        self._rp_loss = trainer_loss.loss_override(self, self._rp_builtin_loss)
        routing = getattr(self.model, "_routing", None)
        if self._rp_loss is not None and routing is not None and routing.coef is not None:
            raise ValueError(f"RoundPipeTrainer: a {self._rp_loss} of the trainer's own is not "
                             "supported for a MoE model with output_router_logits=True (the "
                             "router auxiliary loss is added to the built-in loss only)")

    # --- model and accelerate -------------------------------------------------------------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict:
        """accelerate's arguments without mixed precision (no autocast, no torch.amp
        GradScaler: RoundPipe computes in the model copy's dtype and scales the loss itself)."""
        out = super()._build_accelerator_args(**kwargs)
        out["mixed_precision"] = "no"
        out.pop("dynamo_plugin", None)
        return out

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's accelerator; its ``prepare`` passes the RoundPipe and the optimizer proxy
        through untouched (only data loaders are prepared)."""
        super().create_accelerator_and_postprocess()
        acc = self.accelerator
        original = acc.prepare

        def prepare(*objs: Any, device_placement=None):
            out = []
            for obj in objs:
                if isinstance(obj, StepProxy):
                    if obj not in acc._optimizers:
                        acc._optimizers.append(obj)   # for optimizer_step_was_skipped
                    out.append(obj)
                elif isinstance(obj, (RoundPipe, _TrainerView)):
                    out.append(obj)
                else:
                    out.append(original(obj, device_placement=device_placement))
            return out[0] if len(out) == 1 else tuple(out)

        acc.prepare = prepare
        acc.prepare_model = lambda model, *a, **k: model

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Nothing: the RoundPipe keeps its weights on the host and picks its devices."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None):
        """The model Trainer's loops use: the RoundPipe (never DataParallel/DDP), with a
        ``zero_grad`` that does not wait for the step."""
        if "_rp_view" not in self.__dict__:
            self._rp_view = _TrainerView(self.model)
        return self._rp_view

    def _set_signature_columns_if_needed(self) -> None:
        """The dataset columns kept are those the wrapped HF model's forward takes."""
        if self._signature_columns is not None:
            return
        rp = self.model
        self.model = rp.module
        try:
            super()._set_signature_columns_if_needed()
        finally:
            self.model = rp

    # --- optimizer ------------------------------------------------------------------------------

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """Trainer's optimizer on the RoundPipe's optimizer copies: Trainer's decay / no-decay
        parameter groups (the HF model's names), ``optim`` mapped to ``roundpipe.optim``,
        ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay``, ``optim_args``;
        wrapped in a :class:`StepProxy`. An optimizer given as ``optimizers=(opt, ...)`` must be
        built on ``model.optim_parameters()``."""
        if isinstance(self.optimizer, StepProxy):
            return self.optimizer
        rp = self.model
        copies = {id(p) for p in rp.optim_parameters()}
        if self.optimizer is not None:
            real = self.optimizer
            for g in real.param_groups:
                for p in g["params"]:
                    if id(p) not in copies:
                        raise TypeError(
                            "RoundPipeTrainer: optimizers=(optimizer, ...) holds a tensor that is "
                            "not one of the RoundPipe's optimizer copies; build it on "
                            "trainer.model.optim_parameters() (or optim_named_parameters()), or "
                            "let the trainer build it from TrainingArguments.optim")
        else:
            decay, no_decay = self._rp_param_groups()
            groups = [{"params": decay, "weight_decay": self.args.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}]
            if self.optimizer_cls_and_kwargs is not None:
                cls, kwargs = self.optimizer_cls_and_kwargs
            else:
                cls, kwargs = _optimizer_cls_and_kwargs(self.args)
                if self.args.optim == "adafactor":
                    warnings.warn("RoundPipeTrainer: optim='adafactor' runs "
                                  "roundpipe.optim.Adafactor, which has torch.optim.Adafactor's "
                                  "algorithm (not transformers' Adafactor)", UserWarning,
                                  stacklevel=2)
            real = cls(groups, **kwargs)
        self.optimizer = StepProxy(real, self)
        return self.optimizer

    def _rp_param_groups(self) -> list[list[torch.Tensor]]:
        """The optimizer copies of Trainer's two param groups (decay, no decay: Trainer's
        ``get_decay_parameter_names`` on the HF model's names), or the groups of an optimizer
        given as ``optimizers=``."""
        if self.optimizer is not None:
            real = getattr(self.optimizer, "real", self.optimizer)
            return [list(g["params"]) for g in real.param_groups]
        decay = set(self.get_decay_parameter_names(self.model.module))
        named = [(n, p) for n, p in self.model.optim_named_parameters() if p.requires_grad]
        return [[p for n, p in named if n in decay], [p for n, p in named if n not in decay]]

    def _clip_grad_norm(self, model) -> torch.Tensor:
        """Clipping happens inside RoundPipe's step; returns the tensor that receives its
        global norm (read when Trainer logs)."""
        self._rp_norm = torch.full((), math.nan)
        return self._rp_norm

    def _get_grad_norm(self, model, grad_norm=None) -> torch.Tensor:
        """The tensor that receives RoundPipe's global gradient norm of this step."""
        if grad_norm is None:
            grad_norm = self._clip_grad_norm(model)
        return grad_norm

    def _max_grad_norm(self) -> float:
        """``max_grad_norm`` as RoundPipe's step takes it; without clipping, a bound no norm
        reaches, so the step still measures the norm Trainer logs (the gradients are multiplied
        by exactly 1)."""
        c = self.args.max_grad_norm
        return float(c) if c is not None and c > 0 else float(torch.finfo(torch.float32).max)

    def _roundpipe_step(self) -> None:
        """Trainer's ``optimizer.step()``: RoundPipe's step of the window's gradients (already
        done by the last ``forward_backward`` in exact mode)."""
        rp = self.model
        if self._rp_mode != "exact":
            rp.step(self.optimizer.real, is_async=self._rp_mode == "async",
                    grad_scaler=self._rp_scaler, max_grad_norm=self._max_grad_norm())
        if self._rp_mode == "sync":
            self._fill_norm()

    def _fill_norm(self) -> None:
        if self._rp_norm is not None:
            self._rp_norm.fill_(self.model.last_step_stats().grad_norm)

    def _step_was_skipped(self) -> bool:
        """Whether the last step was skipped (loss scaler overflow): known once it is done."""
        if self._rp_scaler is None:
            return False
        if self._rp_mode != "sync":
            self.model.synchronize()
        return bool(self.model.last_step_stats().skipped)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, *args: Any, **kwargs: Any):
        """Trainer's logging, evaluation and saving, after the pending step is done when any of
        them happens (the logged ``grad_norm`` is then this step's)."""
        if self.control.should_log or self.control.should_evaluate or self.control.should_save:
            if self._rp_mode != "sync":
                self.model.synchronize()
                self._fill_norm()
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, *args, **kwargs)

    # --- the passes -----------------------------------------------------------------------------

    def _host_inputs(self, inputs: dict, where: str) -> dict:
        """The batch's tensors for the pipeline (on the host, HF's keyword names)."""
        out = {}
        for k, v in inputs.items():
            if k not in _INPUT_KEYS:
                if v is None or k in ("use_cache", "return_dict") or (
                        k in _BOUNDARY_KEYS and inputs.get("position_ids") is not None):
                    continue
                if self._rp_loss:  # extra columns: a loss of the trainer's own may read them
                    out[k] = v.cpu() if isinstance(v, torch.Tensor) else v
                    continue
                raise TypeError(f"RoundPipeTrainer.{where}: the batch holds {k!r}, which the "
                                "RoundPipe HF model does not take (it takes "
                                f"{', '.join(_INPUT_KEYS)})")
            if v is not None:
                out[k] = v.cpu() if isinstance(v, torch.Tensor) else v
        return out

    def training_step(self, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """One batch of the accumulation window through ``forward_backward`` (HF's built-in
        loss, divided by ``num_items_in_batch`` as Trainer's model call does; or the trainer's
        own ``compute_loss`` per microbatch, see :mod:`roundpipe.hf.trainer_loss`); returns
        what Trainer's ``training_step`` returns, on ``args.device``."""
        rp = self.model
        rp.train()
        batch = self._host_inputs(inputs, "training_step")
        step_kwargs = self._step_kwargs()
        if self._rp_loss:
            ranks = 1
            if rp.process_group is not None and rp.grad_reduction == "sum":
                ranks = torch.distributed.get_world_size(rp.process_group)
            loss = trainer_loss.training_loss(self, rp, batch, num_items_in_batch, ranks,
                                              **step_kwargs)
            return loss.detach().to(self.args.device)
        if "labels" not in batch:
            raise ValueError("RoundPipeTrainer: the batch has no labels (the pipeline computes "
                             "HF's causal-LM loss from them)")
        scale = 1.0
        if num_items_in_batch is None:   # Trainer's per-batch mean divided by the window size
            num = float(count_items(batch["labels"])) * self.current_gradient_accumulation_steps
        else:
            # with n_gpu > 1 Trainer repeats the count once per DataParallel replica and, without
            # average_tokens_across_devices, divides it by n_gpu: here the whole batch is one
            # pipeline call, so the count of the whole window is used
            num = float(num_items_in_batch.reshape(-1)[0] if torch.is_tensor(num_items_in_batch)
                        else num_items_in_batch)
            if self.args.average_tokens_across_devices:
                scale = float(self.accelerator.num_processes)
            elif self.args.n_gpu > 1:
                num *= self.args.n_gpu
        batch["num_items_in_batch"] = num
        loss = rp.forward_backward(input_kwargs=batch, **step_kwargs)
        return (loss.detach() * scale).to(self.args.device)

    def _step_kwargs(self) -> dict:
        """``forward_backward``'s step arguments for this batch: the loss scaler, and in exact
        mode on the window's last batch the optimizer (and clipping)."""
        step_kwargs: dict = {"grad_scaler": self._rp_scaler}
        last = self.accelerator.gradient_state.sync_gradients
        if self._rp_mode == "exact" and last:
            # without clipping, exact mode steps each stage during the backward (its norm is
            # measured all the same); clipping needs the global norm first (a deferred step)
            clip = self.args.max_grad_norm
            step_kwargs.update(optimizer=self.optimizer.real,
                               max_grad_norm=float(clip) if clip and clip > 0 else None)
        return step_kwargs

    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool,
                        ignore_keys: Optional[list] = None):
        """Evaluation of a batch: with labels and ``prediction_loss_only``, the loss through the
        pipeline without the logits (the chunked loss, summed over the batch's scored tokens and
        divided by ``num_items_in_batch`` as Trainer's ``compute_loss`` does); otherwise the
        wrapper's ``forward`` (full logits on the host), and with a loss of the trainer's own
        its ``compute_loss`` on them. Pending optimizer work is finished first (asynchronous
        mode: the weights are synchronized)."""
        rp = self.model
        rp.synchronize()
        rp.eval()
        batch = self._host_inputs(inputs, "prediction_step")
        labels = batch.get("labels")
        if labels is None:
            with torch.no_grad():
                out = rp(**trainer_loss.model_inputs(batch))
            return None, (None if prediction_loss_only else out.logits), None
        num = self._get_num_items_in_batch([inputs], self.args.device)
        if self._rp_loss:
            loss, logits = trainer_loss.evaluation_loss(self, rp, batch, num)
            loss = loss.to(self.args.device)
            return (loss, None, None) if prediction_loss_only else (loss, logits, labels)
        if prediction_loss_only and getattr(rp, "_routing", None) is None:
            with torch.no_grad():
                sums = RoundPipe.forward(rp, **batch)    # each microbatch's Postfix sums
            total = sums["loss"].sum()
            self._rp_eval_stats(TokenStats(int(count_items(labels)), int(sums["top1"].sum()),
                                           float(sums["entropy"].sum())))
            denom = float(num) if num is not None else float(count_items(labels))
            loss = total.float() / denom
            logits = None
        else:
            kw = {} if num is None else {
                "num_items_in_batch": num.cpu() if torch.is_tensor(num) else num}
            with torch.no_grad():
                out = rp(**batch, **kw)
            loss, logits = out.loss, out.logits
            self._rp_eval_stats(token_stats(logits, labels))
        if self.args.average_tokens_across_devices and num is not None:
            loss = loss * self.accelerator.num_processes
        loss = loss.detach().to(self.args.device)
        if prediction_loss_only:
            return loss, None, None
        return loss, logits, labels

    def _rp_eval_stats(self, stats: TokenStats) -> None:
        """An evaluation batch's :class:`~roundpipe.hf.loss.TokenStats`, for a subclass that
        logs them (RoundPipeSFTTrainer: TRL's ``eval_mean_token_accuracy``, ``eval_entropy``);
        nothing here."""

    # --- checkpoints ----------------------------------------------------------------------------

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Trainer's checkpoint, its model weights (:meth:`_save`) at the optimizer copies'
        precision: what plain Trainer's checkpoint of a mixed-precision run holds."""
        self._rp_checkpointing = True
        try:
            super()._save_checkpoint(*args, **kwargs)
        finally:
            self._rp_checkpointing = False

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The weights at full precision, the optimizer and the grad scaler through
        :func:`roundpipe.save_checkpoint` (every rank writes what it owns), the scheduler as
        Trainer writes it, and ``optimizer.pt`` as plain Trainer writes it (the optimizer's
        state dict in torch's format, float32 state: a ``torch.optim`` optimizer of the same
        class loads it), so that plain ``transformers.Trainer`` resumes the checkpoint with the
        optimizer state. With the optimizer copies sharded over ranks, each rank holds only its
        rows: ``optimizer.pt`` is then a state dict of empty param groups, which
        ``torch.optim.Optimizer.load_state_dict`` (plain Trainer's resume) refuses rather than
        starting Adam's moments afresh without a word; so it is with the optimizer state on a
        disk (``optimizer_dir``), which a state dict in memory would have to hold whole."""
        scaler = None if self._rp_scaler is None else self._rp_scaler.state_dict()
        real = self.optimizer.real
        save_checkpoint(os.path.join(output_dir, STATE_DIR), self.model, real,
                        extra={"grad_scaler": scaler})
        if not self.args.should_save:
            return
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))
        note = (_SHARDED_NOTE if any(r is not None for r in self.model.optim_shard_rows().values())
                else _DISK_NOTE if self.model.optimizer_dir is not None else None)
        if note is not None:
            state = {"state": {}, "param_groups": [
                {"params": [], "roundpipe": note} for _ in real.param_groups]}
        elif hasattr(real, "state_as_float32"):  # roundpipe.optim: compact state as float32
            state = real.state_dict(state_dtype=torch.float32)
        else:
            state = real.state_dict()
        torch.save(state, os.path.join(output_dir, _OPTIMIZER_NAME))

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: the grad scaler's state is in the RoundPipe checkpoint."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """A RoundPipe checkpoint (a ``roundpipe_state`` folder): checked here, its weights
        loaded with the optimizer (:meth:`_load_optimizer_and_scheduler`). A plain Trainer
        checkpoint (model weights and ``optimizer.pt``, see :mod:`roundpipe.hf.plain_checkpoint`):
        checked and its weights loaded into both copies here, its optimizer state converted
        there. Anything else raises ``ValueError`` saying how to start from its weights."""
        self._rp_plain = None
        if os.path.isdir(os.path.join(resume_from_checkpoint, STATE_DIR)):
            return
        from . import plain_checkpoint

        if not plain_checkpoint.is_plain(resume_from_checkpoint):
            raise ValueError(f"RoundPipeTrainer: {resume_from_checkpoint!r} holds neither a "
                             f"{STATE_DIR} folder (a RoundPipe trainer's checkpoint) nor the "
                             "model weights and optimizer.pt of a plain Trainer checkpoint")
        self._rp_plain = plain_checkpoint.read(resume_from_checkpoint, self.model)
        plain_checkpoint.check_optimizer(self._rp_plain, self._rp_param_groups())
        self.model.load_state_dict(self._rp_plain.weights, strict=False)
        self._rp_plain.weights = None

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """Weights, optimizer and grad scaler from :func:`roundpipe.load_checkpoint` (any world
        size), or the optimizer state of a plain Trainer checkpoint converted; the scheduler as
        Trainer reads it."""
        if checkpoint is None:
            return
        plain = self.__dict__.pop("_rp_plain", None)
        if plain is not None:
            from . import plain_checkpoint

            plain_checkpoint.check_optimizer(plain, [g["params"] for g in
                                                     self.optimizer.real.param_groups])
            self.optimizer.load_state_dict(plain.optimizer)
        else:
            extra = load_checkpoint(os.path.join(checkpoint, STATE_DIR), self.model,
                                    self.optimizer.real)
            if self._rp_scaler is not None and extra.get("grad_scaler"):
                self._rp_scaler.load_state_dict(extra["grad_scaler"])
        path = os.path.join(checkpoint, _SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        """Nothing: loaded with the RoundPipe checkpoint."""

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights into the RoundPipe (both
        copies), as plain Trainer loads them into its model: the full-precision weights of its
        RoundPipe checkpoint (every rank takes part); without one (``save_only_model=True``),
        the PEFT adapter or the HF weights ``save_model`` wrote (the model copy's dtype)."""
        best = self.state.best_model_checkpoint
        if os.path.isdir(os.path.join(best, STATE_DIR)):
            load_checkpoint(os.path.join(best, STATE_DIR), self.model)
            return
        peft_model = self.model.peft_model
        if peft_model is None:
            return super()._load_best_model()  # model.safetensors into RoundPipe.load_state_dict
        from peft.utils import get_peft_model_state_dict, load_peft_weights

        # the adapter file's keys are PeftModel.state_dict()'s without the adapter name: PEFT's
        # own renaming, applied to the live parameters, gives the key of each
        live = peft_model.state_dict(keep_vars=True)
        names = {id(t): k for k, t in live.items()}
        saved_keys = {k: names[id(t)] for k, t in get_peft_model_state_dict(
            peft_model, state_dict=live).items()}
        adapter = load_peft_weights(best, device="cpu")
        unknown = sorted(set(adapter) - set(saved_keys))
        if unknown:
            raise ValueError(f"RoundPipeTrainer: the adapter of the best checkpoint {best!r} "
                             f"holds tensors this model has not: {unknown[:5]}")
        self.model.load_state_dict({saved_keys[k]: t for k, t in adapter.items()}, strict=False)

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        """``save_model``: ``save_pretrained`` of the wrapped model (an HF checkpoint, or the PEFT
        adapter; every rank takes part, rank 0 writes; in the model copy's dtype, in a
        checkpoint at the optimizer copies' when wider), the tokenizer and the arguments."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
        dtype = None
        if getattr(self, "_rp_checkpointing", False):  # a checkpoint: at full precision
            have = self.model.hf_model.dtype.itemsize
            dtype = next((p.dtype for p in self.model.optim_parameters()
                          if p.is_floating_point() and p.dtype.itemsize > have), None)
        self.model.save_pretrained(output_dir, dtype=dtype)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


def _optimizer_cls_and_kwargs(args: Any) -> tuple[type, dict]:
    """``TrainingArguments.optim`` and ``optim_args`` as a ``roundpipe.optim`` class and its
    keyword arguments: those transformers gives the torch class
    (``Trainer.get_optimizer_cls_and_kwargs``: ``optim_args`` parsed as it parses them, e.g.
    ``"momentum=0.9,nesterov=False"`` for SGD), for ``roundpipe.optim``'s class of the same name
    (``optim="adafactor"``: ``roundpipe.optim.Adafactor`` with ``lr``).

    Raises:
        ValueError: naming ``optim_args``, when they are not ``key=value`` pairs, when
            transformers would ignore one of them for this optimizer (for ``adamw_*`` and
            ``adafactor`` it reads none), or when the optimizer refuses a value (it is built
            once on a stand-in tensor to check them).
    """
    from .. import optim as rpo

    where = f"RoundPipeTrainer: optim_args={args.optim_args!r}"
    try:
        torch_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    except ValueError as e:  # a pair without "=", a number that does not parse
        raise ValueError(f"{where} (optim={getattr(args.optim, 'value', args.optim)!r}): {e}; "
                         "give comma-separated key=value pairs, e.g. "
                         "'momentum=0.9,nesterov=False'") from e
    if args.optim == "adafactor":
        cls, kwargs = rpo.Adafactor, {"lr": args.learning_rate}
    else:
        cls = getattr(rpo, torch_cls.__name__)  # AdamW, SGD
        kwargs = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}
    if args.optim_args:
        keys = [pair.split("=")[0] for pair in args.optim_args.replace(" ", "").split(",")]
        ignored = [k for k in keys if k not in kwargs]
        if ignored:
            raise ValueError(
                f"{where}: transformers ignores {', '.join(map(repr, ignored))} for "
                f"optim={getattr(args.optim, 'value', args.optim)!r} (plain Trainer would "
                "train without them); remove them, or pass optimizers=(opt, None) with "
                f"roundpipe.optim.{cls.__name__}(trainer.model.optim_parameters(), ...) built "
                "as you want it")
    try:
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: roundpipe.optim.{cls.__name__} refuses {kwargs}: {e}") from e
    return cls, kwargs


class _WrapModel(Trainer):
    """Last before ``transformers.Trainer`` in the MRO: wraps the model the trainer class above
    it hands to ``Trainer.__init__`` (after TRL's SFTTrainer applied ``peft_config``)."""

    def __init__(self, model=None, args=None, *rest: Any, **kwargs: Any) -> None:
        if args is None:
            raise TypeError("RoundPipeTrainer: give args (TrainingArguments)")
        self._check_arguments(args)
        model = self._to_roundpipe(model, args)
        super().__init__(model, args, *rest, **kwargs)

    def _to_roundpipe(self, model: Any, args: Any):
        from .model import HFRoundPipe
        from .parts import is_hf_model
        from .wrap import wrap_model_to_roundpipe

        if isinstance(model, RoundPipe):
            if not isinstance(model, HFRoundPipe):
                raise TypeError("RoundPipeTrainer: model is a RoundPipe of a non-HF model; the "
                                "trainer needs a Hugging Face causal LM (wrapped or not)")
            if self._rp_kwargs:
                raise TypeError("RoundPipeTrainer: roundpipe_kwargs are for a model the trainer "
                                "wraps; this one is already wrapped")
            _warn_ignored_precision(model, args)
            return model
        if model is None or not is_hf_model(model):
            raise TypeError("RoundPipeTrainer: model must be a transformers causal LM, a "
                            "PeftModel around one, or one wrapped by wrap_model_to_roundpipe; "
                            f"got {type(model).__name__}")
        kwargs = dict(self._rp_kwargs)
        if getattr(args, "use_cpu", False):
            kwargs.setdefault("device", "cpu")
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        optim_dtype = kwargs.pop("optim_dtype", None)
        world = args.world_size  # sets up torch.distributed under torchrun, as Trainer does
        if world > 1 and torch.distributed.is_initialized():
            kwargs["process_group"] = torch.distributed.group.WORLD
            kwargs["grad_reduction"] = "sum" if args.average_tokens_across_devices else "mean"
        undo = lambda: None  # noqa: E731
        exact: dict = {}
        if dtype is not None:
            if optim_dtype is None:
                optim_dtype = torch.float32
            # the trained parameters' values before the cast (the tensors the cast replaces)
            exact = {n: p.detach() for n, p in model.named_parameters()
                     if p.requires_grad and p.is_floating_point()}
            undo = _cast(model, dtype)
        try:
            wrapped = wrap_model_to_roundpipe(model, optim_dtype, **kwargs)
        except BaseException:
            undo()  # a refused roundpipe_kwargs (or model) leaves the user's model as it was
            raise
        _start_optimizer_copies_exact(wrapped, exact)
        return wrapped


def _start_optimizer_copies_exact(model: RoundPipe, exact: dict) -> None:
    """The optimizer copies of a model the trainer cast to ``bf16`` / ``fp16`` start at the
    user's weights (``exact``: name -> the tensor before the cast), as plain Trainer's fp32
    parameters do under ``bf16=True``, not at their rounding to the model copy's dtype (the
    model copy keeps its rounding: it is what the first forward computes with either way).
    With a process group, rank 0's weights, as the wrapper took rank 0's model copy: each is
    broadcast over RoundPipe's host group (a collective: every rank calls this)."""
    if not exact:
        return
    rows = model.optim_shard_rows()
    group = model.host_process_group
    src_rank = None if group is None else torch.distributed.get_global_rank(group, 0)
    with torch.no_grad():
        for name, copy in model.optim_named_parameters():
            src = exact.get(name)
            if src is None or src.dtype != copy.dtype:  # e.g. optim_dtype=bf16: nothing to keep
                continue
            if group is not None:  # into a copy: the user's tensor is left as it was
                src = src.clone()
                torch.distributed.broadcast(src, src_rank, group=group)
            r = rows.get(name)
            copy.copy_(src if r is None else src[r[0]:r[1]])


def _cast(model: nn.Module, dtype: torch.dtype):
    """``model.to(dtype)`` in place (the model copy ``bf16`` / ``fp16`` ask for), and the function
    that undoes it exactly: every parameter, its data, every buffer and each quantized linear's
    compute dtype as before (they are held until then: a wrapper that refuses its arguments
    after the cast must leave the user's model as it was)."""
    from ..quant import QuantizedLinear

    params = [(m, n, p, p.data) for m in model.modules() for n, p in m._parameters.items()
              if p is not None]
    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items()]
    computes = [(m, m.compute_dtype) for m in model.modules() if isinstance(m, QuantizedLinear)]
    model.to(dtype)

    def undo() -> None:
        for m, n, p, data in params:
            p.data = data
            m._parameters[n] = p
        for m, n, b in buffers:
            m._buffers[n] = b
        for m, compute_dtype in computes:
            m.compute_dtype = compute_dtype

    return undo


def _warn_ignored_precision(model: RoundPipe, args: Any) -> None:
    """A model wrapped before the trainer keeps the dtype it was wrapped with: ``bf16=True`` /
    ``fp16=True`` that ask for another one are ignored, with a ``UserWarning`` saying so."""
    want = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    have = next((p.dtype for p in model.module.parameters() if p.is_floating_point()), None)
    if want is not None and have is not None and have != want:
        flag = "bf16" if args.bf16 else "fp16"
        warnings.warn(f"RoundPipeTrainer: {flag}=True is ignored: the model was wrapped before "
                      f"the trainer, with a {have} model copy, which RoundPipe computes in (no "
                      f"autocast). To train in {want}, wrap model.to({want}) with "
                      "optim_dtype=torch.float32, or give the trainer the unwrapped model",
                      UserWarning, stacklevel=5)


class RoundPipeTrainer(RoundPipeTrainerMixin, _WrapModel):
    """``transformers.Trainer`` training a Hugging Face causal LM through RoundPipe.

    Constructed as ``Trainer`` is, plus ``roundpipe_kwargs``::

        trainer = RoundPipeTrainer(model=hf_model, args=TrainingArguments(...),
                                   train_dataset=..., eval_dataset=..., data_collator=...,
                                   processing_class=tokenizer,
                                   roundpipe_kwargs={"num_microbatch": 2})
        trainer.train()

    ``model`` is a transformers causal LM (fp32, or any dtype), a ``PeftModel`` around one, or
    a model already wrapped by :func:`roundpipe.wrap_model_to_roundpipe`. ``fp16=True`` /
    ``bf16=True`` make the model copy fp16 / bf16 with fp32 optimizer copies (no autocast)
    that start at the model's fp32 weights, not at their rounding;
    ``fp16`` adds a :class:`roundpipe.GradScaler`. See :class:`RoundPipeTrainerMixin` for
    ``roundpipe_kwargs`` and docs/huggingface.md ("With Hugging Face Trainer and TRL") for what each
    ``TrainingArguments`` field does.

    Raises:
        ValueError: an argument that cannot combine with RoundPipe (named, with the reason),
            before the model is wrapped.
        TypeError: a model that is not an HF causal LM; an ``optimizers=`` optimizer not built
            on the optimizer copies.
    """


__all__ = ["RoundPipeTrainer", "RoundPipeTrainerMixin", "StepProxy", "STEP_MODES"]
