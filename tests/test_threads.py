"""roundpipe.optim's worker threads as a Python program sees them: threads made for a larger
``num_threads`` exit again, a fork during a step (os.fork, multiprocessing's "fork") leaves the
child able to step, and an interpreter exit while a daemon thread is inside a step ends the process
normally. Linux only (thread counts from /proc/self/task); every wait is bounded."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import roundpipe.optim as rpo

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A step call over n elements runs on at most max(1, n // ELEMENTS_PER_THREAD) threads (mirrors
# kElementsPerThread in cpp/optim/parallel.hpp): a step on t threads needs t times as many.
ELEMENTS_PER_THREAD = 196608


def _many_threads() -> int:
    """A per-call thread count above the process's and above the 4 threads other tests use (the
    workers of their steps may not have exited yet)."""
    return max(rpo.num_threads(), 4) + 6


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _eventually(pred, limit: float = 60.0) -> bool:
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _adam(n: int, num_threads=None):
    p = torch.nn.Parameter(torch.ones(n))
    p.grad = torch.full((n,), 0.5)
    opt = rpo.Adam([p], lr=0.1)
    opt.num_threads = num_threads
    return p, opt


def test_threads_made_for_a_larger_count_exit_again():
    many = _many_threads()
    p, opt = _adam(many * ELEMENTS_PER_THREAD)
    opt.step()  # the process's own workers
    before = _threads()
    opt.num_threads = many
    opt.step()
    assert _threads() > before
    assert _eventually(lambda: _threads() <= before), f"{_threads()} threads, {before} before"


class _Stepper:
    """A thread that steps an optimizer without pause until stopped."""

    def __init__(self):
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        _, opt = _adam(4 * ELEMENTS_PER_THREAD, num_threads=4)
        while not self._stop.is_set():
            opt.step()
            self.steps += 1

    def __enter__(self):
        self._thread.start()
        assert _eventually(lambda: self.steps > 0)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()


def _child_step() -> bool:
    # torch's own OpenMP threads do not survive a fork (GNU libgomp): a forked child limits torch
    # to one thread, as torch advises. Our pool is separate and must work there on several.
    torch.set_num_threads(1)
    p, opt = _adam(3 * ELEMENTS_PER_THREAD, num_threads=3)  # its steps use workers of its own
    opt.step()
    opt.num_threads = None
    opt.step()
    return bool((p < 1).all())


def test_os_fork_during_a_step_leaves_the_child_usable():
    with _Stepper():
        for _ in range(8):
            pid = os.fork()
            if pid == 0:  # the child: step, then leave without running the parent's cleanup
                os._exit(0 if _child_step() else 1)
            status = []
            if not _eventually(lambda: status.append(os.waitpid(pid, os.WNOHANG)) or
                               status[-1][0] == pid):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung")
            assert os.waitstatus_to_exitcode(status[-1][1]) == 0


def _mp_child(queue):
    queue.put(_child_step())


def test_multiprocessing_fork_during_a_step_leaves_the_child_usable():
    ctx = multiprocessing.get_context("fork")
    with _Stepper():
        for _ in range(4):
            queue = ctx.Queue()
            proc = ctx.Process(target=_mp_child, args=(queue,))
            proc.start()
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()
                pytest.fail("the forked child hung")
            assert proc.exitcode == 0 and queue.get(timeout=10) is True




_EXIT_DURING_A_STEP = """
import threading, torch, roundpipe.optim as rpo
p = torch.nn.Parameter(torch.ones(4 * {per_thread}))
p.grad = torch.full_like(p, 0.5)
opt = rpo.Adam([p], lr=0.1)
opt.num_threads = 4
started = threading.Event()

def steps():
    while True:
        opt.step()
        started.set()

threading.Thread(target=steps, daemon=True).start()
started.wait(60)
print("exiting", flush=True)
"""


def test_interpreter_exit_while_a_daemon_thread_is_inside_a_step_ends_the_process_normally():
    """The main thread returns while a daemon thread keeps stepping on 4 threads: the process
    must exit with status 0 (no crash in a static destructor, no hang joining the pool)."""
    code = _EXIT_DURING_A_STEP.format(per_thread=ELEMENTS_PER_THREAD)
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "exiting" in done.stdout


def test_the_exit_gate_waits_for_the_threads_inside_and_parks_those_that_enter_after():
    """What interpreter exit does with optimizer steps on daemon threads (the test above sees
    its effect only a few times in a hundred exits): ``close`` returns once the thread inside
    leaves, a thread entering afterwards never gets in, the closing thread itself does."""
    from roundpipe.exit_gate import ExitGate

    gate, inside, leave, entered = ExitGate(), threading.Event(), threading.Event(), []

    def worker():
        with gate:
            inside.set()
            leave.wait(30)

    def late():
        with gate:
            entered.append(True)

    first = threading.Thread(target=worker, daemon=True)
    first.start()
    assert inside.wait(30)
    assert gate.close(0.2) is False            # still inside: the bounded wait gives up
    threading.Timer(0.3, leave.set).start()
    assert gate.close(30) is True              # returned once it left
    first.join(30)
    assert not first.is_alive()
    second = threading.Thread(target=late, daemon=True)
    second.start()
    second.join(0.5)
    assert second.is_alive() and entered == []  # parked: the interpreter is exiting
    with gate:                                  # the thread that closed it steps on
        entered.append("closer")
    assert entered == ["closer"]
