"""What is particular to roundpipe.optim.Adafactor (the generic tests against
torch.optim.Adafactor run from optimizer_cases.CASES): shapes (empty, 0-dim, batched and conv-like
tensors, the kernels' tiles), a missing factor, bfloat16 parameters, foreach."""

from __future__ import annotations

import pytest
import torch

import roundpipe.optim as rpo
from conftest import assert_same_training


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0), (2, 0, 4)])
def test_empty_parameters_count_their_step_where_torch_divides_by_zero(shape):
    p = torch.nn.Parameter(torch.randn(shape))
    opt = rpo.Adafactor([p])
    p.grad = torch.randn(shape)
    opt.step()
    opt.step()
    st = opt.state[p]
    assert st["step"].item() == 2
    assert set(st) == ({"step", "row_var", "col_var"} if len(shape) > 1 else {"step", "variance"})
    if len(shape) > 1:  # as torch creates them: the keepdim shapes of the means
        assert st["row_var"].shape == shape[:-1] + (1,)
        assert st["col_var"].shape == shape[:-2] + (1, shape[-1])
    with pytest.raises(ZeroDivisionError):  # what torch 2.13 does instead
        ref = torch.optim.Adafactor([torch.nn.Parameter(torch.randn(shape))])
        ref.param_groups[0]["params"][0].grad = torch.randn(shape)
        ref.step()


def test_conv_like_and_large_matrices_match_torch():
    # a 4-D tensor (a batch of 3x3 matrices); matrices cut into tiles of 256 rows x 4096 columns,
    # of all rows, and of whole rows (roundpipe/adafactor.hpp)
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    assert_same_training(rpo.Adafactor, torch.optim.Adafactor, kwargs, steps=3,
                         shapes=[(8, 4, 3, 3)])
    # sums over thousands of float32 squares: torch's and ours differ in the last bits of the
    # factors, which the update (lr * u) turns into ~1e-6 absolute on parameters near zero
    assert_same_training(rpo.Adafactor, torch.optim.Adafactor, kwargs, steps=3,
                         shapes=[(300, 5000), (20, 60000)], atol=3e-6)
    # torch's float32 column norm over 70000 rows is off by up to 1.7e-5 of the float64 sum
    # (ours, summed in double per 32 rows, by 1e-7: the C++ tests compare with float64)
    assert_same_training(rpo.Adafactor, torch.optim.Adafactor, kwargs, steps=3,
                         shapes=[(70000, 20)], rtol=1e-4, atol=3e-6)


@pytest.mark.parametrize("key,shape", [("row_var", (6, 4)), ("col_var", (6, 4)),
                                       ("variance", (6,))])
def test_a_missing_factor_is_named_before_anything_changes(key, shape):
    p = torch.nn.Parameter(torch.randn(shape))
    opt = rpo.Adafactor([p])
    p.grad = torch.randn(shape)
    opt.step()
    del opt.state[p][key]
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match=key):
        opt.step()
    assert torch.equal(p, before[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())


def test_bf16_parameters_step_with_float32_state_and_their_machine_epsilon():
    gen = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 90, generator=gen).bfloat16())
    b = torch.nn.Parameter(a.detach().float())
    oa = rpo.Adafactor([a], stochastic_rounding=True, seed=0)
    ob = rpo.Adafactor([b], eps=(2**-7, 1e-3))   # torch's eps1 for bfloat16 parameters
    g = torch.randn(64, 90, generator=gen)
    a.grad, b.grad = g.bfloat16(), g.bfloat16().float()
    oa.step()
    ob.step()
    assert oa.state[a]["row_var"].dtype == torch.float32
    assert torch.equal(oa.state[a]["row_var"], ob.state[b]["row_var"])
    # stochastic rounding: within one bfloat16 step of the float32 result
    step = 2.0 ** (torch.floor(torch.log2(b.detach().abs())) - 7)
    assert ((a.detach().float() - b.detach()).abs() <= step).all()


def test_state_dtype_other_than_float32_is_refused():
    with pytest.raises(ValueError, match="state_dtype"):
        rpo.Adafactor([torch.nn.Parameter(torch.zeros(3))], state_dtype="int8")
