"""The executor of one pass: each device follows its order of visits (:mod:`.schedule`),
calling the stage (:mod:`.stage`) one microbatch at a time and handing results between
stages through :class:`~roundpipe.threads.Slot` s on the host.

Slots: ``acts[s][m]`` is what stage ``s`` receives for microbatch ``m`` (a host tree and the
event of its copy), ``grads[s][m]`` the gradient of that input (a host list aligned with the
input's leaves, and event). A backward visit hands its downloaded parameter gradients to the
``grad_sink`` (the optimizer side) only after the next stage has handed over its own, so the
sink sees the stages in descending order whatever the number of devices: a parameter used
in several stages (tied weights) gets its per-stage sums added in the same order every time,
and results are bit-identical for any number of devices.

A *kept* stage (:attr:`Layout.recompute`) runs its forward visit with autograd; its
:class:`~roundpipe.pipeline.stage.StageVisit` (weights and graphs) waits in :attr:`Pass.kept`
for its backward visit, which fetches nothing.

A pass runs either on the devices' worker threads (several devices) or on the calling thread
in the global order (one device, or a pass started from inside a layer of another RoundPipe,
e.g. a teacher model: its workers could not run while the caller holds the RNG lock).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..plan import Stage, device_index
from ..stats import Stats
from ..torch_private import tree_flatten
from ..transfer import DeviceIO, GradDownload, TensorRef
from .fetch import WeightFetcher
from .schedule import Visit, device_orders, pass_order
from .stage import PassSpec, StageVisit
from ..threads import LayerGates, Slot, Worker, run_all


@dataclass
class Layout:
    """What the pipeline needs to know about the model for one call.

    Attributes:
        layers: the layer modules, in order.
        refs: per layer, the tensors it computes with (taken at the start of the call).
        stages: the stages.
        trainable_stages: per stage, whether it holds a trainable parameter.
        locks: per layer, a lock for modules that run in several stages (or None).
        buffer_deps: per stage, earlier stages sharing a module with buffers with it.
        stage_bytes: per stage, device bytes of its weights and buffers.
        max_resident_bytes: prefetch cap (None: none).
        recompute: per stage, whether a training pass recomputes it (``()``: every stage but
            the last; see :attr:`roundpipe.planner.StagePlan.recompute`).
    """

    layers: list[nn.Module]
    refs: list[list[TensorRef]]
    stages: list[Stage]
    trainable_stages: list[bool]
    locks: list[Optional[threading.Lock]]
    buffer_deps: list[list[int]]
    stage_bytes: list[int]
    max_resident_bytes: Optional[int]
    recompute: Sequence[bool] = ()

    @property
    def first_backward(self) -> int:
        """The lowest stage with a trainable parameter (the last stage when there is none)."""
        return next((s for s, t in enumerate(self.trainable_stages) if t), len(self.stages) - 1)

    def kept(self) -> list[bool]:
        """Per stage, whether a training pass keeps its saved tensors from its forward visit to
        its backward visit (it has both, and does not recompute)."""
        S, first = len(self.stages), self.first_backward
        return [bool(self.recompute) and not self.recompute[s] and first <= s < S - 1
                for s in range(S)]

    def input_grad(self, stage: int) -> bool:
        """Whether the stage's floating inputs need a gradient: an earlier stage trains."""
        return any(self.trainable_stages[:stage])


GradSink = Callable[[int, Optional[GradDownload], DeviceIO], None]


