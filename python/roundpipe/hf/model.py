"""``HFRoundPipe``: RoundPipe with Hugging Face semantics (built by ``wrap_model_to_roundpipe``)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..quant import refuse_foreign_quantization
from ..wrapper import RoundPipe
from . import moe, save
from .attention import describe, use_segment_attention
from .layers import Decoder, Postfix, Prefix, RoutingState
from .loss import TokenStats, count_items
from .packed import packed_starts, split_packed
from .parts import Parts, check_logits, disable_gradient_checkpointing

# keyword arguments of HF's ForCausalLM.forward that the wrapper honours
_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")


class HFRoundPipe(RoundPipe):
    """A Hugging Face causal LM (or a PEFT model around one) in RoundPipe; see
    :func:`roundpipe.wrap_model_to_roundpipe`, which builds it.

    Attributes:
        hf_model: the transformers model (the PEFT model's base model for PEFT).
        peft_model: the ``PeftModel`` or None. ``module`` (what ``state_dict``,
            ``named_parameters`` and attribute access present) is the PEFT model if any,
            else the transformers model.
        loss_chunk_size: tokens per chunk of the training loss.
    """

    def __init__(self, model: nn.Module, optim_dtype: Optional[torch.dtype] = None, *,
                 loss_chunk_size: int = 1024, **roundpipe_kwargs: Any) -> None:
        if not isinstance(loss_chunk_size, int) or isinstance(loss_chunk_size, bool) \
                or loss_chunk_size < 1:
            raise ValueError(f"wrap_model_to_roundpipe: loss_chunk_size must be an int >= 1, "
                             f"got {loss_chunk_size!r}")
        if "layers" in roundpipe_kwargs:
            raise TypeError("wrap_model_to_roundpipe: layers= is built from the model; not accepted")
        refuse_foreign_quantization(model, "wrap_model_to_roundpipe")
        peft = _peft_base(model)
        hf = model if peft is None else peft.get_base_model()
        parts = Parts(hf)
        routing, routers = _find_moe(hf, parts)
        moe_layers = sorted(routers)
        layers = [Prefix(parts.embed_tokens, parts.rotary_emb, parts.rope_types,
                         parts.embed_dropout)]
        layers += [Decoder(layer, parts.config, fn, routing if i in moe_layers else None, i,
                           None if parts.rope_types is None else parts.rope_types[i])
                   for i, (layer, fn) in enumerate(zip(parts.layers, parts.mask_fns))]
        layers.append(Postfix(parts.norm, parts.lm_head, loss_chunk_size))
        use_segment_attention(hf, parts.config, bool(parts.mask_kwargs),
                              lambda: check_logits(hf, parts, layers))
        if roundpipe_kwargs.get("split_fn") is None:  # packed rows cut at sequence starts
            roundpipe_kwargs["split_fn"] = split_packed
        super().__init__(model, optim_dtype, layers=layers, **roundpipe_kwargs)
        disable_gradient_checkpointing(model)
        for modules in routers.values():
            for router in modules:
                router.register_forward_hook(moe.router_hook)
        self.hf_model = hf
        self.peft_model = peft
        self.loss_chunk_size = loss_chunk_size
        self._routing = routing

    def _microbatches(self, args, kwargs, label, num_microbatch) -> list:
        """The call's microbatches (:meth:`RoundPipe._microbatches`, ``split_fn``), each told
        its :class:`~roundpipe.hf.attention.Segments` here, on the host, so that no decoder
        layer has to ask the device."""
        return [(a, {**kw, "segments": describe(kw)}, lab)
                for a, kw, lab in super()._microbatches(args, kwargs, label, num_microbatch)]

    def _last_stage_fence(self, layers: list[nn.Module]) -> tuple[int, str]:
        """With the router auxiliary loss on, no MoE decoder layer may be in the last stage:
        the loss needs the whole forward pass's routing before its backward (see
        :mod:`roundpipe.hf.moe`)."""
        moe_layers = [i for i, layer in enumerate(layers)
                      if isinstance(layer, Decoder) and layer.routing is not None
                      and layer.routing.coef is not None]
        if not moe_layers:
            return 0, ""
        return max(moe_layers) + 1, (
            f"layer {max(moe_layers)} is a MoE layer, and its router auxiliary loss needs the "
            "whole forward pass before its backward, so the last stage must hold only the "
            "layers after it (the postfix); choose a plan whose last stage starts there (e.g. "
            "layers_per_stage=1, or 'auto')")

    def __getattr__(self, name: str) -> Any:
        """Attributes not of the wrapper come from the wrapped model (``config``,
        ``generation_config``, ``peft_config``, ...)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or "module" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules["module"], name)

    # --- passes -----------------------------------------------------------------------------

    def _begin_routing(self) -> Optional[moe.RouterStats]:
        """Fresh routing sums for a call (MoE models with the auxiliary loss on)."""
        if self._routing is None or self._routing.coef is None:
            return None
        self._routing.stats = moe.RouterStats(self._routing.num_experts)
        return self._routing.stats

    def forward(self, input_ids: Optional[torch.Tensor] = None, attention_mask=None, *,
                labels: Optional[torch.Tensor] = None, num_microbatch: Optional[int] = None,
                use_cache: Optional[bool] = None, return_dict: Optional[bool] = None,
                **kwargs: Any):
        """Runs the model as ``hf_model(input_ids, attention_mask, labels=..., use_cache=False)``
        would, in microbatches, without autograd, and returns the same kind of output object
        (``CausalLMOutputWithPast``, or ``MoeCausalLMOutputWithPast`` for MoE models) on the
        host: ``logits`` ``(B, S, V)`` in the model dtype, and with ``labels`` the ``loss``
        (HF's ``loss_function`` on the merged logits; for MoE with
        ``config.output_router_logits``, plus ``router_aux_loss_coef * aux_loss``).

        A padding-free (packed) batch, one row of sequences whose ``position_ids`` restart at
        each (no ``attention_mask``; see :mod:`roundpipe.hf.packed`), keeps attention within
        each sequence, as transformers does without a cache, and runs as one microbatch.

        Accepted keyword arguments: ``position_ids``, ``inputs_embeds``, ``labels``,
        ``num_items_in_batch``, ``use_cache``, ``cache`` (or ``past_key_values``),
        ``logits_to_keep``, ``return_dict`` (ignored: an output object is always returned),
        ``num_microbatch``.

        **With a KV cache** (``use_cache=True``, or ``cache=`` a
        :class:`~roundpipe.hf.PipelineCache` from an earlier call or ``generate``): the pass
        of :func:`roundpipe.hf.generate.cached_forward`, as the model's forward with a cache:
        the new positions' keys and values are appended layer by layer (on the host), the
        output carries the cache (``out.cache``) to pass back, and ``logits_to_keep`` keeps
        the last positions' logits only (no MoE auxiliary loss). Microbatches: those of the
        cache (``num_microbatch`` when a new one is made, default 1).

        Raises:
            TypeError: another keyword argument (e.g. ``output_attentions``), or a cache that
                is not a ``PipelineCache``.
        """
        if "past_key_values" in kwargs:
            kwargs["cache"] = kwargs.pop("past_key_values")
        if use_cache or kwargs.get("cache") is not None or "logits_to_keep" in kwargs:
            from .generate import cached_forward

            with self._call("forward"):
                return cached_forward(self, input_ids, attention_mask, labels=labels,
                                      use_cache=use_cache, num_microbatch=num_microbatch,
                                      **kwargs)
        kwargs.pop("cache", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        inputs = _inputs(input_ids, attention_mask, kwargs, "forward")
        stats = self._begin_routing()
        if packed_starts(inputs):
            # a packed row's logits are (1, N, V): one microbatch (pieces of the row would be
            # merged along the batch dimension); forward_backward cuts it at sequence starts
            num_microbatch = 1
        logits = super().forward(num_microbatch=num_microbatch, **inputs)
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

        loss = None
        if labels is not None:
            extra = {} if num_items is None else {"num_items_in_batch": num_items}
            loss = self.hf_model.loss_function(logits, labels, vocab_size=self.hf_model.config.vocab_size,
                                               **extra)
        if self._routing is None:
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        aux = None
        if stats is not None:
            aux = stats.aux_loss()
            if loss is not None:
                loss = loss + self._routing.coef * aux
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits)

    def forward_backward(self, input_args: tuple = (), input_kwargs: Optional[dict] = None,
                         label: Any = None, loss_fn: Optional[Callable[..., torch.Tensor]] = None,
                         return_outputs: bool = False, num_microbatch: Optional[int] = None,
                         optimizer: Optional[torch.optim.Optimizer] = None, **step_kwargs: Any):
        """One forward and backward pass (see :meth:`roundpipe.RoundPipe.forward_backward`;
        ``step_kwargs``: its ``grad_scaler``, ``max_grad_norm``, ``norm_type``,
        ``error_if_nonfinite``).

        Without ``loss_fn``: HF's causal-LM loss of the **whole batch**.
        ``input_kwargs`` holds ``input_ids`` (or ``inputs_embeds``), optionally
        ``attention_mask`` and ``position_ids``, and ``labels`` (``(B, S)`` int, ``-100``
        ignored, shifted inside as HF does). The returned loss and the gradients are those of
        ``hf_model(**input_kwargs).loss`` on the unsplit batch, whatever ``num_microbatch``:
        the cross-entropy summed over the batch's scored tokens and divided by their count
        (``num_items_in_batch`` in ``input_kwargs``, a number or 0-dim tensor, overrides the
        count, e.g. for gradient accumulation over several calls, as HF's Trainer passes it;
        a batch without a scored token, e.g. every label -100 or one token per row, gives
        HF's loss NaN and zero gradients, as ``loss.backward()`` does there),
        plus, for a MoE model with ``config.output_router_logits``,
        ``router_aux_loss_coef`` times HF's load-balancing loss of the whole batch (see
        :mod:`roundpipe.hf.moe`). The cross-entropy is computed in chunks of
        ``loss_chunk_size`` tokens, never materialising the logits; the same chunks count
        :meth:`last_token_stats`. A padding-free (packed) batch, one row whose
        ``position_ids`` restart at each sequence, is cut into microbatches at sequence
        starts (:mod:`roundpipe.hf.packed`, the default ``split_fn``).

        With ``loss_fn``: as :class:`~roundpipe.RoundPipe`, ``loss_fn`` receiving the logits
        ``(b, S, V)`` of each microbatch (and its ``label``), weighted by ``loss_reduction``
        (default ``"mean"``: rows; ``"token_mean"`` for a token mean over an aligned label).

        Raises:
            TypeError: no ``loss_fn`` and no ``labels``; ``input_args`` without ``loss_fn``
                (pass keyword arguments), or a tensor as ``input_args``
                (``forward_backward(ids)``); an unsupported keyword argument;
                ``return_outputs=True`` without ``loss_fn``.
        """
        if isinstance(input_args, torch.Tensor):
            # forward_backward(ids): `if input_args` would be torch's "Boolean value of Tensor
            # ... is ambiguous"; say what to write instead
            raise TypeError("RoundPipe.forward_backward: got a tensor as its first positional "
                            "argument (input_args); pass the model inputs by keyword: "
                            "forward_backward(input_kwargs={'input_ids': ids, 'labels': ids}) for "
                            "HF's loss, or input_args=(ids,) with a loss_fn")
        kwargs = dict(input_kwargs or {})
        if loss_fn is not None:
            if "labels" in kwargs:
                raise TypeError("RoundPipe.forward_backward: with loss_fn, pass the targets as "
                                "label=, not labels in input_kwargs")
            self._begin_routing()
            return super().forward_backward(input_args, kwargs, label, loss_fn, return_outputs,
                                            num_microbatch, optimizer, **step_kwargs)
        if input_args:
            raise TypeError("RoundPipe.forward_backward: pass the model inputs as input_kwargs "
                            "(input_ids=..., labels=...)")
        if "loss_reduction" in step_kwargs:
            raise TypeError("RoundPipe.forward_backward: loss_reduction is for a custom loss_fn; "
                            "HF's built-in loss is the token mean over the whole batch "
                            "(num_items_in_batch in input_kwargs sets its denominator)")
        if return_outputs:
            raise TypeError("RoundPipe.forward_backward: return_outputs=True needs a loss_fn (the "
                            "built-in loss never materialises the logits)")
        labels = kwargs.pop("labels", None)
        if labels is None:
            raise TypeError("RoundPipe.forward_backward: give labels in input_kwargs (HF's "
                            "causal-LM loss) or a loss_fn")
        if label is not None:
            raise TypeError("RoundPipe.forward_backward: label= is for a custom loss_fn; put "
                            "the targets in input_kwargs['labels']")
        num_items = kwargs.pop("num_items_in_batch", None)
        inputs = _inputs(kwargs.pop("input_ids", None), kwargs.pop("attention_mask", None),
                         kwargs, "forward_backward")
        inputs["labels"] = labels
        scored = count_items(labels)
        if num_items is None:
            num_items = scored
        mean = _token_mean(float(num_items))
        sums: list = []  # each microbatch's (top-1 hits, entropy), on its device

        def loss_fn(out: dict) -> torch.Tensor:
            sums.append((out["top1"], out["entropy"]))
            return mean(out["loss"])

        self._loss_stats = None
        stats = self._begin_routing()
        loss = super().forward_backward((), inputs, None, loss_fn, False, num_microbatch,
                                        optimizer, loss_reduction="sum", **step_kwargs)
        self._loss_stats = TokenStats(int(scored), sum(int(h) for h, _ in sums),
                                      sum(float(e) for _, e in sums))
        if stats is not None:
            loss = loss + self._routing.coef * stats.aux_loss()
        return loss

    def last_token_stats(self) -> Optional[TokenStats]:
        """What the last :meth:`forward_backward` with the built-in loss counted over its
        scored tokens (:class:`roundpipe.hf.loss.TokenStats`: their number, how many had the
        top-1 logit as target, their summed entropy: TRL's ``mean_token_accuracy`` and
        ``entropy``), from the logits the loss computed anyway, chunk by chunk; None before
        the first such call, or when it failed."""
        return self.__dict__.get("_loss_stats")

    # --- generation --------------------------------------------------------------------------

    def generate(self, inputs: Optional[torch.Tensor] = None, generation_config: Any = None, *,
                 kv_cache: str = "host", num_microbatch: Optional[int] = None, **kwargs: Any):
        """Generates as the wrapped model's own transformers ``generate`` does, through the
        pipeline (see :mod:`roundpipe.hf.generate`): the same arguments (``inputs`` /
        ``input_ids``, ``attention_mask`` for left-padded batches, ``generation_config``,
        ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``eos_token_id``, ``num_return_sequences``, ``streamer``, ``return_dict_in_generate``,
        ``output_logits``, ``prefill_chunk_size``, ...) and the same result (token ids
        ``(batch * num_return_sequences, prompt + new)`` on the host, or transformers' output
        object), token for token: greedy search gives transformers' tokens, sampling with the
        same seed gives its samples. Each decoding step is one pass that streams every stage's
        weights once for the whole batch; the prompt is prefilled in one pass, in chunks of
        ``prefill_chunk_size`` positions when set.

        It first waits for pending optimizer work (:meth:`synchronize`: it generates with the
        current weights), holds the wrapper's call lock throughout (other threads' calls wait;
        a call from a layer or step function of this model raises), runs every module in
        eval mode without autograd and gives each its mode back after; gradients accumulated
        since the last step, optimizer state and the RNG are left as they were (only sampling
        draws random numbers, as in transformers).

        Args (besides transformers'):
            kv_cache: ``"host"`` (default): each decoder layer's keys and values in host
                memory in the model dtype, uploaded to the layer's device once per step (its
                sliding window only) and the new ones downloaded; ``"device"``: on the
                device that runs the layer, nothing moved (they must fit there).
            num_microbatch: microbatches of rows per pass (default 1: the whole batch at
                once; more bound the activation memory and pipeline several devices).
            cache / past_key_values: a :class:`~roundpipe.hf.PipelineCache` to continue from.

        Raises:
            ValueError: ``kv_cache`` not ``"host"``/``"device"``, a bad ``num_microbatch`` or
                ``prefill_chunk_size``, beam search (``num_beams > 1``), assisted decoding,
                ``custom_generate``, a ``cache_implementation`` other than dynamic, or
                ``prefill_chunk_size`` with ``use_cache=False`` (all before anything runs);
                what transformers' ``generate`` raises.
            TypeError: ``cache`` is not a ``PipelineCache``.
            RuntimeError: called from inside this model's own call.
        """
        from .generate import generate

        return generate(self, inputs, generation_config, kv_cache=kv_cache,
                        num_microbatch=num_microbatch, **kwargs)

    # --- checkpoints ------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str, dtype: Optional[torch.dtype] = None,
                        merged: bool = False, **kwargs: Any) -> None:
        """Writes a checkpoint that transformers (or peft) loads; see
        :func:`roundpipe.hf.save.save_pretrained`."""
        save.save_pretrained(self, save_directory, dtype=dtype, merged=merged, **kwargs)


