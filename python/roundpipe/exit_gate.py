"""Keeps threads out of C++ work while the interpreter finalises.

A daemon thread inside C++ code with the GIL released (an optimizer kernel, a torch op) when
the interpreter finalises is torn down as it takes the GIL back: a forced unwind through C++
frames, which aborts the process ("terminate called without an active exception"). Code that
enters such work wraps it in ``with STEP_GATE:`` (:mod:`roundpipe.optim`'s steps). At exit this
module's ``atexit`` handler closes the gate: it waits (up to :data:`EXIT_WAIT_S`) for the threads
inside, and a thread that enters afterwards (a daemon thread: every other one was joined before
``atexit`` handlers run) waits forever, in Python, where finalisation ends it cleanly.

:mod:`roundpipe.threads` imports this module before registering its own handler (which lets the
pipeline's workers finish their queued steps), so this one runs after it: exit handlers run in
the reverse order of registration. Standard library only: :mod:`roundpipe.optim` imports it.
"""

from __future__ import annotations

import atexit
import sys
import threading
from typing import Optional

#: how long interpreter exit waits for the threads inside the gate, in seconds
EXIT_WAIT_S = 300.0


class ExitGate:
    """A gate threads pass through (``with gate:``) until :meth:`close`; see the module
    docstring. The thread that closed it still enters (exit handlers may step)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0
        self._closer: Optional[int] = None  # the thread that closed the gate

    def __enter__(self) -> None:
        with self._cond:
            park = self._closer is not None and self._closer != threading.get_ident()
            if not park:
                self._inside += 1
        if park:
            threading.Event().wait()  # the interpreter is exiting: never returns

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._inside -= 1
            if self._inside == 0:
                self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Closes the gate and waits up to ``timeout`` seconds for the threads inside;
        returns whether they all left."""
        with self._cond:
            self._closer = threading.get_ident()
            return self._cond.wait_for(lambda: self._inside == 0, timeout)


#: the gate of the optimizer steps (:mod:`roundpipe.optim`)
STEP_GATE = ExitGate()


@atexit.register
def _close_step_gate() -> None:
    if not STEP_GATE.close(EXIT_WAIT_S):
        print(f"roundpipe: an optimizer step still ran {EXIT_WAIT_S:.0f} s after interpreter "
              "exit began; exiting anyway", file=sys.stderr)
