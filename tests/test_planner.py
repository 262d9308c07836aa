"""The stage planner (:mod:`roundpipe.planner`): its plan is the best of every contiguous
partition of the layers (brute force over all of them, small models, one and several devices,
budgets that bind, a fence before the last stage), and its edge cases: a layer larger than half the budget is refused naming
it, embedding and head layers much larger than the rest, a budget holding the whole model, a
frozen prefix (LoRA), several devices."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from roundpipe.plan import uniform_sizes
from roundpipe.planner import (LayerCost, Link, StagePlan, check_sizes, choose_recompute,
                               plan_bytes, plan_stages, predict, stage_bytes)

LINK = Link(upload_bytes_per_s=50e9, download_bytes_per_s=40e9, visit_s=2e-4, chunk_s=5e-5)


def _compositions(n: int):
    """Every way of cutting ``n`` layers into consecutive non-empty stages."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, run = [], 1
        for cut in cuts:
            if cut:
                sizes.append(run)
                run = 1
            else:
                run += 1
        yield tuple(sizes + [run])


def _brute_force(layers, M, D, budget, link, fence=0):
    cap = budget // 2
    best = (math.inf, None)
    for sizes in _compositions(len(layers)):
        if len(sizes) < min(D, len(layers)) or len(layers) - sizes[-1] < fence:
            continue
        start, ok = 0, True
        for n in sizes:
            ok &= sum(x.weight_bytes + x.grad_bytes + x.act_bytes
                      for x in layers[start:start + n]) <= cap
            start += n
        if ok:
            best = min(best, (predict(layers, sizes, M, D, link), sizes))
    return best


