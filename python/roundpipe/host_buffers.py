"""Host memory for what RoundPipe keeps per parameter.

- :func:`host_empty` / :func:`host_zeros`: a large tensor (>= :data:`LARGE` bytes) gets its own
  anonymous memory mapping, returned to the OS when the tensor is freed, instead of coming from
  malloc: glibc's adaptive mmap threshold otherwise serves such sizes from the heap once a
  large block has been freed, where long-lived buffers interleaved with short-lived ones (the
  gradients autograd makes) leave holes that are never returned — measured at 1.5-2.5 bytes
  per parameter of extra peak memory, varying from run to run with thread timing.
- :class:`HostBuffers`: gradient buffers (the CPU device's gradient sums, the optimizer side's
  accumulated gradients) are taken from a pool and given back once consumed, so their memory is
  reused from one call and one step to the next (no page faults, no allocator churn).
"""

from __future__ import annotations

import math
import mmap
import threading
import weakref
from typing import Sequence

import torch


LARGE = 1 << 20


def host_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor; in its own memory mapping when large (see the
    module docstring), page aligned, freed with the tensor."""
    n = math.prod(shape)
    size = n * torch.tensor([], dtype=dtype).element_size()
    if size < LARGE:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype, count=n).view(tuple(shape))


def host_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """As :func:`host_empty`, filled with zeros (a fresh mapping already is)."""
    t = host_empty(shape, dtype)
    return t if t.numel() * t.element_size() >= LARGE else t.zero_()


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
            flat = host_empty((n,), dtype)
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
