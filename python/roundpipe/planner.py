"""The stage planner: which consecutive layers form each stage, and which stages recompute, chosen
to minimise the predicted time of a training call under a device-memory budget. A pure function
of what it is given, in :mod:`roundpipe.plan`'s style: no state, no threads. RoundPipe feeds it
what it measured (:mod:`roundpipe.pipeline.meter`) with ``layers_per_stage="auto"`` or
``recompute="auto"``.

**Recomputation, per stage.** A stage's backward visit either *recomputes* its forward with
autograd (its forward visit ran without autograd and kept only its inputs, on the host) or
finds what autograd saved in its forward visit still there: the stage is *kept* (its forward
visit runs with autograd, its weights and every microbatch's saved tensors stay on the device
until its backward visit, which uploads nothing and recomputes nothing). The last stage runs
forward, loss and backward in one visit and neither recomputes nor keeps; stages below the
first trainable layer get no backward visit. ``StagePlan.recompute`` says which stages recompute.

**What a plan holds on a device** (:func:`plan_bytes`): every kept stage's weights, gradient
sums and saved tensors of all ``M`` microbatches, plus two of the other stages (the one
computing and the next one's prefetch), each its weights, gradient sums and the activations of
one microbatch (:func:`stage_bytes`). Every stage must fit in ``budget_bytes / 2`` on its own,
and the whole plan in ``budget_bytes``. Without kept stages this is the rule "every stage within
half the budget".

**The predicted call** (:func:`predict`): a training pass visits stages ``0 .. S-2`` forward,
then ``S-1`` down to the first stage that holds a trainable layer backward
(:func:`roundpipe.pipeline.schedule.pass_order`). A visit's compute is ``M`` microbatches of its
layers' ``forward_s`` (a forward visit; ``grad_run_s``, the forward with autograd, for a kept
stage), ``backward_s`` (a backward visit: recomputation with autograd and backward; a kept
stage's, ``backward_s - grad_run_s``; the last stage's, its forward, loss and backward), plus
the host's cost of a visit (``visit_s``) and of each of its microbatches (``chunk_s``). With one
device, the next visit's weights upload while a visit computes and a backward visit's
gradients download after it, so a visit lasts ``max(compute, upload of the next visit,
download of its gradients)``, and the call the first upload plus every visit. With ``D``
devices the visits spread over the devices round-robin, each uploading a stage while it
computes another: a visit lasts ``max(compute, its own upload, its download)``, the call the
first upload plus the sum of the visits over ``D``, and a plan uses at least ``D`` stages
(``min(D, layers)``). A kept stage's backward visit uploads nothing. This is a model: it
ignores the pipeline's fill across devices and what the host does besides.

:func:`plan_stages` finds the stages with the least predicted time by dynamic programming over
the end of the last stage (and, with one device, the start of the one before it), exactly for
a given recomputation of every stage (the predicted time is a sum of terms over consecutive
pairs of stages); with ``recompute="auto"`` it takes the better of every stage kept (when the
whole plan fits) and the stages planned with recomputation, of which :func:`choose_recompute`
then keeps the stages that save the most time per byte while the plan still fits.
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
        act_bytes: what its run with autograd keeps of one microbatch (its saved tensors and
            its output), bytes.
        forward_s: seconds for one microbatch without autograd.
        backward_s: seconds for one microbatch's recomputation with autograd and backward.
        trainable: it holds a trainable parameter.
        upload_bytes: what its upload copies, bytes (None: ``weight_bytes``; less for a
            quantized frozen base, whose dense weights are made on the device).
        grad_forward_s: seconds for one microbatch's forward with autograd: the part of
            ``backward_s`` that keeping the layer's stage saves, and what its forward visit
            then runs instead of ``forward_s`` (None: ``forward_s``).
    """

    weight_bytes: int
    grad_bytes: int
    act_bytes: int
    forward_s: float
    backward_s: float
    trainable: bool
    upload_bytes: Optional[int] = None
    grad_forward_s: Optional[float] = None

    @property
    def uploaded(self) -> int:
        """Bytes its upload copies host to device."""
        return self.weight_bytes if self.upload_bytes is None else self.upload_bytes

    @property
    def grad_forward(self) -> float:
        """Seconds of its forward with autograd (``grad_forward_s``, else ``forward_s``), at
        most ``backward_s``."""
        seconds = self.forward_s if self.grad_forward_s is None else self.grad_forward_s
        return min(seconds, self.backward_s)

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
        reason: in words, where the plan comes from (and why stages recompute or not).
        kept: the plan is no longer revised from measurements (a fixed plan, or an automatic
            one that settled).
        recompute: per stage, whether its backward visit recomputes its forward (False: the
            stage keeps autograd's saved tensors from its forward visit to its backward visit;
            also False for the last stage, which runs forward, loss and backward in one visit,
            and for stages without a backward visit); ``()``: every stage but the last
            recomputes.
    """

    sizes: tuple[int, ...]
    predicted_s: float = math.nan
    stage_bytes: tuple[int, ...] = ()
    budget_bytes: Optional[int] = None
    reason: str = ""
    kept: bool = False
    recompute: tuple[bool, ...] = ()

    @property
    def starts(self) -> tuple[int, ...]:
        """The first layer of each stage."""
        out, start = [], 0
        for n in self.sizes:
            out.append(start)
            start += n
        return tuple(out)

    def recomputes(self, stage: int) -> bool:
        """Whether ``stage``'s backward visit recomputes its forward (see :attr:`recompute`)."""
        if self.recompute:
            return self.recompute[stage]
        return stage < len(self.sizes) - 1


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
    """What stage ``[start, stop)`` holds on its device when it recomputes (or is the last
    stage): its weights, gradient sums and one microbatch's activations."""
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