class Pass:
    """One ``forward`` or ``forward_backward`` call over the stages (see the module docstring).

    Args:
        spec: the call.
        layout: the model's layers and stages.
        ios: one :class:`DeviceIO` per device.
        gates: the optimizer side's layer gates (uploads wait for them).
        stats: where bytes, floors and seconds are counted.
        grad_sink: ``grad_sink(stage, download, io)`` receives each backward visit's
            downloaded gradients (or None), in descending stage order.
    """

    def __init__(self, spec: PassSpec, layout: Layout, ios: list[DeviceIO], gates: LayerGates,
                 stats: Stats, grad_sink: Optional[GradSink] = None) -> None:
        self.spec, self.layout, self.ios, self.gates, self.stats = spec, layout, ios, gates, stats
        self.grad_sink = grad_sink
        S, M = len(layout.stages), len(spec.microbatches)
        self.kept_stages = layout.kept() if spec.training else [False] * S
        self.order = pass_order(S, spec.training, layout.first_backward, self.kept_stages)
        self.kept: dict[int, StageVisit] = {}  # kept stages between their two visits
        self.acts = [[Slot() for _ in range(M)] for _ in range(S + 1)]
        for m, (args, kwargs, _) in enumerate(spec.microbatches):
            self.acts[0][m].set(((args, kwargs), None))
        self.grads = [[Slot() for _ in range(M)] for _ in range(S + 1)]
        # bytes of each stage input the pass made (stages 1 .. S-1) while on the host, their sum
        # and its most at once (``host_stage_input_bytes``)
        self._input_bytes = [[0] * M for _ in range(S + 1)]
        self._held = self._held_most = 0
        self._held_lock = threading.Lock()
        self.forward_done = [Slot() for _ in range(S)]
        self.handed_over = [Slot() for _ in range(S)]
        self.losses: list = [None] * M
        self.outputs: list = [None] * M
        # uploads the pass before made for this one (spec.carry), by device
        self.carried = spec.carry.take() if spec.carry is not None else {}
        self._count_floors()

    def _count_floors(self) -> None:
        """The byte floors of this pass (see :mod:`roundpipe.stats`); a visit uploaded by the
        pass before (:attr:`carried`) was counted there."""
        weight = grad = 0
        firsts = {v for v, _ in self.carried.values()}
        floors: dict[int, tuple[int, int]] = {}
        for v in self.order:
            if v in firsts:
                firsts.discard(v)
                continue
            if v.stage not in floors:
                floors[v.stage] = self._stage_floor(v.stage)
            w, g = floors[v.stage]
            weight += 0 if v.backward and v.kept else w  # a kept stage's weights: uploaded once
            grad += g if v.backward else 0
        self.stats.add("weight_floor_bytes", weight)
        self.stats.add("param_grad_floor_bytes", grad)

    def _stage_floor(self, s: int) -> tuple[int, int]:
        """Bytes of weights a visit of stage ``s`` uploads and of parameter gradients its
        backward visit downloads, at least."""
        M = len(self.spec.microbatches)
        weight = grad = 0
        seen = set()
        for li in self.layout.stages[s].layers:
            for ref in self.layout.refs[li]:
                if ref.is_buffer or id(ref.host) in seen:
                    continue
                seen.add(id(ref.host))
                weight += ref.host.numel() * ref.host.element_size()
                if ref.index is not None and ref.host.requires_grad:
                    grad += ref.host.numel() * min(M * ref.host.element_size(), 4)
        return weight, grad

    # --- running -------------------------------------------------------------------------------

    def run(self, workers: Optional[list[Worker]]) -> None:
        """Runs the pass: on ``workers`` (one per device) or, with None, on this thread."""
        D = len(self.ios)
        orders = device_orders(self.order, D)
        used = [d for d in range(D) if orders[d]]
        abort = threading.Event()
        runners = {d: _DeviceRun(self, d, orders[d], abort) for d in used}
        try:
            if workers is None:
                for v in self.order:
                    runners[device_index(v.stage, D)].run_next()
            else:
                run_all([workers[d] for d in used],
                        [functools.partial(_run_device, runners[d]) for d in used], abort)
        finally:
            abort.set()
            self.kept.clear()  # a failed pass's kept stages
            for d in used:
                self.ios[d].finish()
                self.ios[d].flush_counts()
            self.stats.set("host_stage_input_bytes", self._held_most)
        if self.spec.upload_ahead and self.spec.carry is not None:
            self._upload_ahead(runners)

    def _upload_ahead(self, runners: dict) -> None:
        """Each device's first visit of a next pass like this one, uploaded now into
        ``spec.carry`` (on CUDA on the weights stream, overlapping what the host does until
        that pass starts); its weight bytes are counted in the floor now."""
        for d, runner in runners.items():
            with self.ios[d].activate():
                item = runner.fetcher.upload_ahead()
            self.ios[d].flush_counts()
            if item is not None:
                self.spec.carry.put(d, item, self.ios[d])
                self.stats.add("weight_floor_bytes", self._stage_floor(item[0].stage)[0])

    def hand_over(self, s: int, m: int, item: tuple) -> None:
        """Gives stage ``s`` its input for microbatch ``m`` (a host tree and its event),
        counting its bytes while it is held (stage 0's input is the caller's, stage S's the
        pass's output: not counted)."""
        if 0 < s < len(self.layout.stages):
            tree = item[0]
            size = tree.nbytes if type(tree) is torch.Tensor else sum(
                t.nbytes for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))
            with self._held_lock:
                self._input_bytes[s][m] = size
                self._held += size
                self._held_most = max(self._held_most, self._held)
        self.acts[s][m].set(item)

    def drop_input(self, s: int, m: int) -> None:
        """Stage ``s``'s input for microbatch ``m`` is read for the last time."""
        self.acts[s][m].clear_value()
        with self._held_lock:
            self._held -= self._input_bytes[s][m]
            self._input_bytes[s][m] = 0

    def stage_input_done(self, s: int) -> bool:
        """Whether nothing reads stage ``s``'s inputs after its forward visit."""
        return not self.spec.training or s < self.layout.first_backward or self.kept_stages[s]


def _run_device(runner: "_DeviceRun", abort: threading.Event) -> None:
    with runner.pass_.ios[runner.d].activate():
        while runner.k < len(runner.visits):
            runner.run_next(activate=False)


class _DeviceRun:
    """One device's visits in a pass, run one at a time."""

    def __init__(self, pass_: Pass, d: int, visits: list[Visit], abort: threading.Event) -> None:
        self.pass_, self.d, self.visits, self.abort, self.k = pass_, d, visits, abort, 0
        layout = pass_.layout
        self.fetcher = WeightFetcher(
            pass_.ios[d], visits,
            lambda s: [layout.refs[li] for li in layout.stages[s].layers],
            lambda s: layout.stages[s].layers, pass_.gates,
            [[pass_.forward_done[e] for e in layout.buffer_deps[s]] for s in range(len(layout.stages))],
            layout.stage_bytes, layout.max_resident_bytes, pass_.stats)
        self.fetcher.start_from(pass_.carried.get(d))

    def run_next(self, activate: bool = True) -> None:
        io = self.pass_.ios[self.d]
        with io.activate() if activate else _null:
            k, self.k = self.k, self.k + 1
            v = self.visits[k]
            io.begin_visit()
            layout, p = self.pass_.layout, self.pass_
            if v.backward and v.kept:  # its forward visit's weights and graphs
                visit = p.kept.pop(v.stage)
            else:
                weights = self.fetcher.get(k, self.abort)
                stage = layout.stages[v.stage]
                last = v.stage == len(layout.stages) - 1
                visit = StageVisit(p.spec, stage, [layout.layers[li] for li in stage.layers],
                                   weights, io, layout.input_grad(v.stage),
                                   [layout.locks[li] for li in stage.layers], last,
                                   p.spec.training and not last and not v.kept
                                   and v.stage >= layout.first_backward)
                weights = None  # noqa: F841 - the visit holds them; they die with it
            if v.backward:
                self._backward(k, v, visit)
            else:
                self._forward(k, v, visit)

    def _forward(self, k: int, v: Visit, visit: StageVisit) -> None:
        p, abort, s = self.pass_, self.abort, v.stage
        kind = "output" if s == len(p.layout.stages) - 1 else "activation"
        run = visit.keep_one_chunk if v.kept else visit.forward_one_chunk
        done = p.stage_input_done(s)
        for m in range(len(p.spec.microbatches)):
            tree, event = p.acts[s][m].get(abort)
            if done:
                p.drop_input(s, m)
            p.hand_over(s + 1, m, run(m, tree, event, kind))
            tree = None
            self.fetcher.maybe_prefetch(k)
        visit.finish(False, abort)
        if v.kept:
            p.kept[s] = visit
        p.forward_done[s].set(True)

    def _backward(self, k: int, v: Visit, visit: StageVisit) -> None:
        p, abort, s = self.pass_, self.abort, v.stage
        last = s == len(p.layout.stages) - 1
        visit.begin_backward()
        for m in range(len(p.spec.microbatches)):
            grad_output = None if last else p.grads[s + 1][m].get(abort)
            if v.kept:
                out = visit.backward_kept_chunk(m, grad_output)
            else:
                tree, event = p.acts[s][m].get(abort)
                out = visit.backward_one_chunk(m, tree, event, grad_output)
            p.drop_input(s, m)
            if not last:
                p.grads[s + 1][m].clear_value()
            tree = grad_output = None
            if "input_grad" in out:
                p.grads[s][m].set(out["input_grad"])
            if "loss" in out:
                p.losses[m] = out["loss"]
            if "output" in out:
                p.outputs[m] = out["output"]
            out = None
            self.fetcher.maybe_prefetch(k)
        download = visit.finish(True, abort)
        try:
            if not last:
                p.handed_over[s + 1].get(abort)
            if p.grad_sink is not None:
                p.grad_sink(s, download, p.ios[self.d])
                download = None
        finally:
            if download is not None:
                download.release()
        p.handed_over[s].set(True)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_null = _Null()
