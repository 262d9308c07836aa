"""Keeping data for activation recomputation.

RoundPipe runs each layer's forward twice during training: once in the forward pass (no
autograd graph kept, only the stage input is stored) and again in the backward pass, where the
forward is recomputed with autograd. Randomness is replayed exactly (each layer runs under a seed
fixed for the layer and microbatch), but a layer whose forward makes data-dependent decisions it
does not want to redo (routing in a mixture of experts, a sampled mask) can keep data from the
first run::

    def forward(self, x):
        if roundpipe.doing_recompute():
            (choice,) = roundpipe.get_recompute_data()
        else:
            choice = self.route(x)
            roundpipe.save_for_recompute(choice)
        ...

Data is kept per layer and microbatch on the host until the backward pass has used it. A stage
that does not recompute (it keeps autograd's saved tensors to its backward, see
:mod:`roundpipe.planner`) runs each layer once, with autograd, as the last stage and inference
do: :func:`doing_recompute` is False there, :func:`will_recompute` too, and what
:func:`save_for_recompute` is given is dropped.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

_local = threading.local()


class _Slot:
    """What the running layer may save (first run) or read back (recomputation)."""

    __slots__ = ("recompute", "data", "store", "key")

    def __init__(self, recompute: bool, store: dict, key: tuple) -> None:
        self.recompute = recompute
        self.store = store
        self.key = key


class running:
    """Internal: marks the layer and microbatch running in this thread (a context manager);
    ``store`` None: no recomputation follows this run (nothing is kept)."""

    def __init__(self, store: Optional[dict], key: tuple, recompute: bool) -> None:
        self.slot = _Slot(recompute, store, key)

    def __enter__(self):
        self.outer = getattr(_local, "slot", None)
        _local.slot = self.slot

    def __exit__(self, *exc):
        _local.slot = self.outer


def doing_recompute() -> bool:
    """True while RoundPipe recomputes a layer's forward in the backward pass."""
    slot = getattr(_local, "slot", None)
    return slot is not None and slot.recompute


def will_recompute() -> bool:
    """True while a RoundPipe layer runs a forward that its backward pass will recompute (what
    :func:`save_for_recompute` is given is then kept); False in the recomputation itself, in a
    stage that keeps its saved tensors instead, in the last stage and outside training."""
    slot = getattr(_local, "slot", None)
    return slot is not None and not slot.recompute and slot.store is not None


def save_for_recompute(*data: Any) -> None:
    """Keeps ``data`` for the recomputation of the calling layer on the current microbatch
    (returned there by :func:`get_recompute_data`). Tensors are kept as given: detach or move
    them to the host yourself if they are large device tensors. Where no recomputation follows
    (:func:`will_recompute` is False: a stage that keeps its saved tensors, the last stage,
    inference), nothing is kept.

    Raises:
        RuntimeError: outside a RoundPipe forward pass, or during a recomputation.
    """
    slot = getattr(_local, "slot", None)
    if slot is None:
        raise RuntimeError("save_for_recompute() called outside a RoundPipe layer's forward")
    if slot.recompute:
        raise RuntimeError("save_for_recompute() called during recomputation; "
                           "check doing_recompute() first")
    if slot.store is not None:
        slot.store[slot.key] = data


def get_recompute_data() -> tuple:
    """The tuple the calling layer passed to :func:`save_for_recompute` for this microbatch in
    the forward pass.

    Raises:
        RuntimeError: outside a recomputation, or if the layer saved nothing.
    """
    slot = getattr(_local, "slot", None)
    if slot is None or not slot.recompute:
        raise RuntimeError("get_recompute_data() called outside a RoundPipe recomputation")
    if slot.key not in slot.store:
        raise RuntimeError("get_recompute_data(): this layer saved nothing for this microbatch "
                           "with save_for_recompute() in the forward pass")
    return slot.store[slot.key]
