"""CpuOptimizer.fused_step (the mixed-precision entry point) against its unfused composition —
gradient converted by torch and unscaled in float32, the plain step, the parameter rounded by
torch into the model copy — and against torch.optim; plus its argument checks."""

from __future__ import annotations

import pytest
import torch

import roundpipe.optim as rpo
from conftest import ieee_sqrt
from optimizer_cases import CASES

SHAPES = [(3,), (37, 5), (2100,), (1,)]  # tails, a 2048-element staging slice and more


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def _grads(step, dtype, scale):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * scale).to(dtype) for s in SHAPES]


@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_step_equals_its_composition_and_torch(case, grad_dtype, copy_dtype, isa):
    fused, plain, ref = _params(), _params(), _params()
    kwargs = dict(case.base)
    opt_fused, opt_plain = case.ours(fused, **kwargs), case.ours(plain, **kwargs)
    opt_ref = case.ref(ref, **kwargs, foreach=False)
    scale = 1024.0
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    for step in range(3):
        grads = _grads(step, grad_dtype, scale)
        copies = ([torch.full(s, 7.0, dtype=copy_dtype) for s in SHAPES]
                  if copy_dtype is not None else None)
        stats = opt_fused.fused_step(fused, grads, copies, grad_scale=scale, grad_norm=True)
        unscaled = [g.to(torch.float32) * inv for g in grads]
        for p, q, g in zip(plain, ref, unscaled):
            p.grad, q.grad = g.clone(), g.clone()
        opt_plain.step()
        with ieee_sqrt():
            opt_ref.step()
        assert stats.found_inf is False
        want_norm = sum(float(g.double().square().sum()) for g in unscaled)
        assert stats.grad_norm_sq == pytest.approx(want_norm, rel=1e-5)
        for a, b in zip(fused, plain):
            assert torch.equal(a, b)
        if copies is not None:
            for c, p in zip(copies, plain):
                assert torch.equal(c, p.detach().to(copy_dtype))
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for p, q in zip(fused, plain):
        for key, value in opt_plain.state[q].items():
            assert torch.equal(opt_fused.state[p][key], value), key
    assert all(p.grad is None for p in fused)  # .grad is neither read nor written


def test_found_inf_reports_a_non_finite_gradient_and_the_step_still_runs():
    p = torch.zeros(40, requires_grad=True)
    opt = rpo.SGD([p], lr=0.5)
    g = torch.ones(40, dtype=torch.bfloat16)
    g[17] = float("inf")
    stats = opt.fused_step([p], [g], grad_scale=2.0)
    assert stats.found_inf is True and stats.grad_norm_sq is None
    assert p[0].item() == -0.25 and p[17].item() == float("-inf")
    assert opt.fused_step([p], [torch.ones(40)]).found_inf is False


