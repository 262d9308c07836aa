"""Counting the bytes of tensors alive at once, on the CPU, exactly: :class:`LiveBytes`.

A ``TorchDispatchMode`` sees every tensor operation of the thread that entered it (and of
autograd's backward, which runs on that thread for CPU tensors and carries the mode along).
Each new storage an operation returns is recorded with a weak reference to it
(``torch.multiprocessing.reductions.StorageWeakRef``, which expires when the storage is
freed, whatever tensor objects, views or autograd's saved copies held it); at every new
storage, the bytes of the recorded storages still alive are summed, and the largest sum is
the peak. Storages that existed before the mode (parameters, inputs) are not counted;
buffers allocated inside a fused kernel and freed before it returns are not seen (they are a
kernel's workspace, not the caller's tensors).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as counter: ...``; then ``counter.peak``: the most bytes of storages
    created inside the block that were alive at one time."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._alive: dict[int, tuple[StorageWeakRef, int]] = {}  # data_ptr -> (ref, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        grew = False
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            size = storage.nbytes()
            ptr = storage.data_ptr()
            seen = self._alive.get(ptr)
            # an input's storage (in-place ops, views) is not a new one
            if size == 0 or ptr in inputs or (seen is not None and not seen[0].expired()):
                continue
            self._alive[ptr] = (StorageWeakRef(storage), size)
            grew = True
        if grew:
            self._alive = {p: v for p, v in self._alive.items() if not v[0].expired()}
            self.peak = max(self.peak, sum(size for _, size in self._alive.values()))
        return out