def _token_mean(denominator: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The loss_fn of the built-in loss: a microbatch's summed cross-entropy over the batch's
    scored tokens. With none (denominator 0) HF's mean is ``0 / 0`` = NaN and its backward
    gives zero gradients (no token contributes): the same here, instead of ``1 / 0``
    scaling zeros into NaN gradients that would reach every weight."""
    if denominator == 0:
        return lambda total: total * 0.0 + math.nan
    return lambda total: total / denominator


def _peft_base(model: nn.Module):
    """The model if it is a peft ``PeftModel``, else None."""
    import sys

    peft = sys.modules.get("peft")
    return model if peft is not None and isinstance(model, peft.PeftModel) else None


def _inputs(input_ids, attention_mask, kwargs: dict, where: str) -> dict:
    """The prefix's keyword arguments from HF-style inputs; anything else is a TypeError."""
    for key in ("use_cache", "return_dict"):
        if kwargs.get(key):
            if key == "use_cache":
                raise TypeError(f"RoundPipe.{where}: use_cache=True is not supported (no KV cache)")
        kwargs.pop(key, None)
    unknown = sorted(k for k in kwargs if k not in _INPUT_KEYS)
    if unknown:
        raise TypeError(f"RoundPipe.{where}: unsupported argument(s) {', '.join(unknown)} "
                        f"(supported: {', '.join(_INPUT_KEYS)}, labels, num_items_in_batch)")
    out = {k: v for k, v in kwargs.items() if v is not None}
    if input_ids is not None:
        out["input_ids"] = input_ids
    if attention_mask is not None:
        out["attention_mask"] = attention_mask
    return out


def _find_moe(hf: nn.Module, parts: Parts):
    """The routing state of a MoE model (None for a dense one) and its routers:
    ``{decoder layer index: [router modules]}``."""
    router_cls = moe.find_router_class(hf)
    if router_cls is None:
        return None, {}
    routers = {i: found for i, layer in enumerate(parts.layers)
               if (found := moe.find_routers(layer, router_cls))}
    if not routers:
        return None, {}
    config = parts.config
    coef = (float(config.router_aux_loss_coef)
            if getattr(config, "output_router_logits", False) else None)
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts")
    return RoutingState(int(num_experts), coef), routers
