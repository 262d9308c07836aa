"""Compact storage in roundpipe.optim (roundpipe.optim.compact): bfloat16 and int8 state and
bfloat16 parameters with stochastic rounding, against references written here:

- int8 state: each step equals torch.optim's step (float32, foreach=False) taken from the
  values the state reads back as, then quantised by the dynamic map of tests/dynamic_map_reference.py
  (nearest code, float32-rounded midpoints); bfloat16 state: each stored value is one of the two
  bfloat16 neighbours of that step's float32 result;
- quantisation round trips bounded by the block's scale; stochastic rounding unbiased;
- bfloat16 parameters: tiny updates that rounding to nearest would lose move them by their
  expected amount; step() and fused_step() give the same bits; reproducible from the seed,
  whatever the thread count;
- state_dict: compact form round trip, float32 form loaded by torch.optim, torch's checkpoints
  loaded into compact optimizers; errors.
"""

from __future__ import annotations

import copy

import pytest
import torch

import roundpipe.optim as rpo
from roundpipe import _C
from conftest import ieee_sqrt
from dynamic_map_reference import BOUNDS, MAPS, reference_dequantize, reference_quantize


def test_dynamic_maps_match_their_definition():
    for is_signed in (True, False):
        assert torch.equal(rpo.compact.dynamic_map(is_signed), MAPS[is_signed])


@pytest.mark.parametrize("is_signed", [True, False])
def test_quantize_round_trip_is_bounded_by_the_block_scale(isa, is_signed):
    gen = torch.Generator().manual_seed(0)
    for scale in (1.0, 3e-3, 5e4, 1e-35):
        x = scale * 10 ** (-8 * torch.rand(5 * 256 + 77, generator=gen))
        if is_signed:
            x[::3] *= -1
        codes, absmax = rpo.compact.quantize(x, is_signed)
        want_codes, want_absmax, y = reference_quantize(x, is_signed)
        assert torch.equal(absmax, want_absmax)
        # the same code, except where y sits on a midpoint up to float32 rounding
        near = (y.view(-1, 1) - BOUNDS[is_signed].double().view(1, -1)).abs().min(1).values
        differ = codes.long().flatten() != want_codes.flatten()
        assert not (differ & (near > 1e-6 * y.abs())).any()
        back = rpo.compact.dequantize(codes, absmax, is_signed)
        assert torch.equal(back, reference_dequantize(codes, absmax, is_signed))
        err = (back.double() - x.double()).abs()
        blk = absmax.double().repeat_interleave(256)[: x.numel()]
        # the largest gap of the map is 0.9 / 64 (top decade); half of it times the scale
        assert (err <= 0.5 * 0.9 / 64 * blk + 4e-7 * x.double().abs() + 1e-45).all()


def test_stochastic_rounding_is_unbiased():
    # one value, 2^23 draws (the element index varies): mean error below 1e-3 of a step (the
    # sampling spread of the mean is at most 1.7e-4 of a step)
    for x in (1.0 + 2**-9, -0.3, 1234.567, 3e-30):
        src = torch.full((1 << 23,), x, dtype=torch.float32)
        down = src.view(torch.int32) & ~0xFFFF
        step = (down + 0x10000).view(torch.float32)[0].double() - down.view(torch.float32)[0].double()
        dst = torch.empty(src.shape, dtype=torch.bfloat16)
        _C.round_bf16_stochastic(src, 11, dst)
        mean_err = (dst.double() - src.double()).mean().abs() / step.abs()
        assert mean_err < 1e-3, (x, mean_err)


# --- compact state inside a step, against the quantised algorithm ---------------------------------

# algorithm -> kwargs whose options touch every state slot it keeps
COMPACT_CASES = [
    ("Adam", dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2)),
    ("NAdam", dict(lr=1e-2, weight_decay=0.1)),
    ("RAdam", dict(lr=1e-2, betas=(0.9, 0.99))),
    ("Adamax", dict(lr=1e-2)),
    ("RMSprop", dict(lr=1e-2, momentum=0.9)),   # centered: float32 state only (test below)
    ("SGD", dict(lr=1e-2, momentum=0.9)),
    ("Adagrad", dict(lr=1e-2, initial_accumulator_value=0.1)),
]
SHAPES = [(64, 80), (17,), (4096 + 300,)]   # int8 from 4096 elements: the middle one stays float32


def float32_state(st: dict, key: str, is_signed: bool) -> torch.Tensor:
    v = st[key]
    if v.dtype == torch.uint8:
        return reference_dequantize(v, st[key + "_absmax"], is_signed)
    return v.float()