def _starts(sizes: Sequence[int]) -> list[int]:
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    return starts


def _first_stage(layers: Sequence[LayerCost], starts: Sequence[int]) -> int:
    """The first stage with a backward visit."""
    first = first_backward_layer(layers)
    return next(s for s in range(len(starts) - 1) if starts[s + 1] > first)


def kept_stages(layers: Sequence[LayerCost], sizes: Sequence[int],
                recompute: Sequence[bool] = ()) -> list[bool]:
    """Per stage, whether it keeps autograd's saved tensors from its forward visit to its
    backward visit: it has a backward visit, is not the last stage and does not recompute
    (``recompute``: per stage; ``()``: every stage recomputes)."""
    S, first_stage = len(sizes), _first_stage(layers, _starts(sizes))
    return [bool(recompute) and not recompute[s] and first_stage <= s < S - 1 for s in range(S)]


def kept_bytes(layers: Sequence[LayerCost], start: int, stop: int, num_microbatch: int) -> int:
    """What a kept stage ``[start, stop)`` holds on its device until its backward visit is
    done: its weights, gradient sums and the saved tensors of every microbatch."""
    return sum(x.weight_bytes + x.grad_bytes + num_microbatch * x.act_bytes
               for x in layers[start:stop])


def plan_bytes(layers: Sequence[LayerCost], sizes: Sequence[int], num_microbatch: int,
               num_devices: int = 1, recompute: Sequence[bool] = ()) -> tuple[int, tuple[int, ...]]:
    """The most a plan holds on one of its devices (see the module docstring: every kept
    stage of the device, and two of its other stages), and per stage what it holds (a kept
    stage: :func:`kept_bytes`, else :func:`stage_bytes`)."""
    starts = _starts(sizes)
    kept = kept_stages(layers, sizes, recompute)
    per_stage = tuple(kept_bytes(layers, a, b, num_microbatch) if k else stage_bytes(layers, a, b)
                      for a, b, k in zip(starts, starts[1:], kept))
    peak = 0
    for d in range(min(num_devices, len(sizes))):
        mine = range(d, len(sizes), num_devices)
        held = sum(per_stage[s] for s in mine if kept[s])
        streamed = sorted((per_stage[s] for s in mine if not kept[s]), reverse=True)[:2]
        peak = max(peak, held + (2 * streamed[0] if streamed else 0))
    return peak, per_stage


