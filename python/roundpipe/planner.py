"""The stage planner: which consecutive layers form each stage, chosen to minimise the predicted
time of a training call while every stage fits in half of a device-memory budget (so the next
stage's weights can upload while one stage computes). A pure function of what it is given, in
:mod:`roundpipe.plan`'s style: no state, no threads. RoundPipe feeds it what it measured
(:mod:`roundpipe.pipeline.meter`) with ``layers_per_stage="auto"``.

**What a stage holds on its device** (:func:`stage_bytes`): its weights, its gradient sums
(a backward visit) and what autograd keeps of one microbatch while the stage recomputes it
(the activations of its layers): a stage ``[a, b)`` must hold ``sum(weight + grad + act)`` of
its layers within ``budget_bytes / 2``.

**The predicted call** (:func:`predict`): a training pass visits stages ``0 .. S-2`` forward,
then ``S-1`` down to the first stage that holds a trainable layer backward (the last stage runs
forward, loss and backward in one visit; :func:`roundpipe.pipeline.schedule.pass_order`). A
visit's compute is ``M`` microbatches of its layers' ``forward_s`` (a forward visit) or
``forward_s + backward_s`` (a backward visit: recomputation and backward), plus the host's
cost of a visit (``visit_s``) and of each of its microbatches (``chunk_s``). With one device,
the next visit's weights upload while a visit computes and a backward visit's gradients download
after it, so a visit lasts ``max(compute, upload of the next visit, download of its
gradients)``, and the call the first upload plus every visit. With ``D`` devices the visits
spread over the devices round-robin, each uploading a stage while it computes another: a visit
lasts ``max(compute, its own upload, its download)``, the call the first upload plus the sum of
the visits over ``D``, and a plan uses at least ``D`` stages (``min(D, layers)``). This is a model:
it ignores the pipeline's fill across devices and what the host does besides.

:func:`plan_stages` finds the plan with the least predicted time by dynamic programming over
the end of the last stage (and, with one device, the start of the one before it), exactly: the
predicted time is a sum of terms over consecutive pairs of stages.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class LayerCost:
    """What the planner knows of one layer.

    Attributes:
        weight_bytes: its parameters and buffers on the device (model dtype; for a quantized
            frozen base its packed bytes and the dense weights they are dequantized into).
        grad_bytes: its gradient sums on the device during a backward visit, which are also
            what is downloaded (float32 per trainable element with several microbatches, the
            model dtype with one); 0 for a frozen layer.
        act_bytes: what its recomputation with autograd keeps of one microbatch (its saved
            tensors and its output), bytes.
        forward_s: seconds for one microbatch without autograd.
        backward_s: seconds for one microbatch's recomputation with autograd and backward.
        trainable: it holds a trainable parameter.
        upload_bytes: what its upload copies, bytes (None: ``weight_bytes``; less for a
            quantized frozen base, whose dense weights are made on the device).
    """

    weight_bytes: int
    grad_bytes: int
    act_bytes: int
    forward_s: float
    backward_s: float
    trainable: bool
    upload_bytes: Optional[int] = None

    @property
    def uploaded(self) -> int:
        """Bytes its upload copies host to device."""
        return self.weight_bytes if self.upload_bytes is None else self.upload_bytes

    @property
    def device_bytes(self) -> int:
        """What the layer adds to a stage on the device: weights, gradient sums, activations."""
        return self.weight_bytes + self.grad_bytes + self.act_bytes


@dataclass(frozen=True)
class Link:
    """The machine, as the planner sees it.

    Attributes:
        upload_bytes_per_s: host-to-device copy bandwidth (pinned), bytes/s.
        download_bytes_per_s: device-to-host copy bandwidth, bytes/s.
        visit_s: host seconds per stage visit (uploads issued, events, hand-overs).
        chunk_s: host seconds per microbatch of a visit (issuing the layers, copies).
    """

    upload_bytes_per_s: float
    download_bytes_per_s: float
    visit_s: float = 0.0
    chunk_s: float = 0.0


@dataclass(frozen=True)
class StagePlan:
    """Which layers form each stage, and why.

    Attributes:
        sizes: layers per stage, in order (they sum to the number of layers).
        predicted_s: the predicted time of a training call (:func:`predict`), or NaN when
            the plan was not predicted (given by the user).
        stage_bytes: per stage, what it holds on its device (:func:`stage_bytes`), or ``()``
            when unknown.
        budget_bytes: the device-memory budget it was planned under (None: none).
        reason: in words, where the plan comes from.
        kept: the plan is no longer revised from measurements (a fixed plan, or an automatic
            one that settled).
    """

    sizes: tuple[int, ...]
    predicted_s: float = math.nan
    stage_bytes: tuple[int, ...] = ()
    budget_bytes: Optional[int] = None
    reason: str = ""
    kept: bool = False

    @property
    def starts(self) -> tuple[int, ...]:
        """The first layer of each stage."""
        out, start = [], 0
        for n in self.sizes:
            out.append(start)
            start += n
        return tuple(out)


def check_sizes(sizes: Sequence[int], num_layers: int, where: str) -> tuple[int, ...]:
    """``sizes`` as a tuple, checked: positive ints summing to ``num_layers``.

    Raises:
        ValueError: naming ``where`` and what is wrong.
    """
    sizes = tuple(sizes)
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise ValueError(f"{where}: a plan is a non-empty sequence of positive ints (layers per "
                         f"stage), got {sizes!r}")
    if sum(sizes) != num_layers:
        raise ValueError(f"{where}: the plan's stages hold {sum(sizes)} layers, the model has "
                         f"{num_layers}")
    return sizes


def stage_bytes(layers: Sequence[LayerCost], start: int, stop: int) -> int:
    """What stage ``[start, stop)`` holds on its device (see the module docstring)."""
    return sum(layer.device_bytes for layer in layers[start:stop])


def first_backward_layer(layers: Sequence[LayerCost]) -> int:
    """The first trainable layer (the last layer when none is): stages that end at or before
    it get no backward visit."""
    return next((i for i, layer in enumerate(layers) if layer.trainable), len(layers) - 1)


def _check_counts(where: str, num_microbatch: int, num_devices: int) -> None:
    """Raises ``ValueError`` naming ``where`` unless both counts are >= 1."""
    if num_microbatch < 1 or num_devices < 1:
        raise ValueError(f"{where}: num_microbatch and num_devices must be >= 1, got "
                         f"{num_microbatch}, {num_devices}")


def predict(layers: Sequence[LayerCost], sizes: Sequence[int], num_microbatch: int,
            num_devices: int, link: Link) -> float:
    """The predicted seconds of a training call with stages of ``sizes`` (see the module
    docstring), by walking the pass's visits in order.

    Raises:
        ValueError: ``sizes`` is not a plan of ``layers`` (positive ints summing to their
            number, :func:`check_sizes`), or a count < 1, as :func:`plan_stages` refuses them.
    """
    from .pipeline.schedule import pass_order

    sizes = check_sizes(sizes, len(layers), "predict: sizes")
    _check_counts("predict", num_microbatch, num_devices)
    M = num_microbatch
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    S = len(sizes)
    first = first_backward_layer(layers)
    first_stage = next(s for s in range(S) if starts[s + 1] > first)

    def part(s: int, attr: str) -> float:
        return sum(getattr(layer, attr) for layer in layers[starts[s]:starts[s + 1]])

    def compute(s: int, backward: bool) -> float:
        seconds = part(s, "forward_s") + (part(s, "backward_s") if backward else 0.0)
        return M * (seconds + link.chunk_s) + link.visit_s

    def upload(s: int) -> float:
        return part(s, "uploaded") / link.upload_bytes_per_s

    def download(s: int, backward: bool) -> float:
        return part(s, "grad_bytes") / link.download_bytes_per_s if backward else 0.0

    visits = pass_order(S, True, first_stage)
    total = upload(visits[0].stage)
    for k, v in enumerate(visits):
        if num_devices == 1:
            nxt = upload(visits[k + 1].stage) if k + 1 < len(visits) else 0.0
        else:
            nxt = upload(v.stage)
        total += max(compute(v.stage, v.backward), nxt,
                     download(v.stage, v.backward)) / (1 if num_devices == 1 else num_devices)
    return total


class _Sums:
    """Prefix sums of the layers' costs: a stage's totals in O(1)."""

    def __init__(self, layers: Sequence[LayerCost]) -> None:
        # w: uploaded bytes, g: gradient bytes, dev: device bytes, f/b: forward/backward s
        self.w, self.g, self.dev, self.f, self.b = [0.0], [0.0], [0], [0.0], [0.0]
        for layer in layers:
            self.w.append(self.w[-1] + layer.uploaded)
            self.g.append(self.g[-1] + layer.grad_bytes)
            self.dev.append(self.dev[-1] + layer.device_bytes)
            self.f.append(self.f[-1] + layer.forward_s)
            self.b.append(self.b[-1] + layer.backward_s)


def plan_stages(layers: Sequence[LayerCost], num_microbatch: int, num_devices: int,
                budget_bytes: int, link: Link, names: Optional[Sequence[str]] = None,
                min_last_start: int = 0) -> StagePlan:
    """The stages (contiguous layer ranges) with the least :func:`predict` ed call time among
    those where every stage holds at most ``budget_bytes // 2`` on its device.

    Args:
        layers: every layer's costs, in order (at least one).
        num_microbatch: microbatches per call, >= 1.
        num_devices: compute devices, >= 1 (stages go to them round-robin).
        budget_bytes: device memory the pipeline may use on each device, bytes > 0
            (``math.inf``: no limit; the plan is then the fastest of all).
        link: bandwidths and the host's costs.
        names: the layers' names for error messages (default ``layer i``).
        min_last_start: the last stage starts at this layer or later (e.g. a Hugging Face MoE
            model's auxiliary loss needs its MoE layers out of the last stage); clamped to
            ``[0, len(layers) - 1]``.

    Returns:
        The plan, with its predicted time and each stage's device bytes.

    Raises:
        ValueError: no layer, bad counts, a budget that is not a number > 0 (NaN, a string,
            None: the message names ``budget_bytes``), or a layer that alone holds more than
            half the budget (the message names it, its bytes and the budget).
    """
    L, M, D = len(layers), num_microbatch, num_devices
    if L < 1:
        raise ValueError("plan_stages: no layer to plan")
    _check_counts("plan_stages", M, D)
    cap = _half(budget_bytes)
    for i, layer in enumerate(layers):
        if layer.device_bytes > cap:
            name = names[i] if names is not None else f"layer {i}"
            raise ValueError(
                f"RoundPipe: {name} alone needs {format_bytes(layer.device_bytes)} on the device (weights "
                f"{format_bytes(layer.weight_bytes)}, gradient sums {format_bytes(layer.grad_bytes)}, activations "
                f"of one microbatch {format_bytes(layer.act_bytes)}), more than half of the memory budget "
                f"({format_bytes(cap)} of {format_bytes(budget_bytes)}): raise memory_budget, use more microbatches "
                "(smaller activations), or split the layer")
    sums = _Sums(layers)
    first = first_backward_layer(layers)
    fence = min(max(min_last_start, 0), L - 1)
    up, down = link.upload_bytes_per_s, link.download_bytes_per_s
    visit = lambda seconds: M * (seconds + link.chunk_s) + link.visit_s  # noqa: E731

    def fits(a: int, b: int) -> bool:
        return sums.dev[b] - sums.dev[a] <= cap

    def upload(a: int, b: int) -> float:
        return (sums.w[b] - sums.w[a]) / up

    def fwd(a: int, b: int) -> float:
        return visit(sums.f[b] - sums.f[a])

    def bwd(a: int, b: int) -> float:
        return visit(sums.f[b] - sums.f[a] + sums.b[b] - sums.b[a])

    def download(a: int, b: int) -> float:
        return (sums.g[b] - sums.g[a]) / down

    if D == 1:
        sizes, best = _plan_one_device(L, first, fence, fits, upload, fwd, bwd, download)
    else:
        sizes, best = _plan_devices(L, D, first, fence, fits, upload, fwd, bwd, download)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    return StagePlan(sizes, best, tuple(sums.dev[b] - sums.dev[a] for a, b in zip(starts, starts[1:])),
                     budget_bytes)


def _half(budget_bytes: float) -> float:
    """What one stage may hold of ``budget_bytes``: its half (``math.inf`` for an infinite
    budget: no cap).

    Raises:
        ValueError: naming ``budget_bytes``, unless it is a real number > 0 (not NaN, not a
            bool).
    """
    if (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Real)
            or budget_bytes != budget_bytes or not budget_bytes > 0):
        raise ValueError("plan_stages: budget_bytes must be a number of bytes > 0 (math.inf: "
                         f"no limit), got {budget_bytes!r}")
    return math.inf if budget_bytes == math.inf else budget_bytes // 2


def _plan_one_device(L, first, fence, fits, upload, fwd, bwd, download):
    """``best[(a, b)]``: the least cost of stages covering ``[0, b)`` whose last one is
    ``[a, b)``: the first upload, the forward visits of the stages before it (each needs its
    successor's upload) and the backward visits of every stage up to it (each needs its
    predecessor's upload, the next backward visit's)."""

    def back(p: Optional[int], a: int, b: int) -> float:
        if b <= first:                 # below the first trainable layer: no backward visit
            return 0.0
        if p is None or a <= first:    # the last backward visit: nothing to prefetch after it
            return max(bwd(a, b), download(a, b))
        return max(bwd(a, b), upload(p, a), download(a, b))

    best: dict[tuple[int, int], float] = {}
    came: dict[tuple[int, int], Optional[int]] = {}
    for b in range(1, L + 1):
        if not fits(0, b):
            break
        best[(0, b)] = upload(0, b) + back(None, 0, b)
        came[(0, b)] = None
    for b in range(1, L):
        for a in range(b - 1, -1, -1):
            if (a, b) not in best:
                if not fits(a, b):
                    break
                continue
            base = best[(a, b)]
            for c in range(b + 1, L + 1):
                if not fits(b, c):
                    break
                cost = base + max(fwd(a, b), upload(b, c)) + back(a, b, c)
                if cost < best.get((b, c), math.inf):
                    best[(b, c)] = cost
                    came[(b, c)] = a
    end = min((a for a in range(fence, L) if (a, L) in best), key=lambda a: best[(a, L)])
    total = best[(end, L)]
    bounds, key = [L], (end, L)
    while key is not None:
        bounds.append(key[0])
        prev = came[key]
        key = None if prev is None else (prev, key[0])
    bounds.reverse()
    return tuple(y - x for x, y in zip(bounds, bounds[1:])), total


def _plan_devices(L, D, first, fence, fits, upload, fwd, bwd, download):
    """``best[b][k]``: ``D`` times the least predicted time of stages covering ``[0, b)``
    (the first upload and their visits), ``k`` of them (counted up to ``min(D, L)``: a plan
    must give every device a stage)."""
    need = min(D, L)

    def stage(a: int, b: int) -> float:
        own = upload(a, b)
        cost = max(fwd(a, b), own) if b < L else 0.0          # the last stage: no forward visit
        if b > first:
            cost += max(bwd(a, b), own, download(a, b))
        return cost

    best = [[math.inf] * (need + 1) for _ in range(L + 1)]
    came: list[list[Optional[tuple[int, int]]]] = [[None] * (need + 1) for _ in range(L + 1)]
    best[0][0] = 0.0
    for a in range(L):
        for k in range(need + 1):
            if best[a][k] == math.inf:
                continue
            for b in range(a + 1, L + 1):
                if not fits(a, b):
                    break
                if b == L and a < fence:
                    continue
                kk = min(k + 1, need)
                cost = best[a][k] + stage(a, b) + (D * upload(0, b) if a == 0 else 0.0)
                if cost < best[b][kk]:
                    best[b][kk] = cost
                    came[b][kk] = (a, k)
    bounds, key = [L], (L, need)
    while came[key[0]][key[1]] is not None:
        key = came[key[0]][key[1]]
        bounds.append(key[0])
    bounds.reverse()
    sizes = tuple(y - x for x, y in zip(bounds, bounds[1:]))
    return sizes, best[L][need] / D


def format_bytes(n: float) -> str:
    """``n`` bytes in GB (from 0.1 GB), MB (from 0.1 MB) or kB."""
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"