def torch_step_from(ours, ref_cls, kwargs, params, grads):
    """torch.optim's step from our stored values (parameter and state as they read back)."""
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ref = ref_cls(ref_params, foreach=False, **kwargs)
    for p, q in zip(params, ref_params):
        st = ours.state[p]
        ref.state[q] = {k: (v.clone() if v.dim() == 0 else
                            float32_state(st, k, ours._int8_signed.get(k, True)).clone())
                        for k, v in st.items() if torch.is_tensor(v) and not k.endswith("_absmax")}
    for q, g in zip(ref_params, grads):
        q.grad = g.float().clone()
    with ieee_sqrt():
        ref.step()
    return ref, ref_params


def bf16_neighbours(x: torch.Tensor):
    bits = x.float().view(torch.int32)
    down = (bits & ~0xFFFF).view(torch.float32)
    up = torch.where((bits & 0xFFFF) != 0, ((bits & ~0xFFFF) + 0x10000).view(torch.float32), down)
    return down, up


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
@pytest.mark.parametrize("name,kwargs", COMPACT_CASES, ids=[c[0] for c in COMPACT_CASES])
def test_compact_state_steps_as_the_quantised_algorithm(name, kwargs, state_dtype):
    ours_cls, ref_cls = getattr(rpo, name), getattr(torch.optim, name)
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = ours_cls(params, **kwargs, state_dtype=state_dtype, seed=5)
    for step in range(6):
        grads = [torch.randn(p.shape, generator=gen) * (3.0 if step % 2 else 1e-3) for p in params]
        if step > 0:  # the first step creates the state (zeros: no reference state to read)
            ref, ref_params = torch_step_from(opt, ref_cls, kwargs, params, grads)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        if step == 0:
            continue
        for i, (p, q) in enumerate(zip(params, ref_params)):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"param {i}")
            st = opt.state[p]
            for key, want in ref.state[q].items():
                got = st[key]
                if want.dim() == 0:
                    assert torch.equal(got, want), key
                elif got.dtype == torch.float32:  # below the int8 size, or float32 slots
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max())
                elif got.dtype == torch.bfloat16:
                    down, up = bf16_neighbours(want)
                    g32 = got.float()
                    # one of the two neighbours of the float32 result (the float32 results of
                    # our kernel and torch's may differ in their last bits: allow those)
                    tol = 1e-6 * want.abs()
                    ok = ((g32 - down).abs() <= tol) | ((g32 - up).abs() <= tol)
                    assert ok.all(), (key, g32[~ok][:5], want[~ok][:5])
                else:
                    is_signed = opt._int8_signed[key]
                    codes, absmax, y = reference_quantize(want, is_signed)
                    torch.testing.assert_close(st[key + "_absmax"], absmax, rtol=2e-6, atol=0)
                    differ = (got.long() != codes) & ((got.long() - codes).abs() > 0)
                    near = (y.view(-1, 1) - BOUNDS[is_signed].double().view(1, -1)).abs().min(1).values
                    assert not (differ.flatten() & (near > 2e-6 * y.abs() + 1e-30)).any(), key
                    assert ((got.long() - codes).abs() <= 1).all(), key


def test_int8_state_is_kept_only_from_4096_elements_and_for_its_slots():
    small, large = torch.nn.Parameter(torch.randn(4095)), torch.nn.Parameter(torch.randn(4096))
    opt = rpo.Adam([small, large], amsgrad=True, state_dtype="int8")
    for p in (small, large):
        p.grad = torch.randn(p.shape)
    opt.step()
    assert opt.state[small]["exp_avg"].dtype == torch.float32
    assert "exp_avg_absmax" not in opt.state[small]
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert opt.state[large][key].dtype == torch.uint8
        assert opt.state[large][key + "_absmax"].shape == (16,)


# --- bfloat16 parameters ----------------------------------------------------------------------------

def test_tiny_updates_move_bf16_parameters_by_their_expected_amount():
    # each update is 1/200 of a bfloat16 step at 1.0: rounding to nearest keeps 1.0 forever;
    # stochastic rounding moves the mean by the sum of the updates (spread of the mean ~0.002)
    p = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
    lr = 2**-7 / 200
    opt = rpo.SGD([p], lr=lr, stochastic_rounding=True, seed=1)
    nearest = torch.ones(8192, dtype=torch.bfloat16)
    for _ in range(1000):
        p.grad = torch.ones_like(p)
        opt.step()
        nearest = (nearest.float() - lr).bfloat16()
    assert torch.equal(nearest, torch.ones_like(nearest))
    assert abs(p.float().mean().item() - (1 - 1000 * lr)) < 0.05 * 1000 * lr


