"""The weight fetcher: one device's stage weights in one pass, uploaded when a visit starts,
or earlier (prefetch) when the device supports it and it keeps the memory bound.

A visit's upload first waits until none of its layers is being written by the optimizer
side (:class:`roundpipe.threads.LayerGates`) and until every earlier stage that
shares a module holding buffers with it has finished its forward visit (so buffer updates,
e.g. BatchNorm statistics of a module used twice, happen in model order). A kept stage's backward visit
uploads nothing (its forward visit's weights are still there). The next visit's
weights are prefetched only when that is already true, when the device is done with the
visit before the current one (at most two stages of weights resident) and when the current
and next stage fit under ``max_resident_bytes``.

Across passes (generation, whose passes follow one another with the same weights): after a
pass, :meth:`WeightFetcher.upload_ahead` uploads the device's first visit of the next pass, so
the copy overlaps the host's work between the passes; the next pass's fetcher starts from it
(:meth:`WeightFetcher.start_from`).
"""

from __future__ import annotations

from typing import Callable, Optional

from ..stats import Stats
from ..transfer import DeviceIO, StageWeights, TensorRef
from .schedule import Visit
from ..threads import LayerGates, Slot


class Carry:
    """Uploads handed from one pass to the next (generation's passes, see the module
    docstring): by device index, ``(visit, (weights, event))`` as
    :meth:`WeightFetcher.upload_ahead` made it, with the device that made it. A pass takes
    them (:meth:`take`); what no pass takes is dropped with :meth:`drop`, which waits for the
    copies first: on CUDA they read the pinned host model copy, which must not be written or
    freed under them."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[tuple, DeviceIO]] = {}

    def put(self, device: int, item: tuple, io: DeviceIO) -> None:
        self._items[device] = (item, io)

    def take(self) -> dict[int, tuple]:
        """Every carried upload, by device index, handed over (none is left)."""
        items, self._items = self._items, {}
        return {d: item for d, (item, _) in items.items()}

    def drop(self) -> None:
        """Waits until the copies of every upload not taken are done, and forgets them."""
        items, self._items = self._items, {}
        for (_, (_, event)), io in items.values():
            io.host_wait(event)

    def __bool__(self) -> bool:
        return bool(self._items)


class WeightFetcher:
    """Args:
        io: the device.
        visits: the device's visits in this pass, in order.
        refs: ``refs(stage)`` -> per layer of the stage, its tensors.
        layers_of: ``layers_of(stage)`` -> the stage's global layer indices.
        gates: the optimizer side's layer gates.
        deps: ``deps[stage]`` -> slots of earlier forward visits to wait for.
        stage_bytes: device bytes of each stage's weights and buffers.
        max_resident_bytes: no prefetch above this (None: no cap).
        stats: where waits are counted.
    """

    def __init__(self, io: DeviceIO, visits: list[Visit],
                 refs: Callable[[int], list[list[TensorRef]]],
                 layers_of: Callable[[int], range], gates: LayerGates,
                 deps: list[list[Slot]], stage_bytes: list[int],
                 max_resident_bytes: Optional[int], stats: Stats) -> None:
        self.io, self.visits, self.refs, self.layers_of = io, visits, refs, layers_of
        self.gates, self.deps, self.stage_bytes = gates, deps, stage_bytes
        self.cap, self.stats = max_resident_bytes, stats
        self._next: Optional[tuple[int, tuple]] = None  # (visit position, (weights, event))

    def _upload(self, k: int) -> tuple[StageWeights, object]:
        v = self.visits[k]  # a kept stage's forward visit runs with autograd
        return self.io.upload(self.refs(v.stage), v.backward or v.kept)

    def start_from(self, carried: Optional[tuple]) -> bool:
        """Takes ``carried`` (:meth:`upload_ahead`'s result in the pass before, or None) as the
        upload of this pass's first visit if it is that visit's; returns whether it was."""
        if carried is None or not self.visits or carried[0] != self.visits[0]:
            return False
        self._next = (0, carried[1])
        return True

    def upload_ahead(self) -> Optional[tuple]:
        """After the pass: ``(visit, (weights, event))``, the upload of this device's first
        visit for a next pass with the same visits, issued now; None when it must wait for
        something (the optimizer side's gates, an earlier stage's forward visit)."""
        if not self.visits:
            return None
        v = self.visits[0]
        if self.deps[v.stage] or not self.gates.ready(self.layers_of(v.stage)):
            return None
        return v, self._upload(0)

    def get(self, k: int, abort) -> StageWeights:
        """The weights of visit ``k``, uploaded now unless prefetched; the compute waits for
        their copy."""
        if self._next is not None and self._next[0] == k:
            (weights, event), self._next = self._next[1], None
        else:
            stage = self.visits[k].stage
            for slot in self.deps[stage]:
                slot.get(abort)
            self.stats.add("optimizer_wait_s",
                           self.gates.wait(list(self.layers_of(stage)), abort))
            weights, event = self._upload(k)
        self.io.wait_weights(event)
        return weights

    def maybe_prefetch(self, k: int) -> None:
        """During visit ``k``: starts the upload of visit ``k + 1`` if allowed (see the module
        docstring); does not wait for anything."""
        if not self.io.prefetch or self._next is not None or k + 1 >= len(self.visits):
            return
        if self.visits[k + 1].backward and self.visits[k + 1].kept:  # uploads nothing
            return
        stage, nxt = self.visits[k].stage, self.visits[k + 1].stage
        if self.cap is not None and self.stage_bytes[stage] + self.stage_bytes[nxt] > self.cap:
            return
        if not all(slot.is_set() for slot in self.deps[nxt]):
            return
        if not self.io.done_through_previous_visit():
            return
        if self.gates.ready(self.layers_of(nxt)):
            self._next = (k + 1, self._upload(k + 1))
