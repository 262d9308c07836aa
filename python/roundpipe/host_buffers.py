"""Reused host buffers for gradients: the gradient sums of the CPU device and the accumulated
gradients of the optimizer side are taken from here and given back once consumed, so their
memory is reused from one call and one step to the next instead of being freed and allocated
again (which costs page faults, and with glibc's adaptive mmap threshold leaves freed
gradients in the heap, raising peak memory by ~2-4 bytes per parameter).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Sequence

import torch


class HostBuffers:
    """A pool of host tensors, keyed by element count and dtype. Thread safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._out: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous host tensor of ``shape`` and ``dtype``, reused if one of
        that size was given back."""
        n = math.prod(shape)
        with self._lock:
            free = self._free.get((n, dtype))
            flat = free.pop() if free else None
        if flat is None:
            flat = torch.empty(n, dtype=dtype)
        with self._lock:
            self._out[id(flat)] = flat
        return flat.view(shape)

    def give(self, t: torch.Tensor) -> None:
        """Gives back a tensor from :meth:`take` (any other tensor is ignored: freed as usual).
        The caller must not use it afterwards."""
        base = t._base if t._base is not None else t
        with self._lock:
            if self._out.get(id(base)) is base:
                del self._out[id(base)]
                self._free.setdefault((base.numel(), base.dtype), []).append(base)

    def clear(self) -> None:
        """Frees every buffer given back."""
        with self._lock:
            self._free.clear()
