"""Splitting a batch into microbatches and merging their outputs.

The default split cuts every tensor whose first dimension equals the batch size (the first
dimension of the first tensor found in the inputs) into ``n`` nearly equal pieces along dim 0,
with ``torch.tensor_split``; everything else (non-tensors, tensors of another leading size) is
passed to every microbatch unchanged. Nested tuples, lists and dicts are walked. A custom split
is a function with the signature of :func:`split_microbatches`, given to ``RoundPipe(split_fn=...)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

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
    leaves, spec = tree_flatten((args, kwargs, label))
    pieces = [
        torch.tensor_split(x, n) if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == size
        else [x] * n
        for x in leaves
    ]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(n)]


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
