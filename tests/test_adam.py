"""roundpipe.optim.Adam against torch.optim.Adam(foreach=False): results, state, state dicts,
schedulers, hooks and errors."""

from __future__ import annotations

import io
import itertools
import warnings

import pytest
import torch

import roundpipe.optim as rpo
from conftest import assert_same_training, make_params

FLAGS = list(itertools.product([False, True], [False, True], [0.0, 0.1], [False, True]))


@pytest.mark.parametrize("amsgrad,maximize,weight_decay,decoupled", FLAGS)
def test_matches_torch_for_every_flag_combination(isa, amsgrad, maximize, weight_decay, decoupled):
    assert_same_training(rpo.Adam, torch.optim.Adam, dict(
        lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay, amsgrad=amsgrad,
        maximize=maximize, decoupled_weight_decay=decoupled))


@pytest.mark.parametrize("grad_scale", [1e-20, 1e3])
def test_extreme_gradient_scales(isa, grad_scale):
    # 1e-20 gradients give exp_avg_sq values of 1e-43: subnormal floats, kept as torch keeps them.
    assert_same_training(rpo.Adam, torch.optim.Adam, dict(lr=1e-3, amsgrad=True),
                         grad_scale=grad_scale)


def test_defaults_tensor_lr_and_views_into_one_buffer():
    assert_same_training(rpo.Adam, torch.optim.Adam, {}, as_views=True)
    assert_same_training(rpo.Adam, torch.optim.Adam, dict(lr=torch.tensor(0.01)))


def test_lr_scheduler_drives_both_alike():
    assert_same_training(rpo.Adam, torch.optim.Adam, dict(lr=0.05, weight_decay=0.01),
                         scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5))


def _train(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_state_dict_round_trip(direction):
    kwargs = dict(lr=0.01, amsgrad=True, weight_decay=0.1)
    first, second = (rpo.Adam, torch.optim.Adam) if direction == "ours_to_torch" else (
        torch.optim.Adam, rpo.Adam)
    params = make_params()
    opt = first(params, **kwargs)
    _train(opt, params, 5, seed=1)
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
    # Continue in both classes from the checkpoint: they must agree step for step. Each loads
    # its own copy: load_state_dict keeps the CPU `step` tensors it is given (torch does too),
    # and the step increments them in place.
    resumed = {}
    for cls in (first, second):
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        ps = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
        o = cls(ps, **kwargs)
        o.load_state_dict(saved["opt"])
        _train(o, ps, 5, seed=2)
        resumed[cls] = (ps, o)
    (pa, oa), (pb, ob) = resumed[first], resumed[second]
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for k in ob.state[b]:
            torch.testing.assert_close(oa.state[a][k], ob.state[b][k], rtol=1e-5, atol=1e-6)
    assert ob.state[pb[0]]["step"].dtype == torch.float32
    assert ob.state[pb[0]]["step"].item() == 10


def test_state_layout_matches_torch():
    p = make_params([(3, 4)])
    ours, ref = assert_same_training(rpo.Adam, torch.optim.Adam, dict(amsgrad=True), steps=1,
                                     shapes=[(3, 4)])
    sd_ours, sd_ref = ours.state_dict(), ref.state_dict()
    assert sd_ours["param_groups"][0].keys() == sd_ref["param_groups"][0].keys()
    assert sd_ours["state"][0].keys() == sd_ref["state"][0].keys()
    assert sd_ours["state"][0]["step"].shape == ()


def test_params_without_grad_are_skipped_and_named_parameters_work():
    model = torch.nn.Linear(3, 2)
    opt = rpo.Adam(model.named_parameters(), lr=0.1)
    before = model.bias.detach().clone()
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    assert torch.equal(model.bias, before)
    assert model.bias not in opt.state
    assert not torch.equal(model.weight, torch.zeros_like(model.weight))
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]


def test_add_param_group_and_step_hooks():
    a, b = make_params([(5,), (6,)])
    opt = rpo.Adam([a], lr=0.1)
    opt.add_param_group({"params": [b], "lr": 0.2, "amsgrad": True})
    calls = []
    opt.register_step_pre_hook(lambda o, args, kw: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kw: calls.append("post"))
    a.grad, b.grad = torch.ones(5), torch.ones(6)
    opt.step()
    assert calls == ["pre", "post"]
    assert "max_exp_avg_sq" in opt.state[b] and "max_exp_avg_sq" not in opt.state[a]


def test_closure_runs_with_grad_enabled():
    (p,) = make_params([(4,)])
    opt = rpo.Adam([p])

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert opt.step(closure) is not None
    assert opt.state[p]["step"].item() == 1


@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_foreach_and_fused_warn_and_are_ignored(flag):
    (p,) = make_params([(4,)])
    with pytest.warns(UserWarning, match=flag):
        opt = rpo.Adam([p], **{flag: True})
    assert opt.param_groups[0][flag] is None


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_capturable_and_differentiable_are_errors(flag):
    (p,) = make_params([(4,)])
    with pytest.raises(ValueError, match=flag):
        rpo.Adam([p], **{flag: True})
    opt = rpo.Adam([p])
    opt.param_groups[0][flag] = True  # e.g. from a loaded state dict
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match=flag):
        opt.step()
    assert opt.state[p] == {}


@pytest.mark.parametrize("kwargs", [
    dict(lr=-1.0), dict(eps=-1.0), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)),
    dict(weight_decay=-1.0), dict(betas=(0.9, torch.tensor(0.9))),
    dict(lr=torch.tensor([0.1, 0.2])),
])
def test_hyperparameter_validation_matches_torch(kwargs):
    (p,) = make_params([(4,)])
    with pytest.raises(Exception) as ref:
        torch.optim.Adam([p], **kwargs)
    with pytest.raises(type(ref.value)) as ours:
        rpo.Adam([p], **kwargs)
    assert str(ours.value) == str(ref.value)


def test_sparse_gradient_is_a_runtime_error():
    (p,) = make_params([(4,)])
    p.grad = torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        rpo.Adam([p]).step()


@pytest.mark.parametrize("case", ["float64", "noncontiguous", "grad_shape", "state_dtype",
                                  "state_shape"])
def test_bad_tensors_raise_before_any_change(case):
    good, bad = make_params([(4, 4), (4, 4)])
    for p in (good, bad):
        p.grad = torch.ones(4, 4)
    opt = rpo.Adam([good, bad], lr=0.1)
    if case == "float64":
        bad.data = bad.data.double()
        bad.grad = torch.ones(4, 4, dtype=torch.float64)
    elif case == "noncontiguous":
        bad.data = bad.data.t()
    elif case == "grad_shape":
        bad.data = bad.data.reshape(16)  # the grad stays (4, 4)
    else:
        opt.step()  # creates state, then corrupt it as a bad checkpoint would
        opt.state[bad]["exp_avg_sq"] = (torch.zeros(4, 4, dtype=torch.float64)
                                        if case == "state_dtype" else torch.zeros(5))
    snapshot = good.detach().clone(), bad.detach().clone()
    step_before = opt.state[good].get("step", torch.tensor(0.0)).clone()
    with pytest.raises((TypeError, ValueError)) as err:
        opt.step()
    assert "params group 0" in str(err.value) or "param group 0" in str(err.value)
    assert "[1]" in str(err.value), str(err.value)
    assert torch.equal(good.detach(), snapshot[0]) and torch.equal(bad.detach(), snapshot[1])
    assert torch.equal(opt.state[good]["step"], step_before)
