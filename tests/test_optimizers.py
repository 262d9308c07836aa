"""Every roundpipe.optim class against its torch.optim namesake (foreach=False): results and
state over a hyperparameter sweep on every ISA, extreme gradients, views, tensor lr, LR
schedulers, state-dict round trips, old checkpoints, hooks, placeholders and errors.
The classes and sweeps come from optimizer_cases.CASES."""

from __future__ import annotations

import copy
import inspect
import io
import math
import os
import platform
import subprocess
import sys

import pytest
import torch

from conftest import assert_same_training, ieee_sqrt, make_params
from optimizer_cases import CASES

SWEEP = [pytest.param(case, kw, id=f"{case}-{i}") for case in CASES for i, kw in enumerate(case.sweep)]

# Our scalar ISA fuses a * b + c only where every CPU of the architecture has FMA (aarch64), as
# torch's DEFAULT CPU capability does; on x86 torch's AVX2 and AVX-512 kernels fuse (ATen's
# add(alpha=), lerp and addcmul become FMAs there), so the scalar ISA rounds once more per such op.
X86 = platform.machine().lower() in ("x86_64", "amd64")
SCALAR_ISA_UNFUSED = X86 and torch.backends.cpu.get_cpu_capability() != "DEFAULT"


@pytest.mark.parametrize("case,kwargs", SWEEP)
def test_matches_torch(isa, case, kwargs):
    tolerance = case.scalar_isa_tolerance(kwargs) if isa == "scalar" and SCALAR_ISA_UNFUSED else {}
    assert_same_training(case.ours, case.ref, kwargs, shapes=case.shapes, **tolerance)


_UNFUSED_SCRIPT = """
import torch, roundpipe.optim as rpo
from conftest import assert_same_training
from optimizer_cases import CASES
assert torch.backends.cpu.get_cpu_capability() == "DEFAULT" and rpo.active_isa() == "scalar"
for case in CASES:
    for i, kwargs in enumerate(case.sweep):
        if case.scalar_isa_tolerance(kwargs):
            print(case, i, flush=True)
            assert_same_training(case.ours, case.ref, kwargs, shapes=case.shapes, rtol=0, atol=0)
"""


@pytest.mark.skipif(not X86, reason="torch's DEFAULT capability fuses like ours off x86")
def test_scalar_isa_matches_torch_without_fma():
    # The sweep entries whose scalar-ISA bounds are loosened are bit for bit torch's results when
    # torch runs its no-FMA kernels (ATEN_CPU_CAPABILITY=default, set before torch starts, hence
    # the subprocess): the loosening is the fused roundings, not the algorithm. (The reference's
    # square roots are IEEE ones, conftest.ieee_sqrt: torch's come from MKL, whose code path
    # ATEN_CPU_CAPABILITY does not choose and which rounds differently per CPU vendor.)
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", ROUNDPIPE_ISA="scalar")
    result = subprocess.run([sys.executable, "-c", _UNFUSED_SCRIPT], cwd=os.path.dirname(__file__),
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("grad_scale", [1e-20, 1e3])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_extreme_gradient_scales(case, grad_scale):
    # 1e-20 gradients make squared-gradient state subnormal (1e-40): kept, as torch keeps it.
    assert_same_training(case.ours, case.ref, case.base, grad_scale=grad_scale,
                         shapes=case.shapes)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_views_into_one_buffer_and_tensor_lr(case):
    assert_same_training(case.ours, case.ref, case.base, as_views=True, shapes=case.shapes)
    assert_same_training(case.ours, case.ref, dict(case.base, lr=torch.tensor(case.lr)),
                         shapes=case.shapes)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_lr_scheduler_drives_both_alike(case):
    assert_same_training(case.ours, case.ref, case.base, shapes=case.shapes,
                         scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5))


