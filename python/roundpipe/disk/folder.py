"""The folder a :class:`~roundpipe.disk.store.StateStore` keeps its files in: taken exclusively
(a lock file, so that two processes, or two RoundPipes, never share one), cleared of what a
killed process left there, checked for files that are not the store's (never deleted), and
emptied when the store closes.

Layout: ``<optimizer_dir>/rank<r>/`` (``r``: the rank in the process group, 0 without one, so
the ranks of one machine can share ``optimizer_dir``), holding ``LOCK`` (the owner's pid, host
and start time, locked with ``flock`` while the owner lives), ``*.bin`` (the state) and, for a
moment at first use, ``probe.tmp`` (the disk measurement).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import warnings
from .io import Syscalls


class StateDiskError(OSError):
    """An operation on an optimizer-state folder failed: ``errno`` is the cause's, the message
    names the folder, what was being done and the cause."""


LOCK = "LOCK"
PROBE = "probe.tmp"
_TMPFS = ("tmpfs", "ramfs")


def _ours(name: str) -> bool:
    return name == LOCK or name == PROBE or name.endswith(".bin")


def fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (``/proc/self/mountinfo``; ``""`` when
    unknown)."""
    path = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                sep = parts.index("-")
                mount = parts[4].encode().decode("unicode_escape")
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) \
                        and len(mount) >= len(best):
                    best, kind = mount, parts[sep + 1]
    except (OSError, ValueError, IndexError):
        return ""
    return kind