def _random_layers(rng: random.Random, n: int, frozen_prefix: int = 0) -> list[LayerCost]:
    out = []
    for i in range(n):
        w = rng.choice([1, 2, 4, 8]) * 10**8
        trainable = i >= frozen_prefix
        out.append(LayerCost(w, 2 * w if trainable else 0, rng.choice([1, 3]) * 10**8,
                             rng.uniform(1e-3, 8e-3), rng.uniform(2e-3, 16e-3), trainable,
                             rng.choice([None, None, w // 4])))  # some quantized: packed upload
    return out


@pytest.mark.parametrize("devices", [1, 2, 3])
@pytest.mark.parametrize("seed", range(20))
def test_the_plan_is_the_best_contiguous_partition(seed, devices):
    rng = random.Random(seed * 10 + devices)
    n = rng.randint(1, 9)
    layers = _random_layers(rng, n, frozen_prefix=rng.choice([0, 0, 1, 2]))
    M = rng.choice([1, 2, 4])
    biggest = max(x.weight_bytes + x.grad_bytes + x.act_bytes for x in layers)
    budget = 2 * rng.choice([biggest, 2 * biggest, 10**12])  # tight, loose and unbounded
    fence = rng.choice([0, 0, n - 1, n // 2])  # the last stage starts there or later
    plan = plan_stages(layers, M, devices, budget, LINK, min_last_start=fence)
    best, best_sizes = _brute_force(layers, M, devices, budget, LINK, fence)
    assert plan.predicted_s == pytest.approx(best, rel=1e-12), (plan.sizes, best_sizes)
    assert predict(layers, plan.sizes, M, devices, LINK) == pytest.approx(best, rel=1e-12)
    assert sum(plan.sizes) == n and len(plan.sizes) >= min(devices, n)
    assert n - plan.sizes[-1] >= fence
    assert all(b <= budget // 2 for b in plan.stage_bytes)
    starts = plan.starts
    assert list(plan.stage_bytes) == [stage_bytes(layers, a, a + k)
                                      for a, k in zip(starts, plan.sizes)]


def test_a_layer_larger_than_half_the_budget_is_refused_by_name():
    layers = [LayerCost(10**9, 0, 10**8, 1e-3, 2e-3, False),
              LayerCost(4 * 10**9, 8 * 10**9, 10**9, 1e-3, 2e-3, True)]
    with pytest.raises(ValueError, match=r"decoder\.0 alone needs 13\.00 GB.*half of the memory "
                                         r"budget \(10\.00 GB of 20\.00 GB\).*memory_budget"):
        plan_stages(layers, 4, 1, 20 * 10**9, LINK, names=["embed", "decoder.0"])
    with pytest.raises(ValueError, match="layer 1 alone"):
        plan_stages(layers, 4, 1, 20 * 10**9, LINK)


def test_a_budget_holding_the_whole_model_gives_one_stage_when_compute_dominates():
    """Uploads are cheap next to the compute: one stage (its only visit runs forward, loss and
    backward; no recomputation at all) beats every split."""
    layers = [LayerCost(10**6, 4 * 10**6, 10**6, 0.01, 0.02, True) for _ in range(8)]
    plan = plan_stages(layers, 4, 1, 10**12, LINK)
    assert plan.sizes == (8,)
    # the upload, then the visit: backward_s is the forward with autograd and the backward
    one_visit = 8 * 10**6 / 50e9 + 4 * (8 * 0.02 + 5e-5) + 2e-4
    assert plan.predicted_s == pytest.approx(one_visit)


def test_large_embedding_and_head_get_stages_of_their_own_under_a_tight_budget():
    """An embedding and a head 8x a decoder layer's size under a budget where two decoder layers
    fit beside each other but not beside either: neither shares a stage, and every stage fits."""
    small = LayerCost(10**8, 2 * 10**8, 10**8, 1e-3, 2e-3, True)
    big = LayerCost(8 * 10**8, 16 * 10**8, 10**8, 1e-3, 2e-3, True)
    layers = [big] + [small] * 6 + [big]
    budget = 2 * big.device_bytes
    plan = plan_stages(layers, 4, 1, budget, LINK)
    assert plan.sizes[0] == 1 and plan.sizes[-1] == 1
    assert all(b <= budget // 2 for b in plan.stage_bytes)
    best, _ = _brute_force(layers, 4, 1, budget, LINK)
    assert plan.predicted_s == pytest.approx(best)


def test_several_devices_get_at_least_one_stage_each():
    layers = [LayerCost(10**6, 2 * 10**6, 10**6, 1e-3, 2e-3, True) for _ in range(6)]
    for devices in (2, 3, 6, 8):
        plan = plan_stages(layers, 4, devices, 10**12, LINK)
        assert len(plan.sizes) >= min(devices, 6)


def test_a_frozen_prefix_gets_no_backward_visit_in_the_prediction():
    """LoRA's frozen embedding before trainable layers: its stage is visited forward only, so
    making it heavier to compute backward changes nothing."""
    frozen = LayerCost(10**8, 0, 10**7, 1e-3, 5e-3, False)
    heavier = LayerCost(10**8, 0, 10**7, 1e-3, 50.0, False)
    rest = [LayerCost(10**8, 10**8, 10**7, 1e-3, 2e-3, True) for _ in range(3)]
    for sizes in ((1, 3), (1, 1, 2), (1, 1, 1, 1)):
        assert predict([frozen] + rest, sizes, 2, 1, LINK) == pytest.approx(
            predict([heavier] + rest, sizes, 2, 1, LINK))


@pytest.mark.parametrize("packed", [None, 40])
def test_predict_by_hand_for_two_stages_on_one_device(packed):
    """Two stages of one layer, M = 2: upload of stage 0, its forward visit overlapping stage
    1's upload, stage 1's only visit (forward + backward) overlapping stage 0's upload and its
    own download, stage 0's backward visit and its download. ``packed``: stage 0 as a quantized
    base, whose upload copies 40 of the 100 bytes it holds (the rest is dequantized there)."""
    a = LayerCost(100, 200, 10, 1.0, 2.0, True, upload_bytes=packed)
    b = LayerCost(300, 400, 10, 3.0, 4.0, True)
    link = Link(upload_bytes_per_s=10.0, download_bytes_per_s=100.0, visit_s=0.5, chunk_s=0.25)
    up = lambda x: (x.weight_bytes if x.upload_bytes is None else x.upload_bytes) / 10.0  # noqa
    comp = lambda x, back: 2 * ((x.backward_s if back else x.forward_s) + 0.25) + 0.5  # noqa
    expect = (up(a) + max(comp(a, False), up(b)) + max(comp(b, True), up(a), 4.0)
              + max(comp(a, True), 2.0))
    assert predict([a, b], (1, 1), 2, 1, link) == pytest.approx(expect)


def test_sizes_are_checked():
    assert uniform_sizes(7, 3) == (3, 3, 1)
    assert check_sizes([2, 5], 7, "RoundPipe") == (2, 5)
    with pytest.raises(ValueError, match="RoundPipe: the plan's stages hold 6 layers, the model has 7"):
        check_sizes([2, 4], 7, "RoundPipe")
    with pytest.raises(ValueError, match="positive ints"):
        check_sizes([2, 0, 5], 7, "RoundPipe")
    assert StagePlan((2, 3, 1)).starts == (0, 2, 5)


# --- recomputation per stage ------------------------------------------------------------------

def _uniform(n: int, act: int = 10**8, grad_forward: float = 2e-3) -> list[LayerCost]:
    return [LayerCost(10**8, 2 * 10**8, act, 1e-3, 5e-3, True, None, grad_forward)
            for _ in range(n)]


def test_predict_by_hand_with_a_kept_stage():
    """Stage 0 kept (M = 2): its forward visit runs with autograd (grad_forward_s), its backward
    visit runs the backward alone and needs no upload, so stage 1's visit prefetches nothing."""
    a = LayerCost(100, 200, 10, 1.0, 5.0, True, None, 1.5)
    b = LayerCost(300, 400, 10, 3.0, 4.0, True)
    link = Link(upload_bytes_per_s=10.0, download_bytes_per_s=100.0, visit_s=0.5, chunk_s=0.25)
    visit = lambda seconds: 2 * (seconds + 0.25) + 0.5  # noqa: E731
    expect = (100 / 10 + max(visit(1.5), 300 / 10) + max(visit(4.0), 400 / 100)
              + max(visit(5.0 - 1.5), 200 / 100))
    assert predict([a, b], (1, 1), 2, 1, link, (False, False)) == pytest.approx(expect)
    recomputed = (100 / 10 + max(visit(1.0), 300 / 10) + max(visit(4.0), 100 / 10, 400 / 100)
                  + max(visit(5.0), 200 / 100))
    assert predict([a, b], (1, 1), 2, 1, link, (True, False)) == pytest.approx(recomputed)
    assert predict([a, b], (1, 1), 2, 1, link) == pytest.approx(recomputed)


def test_plan_bytes_count_every_kept_stage_and_two_of_the_others():
    layers = _uniform(4)
    M = 3
    stream = 10**8 + 2 * 10**8 + 10**8          # weights, gradient sums, one microbatch
    kept = 10**8 + 2 * 10**8 + M * 10**8         # ... and every microbatch's saved tensors
    assert plan_bytes(layers, (1, 1, 1, 1), M) == (2 * stream, (stream,) * 4)
    peak, held = plan_bytes(layers, (1, 1, 1, 1), M, 1, (False, True, False, False))
    assert held == (kept, stream, kept, stream) and peak == 2 * kept + 2 * stream
    # two devices: stages 0 and 2 (both kept) on one, 1 and 3 (streamed) on the other
    assert plan_bytes(layers, (1, 1, 1, 1), M, 2, (False, True, False, False))[0] == \
        max(2 * kept, 2 * stream)
    assert plan_bytes(layers, (1, 1, 1, 1), M, 2, (False, True, True, False))[0] == kept + 2 * stream


def test_choose_recompute_keeps_what_fits_and_saves_time():
    layers = _uniform(6)
    M, link = 2, LINK
    stream, kept = 4 * 10**8, 5 * 10**8
    assert choose_recompute(layers, (1,) * 6, M, 1, 10**15, link) == (False,) * 6
    assert choose_recompute(layers, (1,) * 6, M, 1, 2 * stream, link) == (True,) * 5 + (False,)
    flags = choose_recompute(layers, (1,) * 6, M, 1, 2 * stream + 2 * kept, link)
    assert sum(not f for f in flags[:-1]) == 2 and flags[-1] is False
    assert plan_bytes(layers, (1,) * 6, M, 1, flags)[0] <= 2 * stream + 2 * kept
    # a stage whose recomputation costs nothing is not worth its bytes
    free = [LayerCost(10**8, 2 * 10**8, 10**8, 0.0, 0.0, True, None, 0.0) for _ in range(3)]
    assert choose_recompute(free, (1, 1, 1), M, 1, 10**15, Link(1e30, 1e30)) == (True, True, False)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("seed", range(8))
def test_auto_recompute_is_at_least_as_good_as_every_stage_recomputing_or_kept(seed, devices):
    """Against a brute force over every partition: the plan with recompute="auto" fits the
    budget and is predicted no slower than the best plan with every stage recomputing, nor
    than the best with every stage kept among those whose kept stages fit on one device (the
    planner's search counts them so; with two devices each holds only its own)."""
    rng = random.Random(seed)
    layers = [LayerCost(w := rng.choice([1, 2, 4]) * 10**8, 2 * w, rng.choice([1, 3]) * 10**8,
                        rng.uniform(1e-3, 8e-3), 0.0, True) for _ in range(6)]
    layers = [LayerCost(x.weight_bytes, x.grad_bytes, x.act_bytes, x.forward_s,
                        3 * x.forward_s + rng.uniform(0, 1e-3), True, None,
                        x.forward_s * rng.uniform(1.0, 1.2)) for x in layers]
    budget, M = 4 * 10**9, 3
    plan = plan_stages(layers, M, devices, budget, LINK, recompute="auto")
    assert plan_bytes(layers, plan.sizes, M, devices, plan.recompute)[0] <= budget
    assert plan.predicted_s == pytest.approx(
        predict(layers, plan.sizes, M, devices, LINK, plan.recompute))
    best_recomputing = _brute_force(layers, M, devices, budget, LINK)[0]
    best_kept = math.inf
    for sizes in _compositions(len(layers)):
        keep = (False,) * len(sizes)
        if len(sizes) >= devices and all(stage_bytes(layers, a, a + n) <= budget // 2
                                         for a, n in zip(StagePlan(sizes).starts, sizes)) \
                and plan_bytes(layers, sizes, M, 1, keep)[0] <= budget:
            best_kept = min(best_kept, predict(layers, sizes, M, devices, LINK, keep))
    assert plan.predicted_s <= min(best_recomputing, best_kept) + 1e-12
    if best_kept < math.inf:  # and when every stage fits kept, the best of those is found
        kept_plan = plan_stages(layers, M, devices, budget, LINK, recompute=False)
        assert kept_plan.predicted_s == pytest.approx(best_kept)


def test_recompute_false_beyond_the_budget_and_bad_settings_are_refused():
    layers = _uniform(4, act=10**9)
    with pytest.raises(ValueError, match="recompute=False keeps every stage's saved tensors of 3 "
                                         "microbatches.*more than the memory budget"):
        plan_stages(layers, 3, 1, 3 * 10**9, LINK, recompute=False)
    plan = plan_stages(layers, 3, 1, 3 * 10**9, LINK, recompute="auto")
    assert plan.recompute[:-1] == (True,) * (len(plan.sizes) - 1)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="recompute must be 'auto', True or False"):
            plan_stages(layers, 3, 1, 10**12, LINK, recompute=bad)
