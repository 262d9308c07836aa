"""The disk I/O beneath :class:`roundpipe.disk.store.StateStore`: the system calls (one object, so
tests can replace it and fail at the N-th write), whole-range reads and writes that finish short
transfers, a small pool of threads issuing them, and the measurement of a folder's disk that
chooses the request size and the number of requests in flight.

Why threads and ``os.preadv`` / ``os.pwritev`` with ``O_DIRECT`` rather than io_uring: measured on
the development machine (a virtio disk of about 1-2 GB/s, docs/benchmarks.md), a C probe of
liburing's reads and writes and the same probe with POSIX threads were within each other's noise
at every request size (1 and 4 MiB) and depth (1-8); Python threads release the GIL in the
system call, so the pool reaches what the C threads do. ``O_DIRECT`` keeps the page cache out
(no second copy of the state in memory, no write-back storms); where the file system refuses it
(tmpfs before Linux 6.6, some network file systems) the same calls run buffered.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

#: File offsets, lengths and buffer addresses of direct I/O are multiples of this (the largest
#: logical block size of common disks; memory mappings are page aligned).
ALIGN = 4096


class Syscalls:
    """The system calls the store makes, one method each; :data:`SYSCALLS` is the instance a new
    store uses. A test replaces it (``monkeypatch.setattr(roundpipe.disk.io, "SYSCALLS", ...)``)
    with a subclass that fails or shortens a call, to exercise the fault paths."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags, mode)

    def allocate(self, fd: int, offset: int, length: int) -> None:
        """Reserves the blocks of ``[offset, offset + length)`` (reads as zeros)."""
        os.posix_fallocate(fd, offset, length)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.preadv(fd, [buf], offset)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.pwritev(fd, [buf], offset)

    def close(self, fd: int) -> None:
        os.close(fd)


SYSCALLS = Syscalls()


def read_full(sys: Syscalls, fd: int, buf: memoryview, offset: int, direct: bool) -> None:
    """Reads ``len(buf)`` bytes at ``offset`` into ``buf``, going on after a short read (a
    direct one from the last aligned byte it reached).

    Raises:
        OSError: the call's error, or ``EIO`` ("short read") when a read returns nothing.
    """
    _transfer(sys.pread, fd, buf, offset, direct, "read")


def write_full(sys: Syscalls, fd: int, buf: memoryview, offset: int, direct: bool) -> None:
    """Writes ``buf`` at ``offset``, going on after a short write (a direct one from the last
    aligned byte it reached, writing those bytes again).

    Raises:
        OSError: the call's error (``ENOSPC``, ``EFBIG``, ``EIO``...), or ``EIO`` ("short
            write") when a write makes no progress.
    """
    _transfer(sys.pwrite, fd, buf, offset, direct, "write")


def _transfer(call, fd: int, buf: memoryview, offset: int, direct: bool, what: str) -> None:
    done, size = 0, len(buf)
    while done < size:
        n = call(fd, buf[done:], offset + done)
        if direct:
            n -= n % ALIGN  # the rest again, from an aligned position
        if n <= 0:
            raise OSError(errno.EIO, f"short {what}: {done} of {size} bytes at offset "
                                     f"{offset}, then no progress")
        done += n


class Pool:
    """``threads`` threads running ``(fn, done)`` tasks: ``fn()`` then ``done(error or None)``,
    reads before writes (a read is what the next step call waits for; a write only frees its
    window buffer); started on first use, daemon threads (the store waits for its own work
    before it closes)."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._tasks: "queue.PriorityQueue" = queue.PriorityQueue()
        self._threads: list[threading.Thread] = []
        self._name = name
        self._lock = threading.Lock()
        self._count = itertools.count()

    def submit(self, fn: Callable[[], None], done: Callable[[Optional[BaseException]], None],
               write: bool = False) -> None:
        with self._lock:
            if not self._threads:
                for k in range(self.threads):
                    t = threading.Thread(target=self._run, name=f"{self._name}-{k}", daemon=True)
                    t.start()
                    self._threads.append(t)
        self._tasks.put((int(write), next(self._count), fn, done))

    def _run(self) -> None:
        while True:
            _, _, fn, done = self._tasks.get()
            if fn is None:
                return
            error = None
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to done
                error = e
            done(error)
            del fn, done, error

    def close(self) -> None:
        """Ends the threads once the queued tasks have run."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._tasks.put((2, next(self._count), None, None))
        for t in threads:
            if t is not threading.current_thread():
                t.join()


