"""Rprop-specific behaviour: torch's exact element-wise rules (Rprop has no sqrt and no fused
operation whose rounding could differ, so results are compared bit for bit, NaN included), and
lr as the initial step size only. What every optimizer shares is in test_optimizers.py."""

from __future__ import annotations

import pytest
import torch

import roundpipe.optim as rpo
from conftest import make_params

TINY = 1e-30    # squares underflow to 0 in float32: torch sees no sign information
HUGE = 1e30     # squares overflow to inf
NAN, INF = float("nan"), float("inf")


def edge_gradients(n, steps, seed):
    """Random gradients with NaN, +-inf, +-0, subnormals, TINY and HUGE sprinkled in."""
    gen = torch.Generator().manual_seed(seed)
    specials = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 1e-40, -1e-40, TINY, -TINY, HUGE, -HUGE])
    out = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        pick = torch.rand(n, generator=gen) < 0.3
        idx = torch.randint(len(specials), (n,), generator=gen)
        out.append(torch.where(pick, specials[idx], g))
    return out


def assert_bitwise(a, b, what):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(maximize=True, etas=(0.25, 2.0), step_sizes=(1e-3, 1.5e-2)),
    # etas that round to 1.0 in float32: torch's masks then treat every product alike and
    # `sign == etaminus` also zeroes the gradients whose product was 0.
    dict(etas=(1 - 1e-10, 1 + 1e-10)),
    # etaminus rounds to 0 in float32: torch's third mask turns it into 1 (no shrinking) and the
    # gradient is not zeroed on a sign change.
    dict(etas=(1e-46, 1.5)),
    # an infinite step size times a zeroed gradient's sign (0) is NaN in torch.
    dict(lr=INF, step_sizes=(0.0, INF)),
    # step_size_max below step_size_min: torch's clamp gives max. A NaN bound: all NaN.
    dict(step_sizes=(0.5, 0.25)),
    dict(step_sizes=(NAN, 1.0)),
    dict(step_sizes=(1e-6, NAN)),
])
def test_edge_values_match_torch_bit_for_bit(isa, kwargs):
    n = 16 * 4 + 13  # a vector body and a tail on every ISA
    ours_p = make_params([(n,)])
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = rpo.Rprop(ours_p, **kwargs)
    ref = torch.optim.Rprop(ref_p, foreach=False, **kwargs)
    for step, g in enumerate(edge_gradients(n, 12, seed=3)):
        ours_p[0].grad, ref_p[0].grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        assert_bitwise(ours_p[0], ref_p[0], f"param after step {step + 1}")
        for k in ("prev", "step_size", "step"):
            assert_bitwise(ours.state[ours_p[0]][k], ref.state[ref_p[0]][k], f"{k} after step {step + 1}")


def test_nan_gradient_freezes_parameter_and_step_size_as_in_torch():
    # torch.sign(nan) == 0: the parameter does not move, the step size is kept, and the NaN is
    # stored in prev, so the next product is NaN again and that step size is kept too.
    (p,) = make_params([(3,)])
    opt = rpo.Rprop([p], lr=0.1)
    start = p.detach().clone()
    p.grad = torch.tensor([NAN, 1.0, -1.0])
    opt.step()
    assert p[0].item() == start[0].item()
    assert torch.isnan(opt.state[p]["prev"][0])
    p.grad = torch.tensor([1.0, 1.0, 1.0])
    opt.step()
    step_size = opt.state[p]["step_size"]
    assert step_size[0].item() == pytest.approx(0.1) and step_size[1].item() == pytest.approx(0.12)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_training_matches_torch_bit_for_bit(isa, seed):
    shapes = [(), (1,), (17,), (4097,), (33, 65)]
    for kwargs in (dict(lr=1e-2), dict(lr=0.3, etas=(0.3, 1.7), step_sizes=(1e-3, 0.5),
                                       maximize=True)):
        ours_p = make_params(shapes, seed=seed)
        ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
        ours, ref = rpo.Rprop(ours_p, **kwargs), torch.optim.Rprop(ref_p, foreach=False, **kwargs)
        gen = torch.Generator().manual_seed(seed + 10)
        for _ in range(15):
            for a, b in zip(ours_p, ref_p):
                a.grad = torch.randn(a.shape, generator=gen)
                b.grad = a.grad.clone()
            ours.step()
            ref.step()
        for a, b in zip(ours_p, ref_p):
            assert_bitwise(a, b, "param")
            for k in ("prev", "step_size"):
                assert_bitwise(ours.state[a][k], ref.state[b][k], k)


@pytest.mark.parametrize("lr", [0.1, torch.tensor(0.1), torch.tensor([0.1])])
def test_lr_is_only_the_initial_step_size(lr):
    results = []
    for cls in (rpo.Rprop, torch.optim.Rprop):
        a, b = make_params([(5,), (6,)])
        opt = cls([a], lr=lr)
        a.grad = torch.ones(5)
        opt.step()
        opt.param_groups[0]["lr"] = 0.5   # later changes do not touch existing step sizes ...
        opt.add_param_group({"params": [b]})
        a.grad, b.grad = torch.ones(5), torch.ones(6)
        opt.step()                        # ... but initialise new ones
        results.append((opt.state[a]["step_size"], opt.state[b]["step_size"]))
    (oa, ob), (ra, rb) = results
    assert_bitwise(oa, ra, "step_size of the first param")
    assert_bitwise(ob, rb, "step_size of the added param")
    assert ob.dtype == torch.float32 and ob.shape == (6,)
