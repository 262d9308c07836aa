"""``layers_per_stage="auto"`` on the CPU device (the CUDA default; the same code measures and
plans here): the first training call runs one layer per stage and measures every layer, the
next ones are planned from what was measured until the plan settles; training is the same as
with any fixed plan and as plain PyTorch; every planned stage fits in half the budget; a layer
larger than that is refused naming it; a plan can be pinned; the default stays one layer per
stage on the CPU device; a Hugging Face MoE model keeps its MoE layers out of the last stage."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import roundpipe
import roundpipe.optim as rpo
from roundpipe import RoundPipe

from pipeline_models import causal_lm


def _net(layers: int = 6, width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(layers - 1)], nn.Linear(width, 4))


def _loss(o, t):
    return ((o - t) ** 2).mean()


def _train(model: RoundPipe, calls: int, batch: int = 12):
    opt = rpo.SGD(model.optim_parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(calls):
        x, y = torch.randn(batch, 32, generator=g), torch.randn(batch, 4, generator=g)
        losses.append(model.forward_backward(input_args=(x,), label=y, loss_fn=_loss).item())
        model.step(opt)
    return losses


def test_the_cpu_default_stays_one_layer_per_stage_and_recomputes_nothing_that_fits():
    """One layer per stage, fixed; the first call recomputes every stage but the last while it
    measures, then every stage keeps its saved tensors (the machine's RAM holds them): the
    plan changes once, its stages never."""
    model = RoundPipe(_net(), device="cpu")
    assert model.plan().sizes == (1,) * 6 and "fixed" in model.plan().reason
    assert model.plan().recompute == (True,) * 5 + (False,) and not model.plan().kept
    _train(model, 2)
    plan = model.plan()
    assert plan.sizes == (1,) * 6 and plan.recompute == (False,) * 6 and plan.kept
    assert "fixed" in plan.reason and "no stage recomputes" in plan.reason
    assert model.pipeline_stats()["plan_revisions"] == 1


def test_auto_plans_from_the_first_call_and_settles():
    """A budget holding the whole model: after the measured first call the plan is one stage
    (its only visit runs forward, loss and backward: no recomputation, fewest visits), then it
    is kept and nothing is measured any more."""
    model = RoundPipe(_net(), device="cpu", num_microbatch=3, layers_per_stage="auto",
                      memory_budget=2**30)
    first = model.plan()
    assert first.sizes == (1,) * 6 and "first training call" in first.reason and not first.kept
    _train(model, 1)
    assert model.plan().sizes == (1,) * 6  # planned before the next call
    _train(model, 3)
    plan = model.plan()
    assert plan.sizes == (6,), plan
    assert "measured" in plan.reason and plan.predicted_s > 0
    stats = model.pipeline_stats()
    assert stats["stages"] == 1 and stats["plan_revisions"] == 1
    assert plan.kept and model._staging.meter_for([((), {}, None)]) is None


def test_training_does_not_depend_on_the_plan_and_matches_plain_pytorch():
    auto = RoundPipe(_net(), device="cpu", num_microbatch=3, layers_per_stage="auto",
                     memory_budget=2**30)
    fixed = RoundPipe(_net(), device="cpu", num_microbatch=3, layers_per_stage=1)
    assert _train(auto, 4) == _train(fixed, 4)  # bit for bit
    assert auto.plan().sizes != fixed.plan().sizes
    for (_, a), (_, b) in zip(auto.optim_named_parameters(), fixed.optim_named_parameters()):
        assert torch.equal(a, b)
    plain = _net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(12, 32, generator=g), torch.randn(12, 4, generator=g)
        opt.zero_grad()
        _loss(plain(x), y).backward()
        opt.step()
    for (_, a), b in zip(auto.optim_named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_planned_stage_fits_in_half_the_budget(monkeypatch):
    """A budget of about three layers' measured bytes: several stages, each within half of it,
    each as the meter measured it (weights, gradient sums, activations of one microbatch)."""
    probe = RoundPipe(_net(8, 64), device="cpu", num_microbatch=2, layers_per_stage="auto",
                      memory_budget=2**40)
    _train_wide(probe, 2)
    per_layer = max(probe.plan().stage_bytes) / 8  # one stage of all 8 layers: their mean
    budget = int(2 * 3 * per_layer)
    # all of a device that small (an int budget under 1 MiB is refused: test_reliability_round5)
    monkeypatch.setattr(roundpipe.staging, "device_memory", lambda devices: budget)
    model = RoundPipe(_net(8, 64), device="cpu", num_microbatch=2, layers_per_stage="auto",
                      memory_budget=1.0)
    _train_wide(model, 4)
    plan = model.plan()
    assert 1 < len(plan.sizes) < 8, plan
    assert all(b <= budget // 2 for b in plan.stage_bytes)
    assert model.pipeline_stats()["stages"] == len(plan.sizes)


def _train_wide(model: RoundPipe, calls: int):
    opt = rpo.SGD(model.optim_parameters(), lr=0.01)
    x, y = torch.randn(16, 64), torch.randn(16, 4)
    for _ in range(calls):
        model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)
        model.step(opt)


def test_a_layer_larger_than_half_the_budget_is_refused_naming_it(monkeypatch):
    # a device of 100 kB (an int budget that small is refused: test_reliability_round5)
    monkeypatch.setattr(roundpipe.staging, "device_memory", lambda devices: 100_000)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4096), nn.Linear(4096, 4))
    model = RoundPipe(net, device="cpu", layers_per_stage="auto", memory_budget=1.0)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)  # measured, one per stage
    model.zero_grad()
    with pytest.raises(ValueError, match=r"layer 1 alone needs .* more than half of the memory "
                                         r"budget .*memory_budget"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=_loss)


def test_a_plan_can_be_pinned_and_bad_plans_are_refused():
    model = RoundPipe(_net(), device="cpu", layers_per_stage=[2, 3, 1])
    assert model.plan().sizes == (2, 3, 1)
    assert [(st.start, st.stop) for st in model._stages] == [(0, 2), (2, 5), (5, 6)]
    _train(model, 1)
    for bad in ([2, 3], [0, 6], "fast", 0):
        with pytest.raises(ValueError, match="layers_per_stage"):
            RoundPipe(_net(), device="cpu", layers_per_stage=bad)
    for budget in (0, 1.5, -0.1, True, "60%"):
        with pytest.raises(ValueError, match="memory_budget"):
            RoundPipe(_net(), device="cpu", layers_per_stage="auto", memory_budget=budget)


def test_a_larger_microbatch_than_measured_is_planned_again_when_it_no_longer_fits():
    """Settled on small microbatches with a budget that holds the model at that size; a call
    with 16x larger microbatches has 16x the activations: the kept plan no longer fits and
    the call is planned again, into more stages."""
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
                          for _ in range(6)])
    probe = RoundPipe(net, device="cpu", num_microbatch=2, layers_per_stage="auto",
                      memory_budget=2**40)
    opt = rpo.SGD(probe.optim_parameters(), lr=0.001)
    small, large = torch.randn(8, 64), torch.randn(128, 64)
    for _ in range(5):
        probe.forward_backward(input_args=(small,), label=small, loss_fn=_loss)
        probe.step(opt)
    whole = probe.plan().stage_bytes[0]
    model = RoundPipe(net, device="cpu", num_microbatch=2, layers_per_stage="auto",
                      memory_budget=int(2.2 * whole))
    opt = rpo.SGD(model.optim_parameters(), lr=0.001)
    for _ in range(5):
        model.forward_backward(input_args=(small,), label=small, loss_fn=_loss)
        model.step(opt)
    assert model.plan().sizes == (6,) and model.plan().kept
    model.forward_backward(input_args=(large,), label=large, loss_fn=_loss)
    assert len(model.plan().sizes) > 1 and "larger microbatch" in model.plan().reason


def test_hugging_face_moe_keeps_its_moe_layers_out_of_the_last_stage():
    model = causal_lm("qwen3_moe", num_hidden_layers=3)
    with pytest.raises(ValueError, match="last stage starts at layer 2, before layer 4: layer 3 is "
                                         "a MoE layer"):
        roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu",
                                          layers_per_stage=[2, 3])
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu",
                                          layers_per_stage="auto", memory_budget=2**30,
                                          num_microbatch=2)
    opt = rpo.SGD(w.optim_parameters(), lr=0.01)
    ids = torch.randint(0, 101, (4, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        w.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
        w.step(opt)
    sizes = w.plan().sizes
    assert sizes[-1] == 1 and len(sizes) >= 2, sizes  # the postfix alone, the rest together


def test_a_quantized_base_is_planned_with_its_dense_weights_resident_and_packed_upload():
    """NF4 frozen weights: a stage holds the packed bytes and the dense weights they are
    dequantized into, but its upload copies only the packed bytes. The planner's inputs say
    both: the uploaded bytes are what the device I/O counts copying the layers once (a forward
    pass), and what each layer holds adds the dense weight (out x in x 4 bytes, fp32 here)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 8))
    for m in (net[0], net[2]):
        m.weight.requires_grad_(False)
    model = RoundPipe(net, torch.float32, device="cpu", frozen_dtype="nf4")
    costs = model._staging.costs(1, 6)
    with torch.no_grad():
        model(torch.randn(6, 64))
    copied = model.pipeline_stats()["h2d_weight_bytes"] + model.pipeline_stats()["h2d_buffer_bytes"]
    assert sum(c.uploaded for c in costs) == copied
    dense = [128 * 64 * 4, 0, 64 * 128 * 4, 0]
    assert [c.weight_bytes - c.uploaded for c in costs] == dense


