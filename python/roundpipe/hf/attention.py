"""Attention within segments, in memory linear in the sequence: the attention implementation
(``"roundpipe_sdpa"``) a wrapped Hugging Face model runs in place of transformers' ``"sdpa"``.

transformers' sdpa path builds a dense boolean mask ``(B, 1, S, S)`` for every batch that is not
plain causal: a padded one (an ``attention_mask`` with a zero), a packed one (``position_ids``
that restart: TRL's ``padding_free`` / ``packing``), and for a sliding-window layer longer than
its window; sdpa then converts it to a float mask. At 32K tokens that is gigabytes per row. Yet
the mask is a simple function of the row: query ``q`` attends key ``k`` when

    ``k <= q`` and ``valid[k]`` and ``segment[k] == segment[q]`` and ``q - k < window``

(transformers' ``causal_mask_function``, ``padding_mask_function``,
``packed_sequence_mask_function`` and ``sliding_window_overlay``): ``valid`` is the 2D
``attention_mask``; ``segment`` the packed sequence, a new one wherever ``position_ids`` do not
count up by one (``find_packed_sequence_indices``, which transformers applies only without an
``attention_mask`` and without a cache); ``window`` a sliding-window layer's. So each segment is
attended on its own, by sdpa on slices of the query, key and value:

- a segment whose valid tokens form one run ``[v0, v1)``, the window (if any) no shorter than
  the segment: queries ``[v0, v1)`` attend causally (sdpa's ``is_causal``, no mask); padding
  queries after the run attend to all of it (no mask); padding queries before it attend to no
  key and get 0, as sdpa gives a fully masked row;
- any other segment (a window shorter than it, or valid tokens with a gap): its queries in
  chunks, each against only the keys it can reach, ``[max(segment start, q0 - window + 1), q1)``,
  with the chunk's mask built on the device (at most :data:`CHUNK_MASK_ELEMENTS` elements) and
  rebuilt in the backward (``torch.utils.checkpoint``) rather than kept.

Nothing is ``O(S^2)`` in memory: the largest extra tensors are the pieces' outputs (the size of
the attention output) and one chunk's mask. The result equals sdpa with transformers' mask to
rounding (the same softmax over the same keys; kernels may sum in another order).

Where things are decided: :func:`describe` reads a microbatch's ``attention_mask`` and
``position_ids`` once, on the host, into :class:`Segments` (plain Python integers: what
``roundpipe.hf.layers`` passes between layers); each decoder layer asks it for the
:class:`SegmentMask` of its window (:meth:`Segments.mask`, planned once per window) and passes
that as the layer's ``attention_mask``; transformers' attention module hands it to
:func:`segment_attention` through its ``AttentionInterface``, so the decoder layer's own code
runs unchanged. A plain causal batch gets ``None`` (transformers' own sdpa call,
``is_causal``). Any other mask (a tensor: the model run outside the pipeline, or with a KV
cache during generation) goes to transformers' ``sdpa_attention_forward`` as it would under
``"sdpa"``, with the mask transformers builds for ``"sdpa"`` (``sdpa_mask``, registered for
this name too).

On CUDA the same calls run sdpa's flash or memory-efficient kernels per segment. A model loaded
with ``attn_implementation="flash_attention_2"`` (flash-attn's variable-length kernels, also
linear) keeps it: :func:`use_segment_attention` replaces ``"sdpa"`` only. FlexAttention's block
masks are not used: torch 2.13 has no FlexAttention backward on the CPU, and on CUDA it is fast
only compiled.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

#: the name registered with transformers' ``AttentionInterface`` / ``AttentionMaskInterface``
NAME = "roundpipe_sdpa"

#: elements of the mask of one chunk of a masked segment (``queries x keys``, per row): bounds
#: the transient memory of a chunk whatever the sequence length
CHUNK_MASK_ELEMENTS = 1 << 22

#: a piece of a row: ``(how, q0, q1, k0, k1)``, queries ``[q0, q1)`` against keys ``[k0, k1)``;
#: ``how`` is "causal" (q0 == k0, q1 == k1), "full" (every key for every query), "none" (no
#: key: output 0) or "masked" (a segment ``[q0, q1)`` attended in chunks with a mask)
Piece = tuple


@dataclass(eq=False)
class Segments:
    """How one microbatch's tokens attend (see the module docstring), decided on the host.

    Attributes:
        kind: ``"causal"`` (no padding, no packed sequences: transformers' mask functions give
            the plain causal mask), ``"padded"`` (a 2D mask with a zero), ``"packed"``
            (positions that restart, without a mask or a cache), or None (a mask that is not
            2D, or of another length than the inputs: left to transformers).
        rows: per row of the batch, its segments ``((a, b, ((v0, v1), ...)), ...)``: the
            segment ``[a, b)`` and the runs of valid tokens in it; None with ``kind`` None or
            with a KV cache (generation: transformers' masks are used then).
        length: the sequence length ``S``.
    """

    kind: Optional[str]
    rows: Optional[tuple] = None
    length: int = 0
    _plans: dict = field(default_factory=dict, init=False, repr=False)

    def mask(self, window: Optional[int], attention_mask: Optional[torch.Tensor]):
        """What a layer with sliding window ``window`` (None: full attention) passes as its
        ``attention_mask``: None for plain causal attention (no mask at all), else a
        :class:`SegmentMask`; ``attention_mask`` is the microbatch's 2D mask on the device
        (read only by masked pieces)."""
        plan = self._plans.get(window)
        if plan is None:
            plan = self._plans.setdefault(window, _plan(self.rows, window))
        if len(plan) == 1 and plan[0][2] == (("causal", 0, self.length, 0, self.length),):
            return None
        return SegmentMask(plan, window, attention_mask)


@dataclass(frozen=True)
class SegmentMask:
    """A layer's attention mask as :func:`segment_attention` reads it: ``plan`` is a tuple of
    ``(r0, r1, pieces)`` for consecutive rows ``[r0, r1)`` that share their pieces (see
    :data:`Piece`); ``window`` the layer's sliding window or None; ``valid`` the 2D
    ``attention_mask`` ``(B, S)`` on the device or None."""

    plan: tuple
    window: Optional[int]
    valid: Optional[torch.Tensor]


def describe(inputs: dict) -> Segments:
    """The :class:`Segments` of one microbatch's prefix keyword arguments (``input_ids`` or
    ``inputs_embeds`` ``(B, S, ...)``, ``attention_mask`` ``(B, S_kv)``, ``position_ids``
    ``(1 or B, S)``, ``kv`` for a pass with a KV cache), read where they are (the host,
    normally: no device wait; on a device, a few reads per microbatch, none per layer).

    Follows transformers' decisions: a mask of ones is no mask; packed sequences are looked
    for only without a mask and without a cache, starting wherever the positions do not count
    up by one."""
    mask = inputs.get("attention_mask")
    cached = inputs.get("kv") is not None
    x = inputs.get("input_ids")
    if x is None:
        x = inputs.get("inputs_embeds")
    batch, length = (x.shape[0], x.shape[1]) if x is not None and x.dim() >= 2 else (0, 0)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return Segments(None)
        valid = mask.bool()
        kind = "causal" if bool(valid.all()) else "padded"
        if cached or tuple(mask.shape) != (batch, length):
            return Segments(kind)
        if kind == "causal":
            return Segments(kind, _whole_rows(batch, length), length)
        return Segments(kind, tuple(((0, length, runs),) for runs in _valid_runs(valid)), length)
    pos = inputs.get("position_ids")
    if cached or pos is None or pos.shape[-1] < 2 or pos.shape[-1] != (length or pos.shape[-1]):
        return Segments("causal", None if cached else _whole_rows(batch, length), length)
    pos = pos.reshape(-1, pos.shape[-1])
    batch, length = batch or pos.shape[0], pos.shape[-1]
    breaks = (torch.diff(pos, dim=-1) != 1).nonzero().tolist()
    if not breaks:
        return Segments("causal", _whole_rows(batch, length), length)
    starts: list[list[int]] = [[0] for _ in range(pos.shape[0])]
    for r, i in breaks:
        starts[r].append(i + 1)
    rows = tuple(tuple((a, b, ((a, b),)) for a, b in zip(s, s[1:] + [length])) for s in starts)
    if len(rows) == 1:
        rows = rows * batch
    return Segments("packed", rows, length)


def _whole_rows(batch: int, length: int) -> tuple:
    return (((0, length, ((0, length),)),),) * batch


def _valid_runs(valid: torch.Tensor) -> list[tuple]:
    """Per row of a boolean ``(B, S)`` mask, its runs of True as ``((v0, v1), ...)``."""
    batch, length = valid.shape
    flips = (valid[:, 1:] != valid[:, :-1]).nonzero().tolist()
    first = valid[:, 0].tolist()
    edges: list[list[int]] = [[] for _ in range(batch)]
    for r, i in flips:
        edges[r].append(i + 1)
    out = []
    for r in range(batch):
        bounds = [0, *edges[r], length]
        on = first[r]
        runs = []
        for a, b in zip(bounds, bounds[1:]):
            if on:
                runs.append((a, b))
            on = not on
        out.append(tuple(runs))
    return out


def _plan(rows: tuple, window: Optional[int]) -> tuple:
    """``(r0, r1, pieces)`` for each stretch of consecutive rows with the same pieces."""
    out: list = []
    for r, row in enumerate(rows):
        pieces = _row_pieces(row, window)
        if out and out[-1][2] == pieces:
            out[-1] = (out[-1][0], r + 1, pieces)
        else:
            out.append((r, r + 1, pieces))
    return tuple(out)


def _row_pieces(row: tuple, window: Optional[int]) -> tuple:
    out = []
    for a, b, runs in row:
        if not runs:
            out.append(("none", a, b, a, a))
        elif len(runs) == 1 and (window is None or b - runs[0][0] <= window):
            v0, v1 = runs[0]
            if a < v0:
                out.append(("none", a, v0, a, a))
            out.append(("causal", v0, v1, v0, v1))
            if v1 < b:
                out.append(("full", v1, b, v0, v1))
        else:
            out.append(("masked", a, b, a, b))
    return tuple(out)


# --- the attention function -----------------------------------------------------------------

def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                      scaling: Optional[float] = None, **kwargs: Any):
    """transformers' attention-interface function for :data:`NAME`: ``query`` ``(B, Hq, S,
    D)``, ``key`` / ``value`` ``(B, Hkv, S, D)`` (``Hq`` a multiple of ``Hkv``) on any device,
    any floating dtype; returns ``(output (B, S, Hq, D), None)`` as transformers'
    ``sdpa_attention_forward``. With a :class:`SegmentMask`, attends segment by segment (see
    the module docstring); with anything else (None, a tensor), is
    ``sdpa_attention_forward`` itself.

    Raises:
        ValueError: a ``softcap`` or a ``position_bias`` with a :class:`SegmentMask` (sdpa
            supports neither a softcap nor, here, a bias).
    """
    if not isinstance(attention_mask, SegmentMask):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError(f"attention {NAME!r}: a softcap or a position bias is not supported; "
                         "load the model with attn_implementation='eager'")
    groups = []
    for r0, r1, pieces in attention_mask.plan:
        q, k, v = query[r0:r1], key[r0:r1], value[r0:r1]
        valid = None if attention_mask.valid is None else attention_mask.valid[r0:r1]
        parts = [_piece(p, q, k, v, valid, attention_mask.window, dropout, scaling)
                 for p in pieces]
        groups.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = groups[0] if len(groups) == 1 else torch.cat(groups, dim=0)
    return out.transpose(1, 2).contiguous(), None


def _piece(piece: Piece, q, k, v, valid, window, dropout, scale) -> torch.Tensor:
    how, q0, q1, k0, k1 = piece
    if how == "none":
        return q.new_zeros(q.shape[0], q.shape[1], q1 - q0, v.shape[-1])
    if how == "masked":
        return _masked_segment(q, k, v, valid, q0, q1, window, dropout, scale)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(
        q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], dropout_p=dropout, scale=scale,
        is_causal=how == "causal", **({"enable_gqa": True} if gqa else {}))


def _masked_segment(q, k, v, valid, a, b, window, dropout, scale) -> torch.Tensor:
    """Queries ``[a, b)`` of a segment ``[a, b)``, in chunks (see the module docstring)."""
    if window is None:  # a chunk of qc queries reaches at most the segment's b - a keys
        step = CHUNK_MASK_ELEMENTS // (b - a)
    else:  # ... at most qc + window - 1 keys: qc * (qc + window - 1) <= CHUNK_MASK_ELEMENTS,
        # and qc <= window, so that at least half of the chunk's mask is inside the window
        step = (math.isqrt((window - 1) ** 2 + 4 * CHUNK_MASK_ELEMENTS) - (window - 1)) // 2
        step = min(step, window)
    step = max(16, step)
    rep = q.shape[1] // k.shape[1]
    record = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs = []
    for q0 in range(a, b, step):
        q1 = min(q0 + step, b)
        lo = a if window is None else max(a, q0 - window + 1)
        args = (q[:, :, q0:q1], k[:, :, lo:q1], v[:, :, lo:q1],
                None if valid is None else valid[:, lo:q1])
        fn = functools.partial(_masked_chunk, q0=q0, k0=lo, window=window, rep=rep,
                               dropout=dropout, scale=scale)
        if record:
            from torch.utils.checkpoint import checkpoint

            outs.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            outs.append(fn(*args))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _masked_chunk(q, k, v, valid, *, q0, k0, window, rep, dropout, scale) -> torch.Tensor:
    """sdpa of queries ``q0 + [0, qc)`` against keys ``k0 + [0, kc)`` with transformers' mask
    for that block: causal, valid keys, within the window."""
    qi = torch.arange(q0, q0 + q.shape[2], device=q.device).unsqueeze(1)
    ki = torch.arange(k0, k0 + k.shape[2], device=q.device).unsqueeze(0)
    allowed = ki <= qi
    if window is not None:
        allowed = allowed & (qi - ki < window)
    allowed = allowed.unsqueeze(0) if valid is None else allowed & valid.bool()[:, None, :]
    if rep > 1:  # sdpa's fused kernels take a mask only without enable_gqa
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1),
                                          dropout_p=dropout, scale=scale)


# --- wiring it into a model -----------------------------------------------------------------

def register() -> None:
    """Registers :data:`NAME` with transformers: :func:`segment_attention` as its attention
    function, transformers' ``sdpa_mask`` as its mask function (for the model run outside
    the pipeline, or with a KV cache). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, segment_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_segment_attention(model: torch.nn.Module, config: Any, own_mask: bool,
                          check: Callable[[], None]) -> bool:
    """Switches a transformers model whose attention implementation is ``"sdpa"`` (the default)
    to :data:`NAME` (``model.set_attn_implementation``), unless its forward builds its own mask
    (``own_mask``, e.g. Doge's) or its config is not causal, then runs ``check`` (the wrap-time
    check, :func:`roundpipe.hf.parts.check_logits`, which raises ``TypeError``). Should the
    check fail under :data:`NAME` (an attention that reads its mask as a tensor), the model
    goes back to ``"sdpa"`` with a warning and ``check`` runs again, its error propagating.
    Returns whether the model runs :data:`NAME`. Other implementations (``"eager"``,
    ``"flash_attention_2"``, ...) are the user's choice and are kept;
    ``model.set_attn_implementation("sdpa")`` switches back (transformers' dense masks)."""
    if own_mask or config._attn_implementation != "sdpa" or not getattr(config, "is_causal", True):
        check()
        return False
    register()
    model.set_attn_implementation(NAME)
    if config._attn_implementation != NAME:  # a model that cannot switch
        check()
        return False
    try:
        check()
        return True
    except TypeError as e:
        model.set_attn_implementation("sdpa")
        check()
        warnings.warn(f"wrap_model_to_roundpipe: {type(model).__name__} keeps transformers' "
                      f"'sdpa' attention ({e}); padded and packed batches take (S, S) masks, as "
                      "in transformers", stacklevel=3)
        return False
