"""Splitting a batch into microbatches and merging their outputs.

The default split cuts every tensor whose first dimension equals the batch size (the first
dimension of the first tensor found in the inputs) into ``n`` nearly equal pieces along dim 0,
with ``torch.tensor_split``; everything else (non-tensors, tensors of another leading size) is
passed to every microbatch unchanged. Nested tuples, lists and dicts are walked. A custom split
is a function with the signature of :func:`split_microbatches`, given to ``RoundPipe(split_fn=...)``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import torch

from .torch_private import tree_flatten, tree_map, tree_unflatten

Microbatch = tuple[tuple, dict, Any]  # (input_args, input_kwargs, label)


def batch_size(tree: Any) -> int | None:
    """Leading dimension of the first tensor with at least one dimension in ``tree``."""
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return None


def split_microbatches(args: tuple, kwargs: dict, label: Any, n: int) -> list[Microbatch]:
    """Splits ``(args, kwargs, label)`` into at most ``n`` microbatches along dim 0.

    Returns fewer than ``n`` microbatches when the batch has fewer rows. Raises ``ValueError``
    if ``n < 1`` or if no input tensor has a batch dimension while ``n > 1``.
    """
    if n < 1:
        raise ValueError(f"num_microbatch must be >= 1, got {n}")
    size = batch_size((args, kwargs, label))
    if size is None:
        if n > 1:
            raise ValueError("cannot split into microbatches: no input tensor has a batch dimension")
        return [(args, kwargs, label)]
    n = max(1, min(n, size))
    if n == 1:  # what one piece of tensor_split would give, without the tree walk
        return [(args, kwargs, label)]
    leaves, spec = tree_flatten((args, kwargs, label))
    pieces = [
        torch.tensor_split(x, n) if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == size
        else [x] * n
        for x in leaves
    ]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(n)]


LOSS_REDUCTIONS = ("mean", "token_mean", "sum")


def check_loss_reduction(reduction: Any, where: str) -> None:
    """Raises ``ValueError`` naming ``loss_reduction`` unless it is one of
    :data:`LOSS_REDUCTIONS` or a callable."""
    if not (callable(reduction) or (isinstance(reduction, str) and reduction in LOSS_REDUCTIONS)):
        raise ValueError(f"{where}: loss_reduction must be one of {LOSS_REDUCTIONS} or a callable "
                         f"(a microbatch's label -> its number of items), got {reduction!r}")


def loss_shares(microbatches: list[Microbatch], reduction: Any,
                ignore_index: int = -100) -> Optional[list[float]]:
    """Each microbatch's share of the batch: the factor its ``loss_fn`` result is weighted by,
    so that a ``loss_fn`` returning the *mean* over its microbatch gives the mean over the
    whole batch (its value and its gradient) for any number of microbatches.

    Args:
        microbatches: ``(args, kwargs, label)`` per microbatch.
        reduction: ``"mean"``: rows (the leading dimension of the microbatch's label, or
            without a label tensor of its first input tensor with a dimension, as
            :func:`split_microbatches` cuts them); ``"token_mean"``: the label's
            elements not equal to ``ignore_index`` (a label aligned with the output, as
            ``F.cross_entropy(..., ignore_index=-100)`` counts them); a callable: its result on
            each microbatch's label (an int or a 0-dim tensor), e.g. a count of shifted
            tokens; ``"sum"``: no weighting (the losses are summed).

    Returns:
        ``count_i / sum(counts)`` per microbatch (all 0.0 when nothing is counted: a batch
        with no scored token gives a zero loss and zero gradients), or None for ``"sum"`` and
        for one microbatch of share 1 (nothing to weight).

    Raises:
        ValueError: ``"mean"`` with several microbatches of which one has no tensor with a
            batch dimension (a custom ``split_fn``); a count that is negative, inf or NaN.
        TypeError: ``"token_mean"`` with a label that is not a tensor; a callable returning
            something else than a number.
    """
    if reduction == "sum":
        return None
    counts = []
    for i, (args, kwargs, label) in enumerate(microbatches):
        if reduction == "mean":
            # the label's rows first: what a mean loss averages over (an input passed whole to
            # every microbatch by a custom split_fn may come first among the inputs)
            count = batch_size(label)
            if count is None:
                count = batch_size((args, kwargs))
            if count is None:
                if len(microbatches) == 1:
                    return None
                raise ValueError(
                    f"loss_reduction='mean': microbatch {i} has no tensor with a batch dimension "
                    "to count its rows; pass loss_reduction='sum' (each loss_fn result then "
                    "counts as it is) or a callable counting a microbatch's items")
        elif reduction == "token_mean":
            if not isinstance(label, torch.Tensor):
                raise TypeError("loss_reduction='token_mean' counts the label's elements not equal "
                                f"to {ignore_index}: label must be a tensor, got "
                                f"{type(label).__name__}")
            count = int((label != ignore_index).sum())
        else:
            count = reduction(label)
            if isinstance(count, torch.Tensor) and count.numel() == 1:
                count = count.item()
            if isinstance(count, bool) or not isinstance(count, numbers.Real):
                raise TypeError("loss_reduction: the callable must return a microbatch's number "
                                f"of items (a number), got {type(count).__name__}")
            count = float(count)
        if not (math.isfinite(count) and count >= 0):
            raise ValueError(f"loss_reduction: microbatch {i} counts {count} items (must be a "
                             "finite number >= 0)")
        counts.append(count)
    total = sum(counts)
    if total == 0:
        return [0.0] * len(counts)
    shares = [c / total for c in counts]
    return None if shares == [1.0] else shares


def merge_outputs(outputs: list[Any]) -> Any:
    """Concatenates microbatch outputs along dim 0 (0-dim tensors are stacked); nested
    structures are merged leaf by leaf; non-tensor leaves are taken from the first microbatch."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    merged = []
    for leaves in zip(*(f[0] for f in flat)):
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            merged.append(torch.stack(leaves) if first.dim() == 0 else torch.cat(leaves))
        else:
            merged.append(first)
    return tree_unflatten(merged, spec)


def to_device(tree: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Every tensor in ``tree`` moved to ``device`` (no copy when already there)."""
    return tree_map(lambda x: x.to(device, non_blocking=non_blocking)
                    if isinstance(x, torch.Tensor) else x, tree)


def detach_to(tree: Any, device: torch.device) -> Any:
    """Every tensor in ``tree`` detached and moved to ``device``."""
    return tree_map(lambda x: x.detach().to(device) if isinstance(x, torch.Tensor) else x, tree)