def test_bf16_parameters_with_adamw_follow_float32_training_without_bias():
    # AdamW at lr 1e-3 moves a weight near 1 by ~1e-3 a step, an eighth of a bfloat16 step:
    # rounding to nearest after each float32 update loses most of it (the weights lag behind
    # their float32 twin by about the whole movement), stochastic rounding none of it on
    # average (its error is noise, uncorrelated with the movement).
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(50_000, generator=gen)
    p32 = torch.nn.Parameter(start.clone())
    p16 = torch.nn.Parameter(start.bfloat16())
    nearest = torch.nn.Parameter(start.bfloat16())
    a = torch.optim.AdamW([p32], lr=1e-3)
    b = rpo.AdamW([p16], lr=1e-3, stochastic_rounding=True, seed=0)
    c = torch.optim.AdamW([nearest], lr=1e-3)   # bfloat16 throughout: round to nearest
    for _ in range(200):
        g = torch.randn(p32.shape, generator=gen) + 0.5
        p32.grad, p16.grad, nearest.grad = g, g.bfloat16(), g.bfloat16()
        a.step()
        b.step()
        c.step()
    assert p16.dtype == torch.bfloat16 and b.state[p16]["exp_avg"].dtype == torch.float32
    moved = (p32.detach() - start).double()

    def lag(p):  # regression of the error on the movement: -1 when nothing moved
        err = p.detach().double() - p32.detach().double()
        return (err * moved).sum().item() / (moved * moved).sum().item()

    assert abs(lag(p16)) < 0.05, lag(p16)
    assert lag(nearest) < -0.3, lag(nearest)


def test_bf16_parameters_are_refused_without_stochastic_rounding():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    with pytest.raises(TypeError, match="stochastic_rounding=True"):
        rpo.AdamW([p]).step()
    assert torch.equal(p, before)
    with pytest.raises(TypeError, match="stochastic_rounding=True"):
        rpo.AdamW([p]).fused_step([p], [p.grad])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, "int8"])
def test_fused_step_gives_the_bits_of_step(state_dtype):
    gen = torch.Generator().manual_seed(1)
    a = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in ((70, 90), (33,))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oa = rpo.AdamW(a, lr=1e-2, stochastic_rounding=True, state_dtype=state_dtype, seed=9)
    ob = rpo.AdamW(b, lr=1e-2, stochastic_rounding=True, state_dtype=state_dtype, seed=9)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen).bfloat16() for p in a]
        for p, g in zip(a, grads):
            p.grad = g
        oa.step()
        ob.fused_step(b[::-1], grads[::-1])   # order of the call does not matter either
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for k, v in oa.state[p].items():
            assert torch.equal(v, ob.state[q][k]), k


def test_rounding_is_reproducible_from_the_seed_and_independent_of_threads():
    def run(seed, threads):
        gen = torch.Generator().manual_seed(2)
        # enough elements for 3 threads (one per 196608: kElementsPerThread, cpp/optim/parallel.hpp)
        p = torch.nn.Parameter(torch.randn(600_000, generator=gen).bfloat16())
        opt = rpo.Adam([p], stochastic_rounding=True, state_dtype=torch.bfloat16, seed=seed)
        opt.num_threads = threads
        for _ in range(3):
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
            opt.step()
        return p.detach().clone(), opt.state[p]["exp_avg"].clone()

    p1, m1 = run(4, 1)
    p2, m2 = run(4, 3)
    p3, m3 = run(5, 1)
    assert torch.equal(p1, p2) and torch.equal(m1, m2)
    assert not torch.equal(p1, p3) and not torch.equal(m1, m3)


def test_seed_none_comes_from_torch_generator_and_numpy_integers_are_ints():
    p = [torch.nn.Parameter(torch.zeros(2))]
    torch.manual_seed(7)
    s1 = rpo.Adam(p).seed
    torch.manual_seed(7)
    assert rpo.Adam(p).seed == s1
    np = pytest.importorskip("numpy")
    assert rpo.Adam(p, seed=np.int64(3)).seed == 3 and type(rpo.Adam(p, seed=np.uint64(3)).seed) is int


# --- state_dict ---------------------------------------------------------------------------------------