def test_only_the_given_parameters_step_each_with_its_own_group():
    a, b, c = (torch.ones(8, requires_grad=True) for _ in range(3))
    opt = rpo.Adam([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=0.1)
    opt.fused_step([c, a], [torch.ones(8), torch.ones(8)])
    ref_a, ref_c = torch.ones(8, requires_grad=True), torch.ones(8, requires_grad=True)
    ref = torch.optim.Adam([{"params": [ref_a]}, {"params": [ref_c], "lr": 0.5}], lr=0.1)
    ref_a.grad, ref_c.grad = torch.ones(8), torch.ones(8)
    ref.step()
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(c, ref_c)
    assert torch.equal(b, torch.ones(8)) and b not in opt.state
    assert opt.state[a]["step"].item() == 1.0


def _bad_calls(p, q, other):
    ones = torch.ones(6)
    return [
        (ValueError, "not a parameter of this optimizer", ([other], [ones]), {}),
        (ValueError, "given twice", ([p, p], [ones, ones]), {}),
        (ValueError, "same length", ([p, q], [ones]), {}),
        (ValueError, "same length", ([p], [ones], [ones, ones]), {}),
        (ValueError, r"grads\[0\] has shape \(2, 3\)", ([p], [torch.ones(2, 3)]), {}),
        (TypeError, r"grads\[0\] must be float32, bfloat16 or float16",
         ([p], [torch.ones(6, dtype=torch.float64)]), {}),
        (TypeError, r"model_copies\[1\] must be a tensor", ([p, q], [ones, ones], [ones, None]), {}),
        (ValueError, r"model_copies\[0\] must be contiguous",
         ([p], [ones], [torch.ones(12)[::2]]), {}),
        (ValueError, "grad_scale must be a number", ([p], [ones]), {"grad_scale": 0.0}),
        (ValueError, "grad_scale must be a number", ([p], [ones]),
         {"grad_scale": float("nan")}),
        (RuntimeError, "sparse", ([p], [ones.to_sparse()]), {}),
    ]


@pytest.mark.parametrize("index", range(11))
def test_bad_arguments_raise_before_anything_changes(index):
    p, q, other = (torch.ones(6, requires_grad=True) for _ in range(3))
    opt = rpo.AdamW([p, q], lr=0.1)
    exc, match, args, kwargs = _bad_calls(p, q, other)[index]
    with pytest.raises(exc, match=match):
        opt.fused_step(*args, **kwargs)
    assert torch.equal(p, torch.ones(6)) and torch.equal(q, torch.ones(6)) and not opt.state


def test_loading_state_of_the_wrong_shape_is_refused_before_anything_changes():
    p = torch.ones(2, 3, requires_grad=True)
    opt = rpo.Adam([p])
    p.grad = torch.ones(2, 3)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = torch.zeros(3, 2)
    before = opt.state[p]["exp_avg"].clone()
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 has shape \(3, 2\)"):
        opt.load_state_dict(sd)
    assert torch.equal(opt.state[p]["exp_avg"], before)


def test_num_threads_per_optimizer_gives_the_same_result_and_is_checked():
    # 600009 elements: enough for 3 threads (a step runs on at most one per 196608 elements,
    # kElementsPerThread in cpp/optim/parallel.hpp)
    a = [torch.randn(200003, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    results = []
    for threads in (None, 1, 3):
        ps = [t.clone().requires_grad_() for t in a]
        opt = rpo.Adam(ps, lr=0.1)
        opt.num_threads = threads
        for p in ps:
            p.grad = torch.cos(p.detach())
        opt.step()
        opt.fused_step(ps, [p.grad.bfloat16() for p in ps])
        results.append(ps)
    for ps in results[1:]:
        for p, q in zip(ps, results[0]):
            assert torch.equal(p, q)
    for bad in (0, -1, 1025, 2.0, True):
        with pytest.raises(ValueError, match="num_threads"):
            opt.num_threads = bad
    assert opt.num_threads == 3


@pytest.mark.parametrize("case", CASES, ids=str)
def test_autograd_sees_the_update_as_torch_in_place_ops_do(case):
    # torch.optim's in-place updates bump the version counter, so a backward through values
    # saved before the step fails; ours write through raw pointers and must do the same.
    for use_fused in (False, True):
        w = torch.nn.Parameter(torch.ones(3))
        y = (w * w).sum()
        opt = case.ours([w], **case.base)
        if use_fused:
            opt.fused_step([w], [torch.ones(3)])
        else:
            w.grad = torch.ones(3)
            opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


def test_negated_views_are_refused():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = rpo.SGD([p], lr=1.0)
    with pytest.raises(ValueError, match=r"grads\[0\] is a negated view"):
        opt.fused_step([p], [torch._neg_view(torch.ones(4))])
    p.grad = torch._neg_view(torch.ones(4))
    with pytest.raises(ValueError, match="negated view"):
        opt.step()
    assert torch.equal(p, torch.zeros(4))


def test_grad_scale_forms_and_limits():
    p = torch.zeros(3, requires_grad=True)
    opt = rpo.SGD([p], lr=1.0)
    opt.fused_step([p], [torch.full((3,), 4.0)], grad_scale=torch.tensor(4.0))  # GradScaler's
    assert torch.equal(p, torch.full((3,), -1.0))
    for bad in (True, 2**2000, 1e-300, torch.tensor([1.0, 2.0]), torch.tensor(2), "2"):
        with pytest.raises(ValueError, match="grad_scale"):
            opt.fused_step([p], [torch.ones(3)], grad_scale=bad)
    assert torch.equal(p, torch.full((3,), -1.0))


def test_a_bad_group_is_refused_before_any_group_steps():
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    opt = rpo.Adam([a], lr=0.1)
    opt.add_param_group({"params": [b]})
    opt.param_groups[1]["differentiable"] = True
    with pytest.raises(ValueError, match="differentiable"):
        opt.fused_step([a, b], [torch.ones(3), torch.ones(3)])
    assert torch.equal(a, torch.ones(3)) and not opt.state
    with pytest.raises(ValueError, match="differentiable"):
        opt.add_param_group({"params": [torch.ones(2, requires_grad=True)], "differentiable": True})
    assert len(opt.param_groups) == 2


def test_a_parameter_replaced_in_its_group_is_found():
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    opt = rpo.SGD([a], lr=0.5)
    opt.fused_step([a], [torch.ones(3)])
    opt.param_groups[0]["params"][0] = b
    with pytest.raises(ValueError, match="not a parameter"):
        opt.fused_step([a], [torch.ones(3)])
    opt.fused_step([b], [torch.ones(3)])
    assert torch.equal(b, torch.full((3,), 0.5)) and torch.equal(a, torch.full((3,), 0.5))


def test_no_scheduler_warning_and_num_threads_survives_copies():
    import copy
    import pickle
    import warnings

    p = torch.zeros(3, requires_grad=True)
    opt = rpo.Adam([p], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.fused_step([p], [torch.ones(3)])
        sched.step()
    opt.num_threads = __import__("numpy").int64(2)
    assert opt.num_threads == 2 and type(opt.num_threads) is int
    assert copy.deepcopy(opt).num_threads == 2
    assert pickle.loads(pickle.dumps(opt)).num_threads == 2
