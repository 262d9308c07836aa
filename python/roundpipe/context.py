"""``OptimizerCtx``: within its scope, a RoundPipe model's ``parameters()`` and
``named_parameters()`` return the optimizer copies (master weights) instead of the model copies.
"""

from __future__ import annotations

import threading

_local = threading.local()


class OptimizerCtx:
    """Context manager that redirects ``RoundPipe.parameters()`` / ``named_parameters()`` to
    ``optim_parameters()`` / ``optim_named_parameters()`` while it is active.

    The state is thread local: entering it in one thread changes nothing in another. Contexts
    nest, and leaving one restores the state that was current when it was entered, so
    ``OptimizerCtx(enabled=False)`` inside an active one switches the redirection off for its
    own scope only. One instance may be entered again after it has been left, and re-entered
    while active (each ``__exit__`` undoes the matching ``__enter__``).

    Args:
        enabled: whether the redirection is on inside this scope. Must be a ``bool``.

    Raises:
        TypeError: if ``enabled`` is not a ``bool``.
    """

    def __init__(self, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"OptimizerCtx: enabled must be a bool, got {type(enabled).__name__}")
        self.enabled = enabled

    def __enter__(self) -> "OptimizerCtx":
        # The states to restore live in the thread, not in the instance: one instance may be
        # entered by several threads at once.
        saved = getattr(_local, "saved", None)
        if saved is None:
            saved = _local.saved = []
        saved.append(OptimizerCtx.is_active())
        _local.active = self.enabled
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _local.active = _local.saved.pop()

    @staticmethod
    def is_active() -> bool:
        """Whether the redirection is on in the calling thread."""
        return getattr(_local, "active", False)