class Folder:
    """``<base>/rank<rank>``, created if needed and locked for this process.

    Args:
        base: the ``optimizer_dir`` given (created if missing).
        rank: the rank whose subfolder this is.
        sys: the system calls (:data:`roundpipe.disk.io.SYSCALLS`).

    Attributes:
        path: the subfolder.
        direct: whether files here open with ``O_DIRECT`` (False: the file system refuses it;
            a ``UserWarning`` said so).
        fs: its file system type.

    Raises:
        StateDiskError: the folder cannot be created, is in use by another process (or another
            RoundPipe of this one: ``EBUSY``), or holds files that are not a store's
            (``EEXIST``; nothing is deleted).

    A store's files that a killed process left (its lock is free) are removed, with a
    ``UserWarning`` naming the folder, that process and the bytes freed.
    """

    def __init__(self, base: str, rank: int, sys: Syscalls) -> None:
        if not isinstance(base, (str, os.PathLike)):
            raise TypeError(f"RoundPipe: optimizer_dir must be a path (str), got "
                            f"{type(base).__name__}")
        base = os.path.abspath(os.fspath(base))
        self.base, self.path, self.sys = base, os.path.join(base, f"rank{rank}"), sys
        self.pid = os.getpid()  # a fork()-ed child's copy never removes the files
        self._made = [d for d in (base, self.path) if not os.path.isdir(d)]
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise StateDiskError(e.errno, f"RoundPipe optimizer_dir {base!r}: cannot create "
                                          f"{self.path!r}: {e.strerror}") from e
        self._lock_fd = None
        try:
            self._lock_fd = self._lock()
            self.fs = fs_type(self.path)
            self.direct = self._direct_ok()
        except BaseException:
            if self._lock_fd is not None:
                self.close()
            else:
                self._remove_made()
            raise

    def _lock(self) -> int:
        path = os.path.join(self.path, LOCK)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise StateDiskError(e.errno, f"RoundPipe optimizer_dir {self.path!r}: cannot "
                                          f"create {path!r}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = _read_owner(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise StateDiskError(e.errno, f"RoundPipe optimizer_dir {self.path!r}: cannot "
                                              f"lock {path!r}: {e.strerror}") from e
            who = ("another RoundPipe of this process" if owner.get("pid") == os.getpid()
                   else f"process {owner.get('pid', '?')} on {owner.get('host', '?')}")
            raise StateDiskError(errno.EBUSY, f"RoundPipe optimizer_dir {self.path!r} is in use "
                                              f"by {who} (it holds {path!r}); give each run, "
                                              "and each RoundPipe, its own optimizer_dir") from None
        previous = _read_owner(fd)
        try:
            self._check_contents(previous)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.time()}).encode(), 0)
        return fd

    def _check_contents(self, previous: dict) -> None:
        names = [n for n in os.listdir(self.path) if n != LOCK]
        foreign = sorted(n for n in names if not _ours(n))
        if foreign:
            raise StateDiskError(errno.EEXIST, f"RoundPipe optimizer_dir {self.path!r} holds "
                                               f"files that are not RoundPipe's optimizer state "
                                               f"({', '.join(foreign[:5])}"
                                               f"{', ...' if len(foreign) > 5 else ''}); give an "
                                               "empty folder (nothing was deleted)")
        if not names:
            return
        if previous.get("host") not in (None, socket.gethostname()):
            raise StateDiskError(errno.EBUSY, f"RoundPipe optimizer_dir {self.path!r} holds the "
                                              f"files of a run on host {previous['host']!r}, "
                                              "whose process cannot be checked from here; remove "
                                              "them if that run is over, or give another folder")
        freed = 0
        for n in names:
            p = os.path.join(self.path, n)
            try:
                freed += os.stat(p).st_blocks * 512
                os.unlink(p)
            except FileNotFoundError:
                pass
        warnings.warn(f"RoundPipe optimizer_dir {self.path!r}: removed {len(names)} file(s) "
                      f"({freed / 2**30:.2f} GiB) that process {previous.get('pid', '?')} left "
                      "when it ended without closing them (killed?); they held its optimizer "
                      "state, which is not a checkpoint", UserWarning, stacklevel=5)

    def _direct_ok(self) -> bool:
        path = os.path.join(self.path, PROBE)
        try:
            fd = self.sys.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise StateDiskError(e.errno, f"RoundPipe optimizer_dir {self.path!r}: cannot "
                                              f"create a file: {e.strerror}") from e
            direct = False
        else:
            self.sys.close(fd)
            direct = True
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if not direct:
            warnings.warn(f"RoundPipe optimizer_dir {self.path!r}: its file system "
                          f"({self.fs or 'unknown'}) refuses direct I/O (O_DIRECT: EINVAL); the "
                          "optimizer state goes through the page cache (the kernel may keep a "
                          "copy of it in memory)", UserWarning, stacklevel=4)
        if self.fs in _TMPFS:
            warnings.warn(f"RoundPipe optimizer_dir {self.path!r} is on {self.fs}, which is "
                          "memory: the optimizer state stays in host RAM (give a folder on a "
                          "disk to save memory)", UserWarning, stacklevel=4)
        return direct

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def close(self) -> None:
        """Removes the store's files, the lock and the folders this object created (the
        caller closed the files); nothing in a ``fork()``-ed child, whose copy this is (the
        parent still uses them)."""
        if self._lock_fd is None or os.getpid() != self.pid:
            return
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:  # removed by someone else meanwhile
            names = []
        for n in names:
            if _ours(n) and n != LOCK:
                try:
                    os.unlink(os.path.join(self.path, n))
                except FileNotFoundError:
                    pass
        try:
            os.unlink(os.path.join(self.path, LOCK))
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)
        self._lock_fd = None
        self._remove_made()

    def _remove_made(self) -> None:
        """The folders this object created, if empty (innermost first)."""
        for d in reversed(self._made):
            try:
                os.rmdir(d)
            except OSError:
                break


def _read_owner(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        owner = json.loads(raw.decode()) if raw else {}
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def describe(error: BaseException) -> str:
    """An error as the messages show a cause: ``[Errno 28] No space left on device``."""
    if isinstance(error, OSError) and error.errno is not None:
        return f"[Errno {error.errno}] {error.strerror or os.strerror(error.errno)}"
    return f"{type(error).__name__}: {error}"


def as_error(folder: str, what: str, error: BaseException, more: str = "") -> StateDiskError:
    """A :class:`StateDiskError` for ``error`` while doing ``what`` in ``folder``."""
    code = error.errno if isinstance(error, OSError) and error.errno else errno.EIO
    return StateDiskError(code, f"RoundPipe optimizer_dir {folder!r}: {what} failed: "
                                f"{describe(error)}{more}")


def size_text(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