def _train(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        with ieee_sqrt():  # for the torch.optim references (see there); ours never calls it
            opt.step()


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_state_dict_round_trip(case, direction):
    first, second = (case.ours, case.ref) if direction == "ours_to_torch" else (case.ref, case.ours)
    params = make_params(case.shapes)
    opt = first(params, **case.base)
    _train(opt, params, 5, seed=1)
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
    # Both classes continue from the checkpoint and must agree step for step. Each loads its
    # own copy: load_state_dict keeps the CPU `step` tensors it is given (torch does too), and
    # a step increments them in place.
    resumed = []
    for cls in (first, second):
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        ps = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
        o = cls(ps, **case.base)
        o.load_state_dict(saved["opt"])
        _train(o, ps, 5, seed=2)
        resumed.append((ps, o))
    (pa, oa), (pb, ob) = resumed
    for a, b in zip(pa, pb):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert oa.state[a].keys() == ob.state[b].keys()
        for k, v in ob.state[b].items():
            torch.testing.assert_close(oa.state[a][k], v, rtol=1e-5, atol=1e-6)
    assert oa.state_dict()["param_groups"] == ob.state_dict()["param_groups"] or \
        direction == "torch_to_ours"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_state_and_groups_have_torch_layout(case):
    ours, ref = assert_same_training(case.ours, case.ref, case.base, steps=2, shapes=[(3, 4)])
    so, sr = ours.state_dict(), ref.state_dict()
    assert so["param_groups"][0].keys() == sr["param_groups"][0].keys()
    assert so["state"][0].keys() == sr["state"][0].keys()
    for k, v in sr["state"][0].items():
        assert so["state"][0][k].dtype == v.dtype and so["state"][0][k].shape == v.shape, k


@pytest.mark.parametrize("case", CASES, ids=str)
def test_old_checkpoint_defaults_match_torch(case):
    # __setstate__ fills the group keys an older checkpoint lacks, and turns a Python-number
    # step into a tensor, exactly as torch does (SGD keeps no step).
    results = []
    for cls in (case.ours, case.ref):
        (p,) = make_params([(4,)])
        opt = cls([p], **case.base)
        p.grad = torch.ones(4)
        opt.step()
        state = opt.__getstate__()
        group = state["param_groups"][0]
        for key in ("maximize", "foreach", "capturable", "differentiable", "fused",
                    "amsgrad", "decoupled_weight_decay", "nesterov", "centered"):
            group.pop(key, None)
        if "step" in state["state"][p]:
            state["state"][p]["step"] = float(state["state"][p]["step"])
        opt.__setstate__(state)
        results.append((opt.param_groups[0], opt.state[p].get("step")))
    (go, so), (gr, sr) = results
    assert {k: v for k, v in go.items() if k != "params"} == \
        {k: v for k, v in gr.items() if k != "params"}
    assert (so is None and sr is None) or (so.dtype == sr.dtype and so.item() == sr.item())


@pytest.mark.parametrize("case", CASES, ids=str)
def test_named_parameters_add_param_group_hooks_and_skipped_params(case):
    model = torch.nn.Linear(3, 2)
    extra = torch.nn.Parameter(torch.randn(5))
    opt = case.ours(model.named_parameters(), **case.base)
    opt.add_param_group({"params": [("extra", extra)], "lr": case.lr / 2})
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    bias = model.bias.detach().clone()
    model.weight.grad = torch.ones_like(model.weight)
    extra.grad = torch.ones(5)
    opt.step()
    assert calls == ["pre", "post"]
    assert torch.equal(model.bias, bias)
    # The skipped parameter keeps the state torch keeps for a parameter never stepped: none, or
    # the state Adagrad creates at construction.
    (never_stepped,) = make_params([(2,)])
    ref_state = case.ref([never_stepped], **case.base).state.get(never_stepped)
    state = opt.state.get(model.bias)
    assert (state is None) == (ref_state is None)
    if ref_state is not None:
        assert state.keys() == ref_state.keys()
        assert all(torch.equal(state[k], v) for k, v in ref_state.items())
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_closure_runs_with_grad_enabled(case):
    (p,) = make_params([(4,)])
    opt = case.ours([p], **case.base)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert opt.step(closure) is not None


def _signature_flags(case, names):
    params = inspect.signature(case.ref.__init__).parameters
    return [n for n in names if n in params]


# roundpipe's own options (compact storage, roundpipe.optim.compact): keyword-only, after
# torch's, with defaults that change nothing.
EXTRA_OPTIONS = {"state_dtype": torch.float32, "stochastic_rounding": False, "seed": None}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_signature_matches_torch(case):
    ours = inspect.signature(case.ours.__init__).parameters
    ref = inspect.signature(case.ref.__init__).parameters
    assert list(ours) == list(ref) + list(EXTRA_OPTIONS)
    for name, default in EXTRA_OPTIONS.items():
        assert ours[name].kind == inspect.Parameter.KEYWORD_ONLY and ours[name].default is default
    for name, p in ref.items():
        assert ours[name].kind == p.kind, name
        if p.default is not inspect.Parameter.empty:
            assert ours[name].default == p.default, name


@pytest.mark.parametrize("case", CASES, ids=str)
def test_foreach_and_fused_warn_and_are_ignored(case):
    for flag in _signature_flags(case, ["foreach", "fused"]):
        (p,) = make_params([(4,)])
        with pytest.warns(UserWarning, match=flag):
            opt = case.ours([p], **case.base, **{flag: True})
        assert opt.param_groups[0][flag] is None


@pytest.mark.parametrize("case", CASES, ids=str)
def test_capturable_and_differentiable_are_errors(case):
    for flag in _signature_flags(case, ["capturable", "differentiable"]):
        (p,) = make_params([(4,)])
        with pytest.raises(ValueError, match=flag):
            case.ours([p], **case.base, **{flag: True})
        opt = case.ours([p], **case.base)
        opt.param_groups[0][flag] = True  # as from a loaded state dict
        p.grad = torch.ones(4)
        before = p.detach().clone()
        with pytest.raises(ValueError, match=flag):
            opt.step()
        assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("case,kwargs", [
    pytest.param(c, kw, id=f"{c}-{i}") for c in CASES for i, kw in enumerate(c.invalid)])
def test_hyperparameter_validation_matches_torch(case, kwargs):
    (p,) = make_params([(4,)])
    with pytest.raises(Exception) as ref:
        case.ref([p], **kwargs)
    with pytest.raises(type(ref.value)) as ours:
        case.ours([p], **kwargs)
    assert str(ours.value) == str(ref.value)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sparse_gradient_is_a_runtime_error(case):
    (p,) = make_params([(4,)])
    p.grad = torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        case.ours([p], **case.base).step()


@pytest.mark.parametrize("bad", ["float64", "noncontiguous", "grad_shape", "state_dtype",
                                 "state_shape"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_tensors_raise_before_any_change(case, bad):
    good, other = make_params([(4, 4), (4, 4)])
    for p in (good, other):
        p.grad = torch.ones(4, 4)
    opt = case.ours([good, other], **case.base)
    if bad == "float64":
        other.data = other.data.double()
        other.grad = torch.ones(4, 4, dtype=torch.float64)
    elif bad == "noncontiguous":
        other.data = other.data.t()
    elif bad == "grad_shape":
        other.data = other.data.reshape(16)  # the grad stays (4, 4)
    else:
        opt.step()  # creates the state; then corrupt it as a bad checkpoint would
        key = next(k for k, v in opt.state[other].items() if torch.is_tensor(v) and v.dim() > 0)
        opt.state[other][key] = (torch.zeros(4, 4, dtype=torch.float64) if bad == "state_dtype"
                                 else torch.zeros(5))
    snapshot = [good.detach().clone(), other.detach().clone()]
    state_before = {k: v.clone() for k, v in opt.state[good].items() if torch.is_tensor(v)}
    with pytest.raises((TypeError, ValueError)) as err:
        opt.step()
    assert "param group 0" in str(err.value) and "[1]" in str(err.value), str(err.value)
    assert torch.equal(good.detach(), snapshot[0]) and torch.equal(other.detach(), snapshot[1])
    for k, v in state_before.items():
        assert torch.equal(opt.state[good][k], v), k


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_step_of_another_dtype_in_a_checkpoint_is_accepted_as_in_torch(case, dtype):
    # torch keeps a loaded `step` in the dtype it was saved in (int64 from integer counters,
    # float64) and steps on from it; we convert it to float32 and compute the same.
    params = make_params([(5,)])
    opt = case.ours(params, **case.base)
    _train(opt, params, 2, seed=1)
    sd = opt.state_dict()
    for st in sd["state"].values():
        for k in case.ours._scalar_keys:
            if k in st and (k == "step" or dtype.is_floating_point):
                st[k] = st[k].to(dtype)
    resumed = []
    for cls in (case.ours, case.ref):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        o = cls(ps, **case.base)
        o.load_state_dict(copy.deepcopy(sd))
        _train(o, ps, 3, seed=2)
        resumed.append((ps, o))
    (po, oo), (pr, _) = resumed
    for a, b in zip(po, pr):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(v.dtype == torch.float32 for st in oo.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() == 0)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_state_missing_a_key_behaves_as_in_torch(case):
    # torch creates a parameter's state only when it has none; state lacking a key the group
    # needs (a damaged checkpoint) is a KeyError naming it (SGD's missing momentum_buffer is
    # created anew). Ours must do the same, with nothing modified when it raises.
    (probe,) = make_params([(6,)])
    probe_opt = case.ours([probe], **case.base)
    probe.grad = torch.ones(6)
    probe_opt.step()
    for key in list(probe_opt.state[probe]):
        if case.name == "Adafactor" and key != "step":
            continue  # torch: an AssertionError deep in the update (tests/test_adafactor.py)
        outcomes = []
        for cls in (case.ours, case.ref):
            (p,) = make_params([(6,)])
            opt = cls([p], **case.base)
            _train(opt, [p], 2, seed=3)
            del opt.state[p][key]
            before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
            p.grad = torch.ones(6)
            try:
                opt.step()
                outcomes.append(("stepped", p.detach().clone()))
            except KeyError as e:
                outcomes.append(("KeyError", e.args))
                if cls is case.ours:
                    assert torch.equal(p.detach(), before[0]), key
                    assert opt.state[p].keys() == before[1].keys(), key
                    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())
        (kind_o, value_o), (kind_r, value_r) = outcomes
        assert kind_o == kind_r, f"{key}: ours {kind_o}, torch {kind_r}"
        if kind_o == "KeyError":
            assert value_o == value_r
        else:
            torch.testing.assert_close(value_o, value_r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [c for c in CASES if "weight_decay" in
                                  inspect.signature(c.ref.__init__).parameters], ids=str)
def test_weight_decay_that_rounds_to_zero_in_float32_applies_as_in_torch(case):
    # torch decides `weight_decay != 0` on the Python float and rounds the coefficient to float32
    # only inside the op: 1e-50 adds 0 * p to the gradient, NaN where p is inf, and so must we
    # (every algorithm through one shared opening, kernels/gradient.hpp).
    kwargs = dict(case.base, weight_decay=1e-50)
    results = []
    for cls in (case.ours, case.ref):
        (p,) = make_params([(19,)])
        with torch.no_grad():
            p[3], p[11] = float("inf"), -float("inf")
        opt = cls([p], **kwargs) if cls is case.ours else cls([p], foreach=False, **kwargs)
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            p.grad = torch.randn(19, generator=gen)
            opt.step()
        results.append((p.detach().clone(), opt.state[p]))
    (po, so), (pr, sr) = results
    assert torch.equal(po.isnan(), pr.isnan())
    torch.testing.assert_close(po, pr, rtol=1e-5, atol=1e-6, equal_nan=True)
    for k, v in sr.items():
        torch.testing.assert_close(so[k], v, rtol=1e-5, atol=1e-6, equal_nan=True, msg=k)


def test_the_references_square_root_is_correctly_rounded():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(20000, generator=gen) * 10
    exact = torch.tensor([math.sqrt(v) for v in x.tolist()], dtype=torch.float32)
    with ieee_sqrt():
        results = [torch.sqrt(x), x.sqrt(), x.clone().sqrt_(), x[7].sqrt()]
    for r in results[:3]:
        assert torch.equal(r, exact)
    assert torch.equal(results[3], exact[7])
