"""``RoundPipe``: the model wrapper. Host-resident weights (a low-precision model copy and a
full-precision optimizer copy), stages streamed to the compute device, microbatches,
activation recomputation, gradients accumulated on the host in the optimizer dtype.

Reading order: plan.py (stages) -> transfer.py (moving weights) -> execute.py (a stage on a
microbatch) -> this file (the passes over stages and microbatches, and the optimizer side).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from . import microbatch as mb
from .context import OptimizerCtx
from .execute import draw_call_seed, run_stage
from .plan import Stage, default_device, make_stages, split_layers
from .transfer import LayerWeights, download_buffers, upload_layer


def _leaves(tree: Any) -> list:
    return tree_flatten(tree)[0]


class _Backward:
    """The backward pass of one forward_backward call: recomputes a stage on a microbatch with
    autograd, runs its backward (from the loss for the last stage, from the next stage's input
    gradients otherwise), accumulates parameter gradients on the host. Each microbatch's device
    tensors and autograd graph die when :meth:`microbatch` returns."""

    def __init__(self, owner: "RoundPipe", mbs: list, has_label: bool, loss_fn: Callable,
                 return_outputs: bool, call_seed: int) -> None:
        self.owner, self.mbs, self.has_label, self.loss_fn = owner, mbs, has_label, loss_fn
        self.return_outputs, self.call_seed = return_outputs, call_seed
        self.total = torch.zeros((), dtype=torch.float64)
        self.outputs: list[Any] = [None] * len(mbs)

    def microbatch(self, stage: Stage, weights: list[LayerWeights], stage_input: Any, m: int,
                   grad_output: Optional[list], is_last: bool) -> Optional[list]:
        """Returns the gradients w.r.t. the leaves of ``stage_input`` (None for stage 0)."""
        cpu = torch.device("cpu")
        if stage.index == 0:
            x = mb.to_device(stage_input, stage.device)
        else:  # the stage input becomes a leaf whose gradient flows to the previous stage
            x = mb.detach_to(stage_input, stage.device)
            for t in _leaves(x):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t.requires_grad_(True)
        with torch.enable_grad():
            y = self.owner._run(stage, weights, x, m, self.call_seed, recomputing=not is_last)
            if is_last:
                label = mb.to_device(self.mbs[m][2], stage.device)
                loss = self.loss_fn(y, label) if self.has_label else self.loss_fn(y)
                if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                    raise TypeError("RoundPipe.forward_backward: loss_fn must return a 1-element "
                                    f"tensor, got {type(loss).__name__}")
                self.total += loss.detach().to(cpu, torch.float64).reshape(())
                if self.return_outputs:
                    self.outputs[m] = mb.detach_to(y, cpu)
                if loss.requires_grad:
                    loss.backward()
            else:
                pairs = [(t, g) for t, g in zip(_leaves(y), grad_output)
                         if isinstance(t, torch.Tensor) and t.requires_grad and g is not None]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs],
                                            [g.to(stage.device) for _, g in pairs])
        for w in weights:
            self.owner._accumulate(w)
        if stage.index == 0:
            return None
        return [t.grad.to(cpu) if isinstance(t, torch.Tensor) and t.grad is not None else None
                for t in _leaves(x)]


class RoundPipe(nn.Module):
    """Wraps a model so that it trains with its weights in CPU memory and only one stage's
    weights on the compute device at a time.

    The model's layers are the children of an ``nn.Sequential`` (any other module is a single
    layer); ``layers_per_stage`` consecutive layers form a stage. The model stays on the host in
    the dtype it has (the *model copy*: fp16, bf16 or fp32; it is what the device computes in).
    Every trainable parameter also gets an *optimizer copy* in ``optim_dtype`` (default: the
    model's dtype), created once here: optimizers work on those (:meth:`optim_parameters`, or
    :meth:`parameters` inside :class:`roundpipe.OptimizerCtx`).

    Training::

        model = RoundPipe(net.to(torch.bfloat16), optim_dtype=torch.float32)
        with OptimizerCtx():
            opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-4)
        for x, y in loader:
            loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            model.step(lambda: (opt.step(), opt.zero_grad()))

    Args:
        model: the network, with all parameters and buffers on the CPU.
        optim_dtype: floating dtype of the optimizer copies (default: each parameter's dtype).
        device: compute device (default: ``cuda:0`` when CUDA is available, else the CPU, which
            runs the very same code path).
        layers_per_stage: consecutive layers per stage (default 1).
        num_microbatch: default number of microbatches per call (default: number of devices + 1,
            at most the batch size).
        split_fn: custom split of ``(args, kwargs, label, n)`` into microbatches, with the
            signature and contract of :func:`roundpipe.microbatch.split_microbatches`.

    Raises:
        ValueError: a parameter or buffer is not on the CPU, ``optim_dtype`` is not a floating
            dtype, or ``layers_per_stage`` / ``num_microbatch`` is < 1.
    """

    def __init__(self, model: nn.Module, optim_dtype: Optional[torch.dtype] = None, *,
                 device: Optional[torch.device | str] = None, layers_per_stage: int = 1,
                 num_microbatch: Optional[int] = None,
                 split_fn: Optional[Callable[..., list]] = None) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"RoundPipe: model must be an nn.Module, got {type(model).__name__}")
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.device.type != "cpu":
                raise ValueError(f"RoundPipe: {name!r} is on {t.device}; the model must be on "
                                 "the CPU (RoundPipe moves each stage to the device itself)")
        if optim_dtype is not None and not (isinstance(optim_dtype, torch.dtype)
                                            and optim_dtype.is_floating_point):
            raise ValueError(f"RoundPipe: optim_dtype must be a floating torch.dtype, got {optim_dtype!r}")
        if num_microbatch is not None and (not isinstance(num_microbatch, int) or num_microbatch < 1):
            raise ValueError(f"RoundPipe: num_microbatch must be an int >= 1, got {num_microbatch!r}")
        self.module = model
        self.device = torch.device(device) if device is not None else default_device()
        self._layers = split_layers(model)
        self._stages = make_stages(len(self._layers), layers_per_stage, [self.device])
        self.num_microbatch = num_microbatch or 2
        self._split = split_fn or mb.split_microbatches

        # The optimizer copies: one per unique trainable parameter, in named_parameters() order.
        self._names: list[str] = []
        self._model_params: list[nn.Parameter] = []
        self._optim_params: list[nn.Parameter] = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            dtype = optim_dtype or p.dtype
            if not p.dtype.is_floating_point:
                raise ValueError(f"RoundPipe: trainable parameter {name!r} has dtype {p.dtype}")
            self._names.append(name)
            self._model_params.append(p)
            self._optim_params.append(nn.Parameter(p.detach().to(dtype, copy=True)))
        self._index = {id(p): i for i, p in enumerate(self._model_params)}
        self._grads: list[Optional[torch.Tensor]] = [None] * len(self._model_params)
        self._synced = [self._version(p) for p in self._model_params]
        self._recompute_store: dict = {}

    # --- parameters: model copies, or optimizer copies inside OptimizerCtx -----------------

    def optim_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, optimizer copy)`` of every trainable parameter, with the model's names."""
        return iter(zip(self._names, self._optim_params))

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        """The optimizer copies (``optim_dtype``, on the host) of every trainable parameter."""
        return iter(self._optim_params)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters under its own names; inside ``OptimizerCtx``, the optimizer
        copies (trainable parameters only)."""
        if OptimizerCtx.is_active():
            return ((prefix + ("." if prefix else "") + n, p) for n, p in self.optim_named_parameters())
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters; inside ``OptimizerCtx``, the optimizer copies."""
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped model's buffers (host tensors, the model's dtype) under its own names."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def _apply(self, fn, recurse=True):
        raise TypeError("RoundPipe keeps the model on the host in the dtype it was given: convert "
                        "the model (e.g. net.to(torch.bfloat16)) before wrapping it, and choose "
                        "the compute device with RoundPipe(device=...)")

    def __setstate__(self, state) -> None:
        """After ``copy.deepcopy`` or unpickling the parameters are new objects: rebuild the
        identity index over them."""
        super().__setstate__(state)
        self._index = {id(p): i for i, p in enumerate(self._model_params)}
        self._synced = [self._version(p) for p in self._model_params]

    # --- keeping the two copies consistent -------------------------------------------------

    @staticmethod
    def _version(p: torch.Tensor) -> tuple[int, int]:
        return (p.data_ptr(), p._version)

    def _refresh_optim_copies(self) -> None:
        """A model-copy parameter changed behind our back (e.g. ``load_state_dict`` on the
        wrapped model after wrapping): the optimizer copy takes its value, so the next step
        trains what was loaded."""
        with torch.no_grad():
            for i, p in enumerate(self._model_params):
                if self._version(p) != self._synced[i]:
                    self._optim_params[i].copy_(p)
                    self._synced[i] = self._version(p)

    def _write_back(self) -> None:
        """Model copies take the optimizer copies' values, rounded to the model dtype."""
        with torch.no_grad():
            for i, (p, o) in enumerate(zip(self._model_params, self._optim_params)):
                p.copy_(o)
                self._synced[i] = self._version(p)

    # --- gradients -----------------------------------------------------------------------------

    def _accumulate(self, weights: LayerWeights) -> None:
        """Adds the device gradients of a layer's trainable parameters into the host gradient
        buffers (optimizer dtype) and clears them on the device."""
        for name, host in weights.trainable:
            t = weights.tensors[name]
            if t.grad is None:
                continue
            i = self._index.get(id(host))
            if i is None:
                raise RuntimeError(
                    f"RoundPipe: parameter {name!r} requires grad but was frozen when the model "
                    "was wrapped, so it has no optimizer copy; set requires_grad before wrapping "
                    "(parameters frozen after wrapping are simply not trained)")
            g = t.grad.to("cpu", self._optim_params[i].dtype)
            if self._grads[i] is None:
                self._grads[i] = g if g is not t.grad else g.clone()
            else:
                self._grads[i].add_(g)
            t.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discards the gradients accumulated since the last :meth:`step`."""
        self._grads = [None] * len(self._model_params)
        for o in self._optim_params:
            o.grad = None

    # --- the passes ------------------------------------------------------------------------------

    def _upload(self, stage: Stage, with_grad: bool) -> list[LayerWeights]:
        return [upload_layer(self._layers[i], stage.device, with_grad) for i in stage.layers]

    def _microbatches(self, args, kwargs, label, num_microbatch) -> list:
        n = num_microbatch if num_microbatch is not None else self.num_microbatch
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"RoundPipe: num_microbatch must be an int >= 1, got {n!r}")
        return self._split(tuple(args), dict(kwargs or {}), label, n)

    def _run(self, stage: Stage, weights: list[LayerWeights], stage_input: Any, m: int,
             call_seed: int, recomputing: bool) -> Any:
        layers = [self._layers[i] for i in stage.layers]
        return run_stage(layers, stage.start, weights, stage_input, m, call_seed, stage.device,
                         self._recompute_store, recomputing)

    def forward(self, *args: Any, num_microbatch: Optional[int] = None, **kwargs: Any) -> Any:
        """Inference and evaluation: runs the model on ``(*args, **kwargs)`` in microbatches,
        stage by stage, without autograd, and returns the merged outputs on the host. In
        training mode, buffers (e.g. BatchNorm running statistics) are updated on the host."""
        self._refresh_optim_copies()
        mbs = self._microbatches(args, kwargs, None, num_microbatch)
        acts: list[Any] = [(a, k) for a, k, _ in mbs]
        call_seed = draw_call_seed()
        try:
            for stage in self._stages:
                acts = self._forward_stage(stage, acts, call_seed)
        finally:
            self._recompute_store.clear()  # nothing is recomputed after inference
        return mb.merge_outputs(acts)

    def forward_backward(self, input_args: tuple = (), input_kwargs: Optional[dict] = None,
                         label: Any = None, loss_fn: Callable[..., torch.Tensor] = None,
                         return_outputs: bool = False, num_microbatch: Optional[int] = None):
        """One forward and backward pass over a batch, in microbatches.

        The batch is split into microbatches (dim 0 of every batched tensor of ``input_args``,
        ``input_kwargs`` and ``label``, or ``split_fn``). The forward pass runs stage by stage,
        each stage's weights copied to the device for the stage and dropped after, keeping only
        the stage inputs (on the host). The backward pass runs the stages in reverse, recomputing
        each stage's forward (same randomness) before its backward. The loss of microbatch ``i``
        is ``loss_fn(output_i, label_i)`` (``loss_fn(output_i)`` when ``label`` is None).

        Loss convention: the gradients are those of the *sum* of the microbatch losses, and
        that sum is returned. For a mean over the whole batch, make ``loss_fn`` return its
        microbatch's share (e.g. a sum-reduced loss divided by the total number of samples).

        Gradients accumulate on the host, in the optimizer dtype, across microbatches and calls,
        until :meth:`step`. If the call raises, the gradients accumulated since the last step are
        discarded (as by :meth:`zero_grad`), so a partial gradient is never applied, and the
        wrapper stays usable.

        Returns:
            The summed loss (0-dim tensor on the host, detached), or ``(loss, outputs)`` with
            ``return_outputs=True`` (outputs merged over microbatches, on the host).

        Raises:
            TypeError: ``loss_fn`` is missing. Exceptions from the layers and ``loss_fn``
            propagate unchanged.
        """
        if loss_fn is None:
            raise TypeError("RoundPipe.forward_backward: loss_fn is required")
        self._refresh_optim_copies()
        mbs = self._microbatches(input_args, input_kwargs, label, num_microbatch)
        n = len(mbs)
        last = len(self._stages) - 1
        # inputs[s][m]: what stage s receives for microbatch m (on the host)
        inputs: list[list[Any]] = [[(a, k) for a, k, _ in mbs]] + [[None] * n for _ in range(last)]
        call_seed = draw_call_seed()
        run = _Backward(self, mbs, label is not None, loss_fn, return_outputs, call_seed)
        try:
            for stage in self._stages[:-1]:
                inputs[stage.index + 1] = self._forward_stage(stage, inputs[stage.index], call_seed)
            grad_out: list[Any] = [None] * n  # gradients w.r.t. the current stage's outputs
            for stage in reversed(self._stages):
                weights = self._upload(stage, with_grad=True)
                for m in range(n):
                    grad_out[m] = run.microbatch(stage, weights, inputs[stage.index][m], m,
                                                 grad_out[m], stage.index == last)
                if stage.index == last and self.training:
                    download_buffers(weights)
                del weights  # nothing else refers to the stage's device tensors now
        except BaseException:
            self.zero_grad()
            raise
        finally:
            self._recompute_store.clear()
        loss = run.total.to(torch.float32)
        return (loss, mb.merge_outputs(run.outputs)) if return_outputs else loss

    def _forward_stage(self, stage: Stage, stage_inputs: list, call_seed: int) -> list:
        """Forward pass of one stage over all microbatches without autograd; returns the
        outputs on the host (the next stage's inputs) and keeps the buffer updates."""
        cpu = torch.device("cpu")
        weights = self._upload(stage, with_grad=False)
        with torch.no_grad():
            outs = [mb.detach_to(self._run(stage, weights, mb.to_device(x, stage.device), m,
                                           call_seed, recomputing=False), cpu)
                    for m, x in enumerate(stage_inputs)]
        if self.training:
            download_buffers(weights)
        return outs

    # --- the optimizer side ------------------------------------------------------------------------

    def step(self, step_fn: Callable[[], Any]) -> Any:
        """Applies the accumulated gradients: they become the optimizer copies' ``.grad``,
        ``step_fn()`` runs with :class:`OptimizerCtx` active (so ``clip_grad_norm_(
        model.parameters(), ...)`` inside it sees the optimizer copies and their gradients), then
        the model copies take the updated values (rounded to the model dtype) — also when
        ``step_fn`` raises, so the two copies never disagree. The gradients are then cleared.

        Returns:
            What ``step_fn`` returns.
        """
        self._refresh_optim_copies()
        for o, g in zip(self._optim_params, self._grads):
            o.grad = g
        try:
            with OptimizerCtx():
                return step_fn()
        finally:
            self._write_back()
            self.zero_grad()

    # --- checkpoints -------------------------------------------------------------------------------

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped model's state dict, with the model's keys; trainable parameters at full
        precision (from the optimizer copies), buffers and frozen parameters from the model."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        # every name of a parameter, tied ones (one parameter under several names) included
        for name, p in self.module.named_parameters(remove_duplicate=False):
            i = self._index.get(id(p))
            if i is not None:
                o = self._optim_params[i]
                sd[prefix + name] = o if keep_vars else o.detach()
        return sd

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a state dict with the model's keys (e.g. from :meth:`state_dict` or from the
        unwrapped model) into both copies: the model copy rounded to its dtype, the optimizer
        copies at the precision given. ``assign=True`` is not supported. RoundPipe is meant to
        be the outermost module: save and load its own state dict, not one of a module that
        contains it."""
        if assign:
            raise ValueError("RoundPipe.load_state_dict: assign=True is not supported")
        result = self.module.load_state_dict(state_dict, strict=strict)
        with torch.no_grad():
            for i, (name, o) in enumerate(zip(self._names, self._optim_params)):
                if name in state_dict:
                    o.copy_(state_dict[name])
                self._synced[i] = self._version(self._model_params[i])
        return result
