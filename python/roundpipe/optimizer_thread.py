"""The optimizer thread: one worker running the optimizer side's jobs in the order they were
queued, with per-layer gates so the pipeline waits only for the layers being written.

A job is ``job(release)``: the layers it writes are blocked (:class:`LayerGates`) from its
submission until it calls ``release(layer)`` for each, or ends. An error in a background job
is kept and raised at the next call into the wrapper (:meth:`OptimizerThread.raise_error`),
once everything queued before it has finished. What the jobs do is :mod:`roundpipe.steps`.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Callable, Iterable, Optional

from .threads import LayerGates, Worker, check_not_forked

Job = Callable[[Callable[[int], None]], Any]


def _nothing() -> None:
    pass


class OptimizerThread:
    """Args:
        num_layers: number of pipeline layers (for the gates).
        on_error: ``on_error(error)``, called (on the caller's thread) when a background error
            is raised, before it propagates (the owner discards what the failed work left
            behind, and abandons its ranks' collectives).
    """

    def __init__(self, num_layers: int,
                 on_error: Callable[[BaseException], None] = lambda e: None) -> None:
        self.worker = Worker("roundpipe-optimizer")
        self.gates = LayerGates(num_layers)
        self._on_error = on_error
        self._futures: list[cf.Future] = []
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._started = False  # run_here started the thread

    def is_current(self) -> bool:
        """Whether the calling thread is the optimizer thread."""
        return self.worker.is_current()

    def submit(self, job: Job, layers: Iterable[int]) -> None:
        """Queues ``job(release)``, the layers ``layers`` blocked until it releases them (at
        the latest when it ends); its error is kept for :meth:`raise_error`."""
        layers = list(layers)
        self.gates.block(layers)
        with self._lock:  # workers and the caller both submit
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(self.worker.submit(self._run_kept, job, layers))

    def run_here(self, job: Job) -> None:
        """Runs ``job(release)`` on the calling thread as a queued job that blocks no layer
        would run on the optimizer thread, its error kept for :meth:`raise_error` likewise:
        for a job with nothing to wait for (the caller checked :meth:`idle`) and nothing to
        overlap with, saving the hand-off to the thread and back. The thread is started all the
        same, as a queued job would start it: what the wrapper's threads being started means
        (the error of a call in a ``fork()``-ed child) does not depend on where a job ran."""
        if not self._started:
            self._started = True
            self.worker.submit(_nothing)
        self._run_kept(job, ())

    def _run_kept(self, job: Job, layers: list[int]) -> None:
        try:
            self.run_now(job, layers, in_background=True)
        except BaseException as e:  # noqa: BLE001 - re-raised at the next call
            with self._lock:
                if self._error is None:
                    self._error = e
            del e

    def run_now(self, job: Job, layers: Iterable[int], in_background: bool = False) -> Any:
        """Runs ``job(release)`` here; every layer in ``layers`` it did not release is
        released at the end, whatever happens."""
        remaining = set(layers)

        def release(li: int) -> None:
            if li in remaining:
                remaining.discard(li)
                self.gates.release([li])

        try:
            return job(release)
        except BaseException as e:
            if in_background:
                e.add_note("(raised in RoundPipe's optimizer thread, in a step started earlier)")
            raise
        finally:
            self.gates.release(sorted(remaining))

    def pending(self) -> list[cf.Future]:
        """The jobs queued or running."""
        with self._lock:
            return list(self._futures)

    def idle(self) -> bool:
        with self._lock:
            return all(f.done() for f in self._futures)

    def wait(self, futures: Optional[list] = None) -> None:
        """Waits for the queued work (or ``futures``); nothing to wait for on the thread itself."""
        if self.is_current():
            return
        futures = self.pending() if futures is None else futures
        if not all(f.done() for f in futures):  # in a fork()-ed child they never would be
            check_not_forked([self.worker], "RoundPipe (waiting for its optimizer work)")
        cf.wait(futures)

    def raise_error(self) -> None:
        """Raises the first error of the background work once all of it queued so far has
        finished (later errors of the same work are dropped with it)."""
        with self._lock:
            if self._error is None:
                return
        self.wait()
        with self._lock:
            e, self._error = self._error, None
        self._on_error(e)
        try:
            raise e
        finally:
            e = None  # noqa: F841 - no reference cycle through this frame

    def close(self) -> None:
        self.worker.close()
