"""The pipeline layers of a Hugging Face decoder-only causal LM.

A model is cut into ``[prefix, decoder layer 0, ..., decoder layer L-1, postfix]``. Layer 0 (the
prefix) receives the user's keyword arguments; every later layer receives the previous one's
output, a *state* dict:

============== =================================== ==========================================
key            value                               why it travels
============== =================================== ==========================================
hidden         ``(B, S, H)`` model dtype           the activation (the only tensor with a
                                                   gradient)
position_ids   ``(1, S)`` or ``(B, S)`` int64      HF's mask functions and attention kernels
attention_mask ``(B, S)`` as given, or None        the padding mask, 2D (see below)
segments       a :class:`~.attention.Segments`     which keys each token attends to, decided
                                                   once per microbatch on the host
                                                   (:func:`~.attention.describe`)
labels         ``(B, S)`` int64, shifted, or None  read by the postfix (the loss)
cos, sin       ``(1 or B, S, head_dim)`` bit       rotary embedding, computed once per
               pattern as an integer tensor        microbatch by the prefix
rope_dtype     a ``torch.dtype``                   the floating dtype of cos/sin
kv             a ``MicrobatchKV`` (generation)     the microbatch's part of the KV cache
               (absent without a cache)            (see :mod:`.kv_cache`): each decoder layer
                                                   reads and extends its own
logits_to_keep int, 1D tensor or None (absent: 0)  as transformers' ``logits_to_keep``; None:
                                                   no logits (a prefill chunk before the last)
============== =================================== ==========================================

A model whose rotary embedding takes a ``layer_type`` (Gemma 3, Olmo 3) gets ``cos.<type>`` and
``sin.<type>`` for each of its layer types instead of ``cos`` and ``sin``.

Bytes per layer and microbatch, host <-> device, besides the hidden state ``2·B·S·H`` (bf16):
the 2D mask, positions and labels (``8·S`` to ``8·B·S`` each) and cos/sin (``4·S·head_dim`` for
the default positions) — a few percent of the hidden state for real sizes. Two choices keep it so:

- No 4D attention mask exists, neither sent nor built: under RoundPipe's attention
  implementation (:mod:`.attention`, what a model on transformers' default ``"sdpa"`` gets),
  each decoder layer passes the microbatch's :class:`~.attention.Segments`, planned for its
  sliding window, as its ``attention_mask``, and attention runs segment by segment in memory
  linear in ``S``. Under another implementation (``"eager"``, ``"flash_attention_2"``, ...) and
  with a KV cache, each decoder layer calls HF's own mask function (``create_causal_mask`` /
  ``create_sliding_window_causal_mask``) on the 2D mask, on the device, as HF's model forward
  does once per call (``B·S²`` for a padded batch under ``"eager"``, as in transformers).
- No layer asks the device what its mask is. HF's mask functions decide it with a Python
  ``if`` on the 2D mask (``padding_mask.all()``) or on the positions (packed sequences): on a
  GPU each is a host wait for the device to finish the work issued so far, once per layer and
  microbatch, forward and recomputation. :func:`~.attention.describe` decides it once per
  microbatch from the host's tensors, and the layers call HF's function so that it does not
  look (the same mask: see ``Segments.kind``).
- cos/sin travel as their bit patterns in an integer tensor (``Tensor.view(torch.int16)`` for
  bf16/fp16, ``int32`` for fp32): the pipeline attaches gradients only to floating stage inputs,
  so no gradient is computed for them or sent back through every layer; the decoder layer views
  them back (no copy, exact).

Labels travel with the state rather than through ``label=``/``loss_fn``, because the loss is
computed inside the postfix, where the ``lm_head`` weight is (see :mod:`.loss`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from . import attention, moe
from .attention import Segments
from .loss import chunked_cross_entropy_sum, shift_labels

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.element_size()])


class Prefix(nn.Module):
    """Layer 0: token embeddings (and the dropout the model's forward applies to them, if any:
    ``embed_dropout``, e.g. Phi's and Starcoder2's), position ids, rotary cos/sin (once per
    microbatch), shifted labels. Takes the keyword arguments of HF's ``ForCausalLM.forward``
    that RoundPipe supports."""

    def __init__(self, embed_tokens: nn.Module, rotary_emb: nn.Module,
                 rope_types: Optional[list] = None,
                 embed_dropout: Optional[Callable] = None) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        # the layer types the rotary embedding is computed for (None: one for every layer)
        self.rope_types = None if rope_types is None else sorted(set(rope_types))
        self.embed_dropout = embed_dropout

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, kv: Any = None,
                logits_to_keep: Any = 0, segments: Optional[Segments] = None) -> dict:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("RoundPipe (Hugging Face model): give exactly one of input_ids "
                             "and inputs_embeds")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embed_dropout is not None:  # as the model's forward: given embeddings too
            hidden = self.embed_dropout(hidden)
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rope = {}
        for kind in self.rope_types or [None]:
            cos, sin = (self.rotary_emb(hidden, position_ids) if kind is None
                        else self.rotary_emb(hidden, position_ids, kind))
            suffix = "" if kind is None else "." + kind
            rope["cos" + suffix], rope["sin" + suffix] = _as_bits(cos), _as_bits(sin)
        state = {"hidden": hidden, "position_ids": position_ids, "attention_mask": attention_mask,
                 "segments": segments,
                 "labels": None if labels is None else shift_labels(labels),
                 **rope, "rope_dtype": cos.dtype}
        if kv is not None:
            state["kv"] = kv
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            state["logits_to_keep"] = logits_to_keep
        return state


class Decoder(nn.Module):
    """One HF decoder layer, called as the HF model calls it, with its 4D mask built by
    ``mask_fn`` (HF's mask function for the layer's attention type): ``use_cache=False``, or,
    when the state carries a KV cache (generation), with its layer's view of it as ``cache``.
    ``index``: the layer's position among the decoder layers (its KV cache layer);
    ``sliding_window``: its window (None for full attention), read from the config when
    ``mask_fn`` is HF's sliding-window mask function; ``rope_type``: the layer type whose
    cos/sin it reads (``cos.<type>``) when the rotary embedding takes one, else None."""

    def __init__(self, layer: nn.Module, config: Any, mask_fn: Callable,
                 routing: Optional["RoutingState"] = None, index: int = 0,
                 rope_type: Optional[str] = None) -> None:
        super().__init__()
        import inspect

        from transformers import masking_utils as mu

        self.layer = layer
        self.config = config
        self.mask_fn = mask_fn
        self.routing = routing
        self.index = index
        base = getattr(mask_fn, "func", mask_fn)  # a functools.partial of HF's function
        sliding = (base is mu.create_sliding_window_causal_mask
                   or getattr(base, "__name__", "") == "create_sliding_window_causal_mask")
        self.sliding_window = getattr(config, "sliding_window", None) if sliding else None
        params = inspect.signature(layer.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.rope_suffix = "" if rope_type is None else "." + rope_type
        # whether HF's mask function can be told not to look at a padded mask (newer 5.x)
        self._no_skip = "allow_is_causal_skip" in inspect.signature(base).parameters

    def _mask(self, state: dict, hidden: torch.Tensor, cache: Any):
        """The layer's attention mask: under :data:`.attention.NAME` without a cache, the
        microbatch's segments planned for the layer's window (None: plain causal); else HF's
        4D mask (or None: SDPA's ``is_causal``) from HF's mask function, told what
        :func:`~.attention.describe` found so that it reads nothing on the device."""
        segments = state.get("segments")
        if (cache is None and segments is not None and segments.rows is not None
                and self.config._attn_implementation == attention.NAME):
            return segments.mask(self.sliding_window, state["attention_mask"])
        kind = None if segments is None else segments.kind
        if kind == "causal":
            return self.mask_fn(self.config, hidden, None, cache, None)
        look = (kind != "padded" or not self._no_skip
                or (cache is not None and self.sliding_window is not None))
        extra = {} if look else {"allow_is_causal_skip": False}
        # positional: the 4th parameter is the cache (named past_key_values before 5.x renames)
        return self.mask_fn(self.config, hidden, state["attention_mask"], cache,
                            state["position_ids"], **extra)

    def forward(self, state: dict) -> dict:
        hidden = state["hidden"]
        kv = state.get("kv")
        cache = None if kv is None else kv.view(self.index)
        mask = self._mask(state, hidden, cache)
        dtype = state["rope_dtype"]
        rope = (state["cos" + self.rope_suffix].view(dtype),
                state["sin" + self.rope_suffix].view(dtype))
        # generation passes (a cache, or logits_to_keep as generate passes it) keep no routing
        # for a recomputation and sum none for the auxiliary loss
        if self.routing is None or cache is not None or "logits_to_keep" in state:
            out = self._call(hidden, mask, state["position_ids"], rope, cache)
        else:
            with moe.routing_scope(self.routing.stats, state["attention_mask"], self.routing.coef):
                out = self._call(hidden, mask, state["position_ids"], rope, None)
        return {**state, "hidden": out}

    def _call(self, hidden, mask, position_ids, rope, cache) -> torch.Tensor:
        extra = {} if cache is None else {self._cache_arg: cache}
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                         position_embeddings=rope, use_cache=cache is not None, **extra)
        return out[0] if isinstance(out, tuple) else out


class Postfix(nn.Module):
    """Last layer: final norm, then either the logits (no labels in the state: ``(B, S, V)``, as
    HF's ``logits``) or, computed in chunks of ``chunk_size`` tokens without the logits (see
    :mod:`.loss`), the microbatch's sums as a dict: ``loss`` the summed cross-entropy (fp32,
    0-dim, differentiable), ``top1`` the scored tokens whose target is the top-1 logit (int64)
    and ``entropy`` their summed entropy (fp32), both 0-dim without gradient."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, chunk_size: int) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.chunk_size = chunk_size

    def forward(self, state: dict) -> Optional[torch.Tensor]:
        hidden = self.norm(state["hidden"])
        if state["labels"] is None:
            keep = state.get("logits_to_keep", 0)
            if keep is None:  # a prefill chunk whose logits nobody reads
                return None
            if not (isinstance(keep, int) and keep == 0):
                hidden = _keep_positions(hidden, keep)
            return self.lm_head(hidden)
        loss, top1, entropy = chunked_cross_entropy_sum(
            hidden, self.lm_head.weight, self.lm_head.bias, state["labels"], self.chunk_size,
            with_stats=True)
        return {"loss": loss, "top1": top1, "entropy": entropy}


def _keep_positions(hidden: torch.Tensor, keep) -> torch.Tensor:
    """The positions of ``hidden`` (B, S, H) whose logits the model's forward computes for
    ``logits_to_keep``: transformers' ``slice_logits_to_keep`` where it has one (5.2x: 2D
    position and mask tensors too), else what its models did before it (an int keeps the last
    ``keep`` positions, a tensor indexes the positions)."""
    from transformers import modeling_utils

    slicer = getattr(modeling_utils, "slice_logits_to_keep", None)
    if slicer is not None:
        return slicer(hidden, keep)
    return hidden[:, slice(-keep, None) if isinstance(keep, int) else keep, :]


class RoutingState:
    """Shared by the MoE decoder layers of one wrapper: the current call's
    :class:`~roundpipe.hf.moe.RouterStats` (set by the wrapper before each pass) and the
    auxiliary-loss coefficient (None: no auxiliary loss)."""

    def __init__(self, num_experts: int, coef: Optional[float]) -> None:
        self.num_experts = num_experts
        self.coef = coef
        self.stats: Optional[moe.RouterStats] = None