def trained(state_dtype, stochastic_rounding=False, steps=3):
    gen = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16 if stochastic_rounding else torch.float32
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in ((80, 60), (5,))]
    opt = rpo.AdamW(params, lr=1e-2, state_dtype=state_dtype,
                    stochastic_rounding=stochastic_rounding, seed=3)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return params, opt


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_compact_state_dict_round_trip_resumes_exactly(state_dtype):
    params, opt = trained(state_dtype, stochastic_rounding=True)
    saved = copy.deepcopy(opt.state_dict())
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = rpo.AdamW(twin_params, lr=1e-2, state_dtype=state_dtype, stochastic_rounding=True,
                     seed=3)
    twin.load_state_dict(saved)
    for p, q in zip(params, twin_params):
        for k, v in opt.state[p].items():
            assert torch.equal(v, twin.state[q][k]), k
    gen = torch.Generator().manual_seed(8)
    for p, q in zip(params, twin_params):
        p.grad = q.grad = torch.randn(p.shape, generator=gen).bfloat16()
    opt.step()
    twin.step()
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_float32_state_dict_loads_into_torch(state_dtype):
    params, opt = trained(state_dtype)
    sd = opt.state_dict(state_dtype=torch.float32)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    ref.load_state_dict(sd)
    for p, q in zip(params, ref_params):
        st = opt.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            assert ref.state[q][k].dtype == torch.float32
            want = float32_state(st, k, k == "exp_avg")
            assert torch.equal(ref.state[q][k], want), k
        assert set(ref.state[q]) == {"step", "exp_avg", "exp_avg_sq"}
    assert all(v.dtype != torch.uint8 for st in opt.state.values() for v in st.values())  \
        or state_dtype == "int8"  # our own state is untouched


def test_torch_checkpoint_loads_into_compact_optimizers():
    gen = torch.Generator().manual_seed(6)
    params = [torch.nn.Parameter(torch.randn(90, 70, generator=gen))]
    ref = torch.optim.AdamW(params, lr=1e-2)
    params[0].grad = torch.randn(params[0].shape, generator=gen)
    ref.step()
    sd = ref.state_dict()
    m = ref.state[params[0]]["exp_avg"]
    for state_dtype in (torch.bfloat16, "int8"):
        opt = rpo.AdamW(params, lr=1e-2, state_dtype=state_dtype)
        opt.load_state_dict(sd)
        st = opt.state[params[0]]
        if state_dtype == "int8":
            codes, absmax, _ = reference_quantize(m, True)
            assert st["exp_avg"].dtype == torch.uint8 and torch.equal(st["exp_avg_absmax"], absmax)
        else:
            assert torch.equal(st["exp_avg"], m.bfloat16())
        assert ref.state[params[0]]["exp_avg"].dtype == torch.float32  # the source is untouched
    # and back: an int8 checkpoint into a float32 optimizer reads back its values
    int8 = rpo.AdamW(params, lr=1e-2, state_dtype="int8")
    int8.load_state_dict(sd)
    plain = rpo.AdamW(params, lr=1e-2)
    plain.load_state_dict(int8.state_dict())
    st = int8.state[params[0]]
    assert torch.equal(plain.state[params[0]]["exp_avg"],
                       reference_dequantize(st["exp_avg"], st["exp_avg_absmax"], True))


def test_int8_codes_without_absmax_are_refused_before_anything_changes():
    params, opt = trained("int8")
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][0]["exp_avg_absmax"]
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    with pytest.raises(ValueError, match="exp_avg_absmax"):
        opt.load_state_dict(sd)
    for k, v in before.items():
        assert torch.equal(opt.state[params[0]][k], v)


def test_bad_options_are_errors():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="state_dtype"):
        rpo.Adam(p, state_dtype=torch.float16)
    with pytest.raises(ValueError, match="'int8' is not supported"):
        rpo.ASGD(p, state_dtype="int8")
    with pytest.raises(TypeError, match="stochastic_rounding"):
        rpo.Adam(p, stochastic_rounding=1)
    for seed in (-1, 2**64, 1.0, True, "1"):
        with pytest.raises(ValueError, match="seed"):
            rpo.Adam(p, seed=seed)
    with pytest.raises(ValueError, match="state_dtype"):
        rpo.Adam(p).state_dict(state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="centered"):
        rpo.RMSprop(p, centered=True, state_dtype=torch.bfloat16)
    opt = rpo.RMSprop(p, state_dtype="int8")
    opt.param_groups[0]["centered"] = True   # switched on later: refused at the step
    p[0].grad = torch.ones(2)
    with pytest.raises(ValueError, match="centered"):
        opt.step()
    assert not opt.state
