"""The schedule: in which order each device visits the stages in one pass. A pure function of
the pass's shape, unit-tested on its own; :mod:`roundpipe.pipeline.run` executes it.

A *visit* is one stage's turn on its device: its weights are uploaded once, then it runs on
every microbatch in order. An inference pass visits the stages forward. A training pass visits
stages ``0 .. S-2`` forward without autograd (keeping only their inputs on the host), then
``S-1 .. first_backward`` backward: the recomputation of the stage with autograd and its
backward (for the last stage: its only forward, the loss and the backward). Stages below
``first_backward`` hold nothing trainable and produce no input whose gradient is needed, so
they get no backward visit. A *kept* stage (one that does not recompute, see
:mod:`roundpipe.planner`) runs its forward visit with autograd and keeps its weights and what
autograd saved until its backward visit, which uploads nothing and only runs the backward.

Stage ``s`` runs on device ``s % num_devices``. Each device's visits are a subsequence of one
global order in which every visit comes after the visits it depends on (a forward visit after
the previous stage's forward visit, a backward visit after the next stage's backward visit
and its own stage's input), so workers that each follow their own order cannot deadlock.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from ..plan import device_index


class Visit(NamedTuple):
    """One stage's turn on its device; ``backward``: recomputation + backward, or the backward
    alone when ``kept``: the stage keeps autograd's saved tensors from its forward visit (run
    with autograd) to its backward visit (see above)."""

    stage: int
    backward: bool
    kept: bool = False


def pass_order(num_stages: int, training: bool, first_backward: int = 0,
               kept: Sequence[bool] = ()) -> list[Visit]:
    """The global order of a pass's visits.

    Args:
        num_stages: number of stages, >= 1.
        training: a ``forward_backward`` pass (else inference: forward visits only).
        first_backward: the lowest stage that gets a backward visit (clamped to
            ``[0, num_stages - 1]``: the last stage always runs in a training pass).
        kept: per stage, whether it is kept (only a training pass's stages from
            ``first_backward`` up to the last but one are; ``()``: none).

    Raises:
        ValueError: ``num_stages < 1``.
    """
    if num_stages < 1:
        raise ValueError(f"pass_order: num_stages must be >= 1, got {num_stages}")
    if not training:
        return [Visit(s, False) for s in range(num_stages)]
    first_backward = min(max(first_backward, 0), num_stages - 1)
    keep = [bool(kept) and kept[s] and first_backward <= s < num_stages - 1
            for s in range(num_stages)]
    return ([Visit(s, False, keep[s]) for s in range(num_stages - 1)]
            + [Visit(s, True, keep[s]) for s in range(num_stages - 1, first_backward - 1, -1)])


def device_orders(order: list[Visit], num_devices: int) -> list[list[Visit]]:
    """Each device's visits, in global order: stage ``s`` on device ``s % num_devices``
    (:func:`roundpipe.plan.device_index`)."""
    out: list[list[Visit]] = [[] for _ in range(num_devices)]
    for v in order:
        out[device_index(v.stage, num_devices)].append(v)
    return out