@dataclass(frozen=True)
class IOChoice:
    """How a store issues its I/O, chosen by :func:`measure` (``roundpipe.disk`` has no knobs).

    Attributes:
        block: bytes per request (a multiple of :data:`ALIGN`).
        depth: requests in flight per direction (the pool has twice as many threads: a step
            reads the next set while it writes the last one).
        direct: whether the files are opened with ``O_DIRECT``.
        read_gbps / write_gbps: what the chosen setting reached in the measurement (1e9 B/s).
        reason: how it was chosen.
    """

    block: int
    depth: int
    direct: bool
    read_gbps: float
    write_gbps: float
    reason: str


#: Candidates of the measurement: request sizes and depths (sequential transfers).
BLOCKS = (1 << 20, 4 << 20)
DEPTHS = (1, 2, 4, 8)
PROBE_BYTES = 16 << 20
_measured: dict[tuple[int, bool], IOChoice] = {}
_measure_lock = threading.Lock()


def measure(folder: str, direct: bool, sys: Syscalls) -> IOChoice:
    """The request size and depth for files in ``folder``: each candidate of :data:`BLOCKS` x
    :data:`DEPTHS` writes then reads a :data:`PROBE_BYTES` file there, and the one with the
    highest mean of read and write bandwidth wins, unless a smaller depth (then a smaller
    request) is within 10% of it (fewer threads, less memory in flight for the same speed).
    Measured once per disk (``st_dev``) and process, in about a third of a second on a 1.5 GB/s
    disk.

    Raises:
        OSError: the probe file cannot be created, written or read.
    """
    key = (os.stat(folder).st_dev, direct)
    with _measure_lock:
        if key in _measured:
            return _measured[key]
        path = os.path.join(folder, "probe.tmp")
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = sys.open(path, flags)
        buf = mmap.mmap(-1, PROBE_BYTES)
        try:
            buf.write(os.urandom(1 << 16) * (PROBE_BYTES >> 16))
            sys.allocate(fd, 0, PROBE_BYTES)
            view = memoryview(buf)
            results = []
            for depth in DEPTHS:
                for block in BLOCKS:
                    w = _timed(write_full, sys, fd, view, block, depth, direct)
                    r = _timed(read_full, sys, fd, view, block, depth, direct)
                    results.append((depth, block, r, w))
            view.release()
        finally:
            sys.close(fd)
            buf.close()
            try:
                os.unlink(path)
            except OSError:
                pass
        best = max((r + w) / 2 for _, _, r, w in results)
        depth, block, r, w = next(c for c in results if (c[2] + c[3]) / 2 >= 0.9 * best)
        choice = IOChoice(block, depth, direct, r, w,
                          f"measured: {len(results)} settings of request size x depth, each "
                          f"writing and reading {PROBE_BYTES >> 20} MiB; the smallest within "
                          f"10% of the best mean bandwidth ({best:.2f} GB/s)")
        _measured[key] = choice
        return choice


def _timed(op, sys: Syscalls, fd: int, view: memoryview, block: int, depth: int,
           direct: bool) -> float:
    """GB/s of ``op`` over ``view`` in requests of ``block`` bytes, ``depth`` at a time."""
    offsets = list(range(0, len(view), block))
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                if not offsets or errors:
                    return
                o = offsets.pop()
            try:
                op(sys, fd, view[o:o + block], o, direct)
            except OSError as e:
                errors.append(e)

    start = time.perf_counter()
    threads = [threading.Thread(target=run) for _ in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return len(view) / (time.perf_counter() - start) / 1e9


def aligned_buffer(size: int) -> mmap.mmap:
    """Anonymous page-aligned memory of ``size`` bytes (rounded up to :data:`ALIGN`), advised for
    transparent huge pages where the OS has them; freed when the object is."""
    buf = mmap.mmap(-1, max(ALIGN, -(-size // ALIGN) * ALIGN),
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf
