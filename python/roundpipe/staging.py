"""How a RoundPipe's stages are chosen, and revised while layer costs are measured.

``layers_per_stage`` (``RoundPipe(...)``):

- an int ``N``: stages of ``N`` consecutive layers, fixed;
- a sequence of ints: the layers of each stage, in order (a pinned plan, e.g. ``model.plan().sizes``
  from an earlier run), fixed;
- ``"auto"`` (the default on CUDA; ``None`` means ``"auto"`` on CUDA and ``1`` on the CPU
  device): planned by :func:`roundpipe.planner.plan_stages` under a device-memory budget
  (``memory_budget``: a fraction of the smallest device's memory, 0.6 by default, or bytes).
  The first training call runs one layer per stage and measures every layer
  (:mod:`roundpipe.pipeline.meter`); before each of the next calls the plan is made again from
  what was measured so far, until it stops changing (or :data:`SETTLE_CALLS` plans were made);
  then it is kept, and measuring stops. A later call whose microbatches are larger than those
  measured (more activations) is planned again when the kept plan would no longer fit.
  With a ``process_group``, the budget is the smallest rank's, every rank takes rank 0's plan
  at the same calls (the ranks' collectives follow the stages), and a kept plan is not
  revised.

``recompute`` (``RoundPipe(...)``), which stages recompute their forward in the backward pass
(:mod:`roundpipe.planner`: the others keep autograd's saved tensors from their forward visit):

- ``"auto"`` (the default): the first training call recomputes every stage but the last while
  every layer is measured; then the planner keeps the stages whose recomputation costs the most
  time per byte, as long as the plan fits ``memory_budget`` (with ``layers_per_stage="auto"``
  together with the stages; with fixed stages once, after the first call). On the CPU device the
  budget is a share of the machine's RAM, so a model whose activations fit trains without
  recomputing;
- ``True``: every stage but the last recomputes (nothing is measured for it);
- ``False``: no stage recomputes (the planner plans stages that fit with every stage kept, or
  refuses naming the bytes);
- with fixed stages, one bool per stage (a pinned plan: ``layers_per_stage=plan().sizes,
  recompute=plan().recompute``).

A plan changes only between calls, once the optimizer work already queued is done (it refers
to the stages it was queued for).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch import nn

from .pipeline.meter import LayerMeter, PassMeter, microbatch_elements
from .plan import uniform_sizes
from .planner import (LayerCost, Link, StagePlan, check_sizes, choose_recompute,
                      describe_recompute, format_bytes, kept_stages, plan_bytes, plan_stages,
                      predict)

#: plans made from measurements before the plan is kept even if it still changes
SETTLE_CALLS = 4
#: the host's costs per stage visit and per microbatch of a visit (the CPU device's, measured by
#: the overhead profile of a 24-layer model: about 0.25 ms per microbatch and visit)
VISIT_S, CHUNK_S = 5e-4, 1.5e-4
#: the smallest budget in bytes (an int ``memory_budget``) accepted: below it, an int is a
#: fraction written as an int (``memory_budget=1`` meaning "all of it" is one byte)
MIN_BUDGET_BYTES = 1 << 20
#: host-to-device bandwidth assumed before an upload was timed (PCIe 4.0 x16, pinned)
DEFAULT_UPLOAD_BYTES_PER_S = 25e9


def parse(layers_per_stage: Any, memory_budget: Any, num_layers: int,
          device_type: str) -> tuple[Optional[tuple[int, ...]], Any]:
    """``RoundPipe``'s ``layers_per_stage`` and ``memory_budget``, checked: the fixed sizes
    (None for ``"auto"``) and the budget.

    Raises:
        ValueError: ``layers_per_stage`` is not ``None``, ``"auto"``, an int >= 1 or a sequence
            of positive ints summing to the number of layers; ``memory_budget`` is not a float
            in ``(0, 1]`` or an int >= :data:`MIN_BUDGET_BYTES` (bytes: ``memory_budget=1``
            is one byte, refused with a message saying that fractions are floats).
    """
    if isinstance(memory_budget, int) and not isinstance(memory_budget, bool) \
            and 1 <= memory_budget < MIN_BUDGET_BYTES:
        raise ValueError(f"RoundPipe: memory_budget={memory_budget!r} is an int, so bytes: "
                         f"{memory_budget} bytes, less than the {MIN_BUDGET_BYTES} (1 MiB) any "
                         "device needs; a fraction of the device's memory is written as a float "
                         "(memory_budget=1.0 for all of it, 0.6 for 60%)")
    if isinstance(memory_budget, bool) or not (
            (isinstance(memory_budget, float) and 0.0 < memory_budget <= 1.0)
            or (isinstance(memory_budget, int) and memory_budget >= 1)):
        raise ValueError("RoundPipe: memory_budget must be a fraction of the device's memory "
                         f"(a float in (0, 1]) or bytes (an int >= {MIN_BUDGET_BYTES}), got "
                         f"{memory_budget!r}")
    if layers_per_stage is None:
        layers_per_stage = "auto" if device_type == "cuda" else 1
    if layers_per_stage == "auto":
        return None, memory_budget
    if isinstance(layers_per_stage, int) and not isinstance(layers_per_stage, bool):
        if layers_per_stage < 1:
            raise ValueError(f"RoundPipe: layers_per_stage must be >= 1, got {layers_per_stage}")
        return uniform_sizes(num_layers, layers_per_stage), memory_budget
    if isinstance(layers_per_stage, (list, tuple)):
        return check_sizes(layers_per_stage, num_layers, "RoundPipe: layers_per_stage"), \
            memory_budget
    raise ValueError("RoundPipe: layers_per_stage must be 'auto', an int >= 1 or a sequence of "
                     f"layers per stage, got {layers_per_stage!r}")


def parse_recompute(recompute: Any, fixed: Optional[Sequence[int]]) -> Any:
    """``RoundPipe``'s ``recompute``, checked: ``"auto"``, ``True``, ``False``, or with fixed
    stages (``fixed``: their sizes, from :func:`parse`) a sequence of bools, one per stage (a
    pinned plan's ``plan().recompute``; the last stage's False: it never recomputes), returned
    as a tuple.

    Raises:
        ValueError: anything else (naming ``recompute`` and what it got).
    """
    if isinstance(recompute, bool) or (isinstance(recompute, str) and recompute == "auto"):
        return recompute
    if isinstance(recompute, (list, tuple)) and all(isinstance(r, bool) for r in recompute):
        if fixed is None or len(recompute) != len(fixed):
            raise ValueError(
                f"RoundPipe: recompute as a sequence gives each stage of a fixed layers_per_stage "
                f"its setting: {len(recompute)} entries for "
                + (f"{len(fixed)} stages" if fixed else "stages that are planned ('auto')"))
        if recompute and recompute[-1]:
            raise ValueError("RoundPipe: recompute[-1] must be False: the last stage runs "
                             "forward, loss and backward in one visit and never recomputes")
        return tuple(recompute)
    raise ValueError("RoundPipe: recompute must be 'auto' (recompute only where the memory "
                     "budget requires it), True (every stage but the last recomputes), False "
                     "(none does) or, with fixed stages, one bool per stage, got "
                     f"{recompute!r}")


def device_memory(devices: Sequence[torch.device]) -> int:
    """The smallest device's memory, bytes: a CUDA device's total memory times the process's
    memory fraction (``torch.cuda.set_per_process_memory_fraction``); the CPU device's: the
    machine's physical memory."""
    if devices[0].type == "cuda":
        sizes = []
        for d in devices:
            total = torch.cuda.get_device_properties(d.index).total_memory
            fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            sizes.append(int(total * (fraction(d.index) if fraction is not None else 1.0)))
        return min(sizes)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measured_link(stats: dict, device_type: str) -> Link:
    """The planner's :class:`Link` from ``pipeline_stats()``: the upload bandwidth measured so
    far on CUDA (:data:`DEFAULT_UPLOAD_BYTES_PER_S` before any upload was timed; downloads
    assumed as fast), the CPU device's "copies" as good as free; the host costs
    :data:`VISIT_S` and :data:`CHUNK_S`."""
    if device_type != "cuda":
        return Link(1e12, 1e12, VISIT_S, CHUNK_S)
    up = DEFAULT_UPLOAD_BYTES_PER_S
    if stats.get("upload_s", 0.0) > 0 and stats.get("h2d_weight_bytes", 0.0) > 0:
        up = stats["h2d_weight_bytes"] / stats["upload_s"]
    return Link(up, up, VISIT_S, CHUNK_S)


class _LayerBytes(NamedTuple):
    """What a layer's sizes say of it, before anything is measured."""

    weights: int   # device bytes: its distinct parameters and buffers, and the dense weights
                   # a quantized frozen base is dequantized into for a visit
    uploaded: int  # what its upload copies: the parameters and buffers alone
    numel: int     # elements of its trainable parameters
    itemsize: int  # their item size, bytes


def _layer_bytes(layer: nn.Module) -> _LayerBytes:
    """A layer's :class:`_LayerBytes`."""
    from .quant import QuantizedLinear

    seen: dict[int, torch.Tensor] = {}
    for t in list(layer.parameters()) + list(layer.buffers()):
        seen[id(t)] = t
    uploaded = sum(t.numel() * t.element_size() for t in seen.values())
    weights = uploaded + sum(math.prod(m.weight_shape) * m.compute_dtype.itemsize
                   for m in {id(m): m for m in layer.modules()
                             if isinstance(m, QuantizedLinear)}.values())
    trainable = [t for t in layer.parameters() if t.requires_grad]
    numel = sum(t.numel() for t in {id(t): t for t in trainable}.values())
    itemsize = max((t.element_size() for t in trainable), default=4)
    return _LayerBytes(weights, uploaded, numel, itemsize)


class Staging:
    """The stages of one RoundPipe and which of them recompute: fixed, or planned and revised
    (see the module docstring).

    Args:
        layers: the pipeline's layers.
        devices: the compute devices.
        layers_per_stage, memory_budget: as given to ``RoundPipe`` (see :func:`parse`).
        min_last_start: the last stage may not start before this layer (a Hugging Face MoE
            model with its auxiliary loss keeps its MoE layers out of the last stage).
        fence_reason: why, for the error a fixed plan breaking it gets.
        recompute: as given to ``RoundPipe`` (see :func:`parse_recompute`).

    Raises:
        ValueError: see :func:`parse` and :func:`parse_recompute`; a fixed plan whose last
            stage starts before ``min_last_start``.
    """

    def __init__(self, layers: Sequence[nn.Module], devices: Sequence[torch.device],
                 layers_per_stage: Any, memory_budget: Any, min_last_start: int = 0,
                 fence_reason: str = "", recompute: Any = "auto") -> None:
        self.num_layers = len(layers)
        self.num_devices = len(devices)
        fixed, self.memory_budget = parse(layers_per_stage, memory_budget, self.num_layers,
                                          devices[0].type)
        self.recompute = parse_recompute(recompute, fixed)
        self.auto = fixed is None
        # planned from measurements: the stages, or which fixed stages recompute
        self.measured = self.auto or self.recompute == "auto"
        self.min_last_start = min_last_start
        self.budget_bytes: Optional[int] = None
        if self.measured:
            self.budget_bytes = (self.memory_budget if isinstance(self.memory_budget, int)
                                 else int(self.memory_budget * device_memory(devices)))
        if self.auto:
            sizes = uniform_sizes(self.num_layers, 1)
            reason = "auto: one layer per stage for the first training call, while every layer " \
                     "is measured"
        else:
            last = self.num_layers - fixed[-1]
            if last < min(min_last_start, self.num_layers - 1):
                raise ValueError(
                    f"RoundPipe: with layers_per_stage={layers_per_stage!r} the last stage "
                    f"starts at layer {last}, before layer {min_last_start}: {fence_reason}")
            sizes, reason = fixed, (f"layers_per_stage={layers_per_stage!r} (fixed)"
                                    if layers_per_stage is not None else
                                    "layers_per_stage=1 (fixed: the CPU device's default)")
            if self.recompute == "auto":
                reason += "; every stage but the last recomputes in the first training call, " \
                          "while every layer is measured (recompute='auto')"
        flags = self.recompute if isinstance(self.recompute, tuple) else \
            tuple(self.recompute is not False and s < len(sizes) - 1 for s in range(len(sizes)))
        self.static = [_layer_bytes(layer) for layer in layers]
        if self.recompute != "auto":
            first = next((i for i, b in enumerate(self.static) if b.numel), self.num_layers - 1)
            kept = [not r and a + n > first and s < len(sizes) - 1
                    for s, (a, n, r) in enumerate(zip(StagePlan(sizes).starts, sizes, flags))]
            reason += "; " + describe_recompute(flags, self.recompute, kept)
        self.plan = StagePlan(sizes, budget_bytes=self.budget_bytes, reason=reason,
                              kept=not self.measured, recompute=flags)
        self.meter = LayerMeter(self.num_layers)
        self.settled = not self.measured
        self.plans_made = 0
        self.measured_elements = 0
        self._fitting: Optional[tuple[int, int]] = None  # the last (M, elements) that fit

    def planning(self) -> bool:
        """Whether the next training call is planned from measurements (the plan settles)."""
        return self.measured and not self.settled and self.meter.passes > 0

    def meter_for(self, microbatches: list) -> Optional[PassMeter]:
        """A meter for a training pass over ``microbatches`` while the plan settles, else None."""
        if self.settled:
            return None
        return PassMeter([microbatch_elements(mb) for mb in microbatches])

    def fold(self, meter: Optional[PassMeter]) -> None:
        """After a measured pass: its costs join the layers' (see :class:`LayerMeter`)."""
        if meter is not None:
            self.meter.fold(meter)
            self.measured_elements = max(self.measured_elements, max(meter.elements))

    def revise(self, microbatches: list, link: Callable[[], Link],
               agree: Optional[Callable[[StagePlan], StagePlan]] = None) -> Optional[StagePlan]:
        """The plan for the next training call over ``microbatches`` when it differs from the
        current one (None: keep it). ``link()`` gives the machine's figures (asked only when a
        plan is made); ``agree(plan)`` (with a process group) returns the plan every rank
        takes.

        Raises:
            ValueError: a layer alone does not fit in half the budget; ``recompute=False``
                and the kept stages do not fit the budget.
        """
        if not self.measured or self.meter.passes == 0:
            return None
        M = len(microbatches)
        elements = max(microbatch_elements(mb) for mb in microbatches)
        if self.settled:
            if agree is not None or self._fits(M, elements):
                return None
            plan = self._plan(M, elements, link(), "a larger microbatch than those measured")
        else:
            self.plans_made += 1
            calls = self.meter.passes
            try:
                plan = self._plan(M, elements, link(), f"from layer costs measured over {calls} "
                                                     f"training call{'s' if calls > 1 else ''}")
            except ValueError as e:
                if agree is None:
                    raise
                plan = e
            if agree is not None:  # rank 0's plan, or its error, on every rank
                plan = agree(plan)
                if isinstance(plan, Exception):
                    raise plan
            if not self.auto or plan.sizes == self.plan.sizes or self.plans_made >= SETTLE_CALLS:
                self.settled = True
        self._fitting = None
        if (plan.sizes, plan.recompute) == (self.plan.sizes, self.plan.recompute):
            self.plan = replace(self.plan, predicted_s=plan.predicted_s,
                                stage_bytes=plan.stage_bytes, reason=plan.reason,
                                kept=self.settled)
            return None
        self.plan = replace(plan, kept=self.settled)
        return self.plan

    def costs(self, num_microbatch: int, elements: int) -> list[LayerCost]:
        """Every layer's :class:`LayerCost` for microbatches of ``elements`` elements."""
        m = self.meter
        first = next((i for i, b in enumerate(self.static) if b.numel), self.num_layers - 1)
        out = []
        for i, (weights, uploaded, numel, itemsize) in enumerate(self.static):
            forward = m.forward_s[i] if m.forward_s[i] is not None else m.recompute_s[i]
            forward = forward or 0.0
            if i < first:       # recomputed without anything to differentiate, never backward
                backward = forward
            else:
                backward = (m.recompute_s[i] if m.recompute_s[i] is not None else forward) + \
                    (m.backward_s[i] or 2 * forward)
            grad = numel * (4 if num_microbatch > 1 else itemsize)
            with_grad = m.recompute_s[i] if m.recompute_s[i] is not None else forward
            # fixed_bytes (the chunked loss's gradient) is the last layer's: never a kept stage's
            act = int(math.ceil(m.act_bytes[i] * elements)) + m.fixed_bytes[i]
            out.append(LayerCost(weights, grad, act, forward * elements, backward * elements,
                                 numel > 0, uploaded, min(with_grad, backward) * elements))
        return out

    def _plan(self, num_microbatch: int, elements: int, link: Link, why: str) -> StagePlan:
        layers = self.costs(num_microbatch, elements)
        M, D = num_microbatch, self.num_devices
        share = "" if isinstance(self.memory_budget, int) else \
            f", memory_budget={self.memory_budget} of the device"
        if self.auto:
            plan = plan_stages(layers, M, D, self.budget_bytes, link,
                               [f"layer {i}" for i in range(self.num_layers)],
                               self.min_last_start, self.recompute)
            n = len(plan.sizes)
            reason = (f"auto: {self.num_layers} layers in {n} stage{'s' if n > 1 else ''}, each "
                      f"within half of a {format_bytes(self.budget_bytes)} budget"
                      f"{f' ({share[2:]})' if share else ''}, {why}")
        else:  # fixed stages, recompute="auto"
            sizes = self.plan.sizes
            flags = choose_recompute(layers, sizes, M, D, self.budget_bytes, link)
            plan = StagePlan(sizes, predict(layers, sizes, M, D, link, flags),
                             plan_bytes(layers, sizes, M, D, flags)[1], self.budget_bytes,
                             recompute=flags)
            reason = f"{self.plan.reason.split(';')[0]}; recompute planned {why}"
        peak = plan_bytes(layers, plan.sizes, M, D, plan.recompute)[0]
        reason += (f"; predicted {plan.predicted_s * 1e3:.1f} ms per call of {M} microbatches; "
                   + describe_recompute(plan.recompute, self.recompute,
                                        kept_stages(layers, plan.sizes, plan.recompute), peak,
                                        self.budget_bytes, share))
        return replace(plan, reason=reason)

    def _fits(self, num_microbatch: int, elements: int) -> bool:
        """Whether the plan in effect still fits the budget with these microbatches (an
        automatic plan: every stage within half the budget, and the whole plan within it;
        fixed stages: the kept ones within it)."""
        if self._fitting == (num_microbatch, elements):
            return True
        layers = self.costs(num_microbatch, elements)
        sizes, flags = self.plan.sizes, self.plan.recompute
        peak, _ = plan_bytes(layers, sizes, num_microbatch, self.num_devices, flags)
        fits = peak <= self.budget_bytes or not (self.auto or any(kept_stages(layers, sizes, flags)))
        if fits:
            self._fitting = (num_microbatch, elements)
        return fits