def predict(layers: Sequence[LayerCost], sizes: Sequence[int], num_microbatch: int,
            num_devices: int, link: Link, recompute: Sequence[bool] = ()) -> float:
    """The predicted seconds of a training call with stages of ``sizes`` (see the module
    docstring), by walking the pass's visits in order; ``recompute``: per stage, whether it
    recomputes (``()``: every stage but the last does).

    Raises:
        ValueError: ``sizes`` is not a plan of ``layers`` (positive ints summing to their
            number, :func:`check_sizes`), or a count < 1, as :func:`plan_stages` refuses them.
    """
    from .pipeline.schedule import pass_order

    sizes = check_sizes(sizes, len(layers), "predict: sizes")
    _check_counts("predict", num_microbatch, num_devices)
    M = num_microbatch
    starts = _starts(sizes)
    S = len(sizes)
    kept = kept_stages(layers, sizes, recompute)

    def part(s: int, attr: str) -> float:
        return sum(getattr(layer, attr) for layer in layers[starts[s]:starts[s + 1]])

    def compute(s: int, backward: bool) -> float:
        if backward:
            seconds = part(s, "backward_s") - (part(s, "grad_forward") if kept[s] else 0.0)
        else:
            seconds = part(s, "grad_forward" if kept[s] else "forward_s")
        return M * (seconds + link.chunk_s) + link.visit_s

    def upload(s: int, backward: bool) -> float:
        return 0.0 if backward and kept[s] else part(s, "uploaded") / link.upload_bytes_per_s

    def download(s: int, backward: bool) -> float:
        return part(s, "grad_bytes") / link.download_bytes_per_s if backward else 0.0

    visits = pass_order(S, True, _first_stage(layers, starts))
    total = upload(visits[0].stage, visits[0].backward)
    for k, v in enumerate(visits):
        if num_devices == 1:
            nxt = upload(visits[k + 1].stage, visits[k + 1].backward) if k + 1 < len(visits) else 0.0
        else:
            nxt = upload(v.stage, v.backward)
        total += max(compute(v.stage, v.backward), nxt,
                     download(v.stage, v.backward)) / (1 if num_devices == 1 else num_devices)
    return total


def choose_recompute(layers: Sequence[LayerCost], sizes: Sequence[int], num_microbatch: int,
                     num_devices: int, budget_bytes: float, link: Link) -> tuple[bool, ...]:
    """Which stages of ``sizes`` recompute: starting from every stage recomputing, stages are
    kept one by one, the one whose keeping shortens the :func:`predict` ed call the most per
    byte it holds first (ties: the later stage), each only if the plan still fits in
    ``budget_bytes`` (:func:`plan_bytes`) and saves time. A greedy choice (the exact one is a
    knapsack): every kept stage saves its recomputation, and stages are kept in the order that
    saves the most while memory lasts."""
    S = len(sizes)
    first_stage = _first_stage(layers, _starts(sizes))
    flags = [first_stage <= s < S - 1 for s in range(S)]
    base = predict(layers, sizes, num_microbatch, num_devices, link, flags)
    _, held = plan_bytes(layers, sizes, num_microbatch, num_devices, [False] * S)
    order = []
    for s in range(first_stage, S - 1):
        trial = flags.copy()
        trial[s] = False
        saved = base - predict(layers, sizes, num_microbatch, num_devices, link, trial)
        if saved > 0:
            order.append((saved / max(held[s], 1), s))
    for _, s in sorted(order, reverse=True):
        flags[s] = False
        if plan_bytes(layers, sizes, num_microbatch, num_devices, flags)[0] > budget_bytes:
            flags[s] = True
    return tuple(flags)


class _Sums:
    """Prefix sums of the layers' costs: a stage's totals in O(1)."""

    def __init__(self, layers: Sequence[LayerCost], num_microbatch: int = 1) -> None:
        # w: uploaded bytes, g: gradient bytes, dev: device bytes, kept: bytes when kept, f:
        # forward s, r: forward with autograd s, b: backward (with recomputation) s
        self.w, self.g, self.dev, self.kept = [0.0], [0.0], [0], [0]
        self.f, self.r, self.b = [0.0], [0.0], [0.0]
        for layer in layers:
            self.w.append(self.w[-1] + layer.uploaded)
            self.g.append(self.g[-1] + layer.grad_bytes)
            self.dev.append(self.dev[-1] + layer.device_bytes)
            self.kept.append(self.kept[-1] + kept_bytes([layer], 0, 1, num_microbatch))
            self.f.append(self.f[-1] + layer.forward_s)
            self.r.append(self.r[-1] + layer.grad_forward)
            self.b.append(self.b[-1] + layer.backward_s)


RECOMPUTE_MODES = ("auto", True, False)


