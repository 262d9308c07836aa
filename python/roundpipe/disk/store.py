"""Optimizer copies and optimizer state kept in files on a local disk, with a bounded window of
host memory through which each step's tensors stream: :class:`StateStore`.

Every tensor the store holds (a *slot*: an optimizer copy, a per-element state tensor, an int8
state's block maxima) keeps its Python object, shape and dtype; only where its values live
changes:

- **home** (between steps): the tensor views its bytes in the store's file through a shared
  memory mapping. Nothing is read until someone reads it (``state_dict``, a checkpoint, a user's
  ``print``): such reads go through the page cache, and writes through it reach the file
  (``load_checkpoint`` loads in place this way, one tensor at a time).
- **in the window** (during a step): :meth:`StateStore.acquire` reads the tensors of one step
  call (a stage's or a layer's optimizer copies and state) with direct I/O into one buffer of
  anonymous memory and points the tensors at it; the C++ kernels run on it unchanged; on leaving,
  the buffer is written back (direct I/O again) and the tensors return home once it is on disk.

The window is bounded: its buffers never exceed :attr:`StateStore.limit`, the largest sum of three
sets of tensors acquired in a row (triple buffering: one set being stepped, the next one being
read, the previous one being written). Reads are started ahead: the store learns which set
followed which (the same order every step: exact mode's stages in descending order, a step's
layers in ascending order) and, on each acquire, starts reading the sets that followed it last
time, as far as the window allows. A set read ahead is used only if none of its tensors changed
since (their version counters); direct reads see what was written through the mapping (the
kernel writes dirty cached pages back first) and direct writes drop the cached pages they
overwrite, so the two paths agree.

Faults. The files are allocated when created (``posix_fallocate``): a full disk is an error
there, before anything is stepped (the optimizer reserves its whole state at its first step).
A write that fails (a full copy-on-write file system, an I/O error, a write that stops short)
leaves its tensors in the window, holding the stepped values (nothing is lost: every reader sees
them, a checkpoint saves them); the error is raised, naming the folder, the cause and the
tensors, at the next acquire or :meth:`StateStore.flush`, before anything else is stepped, and
each later acquire first retries those writes. A read that fails raises before the kernel runs on
those tensors. Every error is a :class:`~roundpipe.disk.folder.StateDiskError`.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import io
from .folder import Folder, StateDiskError, as_error, size_text

HOME, LOADING, READY, PINNED, WRITING, HELD = range(6)
_owner: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # tensor -> its store (slots, and params
# whose state the store keeps: bf16 master weights, which stay in memory as the model copy)


def store_of(t: torch.Tensor) -> Optional["StateStore"]:
    """The store holding ``t`` (an optimizer copy or state tensor), or keeping the state of the
    parameter ``t``; None for any other tensor."""
    s = _owner.get(t)
    return s if s is not None and not s.closed else None


_ELEMENT_SIZE: dict = {}
_open_stores = [0]  # stores not closed yet: optimizers skip looking when there is none


def any_open() -> bool:
    """Whether any store is open in this process (a cheap test before :func:`store_of`)."""
    return _open_stores[0] > 0


def element_size(dtype: torch.dtype) -> int:
    size = _ELEMENT_SIZE.get(dtype)
    if size is None:
        size = _ELEMENT_SIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


class Slot:
    """One tensor's place in a file: ``size`` bytes at ``offset`` of ``extent`` (both multiples
    of :data:`~roundpipe.disk.io.ALIGN`), its values from ``offset + stagger``."""

    __slots__ = ("extent", "offset", "size", "stagger", "shape", "dtype", "label", "home", "ref",
                 "state", "batch", "version", "pins", "__weakref__")

    def __init__(self, extent: "Extent", offset: int, size: int, stagger: int,
                 shape: torch.Size, dtype: torch.dtype, label: str) -> None:
        self.extent, self.offset, self.size, self.stagger = extent, offset, size, stagger
        self.shape, self.dtype, self.label = shape, dtype, label
        n = math.prod(shape)
        self.home = torch.frombuffer(extent.map, dtype=dtype, count=n,
                                     offset=offset + stagger).view(shape)
        self.ref: Any = None
        self.state = HOME
        self.batch: Optional[Batch] = None
        self.version = -1
        self.pins = 0

    def tensor(self) -> Optional[torch.Tensor]:
        return None if self.ref is None else self.ref()


class Extent:
    """One file of the store: created at its full size (``posix_fallocate``), mapped shared."""

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path, self.fd, self.size = path, fd, size
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.carved = 0  # bytes handed out
        self.live = 0    # slots alive
        self.carving = False  # an optimizer may still carve state from it


@dataclass
class Batch:
    """Slots sharing one window buffer, laid out as they lie in their files (so a run of
    adjacent slots is one contiguous transfer)."""

    slots: list
    buffer: Any = None
    where: dict = field(default_factory=dict)  # id(slot) -> offset in the buffer
    size: int = 0
    pending: int = 0
    error: Optional[BaseException] = None
    done: threading.Event = field(default_factory=threading.Event)
    dirty: bool = False
    prefetched: bool = False


class StateStore:
    """The files of one RoundPipe's optimizer copies and optimizer state (see the module
    docstring), in ``<folder>/rank<rank>`` (:class:`~roundpipe.disk.folder.Folder`).

    Args:
        folder: the ``optimizer_dir``.
        rank: this process's rank (its own subfolder).

    Attributes:
        limit: bytes the window may hold: the largest sum of three sets acquired in a row (the
            one being written, the one being stepped, the one being read ahead), as seen so
            far (it only grows; a set larger than the room left is still taken when nothing
            else is in flight).
        closed: whether :meth:`close` ran.

    Raises:
        StateDiskError: see :class:`~roundpipe.disk.folder.Folder`.
    """

    def __init__(self, folder: str, rank: int = 0) -> None:
        self.sys = io.SYSCALLS
        self.folder = Folder(folder, rank, self.sys)
        self.path = self.folder.path
        self.closed = False
        self._cv = threading.Condition()
        self._extents: list[Extent] = []
        self._count = 0  # files made
        self._choice: Optional[io.IOChoice] = None
        self._pool: Optional[io.Pool] = None
        self.limit = 0
        self._used = 0                        # bytes of buffers in batches
        self._free: dict[int, list] = {}      # size -> idle buffers
        self._pooled = 0
        self._ahead: dict[tuple, Batch] = {}  # key -> batch read ahead
        self._next: dict[tuple, tuple] = {}   # key -> the key acquired after it last time
        self._units: dict[tuple, list] = {}   # key -> its slots (weak)
        self._sizes: dict[tuple, int] = {}    # key -> its bytes
        self._last: Optional[tuple] = None
        self._doomed: list[Extent] = []  # files to remove once no transfer is in flight
        self._held: list[tuple[Batch, bool]] = []  # failed writes, whether raised already
        self.stats = dict.fromkeys(("read_bytes", "write_bytes", "wait_s", "window_peak_bytes",
                                    "read_ahead_hits", "acquires"), 0.0)
        self._collected: dict[str, float] = {}
        self._names: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # param -> its name
        _open_stores[0] += 1
        self._finalizer = weakref.finalize(self, _close_quietly, self.folder, self._extents)

    # --- files ---------------------------------------------------------------------------------

    @property
    def choice(self) -> io.IOChoice:
        """How this store issues I/O (:func:`roundpipe.disk.io.measure`, at first use)."""
        if self._choice is None:
            try:
                self._choice = io.measure(self.path, self.folder.direct, self.sys)
            except OSError as e:
                raise as_error(self.path, "measuring the disk (probe.tmp)", e) from e
        return self._choice

    def extent(self, size: int, what: str) -> Extent:
        """A new file of ``size`` bytes (a multiple of ALIGN), allocated on the disk now.

        Raises:
            StateDiskError: the disk cannot hold it (``ENOSPC``, ``EFBIG``...), naming
                ``what`` and the free space.
        """
        self._check_open()
        size = max(io.ALIGN, -(-size // io.ALIGN) * io.ALIGN)
        self._count += 1
        path = self.folder.file(f"{self._count}.bin")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.folder.direct else 0)
        try:
            fd = self.sys.open(path, flags)
        except OSError as e:
            raise as_error(self.path, f"creating {os.path.basename(path)}", e) from e
        try:
            self.sys.allocate(fd, 0, size)
            ext = Extent(path, fd, size)
        except OSError as e:
            self.sys.close(fd)
            os.unlink(path)
            try:
                free = os.statvfs(self.path)
                more = f" (free there: {size_text(free.f_bavail * free.f_frsize)})"
            except OSError:
                more = ""
            raise as_error(self.path, f"allocating {size_text(size)} for {what}", e,
                           more) from e
        self._extents.append(ext)
        return ext

    def slots(self, shapes: Sequence[tuple], extent: Optional[Extent] = None) -> list:
        """Carves one slot per ``(shape, dtype, label, stagger)`` of ``shapes`` from ``extent``
        (or a new file of their total size when it has no room)."""
        sizes = [_slot_size(shape, dtype, stagger) for shape, dtype, _, stagger in shapes]
        if extent is None or extent.carved + sum(sizes) > extent.size:
            extent = self.extent(sum(sizes), f"{len(shapes)} tensor(s)")
        out = []
        for (shape, dtype, label, stagger), size in zip(shapes, sizes):
            out.append(Slot(extent, extent.carved, size, stagger, torch.Size(shape), dtype,
                            label))
            extent.carved += size
        return out

    def bind(self, t: torch.Tensor, slot: Slot, fill: bool = True) -> None:
        """Makes ``t`` the tensor of ``slot`` (its shape and dtype): its values move to the file
        (``fill``: copied through the mapping, skipped when all zero, which a new file reads as),
        ``t`` views them, and the slot is freed with ``t``."""
        with torch.no_grad():
            if fill and t.numel() and bool(t.count_nonzero()):
                slot.home.copy_(t)
                try:  # the copy's pages leave this process's resident set (they are cached)
                    slot.extent.map.madvise(mmap.MADV_DONTNEED, slot.offset, slot.size)
                except OSError:
                    pass
            t.data = slot.home
        slot.ref = weakref.ref(t)
        slot.version = -1
        slot.extent.live += 1
        _owner[t] = self
        _slots[t] = slot
        weakref.finalize(t, _slot_freed, weakref.ref(self), slot.extent)

    def keep_state_of(self, p: torch.Tensor, name: str) -> None:
        """``p`` stays in memory (a bfloat16 master weight: it is the model copy), but the
        optimizer state of it is kept here; ``name`` names it in errors."""
        _owner[p] = self
        self._names[p] = name

    def name(self, t: torch.Tensor) -> str:
        """The name ``t`` was given (its slot's label), for errors."""
        slot = _slot_of(t) if _owner.get(t) is self else None
        return slot.label if slot is not None else self._names.get(t, "a parameter")

    def reserve(self, shapes: Sequence[tuple], what: str) -> Optional[Extent]:
        """A file with room for tensors of ``(shape, dtype)`` in ``shapes`` (None for none),
        allocated now: a full disk is an error before anything is stepped."""
        size = sum(_slot_size(shape, dtype, io.ALIGN - 64) for shape, dtype in shapes)
        if not size:
            return None
        ext = self.extent(size, what)
        ext.carving = True
        return ext

    def empty(self, shape: Sequence[int], dtype: torch.dtype, label: str,
              extent: Optional[Extent] = None) -> torch.Tensor:
        """A new tensor held here (its values: zeros, in the file), e.g. for a checkpoint to
        load into through the mapping; one without elements is not (nothing to keep)."""
        if math.prod(shape) == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        slot, = self.slots([(tuple(shape), dtype, label, 0)], extent)
        t = torch.empty(0, dtype=dtype)
        self.bind(t, slot, fill=False)
        return t

    def holds(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and _owner.get(t) is self and _slot_of(t) is not None

    def adopt(self, tensors: Sequence[torch.Tensor], labels: Sequence[str],
              extent: Optional[Extent] = None) -> None:
        """Each of ``tensors`` (not held yet; empty ones are left as they are) becomes a slot
        of this store, carved from ``extent`` when it has room."""
        todo = [(t, lab) for t, lab in zip(tensors, labels) if t.numel() and not self.holds(t)]
        if not todo:
            return
        made = self.slots([(t.shape, t.dtype, lab, _stagger(k)) for k, (t, lab) in
                           enumerate(todo)], extent)
        for (t, _), slot in zip(todo, made):
            self.bind(t, slot)

    def release_slot(self, extent: Extent) -> None:
        """A slot of ``extent`` was freed with its tensor: a file whose slots are all gone is
        removed."""
        extent.live -= 1
        self._maybe_remove(extent)

    def done_carving(self, extent: Optional[Extent]) -> None:
        """No more slots will be carved from ``extent``: it is removed once its slots are."""
        if extent is not None:
            extent.carving = False
            self._maybe_remove(extent)

    def _maybe_remove(self, extent: Extent) -> None:
        if extent.live == 0 and not extent.carving and not self.closed:
            with self._cv:
                if extent in self._extents and extent not in self._doomed:
                    self._doomed.append(extent)
                self._reap()

    def _reap(self) -> None:
        """Files whose slots are all gone are closed and removed once no transfer is in flight
        (caller holds the lock)."""
        if not self._doomed or self._writing or any(b.pending for b in self._ahead.values()):
            return
        for extent in self._doomed:
            self._extents.remove(extent)
            try:
                self.sys.close(extent.fd)
                os.unlink(extent.path)
            except OSError:
                pass
        self._doomed.clear()

    def sync_files(self) -> None:
        """What was written through the mappings reaches the disk now (``msync``), so a write
        error shows here rather than being lost by the kernel's write-back; mapped pages are
        let go (resident set)."""
        for ext in list(self._extents):
            try:
                ext.map.flush()
                ext.map.madvise(mmap.MADV_DONTNEED)
            except OSError as e:
                raise as_error(self.path, f"writing {os.path.basename(ext.path)}", e) from e

    # --- the window ----------------------------------------------------------------------------

    def acquire(self, tensors: Iterable[torch.Tensor], write: bool = True) -> "_Acquired":
        """A context manager: while inside, every tensor of ``tensors`` held by this store views
        its values in the window (read ahead, or read now), and the sets that followed this one
        last time are being read ahead. On leaving, with ``write``, they are written back and
        return home once on disk (the next acquire or :meth:`flush` raises if that failed);
        without, they return home at once. Re-entrant: tensors an enclosing acquire holds stay
        as they are.

        Raises:
            StateDiskError: a read failed (nothing was handed out), or writes that failed before
                still fail.
        """
        return _Acquired(self, tensors, write)

    def _enter(self, tensors: Iterable[torch.Tensor], write: bool) -> list:
        self._check_open()
        slots, seen = [], set()
        for t in tensors:
            s = _slot_of(t) if _owner.get(t) is self else None
            if s is not None and id(s) not in seen:
                seen.add(id(s))
                slots.append(s)
        self._retry_held(wait=False)
        if not slots:
            return []
        start = time.perf_counter()
        with self._cv:
            fresh = [s for s in slots if s.state != PINNED]
            size = sum(s.size for s in slots)
            if fresh:
                key = tuple(sorted(id(s) for s in fresh))
                self.stats["acquires"] += 1
                if self._last is not None and self._last != key:
                    self._next[self._last] = key
                # room for three sets: the one written before, this one, the one read next
                # (this one's size again until the order is known)
                after = self._sizes.get(self._next.get(key), size)
                self.limit = max(self.limit, self._sizes.get(self._last, size) + size + after)
                self._last = key
                self._sizes[key] = size
                self._units[key] = [weakref.ref(s) for s in fresh]
                batch = self._take_ahead(key, fresh)
                if batch is None:
                    for s in fresh:
                        while s.state in (LOADING, READY, WRITING):
                            if s.state == READY:
                                self._drop(s.batch)
                            else:
                                self._cv.wait()
                    batch = self._new_batch(fresh, wait=True)
                    self._read(batch)
                    self._cv.release()
                    try:
                        batch.done.wait()
                    finally:
                        self._cv.acquire()
                    if batch.error is not None:
                        error = batch.error
                        self._discard(batch)
                        raise as_error(self.path, "reading the optimizer state of "
                                       f"{_labels(fresh)}", error) from error
                for s in fresh:
                    s.state, s.pins = PINNED, 1
                    t = s.tensor()
                    if t is not None:
                        t.data = self._view(batch, s)
                batch.dirty = write
                self._read_ahead(key)
            taken = {id(s) for s in fresh}
            for s in slots:  # held by an enclosing acquire: one more pin
                if id(s) not in taken:
                    s.pins += 1
                    if write:
                        s.batch.dirty = True
        self.stats["wait_s"] += time.perf_counter() - start
        return slots

    def _exit(self, slots: list) -> None:
        with self._cv:
            done = {}
            for s in slots:
                s.pins -= 1
                if s.pins == 0:
                    done[id(s.batch)] = s.batch
            for batch in done.values():
                if all(s.pins == 0 for s in batch.slots):
                    if batch.dirty:
                        self._write(batch)
                    else:
                        self._home(batch)

    def _take_ahead(self, key: tuple, fresh: list) -> Optional[Batch]:
        """The batch read ahead for ``key`` if its values are still current (waits for its read
        to end), else None (it is dropped)."""
        batch = self._ahead.pop(key, None)
        if batch is None:
            return None
        while batch.pending:
            self._cv.wait()
        ok = batch.error is None and all(
            s.state == READY and s.batch is batch and (t := s.tensor()) is not None
            and t._version == s.version for s in fresh) and len(batch.slots) == len(fresh)
        if not ok:
            self._drop(batch)
            return None
        self.stats["read_ahead_hits"] += 1
        return batch

    def _read_ahead(self, key: tuple) -> None:
        seen = {key}
        k = self._next.get(key)
        while k is not None and k not in seen and len(seen) <= 8:
            seen.add(k)
            if k not in self._ahead:
                slots = [r() for r in self._units.get(k, ())]
                if not slots or any(s is None or s.state != HOME or s.tensor() is None
                                    for s in slots):
                    break
                batch = self._new_batch(slots, wait=False)
                if batch is None:
                    break
                batch.prefetched = True
                for s in slots:
                    s.version = s.tensor()._version
                self._ahead[k] = batch
                self._read(batch)
            k = self._next.get(k)

    def _drop(self, batch: Batch) -> None:
        """A batch read ahead that will not be used: its slots are home again (caller holds the
        lock; its read has ended)."""
        while batch.pending:
            self._cv.wait()
        for k, b in list(self._ahead.items()):
            if b is batch:
                del self._ahead[k]
        self._discard(batch)

    def _discard(self, batch: Batch) -> None:
        for s in batch.slots:
            if s.batch is batch:
                s.state, s.batch = HOME, None
        self._give(batch)
        self._cv.notify_all()

    def _new_batch(self, slots: list, wait: bool) -> Optional[Batch]:
        slots = sorted(slots, key=lambda s: (id(s.extent), s.offset))
        batch = Batch(slots)
        for s in slots:
            batch.where[id(s)] = batch.size
            batch.size += s.size
        buffer = self._take(batch.size, wait)
        if buffer is None:
            return None
        batch.buffer = buffer
        for s in slots:
            s.state, s.batch = LOADING, batch
        return batch

    def _take(self, size: int, wait: bool) -> Any:
        """A window buffer of ``size`` bytes (caller holds the lock): an idle one of that size,
        else a new one once the window has room (``wait``: waits for reads and writes to end
        and idle buffers are freed; a set larger than the room left gets it anyway once nothing
        else is in flight), else None."""
        while True:
            idle = self._free.get(size)
            if idle:
                self._pooled -= size
                self._used += size
                return idle.pop()
            if self._used + self._pooled + size > self.limit and self._pooled:
                for k in sorted(self._free, reverse=True):
                    while self._free[k] and self._used + self._pooled + size > self.limit:
                        self._free[k].pop()  # freed once no view of it is left
                        self._pooled -= k
            if self._used + size <= self.limit or (wait and not self._in_flight()):
                self._used += size
                self.stats["window_peak_bytes"] = max(self.stats["window_peak_bytes"],
                                                      self._used + self._pooled)
                return io.aligned_buffer(size)
            if not wait:
                return None
            if self._ahead:  # reads ahead give way to the set needed now
                self._drop(next(iter(self._ahead.values())))
                continue
            self._cv.wait()

    def _in_flight(self) -> bool:
        return any(b.pending for b in self._ahead.values()) or self._writing > 0

    _writing = 0

    def _give(self, batch: Batch) -> None:
        if batch.buffer is not None:
            self._used -= batch.size
            self._free.setdefault(batch.size, []).append(batch.buffer)
            self._pooled += batch.size
            batch.buffer = None

    def _view(self, batch: Batch, s: Slot) -> torch.Tensor:
        return torch.frombuffer(batch.buffer, dtype=s.dtype, count=math.prod(s.shape),
                                offset=batch.where[id(s)] + s.stagger).view(s.shape)

    def _home(self, batch: Batch) -> None:
        """Every slot of ``batch`` views its file again; the buffer goes back (lock held)."""
        for s in batch.slots:
            t = s.tensor()
            if t is not None:
                t.data = s.home
            s.state, s.batch = HOME, None
        self._give(batch)
        self._cv.notify_all()

    # --- transfers ---------------------------------------------------------------------------

    def _runs(self, batch: Batch):
        """``(extent, file offset, buffer offset, length)`` of each run of adjacent slots."""
        run = None
        for s in batch.slots:
            b = batch.where[id(s)]
            if run is not None and run[0] is s.extent and run[1] + run[3] == s.offset \
                    and run[2] + run[3] == b:
                run[3] += s.size
            else:
                if run is not None:
                    yield tuple(run)
                run = [s.extent, s.offset, b, s.size]
        if run is not None:
            yield tuple(run)

    def _transfer(self, batch: Batch, writing: bool) -> None:
        """Starts ``batch``'s reads or writes in requests of the chosen size (lock held)."""
        choice = self.choice
        if self._pool is None:
            self._pool = io.Pool(2 * choice.depth, "roundpipe-disk")
        pieces = []
        for ext, off, boff, length in self._runs(batch):
            for k in range(0, length, choice.block):
                pieces.append((ext.fd, off + k, boff + k, min(choice.block, length - k)))
        batch.pending, batch.error = len(pieces), None
        batch.done.clear()
        if writing:
            self._writing += 1
        view = memoryview(batch.buffer)
        op = io.write_full if writing else io.read_full
        sys, direct = self.sys, self.folder.direct
        key = "write_bytes" if writing else "read_bytes"

        def done(error: Optional[BaseException]) -> None:
            with self._cv:
                if error is not None and batch.error is None:
                    batch.error = error
                batch.pending -= 1
                if batch.pending == 0:
                    self.stats[key] += batch.size
                    if writing:
                        self._writing -= 1
                        self._written(batch)
                        self._reap()
                    elif batch.prefetched:  # an error is seen (and dropped) when taken
                        for s in batch.slots:
                            if s.batch is batch:
                                s.state = READY
                    batch.done.set()
                    self._cv.notify_all()

        for fd, off, boff, length in pieces:
            part = view[boff:boff + length]
            self._pool.submit(lambda fd=fd, part=part, off=off: op(sys, fd, part, off, direct),
                              done, write=writing)

    def _read(self, batch: Batch) -> None:
        self._transfer(batch, writing=False)

    def _write(self, batch: Batch) -> None:
        for s in batch.slots:
            s.state = WRITING
        self._transfer(batch, writing=True)

    def _written(self, batch: Batch) -> None:
        if batch.error is None:
            self._home(batch)
            return
        for s in batch.slots:
            s.state = HELD
        self._held.append((batch, False))  # (batch, error raised already)

    def _retry_held(self, wait: bool) -> None:
        """With ``wait``, waits for the writes in flight first. A write that failed is raised
        once (the step that made it fails with its error); later, each failed write is tried
        again first, raising if it still fails."""
        with self._cv:
            while wait and self._writing:
                self._cv.wait()
            if not self._held:
                return
            fresh = [b for b, reported in self._held if not reported]
            if not fresh:  # reported already: try them again
                held, self._held = self._held, []
                for batch, _ in held:
                    self._write(batch)
                while any(b.pending for b, _ in held):
                    self._cv.wait()
                fresh = [b for b, _ in self._held]
                if not fresh:
                    return
            while self._writing:  # the writes in flight too: one error for all that failed
                self._cv.wait()
            fresh = [b for b, reported in self._held if not reported] or fresh
            self._held = [(b, True) for b, _ in self._held]
        error = fresh[0].error
        raise as_error(
            self.path, "writing the optimizer state", error,
            f"; {_labels([s for b in fresh for s in b.slots])} could not be written and are "
            "held in memory with their stepped values (nothing is lost: reading them, "
            "state_dict() and roundpipe.save_checkpoint() see those); what was stepped before "
            "them was written, what comes after them in this step was not stepped. Free the "
            "disk (or fix it) and go on: each later step first writes the held tensors "
            "again") from error

    def flush(self) -> None:
        """Waits until every write has ended; raises if one failed (see :meth:`acquire`)."""
        if self.closed:
            return
        self._retry_held(wait=True)

    def settle(self) -> None:
        """Every write has ended (one that failed is left to the next acquire or flush: the
        tensors it holds keep their values in memory) and nothing read ahead is kept: before
        the tensors are read or changed outside a step (through their mappings)."""
        self.wait_writes()
        with self._cv:
            for batch in list(self._ahead.values()):
                self._drop(batch)

    def wait_writes(self) -> None:
        """Waits until every write has ended, raising nothing (a failed one is raised by the
        next acquire or flush)."""
        with self._cv:
            while self._writing:
                self._cv.wait()

    def collect(self) -> dict[str, float]:
        """``disk_read_bytes``, ``disk_write_bytes`` and ``disk_wait_s`` since the last call
        (for ``RoundPipe.pipeline_stats``)."""
        keys = {"disk_read_bytes": "read_bytes", "disk_write_bytes": "write_bytes",
                "disk_wait_s": "wait_s"}
        with self._cv:
            out = {k: self.stats[v] - self._collected.get(v, 0.0) for k, v in keys.items()}
            self._collected = {v: self.stats[v] for v in keys.values()}
        return out

    def window_bytes(self) -> int:
        """Bytes of window buffers held now (in use or idle)."""
        with self._cv:
            return self._used + self._pooled

    def _check_open(self) -> None:
        if self.closed:
            raise StateDiskError(9, f"RoundPipe optimizer_dir {self.path!r} was closed (its "
                                    "RoundPipe was deleted): its optimizer state is gone")

    def close(self) -> None:
        """Waits for the writes, then removes the files and the folder (at a normal exit, or
        when the RoundPipe is deleted). Tensors still alive keep the values they had (the
        mappings live on until they are freed) but can no longer be stepped."""
        if self.closed:
            return
        if os.getpid() != self.folder.pid:  # a fork()-ed child's copy: the parent's files
            self.closed = True
            return
        try:
            self.flush()
        except StateDiskError:
            pass
        with self._cv:
            self.closed = True
            for batch in list(self._ahead.values()):
                self._drop(batch)
        if self._pool is not None:
            self._pool.close()
        self._finalizer()


def _slot_freed(store_ref, extent: Extent) -> None:
    store = store_ref()
    if store is not None:
        store.release_slot(extent)


def _close_quietly(folder: Folder, extents: list) -> None:
    _open_stores[0] -= 1
    for ext in extents:
        try:
            os.close(ext.fd)
        except OSError:
            pass
    extents.clear()
    folder.close()


def _slot_of(t: torch.Tensor) -> Optional[Slot]:
    return _slots.get(t)


_slots: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _slot_size(shape, dtype, stagger: int) -> int:
    n = math.prod(shape) * element_size(dtype)
    return -(-(stagger + n) // io.ALIGN) * io.ALIGN


def _stagger(k: int) -> int:
    """Where the ``k``-th tensor of a set starts in its slot: spread over the page in steps of
    1/4 page (rounded to a cache line), so that element i of a parameter and of its state
    tensors do not all sit at one page offset (see ``compact.staggered_zeros``)."""
    return (k % 4) * (io.ALIGN // 4) // 64 * 64


def _labels(slots: list) -> str:
    names = [s.label for s in slots]
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


class _Acquired:
    def __init__(self, store: StateStore, tensors, write: bool) -> None:
        self.store, self.tensors, self.write = store, tensors, write
        self.slots: list = []

    def __enter__(self) -> "_Acquired":
        self.slots = self.store._enter(self.tensors, self.write)
        self.tensors = None
        return self

    def __exit__(self, *exc) -> None:
        if self.slots:
            self.store._exit(self.slots)
