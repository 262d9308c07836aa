"""The threads of a RoundPipe and the primitives they wait on.

- :class:`Worker`: one daemon thread running submitted functions in order (one per compute
  device, and one for the CPU optimizer).
- :class:`Slot`: a value handed from one thread to another (a stage's output for one
  microbatch, the gradient of its input, ...), set once per pass.
- :class:`Permits`: a counting semaphore whose waits can be aborted (the bound on gradient
  downloads not yet consumed by the optimizer side).
- :class:`LayerGates`: per-layer readiness. A layer is *blocked* while an optimizer job that
  writes its model copy is queued or running; uploads of that layer wait until it is released.
- :func:`run_all`: runs one function per worker and waits for all of them; the first error
  aborts the others and reaches the caller.
- :func:`check_not_forked`: a clear error in a ``fork()``-ed child, whose copy of a started
  worker has no thread (anything queued would never run).

Every wait here wakes up at least every :data:`POLL_S` seconds to check an abort flag, so no
thread blocks forever when another one fails or the caller is interrupted.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

from . import exit_gate  # noqa: F401 - its exit handler, registered first, runs after ours

POLL_S = 0.05
_live: "weakref.WeakSet[Worker]" = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    """At interpreter exit, lets every worker finish the work already queued (an asynchronous
    optimizer step, say) and exit before finalisation starts. A daemon thread still inside
    C++ code (an optimizer kernel, torch) when the interpreter finalises is torn down by a
    forced unwind, which aborts the process ("terminate called without an active
    exception"); queued work is finite, so waiting for it is the safe choice."""
    workers = list(_live)
    for w in workers:
        w.close()
    for w in workers:
        if not w.is_current():
            w.join()


class Aborted(Exception):
    """Raised inside a worker whose pass was aborted because another worker failed."""


class Worker:
    """One daemon thread that runs submitted functions one after the other, in order.

    The thread starts on the first :meth:`submit`; :meth:`close` lets it exit after the work
    already queued. Being a daemon thread, it never keeps the interpreter alive (but see
    :func:`_stop_workers`: queued work finishes at exit).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._closed = False
        self._pid = 0  # the process that started the thread
        _live.add(self)

    @property
    def forked(self) -> bool:
        """Whether the thread was started by another process: this is a ``fork()``-ed child,
        where the worker's thread does not exist."""
        return self._thread is not None and self._pid != os.getpid()

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """Queues ``fn(*args)``; the returned future holds its result or exception.

        Raises:
            RuntimeError: the worker is closed, or its thread was started by the parent of
                this ``fork()``-ed process (see :func:`check_not_forked`).
        """
        check_not_forked([self], self.name)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the worker is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._pid = os.getpid()
                self._thread.start()
        future: cf.Future = cf.Future()
        self._queue.put((future, fn, args))
        return future

    def is_current(self) -> bool:
        """Whether the calling thread is this worker's thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def close(self) -> None:
        """Lets the thread exit once the queued work is done (does not wait for it)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)

    def join(self, timeout: Optional[float] = None) -> None:
        """Waits (at most ``timeout`` seconds) for the thread to exit after :meth:`close`."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            _run(*item)
            # Nothing of the job may stay referenced while the thread waits for the next one:
            # a job's function refers to its RoundPipe, which must be freed when unused.
            del item


def check_not_forked(workers: Iterable[Worker], where: str) -> None:
    """Raises at once in a ``fork()``-ed child when one of ``workers`` had started its thread
    in the parent: the child has none of the parent's threads, so work queued to it would
    never run (and work the parent had queued, an asynchronous step say, never ends).

    Raises:
        RuntimeError: naming ``where``, the parent's and this process's ids, and the ways on.
    """
    for w in workers:
        if w.forked:
            raise RuntimeError(
                f"{where}: this RoundPipe's threads were started in process {w._pid}, and this "
                f"is a fork()-ed child (process {os.getpid()}) where they do not exist; build "
                "the model in the child, or start child processes with the 'spawn' (or "
                "'forkserver') start method of multiprocessing")


def _run(future: cf.Future, fn: Callable[..., Any], args: tuple) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        # this frame is in the error's traceback: it must not refer to the future holding
        # the error (a cycle that keeps the job, and its RoundPipe, alive until gc runs)
        fn = args = None  # noqa: F841
        future.set_exception(e)
        del e, future


def _wait(event: threading.Event, abort: Optional[threading.Event]) -> None:
    """Waits for ``event``; raises :class:`Aborted` once ``abort`` is set (checked first)."""
    if abort is not None and abort.is_set():
        raise Aborted()
    while not event.wait(POLL_S):
        if abort is not None and abort.is_set():
            raise Aborted()


class Slot:
    """A value set once by one thread and read by others; :meth:`get` waits for it. The event
    a reader waits on is made only when one has to wait (most slots are read after they are
    set, and a pass makes a few per stage and microbatch)."""

    __slots__ = ("_done", "_event", "_value")
    _guard = threading.Lock()  # makes an event and decides whether a reader must wait on it

    def __init__(self) -> None:
        self._done = False
        self._event: Optional[threading.Event] = None
        self._value: Any = None

    def set(self, value: Any) -> None:
        self._value = value
        with Slot._guard:
            self._done = True
            event = self._event
        if event is not None:
            event.set()

    def is_set(self) -> bool:
        return self._done

    def clear_value(self) -> None:
        """Drops the value (its last reader is done with it); the slot stays set."""
        self._value = None

    def get(self, abort: Optional[threading.Event]) -> Any:
        """The value, once set. Raises :class:`Aborted` if ``abort`` is set (checked first, so
        a worker whose inputs are all ready still stops at its next microbatch)."""
        if abort is not None and abort.is_set():
            raise Aborted()
        if not self._done:
            with Slot._guard:
                if self._done:
                    event = None
                else:
                    if self._event is None:
                        self._event = threading.Event()
                    event = self._event
            if event is not None:
                _wait(event, abort)
        return self._value


class Permits:
    """A counting semaphore of ``n`` permits whose :meth:`acquire` can be aborted."""

    def __init__(self, n: int) -> None:
        self._cond = threading.Condition()
        self._free = n

    def acquire(self, abort: Optional[threading.Event]) -> None:
        """Takes one permit, waiting for one to be released; raises :class:`Aborted` if
        ``abort`` is set while waiting."""
        with self._cond:
            while self._free == 0:
                if abort is not None and abort.is_set():
                    raise Aborted()
                self._cond.wait(POLL_S)
            self._free -= 1

    def release(self) -> None:
        with self._cond:
            self._free += 1
            self._cond.notify()


class LayerGates:
    """Per-layer readiness of the host model copy.

    :meth:`block` marks layers as about to be rewritten by an optimizer job (counted: several
    jobs may be queued), :meth:`release` marks one job's write of them done. Uploads call
    :meth:`wait` first, so a layer is never read while it is being written, and each layer waits
    only for its own update (no global barrier).
    """

    def __init__(self, num_layers: int) -> None:
        self._cond = threading.Condition()
        self._blocked = [0] * num_layers

    def block(self, layers: Iterable[int]) -> None:
        with self._cond:
            for i in layers:
                self._blocked[i] += 1

    def release(self, layers: Iterable[int]) -> None:
        with self._cond:
            for i in layers:
                self._blocked[i] -= 1
            self._cond.notify_all()

    def ready(self, layers: Iterable[int]) -> bool:
        """Whether none of ``layers`` is blocked (does not wait)."""
        with self._cond:
            return not any(self._blocked[i] for i in layers)

    def wait(self, layers: Sequence[int], abort: Optional[threading.Event] = None) -> float:
        """Waits until none of ``layers`` is blocked; returns the seconds waited. Raises
        :class:`Aborted` if ``abort`` is set while waiting."""
        start = time.perf_counter()
        with self._cond:
            while any(self._blocked[i] for i in layers):
                if abort is not None and abort.is_set():
                    raise Aborted()
                self._cond.wait(POLL_S)
        return time.perf_counter() - start


def run_all(workers: Sequence[Worker], fns: Sequence[Callable[[threading.Event], Any]],
            abort: Optional[threading.Event] = None) -> list:
    """Runs ``fns[i](abort)`` on ``workers[i]`` and waits for all of them.

    If one raises, ``abort`` is set so the others stop at their next wait, and once all have
    stopped the first error (in completion order, :class:`Aborted` ignored) is raised here with
    its original traceback. If the calling thread is interrupted (e.g. ``KeyboardInterrupt``)
    the workers are aborted and waited for the same way before the interruption propagates.
    Returns the functions' results. Nothing here keeps a reference to the error once it is
    raised (the caller's traceback would otherwise form a cycle that only ``gc`` frees).
    """
    abort = abort or threading.Event()
    futures = [w.submit(fn, abort) for w, fn in zip(workers, fns)]
    try:
        error = _wait_all(futures, abort)
    except BaseException:
        abort.set()
        cf.wait(futures)
        raise
    if error is None:
        return [f.result() for f in futures]
    futures = None  # noqa: F841 - nothing here may refer to the error once it is raised
    try:
        raise error
    finally:
        error = None  # noqa: F841


def _wait_all(futures: list, abort: threading.Event) -> Optional[BaseException]:
    """Waits for every future; at the first error that is not :class:`Aborted` (in completion
    order) sets ``abort`` and keeps waiting. Returns that error (else any error: an Aborted
    without a cause cannot happen, but never return half results) or None."""
    first = None
    pending = set(futures)
    while pending:
        done, pending = cf.wait(pending, timeout=POLL_S, return_when=cf.FIRST_EXCEPTION)
        for f in done:
            e = f.exception()
            if e is not None and first is None and not isinstance(e, Aborted):
                first = e
                abort.set()
    if first is None:
        first = next((f.exception() for f in futures if f.exception() is not None), None)
    return first
