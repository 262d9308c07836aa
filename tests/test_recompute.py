"""Recomputation per stage (``RoundPipe(recompute=...)``, :mod:`roundpipe.planner`): a stage that
does not recompute keeps autograd's saved tensors from its forward visit to its backward visit.
Training equals plain PyTorch without checkpointing (an independent loop, the documented
per-layer seeds, dropout and BatchNorm) with every setting, bit for bit the same whichever stages
recompute, in every mode and on two workers; a kept stage runs each layer once per microbatch
and keeps nothing for a recomputation; the setting is checked; a Hugging Face MoE model with
its auxiliary loss trains as HF's own on kept stages, its routing not kept for them."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import roundpipe
import roundpipe.optim as rpo
from roundpipe import RoundPipe

from pipeline_models import (MODELS, assert_params_equal, causal_lm, data, loss_fn, small_device,
                             reference_forward_backward)


def _train(model: RoundPipe, name: str, mode: str, steps: int = 4) -> list[float]:
    opt = rpo.SGD(model.optim_parameters(), lr=0.05, momentum=0.5)
    losses = []
    for step in range(steps):
        x, y = data(name, step)
        torch.manual_seed(step)
        kw = dict(input_args=(x,), label=y, loss_fn=loss_fn)
        if mode == "exact":
            losses.append(model.forward_backward(**kw, optimizer=opt).item())
        else:
            losses.append(model.forward_backward(**kw).item())
            model.step(opt, is_async=mode == "async")
    model.synchronize()
    return losses


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("num_microbatch", [1, 3])
def test_kept_stages_train_as_plain_pytorch_without_checkpointing(name, num_microbatch):
    """No stage recomputing (dropout, BatchNorm statistics): losses, weights and buffers of
    plain PyTorch training, whose layers run once with autograd."""
    torch.manual_seed(0)
    net = MODELS[name]()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, device="cpu", num_microbatch=num_microbatch, recompute=False)
    assert model.plan().recompute == (False,) * len(model.plan().sizes)
    opt = rpo.SGD(model.optim_parameters(), lr=0.05, momentum=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.5)
    for step in range(5):
        x, y = data(name, step)
        torch.manual_seed(step)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(opt)
        torch.manual_seed(step)
        want = reference_forward_backward(ref, x, y, num_microbatch,
                                          roundpipe.pipeline.execute.draw_call_seed())
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(want, rel=1e-5)
        assert_params_equal(model, ref)
    for (key, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, rb, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("mode", ["sync", "async", "exact"])
@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_results_do_not_depend_on_which_stages_recompute(mode, devices):
    """Every stage recomputing, none, and the planner's choice (one device: under a budget
    that keeps only some): the same losses and weights, bit for bit, with dropout, in every
    mode."""
    results = {}
    settings = [(True, 0.6), (False, 0.6), ("auto", 0.6)] + [("auto", 90_000)] * (len(devices) == 1)
    for recompute, budget in settings:
        torch.manual_seed(0)
        tiny = isinstance(budget, int)  # bytes: a device that small
        with small_device(budget) if tiny else contextlib.nullcontext():
            model = RoundPipe(MODELS["transformer"](), device=devices, num_microbatch=3,
                              recompute=recompute,
                              memory_budget=1.0 if tiny else budget)
        losses = _train(model, "transformer", mode)
        results[(recompute, budget)] = (losses, [p.clone() for p in model.optim_parameters()],
                                        model.plan().recompute)
    assert results[("auto", 0.6)][2] == (False,) * 5          # everything fits: kept
    if len(devices) == 1:  # the encoder layers recompute, the small stages keep
        assert results[("auto", 90_000)][2] == (False, True, True, False, False)
    base_losses, base_params, _ = results[(True, 0.6)]
    for key, (losses, params, _) in results.items():
        assert losses == base_losses, key
        assert all(torch.equal(a, b) for a, b in zip(params, base_params)), key


class _Counting(nn.Module):
    """Linear 8 -> 8 and Tanh, counting its runs, whether they were recomputations, and what
    ``save_for_recompute`` gave back."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.runs = {"first": 0, "recompute": 0, "will_recompute": 0}

    def forward(self, x):
        if roundpipe.doing_recompute():
            self.runs["recompute"] += 1
            (kept,) = roundpipe.get_recompute_data()
            assert torch.equal(kept, x)
        else:
            self.runs["first"] += 1
            self.runs["will_recompute"] += roundpipe.will_recompute()
            roundpipe.save_for_recompute(x.detach().clone())
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("recompute", [True, False])
def test_a_kept_stage_runs_each_layer_once_and_keeps_nothing_for_a_recomputation(recompute):
    torch.manual_seed(0)
    layers = [_Counting() for _ in range(4)]
    model = RoundPipe(nn.Sequential(*layers), device="cpu", num_microbatch=3, recompute=recompute)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        again = 3 if recompute and not last else 0
        assert layer.runs == {"first": 3, "recompute": again, "will_recompute": again}, i
    stats = model.pipeline_stats()
    # a kept stage's weights go to the device once per call, for its forward visit
    per_stage = layers[0].linear.weight.numel() * 4 + 8 * 4
    assert stats["h2d_weight_bytes"] == per_stage * (4 + (3 if recompute else 0))
    assert stats["weight_floor_bytes"] == stats["h2d_weight_bytes"]


@pytest.mark.parametrize("bad", ["always", "yes", 1, 0, None, "AUTO", [1, 0], (True, None)])
def test_recompute_is_checked(bad):
    with pytest.raises(ValueError, match="recompute must be 'auto'.*True.*False"):
        RoundPipe(nn.Sequential(nn.Linear(4, 4)), device="cpu", recompute=bad)


def test_a_pinned_recomputation_is_checked_and_taken_as_it_is():
    net = lambda: nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])  # noqa: E731
    with pytest.raises(ValueError, match="3 entries for 4 stages"):
        RoundPipe(net(), device="cpu", recompute=[True, False, False])
    with pytest.raises(ValueError, match="stages that are planned"):
        RoundPipe(net(), device="cpu", layers_per_stage="auto", recompute=[True] * 4)
    with pytest.raises(ValueError, match=r"recompute\[-1\] must be False.*last stage"):
        RoundPipe(net(), device="cpu", layers_per_stage=2, recompute=[False, True])
    model = RoundPipe(net(), device="cpu", layers_per_stage=[1, 2, 1],
                      recompute=[True, False, False])
    assert model.plan().recompute == (True, False, False) and model.plan().kept
    assert "stage 1 keep" in model.plan().reason and "stage 0 recompute" in model.plan().reason
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
    assert model.plan().recompute == (True, False, False)
    assert model.pipeline_stats()["plan_revisions"] == 0


def test_plan_says_which_stages_recompute_and_why():
    forced = RoundPipe(MODELS["mlp"](), device="cpu", recompute=True)
    assert forced.plan().recompute == (True,) * 4 + (False,)
    assert "every stage but the last recomputes (recompute=True)" in forced.plan().reason
    never = RoundPipe(MODELS["mlp"](), device="cpu", recompute=False)
    assert "no stage recomputes" in never.plan().reason and "recompute=False" in never.plan().reason
    auto = RoundPipe(MODELS["mlp"](), device="cpu", num_microbatch=2)
    assert auto.plan().recompute == (True,) * 4 + (False,)
    assert "first training call" in auto.plan().reason and not auto.plan().kept
    _train(auto, "mlp", "sync", steps=2)
    plan = auto.plan()
    assert plan.kept and plan.recompute == (False,) * 5
    assert "no stage recomputes: every stage's saved tensors fit" in plan.reason
    assert "budget" in plan.reason and plan.predicted_s > 0


def test_kept_stages_beyond_the_budget_under_recompute_false_are_refused_naming_the_bytes():
    """Small weights, large activations: every layer fits on its own, the saved tensors of all
    three microbatches of every stage do not; recompute="auto" recomputes instead."""
    x, y = torch.randn(96, 8), torch.randn(96, 1)
    for recompute in (False, "auto"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        with small_device(8_000):
            model = RoundPipe(net, device="cpu", num_microbatch=3, recompute=recompute,
                              layers_per_stage="auto", memory_budget=1.0)
        model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
        if recompute is False:
            with pytest.raises(ValueError, match="recompute=False keeps every stage's saved "
                                                 "tensors.*more than the memory budget"):
                model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
        else:
            model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
            assert True in model.plan().recompute, model.plan()


# --- Hugging Face mixture of experts --------------------------------------------------------

def _hf_batch(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 101, (3, 11), generator=gen)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _grads(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_moe_with_its_auxiliary_loss_on_kept_stages_equals_hf(devices):
    """The router auxiliary loss's gradient, known only after the whole forward pass, reaches
    routers whose stages keep their graph; the routing is the router's own, run once."""
    pytest.importorskip("transformers")
    model = causal_lm("qwen3_moe")
    batch = _hf_batch()
    ref = copy.deepcopy(model)
    want = ref(**batch)
    assert want.aux_loss > 0
    want.loss.backward()
    router_cls = type(model.model.layers[0].mlp.gate)
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device=devices,
                                          num_microbatch=3, recompute=False)
    runs = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: runs.append(roundpipe.doing_recompute()) if isinstance(m, router_cls)
        else None)
    try:
        loss = w.forward_backward(input_kwargs=batch)
    finally:
        hook.remove()
    assert runs == [False] * 6  # 2 MoE layers x 3 microbatches, never recomputed
    torch.testing.assert_close(loss, want.loss.detach(), rtol=1e-6, atol=1e-6)
    got = {k: g for k, g in w.accumulated_grads().items() if g is not None}
    expected = _grads(ref)
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
