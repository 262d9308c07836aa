"""Microbatches of a padding-free (packed) batch: one row cut at sequence starts.

TRL's ``padding_free`` / ``packing`` (and any collator of the same format) concatenate a
batch's sequences into **one row**, ``input_ids`` / ``labels`` / ``position_ids`` of shape
``(1, N)`` with no ``attention_mask``: ``position_ids`` restart at 0 where a sequence starts,
and transformers' mask functions keep attention within each sequence from them (a
block-diagonal causal mask, ``masking_utils.find_packed_sequence_indices``); the label of
each sequence's first token is -100, so no token is scored against the next sequence's.

RoundPipe's default split cuts along dim 0 (rows), so such a batch would be one microbatch.
:func:`split_packed` cuts the row along dim 1 instead, at sequence starts only, into up to
``n`` pieces of nearly equal token counts. Each piece is a whole number of sequences, so its
mask and positions are what the whole row gives them; the loss is unchanged too: the last
token of a piece, scored against ``-100`` after the shift inside the piece, is scored against
the next sequence's first label (also -100) in the whole row. Every other batch is split as
:func:`roundpipe.microbatch.split_microbatches` splits it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..microbatch import Microbatch, split_microbatches
from .loss import IGNORE_INDEX


def packed_starts(kwargs: dict) -> list[int] | None:
    """The positions where a cut may go in a padding-free batch (a sequence start other than
    the first token, whose label is -100 or that has no labels), or None when ``kwargs`` is not
    one (more than one row, an ``attention_mask``, no ``position_ids``)."""
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    pos = kwargs.get("position_ids")
    if (x is None or pos is None or kwargs.get("attention_mask") is not None or x.dim() < 2
            or x.shape[0] != 1 or tuple(pos.shape) != (1, x.shape[1])):
        return None
    starts = (pos[0] == 0).nonzero().flatten()
    labels = kwargs.get("labels")
    if labels is not None:
        starts = starts[labels[0, starts] == IGNORE_INDEX]
    return [s for s in starts.tolist() if s > 0]


def _cuts(starts: list[int], length: int, n: int) -> list[int]:
    """Up to ``n - 1`` increasing positions among ``starts``, each the start nearest to an even
    share ``k * length / n`` of the row."""
    cuts: list[int] = []
    for k in range(1, n):
        target = k * length / n
        candidates = [s for s in starts if not cuts or s > cuts[-1]]
        if not candidates:
            break
        best = min(candidates, key=lambda s: (abs(s - target), s))
        if best not in cuts:
            cuts.append(best)
    return cuts


def split_packed(args: tuple, kwargs: dict, label: Any, n: int) -> list[Microbatch]:
    """``HFRoundPipe``'s default ``split_fn``: a padding-free batch (see the module docstring)
    cut into up to ``n`` pieces along the sequence dimension at sequence starts, every
    ``(1, N, ...)`` tensor of ``kwargs`` sliced alike, the rest passed whole; any other batch
    as :func:`roundpipe.microbatch.split_microbatches` (the signature and contract of which
    this shares)."""
    starts = packed_starts(kwargs) if n > 1 and not args and label is None else None
    if not starts:
        return split_microbatches(args, kwargs, label, n)
    x = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    length = x.shape[1]
    bounds = [0, *_cuts(starts, length, n), length]
    return [((), {k: v[:, a:b] if isinstance(v, torch.Tensor) and v.dim() >= 2
                  and v.shape[:2] == (1, length) else v for k, v in kwargs.items()}, None)
            for a, b in zip(bounds, bounds[1:])]
