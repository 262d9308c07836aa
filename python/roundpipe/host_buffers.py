"""Host memory for what RoundPipe keeps per parameter.

- :func:`host_empty` / :func:`host_zeros`: a large tensor (>= :data:`LARGE` bytes) gets its own
  anonymous memory mapping, returned to the OS when the tensor is freed, instead of coming from
  malloc: glibc's adaptive mmap threshold otherwise serves such sizes from the heap once a
  large block has been freed, where long-lived buffers interleaved with short-lived ones (the
  gradients autograd makes) leave holes that are never returned — measured at 1.5-2.5 bytes
  per parameter of extra peak memory, varying from run to run with thread timing.
- :func:`tune_malloc`: with glibc, RoundPipe fixes malloc's mmap threshold at 1 MiB when the
  first RoundPipe is built (unless ``MALLOC_MMAP_THRESHOLD_`` is set or
  ``ROUNDPIPE_MALLOC_TUNING=0``): every block of 1 MiB or more is then its own mapping, given
  back to the OS when freed. With the adaptive default, blocks that the transport (gloo),
  torch's operators or the data path allocate and free land in the heap once a large block
  has been freed, and the heap keeps the holes: measured on a 2-rank sharded run at 13.4-14.3
  bytes per parameter of peak RSS instead of 9.4. The cost is a page fault per page of a
  large block on each allocation, which the hot path avoids by reusing its buffers.
- :class:`HostBuffers`: gradient buffers (the CPU device's gradient sums, the optimizer side's
  accumulated gradients) are taken from a pool and given back once consumed, so their memory is
  reused from one call and one step to the next (no page faults, no allocator churn).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import threading
import weakref
from typing import Sequence

import torch

from .torch_private import tensor_base

LARGE = 1 << 20
_M_MMAP_THRESHOLD = -3
_tuned = False


def tune_malloc() -> bool:
    """Fixes glibc's mmap threshold at :data:`LARGE` (see the module docstring), once per
    process; returns whether it did (False: not glibc, the environment already chose, or
    ``ROUNDPIPE_MALLOC_TUNING=0``)."""
    global _tuned
    if _tuned:
        return True
    if os.environ.get("ROUNDPIPE_MALLOC_TUNING", "1") == "0" or \
            "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        _tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE))
    except (OSError, AttributeError):
        return False
    return _tuned


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
        base = tensor_base(t)
        base = t if base is None else base
        with self._lock:
            if self._out.get(id(base)) is base:
                del self._out[id(base)]
                self._free.setdefault((base.numel(), base.dtype), []).append(base)

    def clear(self) -> None:
        """Frees every buffer given back."""
        with self._lock:
            self._free.clear()