def test_the_chunked_loss_weight_gradient_is_counted_once_not_per_token():
    """The chunked cross-entropy of a Hugging Face model computes the float32 gradient of
    ``lm_head``'s weight in its forward and saves it for the backward: vocabulary x hidden x 4
    bytes, whatever the tokens. The meter keeps it apart from the per-token activations, so a
    call with microbatches 16x those measured is planned with it once: under a budget whose
    half holds the last layer at that size only then, the call is planned and trains as plain
    transformers computes its loss (it used to be refused: "layer 3 alone needs ...")."""
    vocab, hidden = 4096, 32
    head = vocab * hidden * 4                           # fp32: the weight, its gradient sum

    def wrapped(budget):
        return roundpipe.wrap_model_to_roundpipe(
            causal_lm("llama", vocab_size=vocab, max_position_embeddings=512), torch.float32,
            device="cpu", layers_per_stage="auto", memory_budget=budget, num_microbatch=2)

    g = torch.Generator().manual_seed(0)
    small, large = (torch.randint(0, vocab, (2, s), generator=g) for s in (16, 256))
    probe = wrapped(2**40)
    probe.forward_backward(input_kwargs={"input_ids": small, "labels": small})
    last = probe._staging.num_layers - 1
    meter = probe._staging.meter
    assert meter.fixed_bytes[last] == head              # the loss's fp32 gradient of lm_head
    need = probe._staging.costs(2, 256)[last].device_bytes
    norm = hidden * 4                                   # the final norm's weight
    assert need == 3 * head + 2 * norm + int(math.ceil(256 * meter.act_bytes[last]))

    model = wrapped(int(2.2 * need))                    # half of it holds the layer, once
    model.forward_backward(input_kwargs={"input_ids": small, "labels": small})  # measured
    got = model.forward_backward(input_kwargs={"input_ids": large, "labels": large})
    assert "auto:" in model.plan().reason
    with torch.no_grad():
        want = causal_lm("llama", vocab_size=vocab, max_position_embeddings=512)(
            input_ids=large, labels=large).loss
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