def plan_stages(layers: Sequence[LayerCost], num_microbatch: int, num_devices: int,
                budget_bytes: int, link: Link, names: Optional[Sequence[str]] = None,
                min_last_start: int = 0, recompute: object = True) -> StagePlan:
    """The stages (contiguous layer ranges), and which of them recompute, with the least
    :func:`predict` ed call time among those that fit the budget (see the module docstring).

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
        recompute: ``True`` (every stage but the last recomputes), ``False`` (none does: every
            stage keeps its saved tensors) or ``"auto"`` (the planner decides, per stage).

    Returns:
        The plan, with its predicted time, each stage's device bytes and its recomputation.

    Raises:
        ValueError: no layer, bad counts or ``recompute``, a budget that is not a number > 0
            (NaN, a string, None: the message names ``budget_bytes``), a layer that alone holds
            more than half the budget (the message names it, its bytes and the budget), or
            with ``recompute=False`` a plan whose kept stages do not fit the budget.
    """
    L, M, D = len(layers), num_microbatch, num_devices
    if L < 1:
        raise ValueError("plan_stages: no layer to plan")
    _check_counts("plan_stages", M, D)
    if not (isinstance(recompute, bool) or recompute == "auto"):
        raise ValueError(f"plan_stages: recompute must be 'auto', True or False, got {recompute!r}")
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
    sums = _Sums(layers, M)
    first = first_backward_layer(layers)
    fence = min(max(min_last_start, 0), L - 1)
    up, down = link.upload_bytes_per_s, link.download_bytes_per_s
    visit = lambda seconds: M * (seconds + link.chunk_s) + link.visit_s  # noqa: E731

    def fits(a: int, b: int) -> bool:
        return sums.dev[b] - sums.dev[a] <= cap

    def upload(a: int, b: int) -> float:
        return (sums.w[b] - sums.w[a]) / up

    def download(a: int, b: int) -> float:
        return (sums.g[b] - sums.g[a]) / down

    def search(keep: bool) -> tuple[int, ...]:
        """The best sizes with every stage recomputing, or (``keep``) every stage kept."""

        def kept(b: int) -> bool:  # a stage ending at b: not the last, has a backward visit
            return keep and first < b < L

        def fwd(a: int, b: int) -> float:
            run = sums.r if kept(b) else sums.f
            return visit(run[b] - run[a])

        def bwd(a: int, b: int) -> float:
            saved = sums.r[b] - sums.r[a] if kept(b) else 0.0
            return visit(sums.b[b] - sums.b[a] - saved)

        def back_upload(a: int, b: int) -> float:  # a backward visit's own upload
            return 0.0 if kept(b) else upload(a, b)

        def last_ok(a: int) -> bool:  # every stage before [a, L) kept: the whole plan fits
            held = sums.kept[a] - sums.kept[min(first, a)]  # (counted as if on one device)
            return not keep or held + 2 * (sums.dev[L] - sums.dev[a]) <= budget_bytes

        if D == 1:
            return _plan_one_device(L, first, fence, fits, upload, fwd, bwd, download,
                                    back_upload, last_ok)
        return _plan_devices(L, D, first, fence, fits, upload, fwd, bwd, download, back_upload,
                             last_ok)

    def made(sizes: tuple[int, ...], flags: tuple[bool, ...]) -> StagePlan:
        _, held = plan_bytes(layers, sizes, M, D, flags)
        return StagePlan(sizes, predict(layers, sizes, M, D, link, flags), held, budget_bytes,
                         recompute=flags)

    def every(sizes: tuple[int, ...], value: bool) -> tuple[bool, ...]:
        first_stage = _first_stage(layers, _starts(sizes))
        return tuple(value and first_stage <= s < len(sizes) - 1 for s in range(len(sizes)))

    plans = []
    if recompute is not False:
        sizes, _ = search(False)
        flags = every(sizes, True) if recompute is True else \
            choose_recompute(layers, sizes, M, D, budget_bytes, link)
        plans.append(made(sizes, flags))
    if recompute is not True:
        found = search(True)
        peak = math.inf
        if found is not None:
            plan = made(found[0], every(found[0], False))
            peak = plan_bytes(layers, plan.sizes, M, D, plan.recompute)[0]
            if peak <= budget_bytes:
                plans.append(plan)
        if recompute is False and not plans:
            least = sums.kept[L - 1] - sums.kept[first] + 2 * layers[-1].device_bytes
            raise ValueError(
                f"RoundPipe: recompute=False keeps every stage's saved tensors of {M} microbatch"
                f"{'es' if M > 1 else ''} on the device until its backward, at least "
                f"{format_bytes(min(peak, least))}, more than the memory budget "
                f"({format_bytes(budget_bytes)}): use recompute='auto' (recompute only where "
                "memory requires it), raise memory_budget or use fewer microbatches")
    return min(plans, key=lambda p: p.predicted_s)


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


