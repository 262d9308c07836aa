"""Optimizer copies and optimizer state in files on a local disk (``RoundPipe(...,
optimizer_dir=...)``): :mod:`.store` (the store and its window of host memory), :mod:`.folder`
(the folder: lock, leftovers, errors), :mod:`.io` (system calls, the I/O threads, measuring the
disk). See docs/host_memory.md, "Optimizer state on a disk"."""

from .folder import StateDiskError
from .store import StateStore, any_open, store_of

__all__ = ["StateDiskError", "StateStore", "any_open", "store_of"]