def _plan_one_device(L, first, fence, fits, upload, fwd, bwd, download, back_upload, last_ok):
    """``best[(a, b)]``: the least cost of stages covering ``[0, b)`` whose last one is
    ``[a, b)``: the first upload, the forward visits of the stages before it (each needs its
    successor's upload) and the backward visits of every stage up to it (each needs its
    predecessor's upload, the next backward visit's: ``back_upload``). The last stage
    ``[a, L)`` starts where ``last_ok(a)``; None when nowhere."""

    def back(p: Optional[int], a: int, b: int) -> float:
        if b <= first:                 # below the first trainable layer: no backward visit
            return 0.0
        if p is None or a <= first:    # the last backward visit: nothing to prefetch after it
            return max(bwd(a, b), download(a, b))
        return max(bwd(a, b), back_upload(p, a), download(a, b))

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
    ends = [a for a in range(fence, L) if (a, L) in best and last_ok(a)]
    if not ends:
        return None
    end = min(ends, key=lambda a: best[(a, L)])
    total = best[(end, L)]
    bounds, key = [L], (end, L)
    while key is not None:
        bounds.append(key[0])
        prev = came[key]
        key = None if prev is None else (prev, key[0])
    bounds.reverse()
    return tuple(y - x for x, y in zip(bounds, bounds[1:])), total


def _plan_devices(L, D, first, fence, fits, upload, fwd, bwd, download, back_upload, last_ok):
    """``best[b][k]``: ``D`` times the least predicted time of stages covering ``[0, b)``
    (the first upload and their visits), ``k`` of them (counted up to ``min(D, L)``: a plan
    must give every device a stage). The last stage ``[a, L)`` starts where ``last_ok(a)``;
    None when nowhere."""
    need = min(D, L)

    def stage(a: int, b: int) -> float:
        cost = max(fwd(a, b), upload(a, b)) if b < L else 0.0  # the last stage: no forward visit
        if b > first:
            cost += max(bwd(a, b), back_upload(a, b), download(a, b))
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
                if b == L and (a < fence or not last_ok(a)):
                    continue
                kk = min(k + 1, need)
                cost = best[a][k] + stage(a, b) + (D * upload(0, b) if a == 0 else 0.0)
                if cost < best[b][kk]:
                    best[b][kk] = cost
                    came[b][kk] = (a, k)
    if best[L][need] == math.inf:
        return None
    bounds, key = [L], (L, need)
    while came[key[0]][key[1]] is not None:
        key = came[key[0]][key[1]]
        bounds.append(key[0])
    bounds.reverse()
    sizes = tuple(y - x for x, y in zip(bounds, bounds[1:]))
    return sizes, best[L][need] / D


def _ranges(stages: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"stages 0-2, 5"``."""
    parts: list[list[int]] = []
    for s in stages:
        if parts and parts[-1][1] == s - 1:
            parts[-1][1] = s
        else:
            parts.append([s, s])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in parts)
    return ("stages " if len(stages) > 1 else "stage ") + text


def describe_recompute(recompute: Sequence[bool], mode: object, kept: Sequence[bool] = (),
                       peak: Optional[int] = None, budget_bytes: Optional[int] = None,
                       share: str = "") -> str:
    """In words, which stages of a plan recompute (``recompute``, as
    :attr:`StagePlan.recompute`; ``kept``: :func:`kept_stages`) and why (``mode``: the
    ``recompute`` setting; ``peak``: what the plan holds, :func:`plan_bytes`, against
    ``budget_bytes``)."""
    recomputed = [s for s, r in enumerate(recompute) if r]
    if mode is True:
        return "every stage but the last recomputes (recompute=True)"
    if mode is False:
        return "no stage recomputes: every stage keeps autograd's saved tensors until its " \
               "backward (recompute=False)"
    kept = [s for s, k in enumerate(kept) if k]
    if not isinstance(mode, str):  # a sequence: pinned
        parts = ([f"{_ranges(kept)} keep autograd's saved tensors until their backward"] * bool(kept)
                 + [f"{_ranges(recomputed)} recompute"] * bool(recomputed))
        return ", ".join(parts or ["no stage recomputes"]) + " (recompute pinned)"
    within = "" if peak is None else \
        f" (the plan holds {format_bytes(peak)} of a {format_bytes(budget_bytes)} budget{share})"
    if not recomputed:
        return "no stage recomputes: every stage's saved tensors fit" + within
    if not kept:
        return (f"{_ranges(recomputed)} recompute: keeping the saved tensors of any of them "
                "would exceed the budget or save no time" + within)
    return (f"{_ranges(kept)} keep autograd's saved tensors until their backward, "
            f"{_ranges(recomputed)} recompute: keeping those too would exceed the budget" + within)


def format_bytes(n: float) -> str:
    """``n`` bytes in GB (from 0.1 GB), MB (from 0.1 MB) or kB."""
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"
