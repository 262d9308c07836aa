"""roundpipe._C refuses what it cannot update in place: no silent conversion to a temporary."""

from __future__ import annotations

import pytest
import torch

from roundpipe import _C


def _args(param, grad=None):
    grad = torch.ones(param.shape, dtype=param.dtype) if grad is None else grad
    zeros = lambda: torch.zeros(param.shape, dtype=torch.float32)  # noqa: E731
    return [param], [grad], [[zeros()], [zeros()], []], [[torch.tensor(0.0)]]


def _step(param, grad=None):
    o = _C.AdamOptions()
    o.lr = 0.1
    _C.adam_step(o, *_args(param, grad))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_wrong_dtype_raises_and_leaves_the_tensor_unchanged(dtype):
    p = torch.ones(8, dtype=dtype)
    with pytest.raises(TypeError, match=r"params\[0\] must be float32"):
        _step(p)
    assert torch.equal(p, torch.ones(8, dtype=dtype))


def test_transposed_param_raises_and_leaves_the_tensor_unchanged():
    p = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    before = p.clone()
    with pytest.raises(ValueError, match=r"params\[0\] must be contiguous"):
        _step(p, torch.ones(4, 3))
    assert torch.equal(p, before)


def test_wrongly_sized_grad_and_state_raise():
    p = torch.ones(8)
    with pytest.raises(ValueError, match=r"grads\[0\] must have the shape of params\[0\]"):
        _step(p, torch.ones(9))
    params, grads, states, steps = _args(p)
    states[1] = [torch.zeros(7)]
    with pytest.raises(ValueError, match=r"exp_avg_sq\[0\]"):
        _C.adam_step(_C.AdamOptions(), params, grads, states, steps)
    steps = [[torch.zeros(2)]]
    with pytest.raises(ValueError, match=r"step\[0\] must hold one element"):
        _C.adam_step(_C.AdamOptions(), params, grads, _args(p)[2], steps)
    assert torch.equal(p, torch.ones(8))


def test_list_lengths_and_none_entries():
    p = torch.ones(4)
    params, grads, states, steps = _args(p)
    with pytest.raises(ValueError, match="grads has 2 tensors, params has 1"):
        _C.adam_step(_C.AdamOptions(), params, grads * 2, states, steps)
    with pytest.raises(ValueError, match=r"grads\[0\] is None"):
        _C.adam_step(_C.AdamOptions(), params, [None], states, steps)
    # A None param is skipped, with None in every other list.
    _C.adam_step(_C.AdamOptions(), [None], [None], [[None], [None], []], [[None]])


def test_amsgrad_needs_its_state_and_options_are_checked():
    p = torch.ones(4)
    o = _C.AdamOptions()
    o.amsgrad = True
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        _C.adam_step(o, *_args(p))
    o = _C.AdamOptions()
    o.beta2 = 1.0
    with pytest.raises(ValueError, match="beta2"):
        _C.adam_step(o, *_args(p))
    assert torch.equal(p, torch.ones(4))


def test_parameter_that_requires_grad_is_updated_in_place():
    p = torch.nn.Parameter(torch.ones(4))
    with torch.no_grad():
        _C.adam_step(_C.AdamOptions(), *_args(p))
    assert torch.all(p < 1)


def test_a_slot_list_left_empty_is_not_passed():
    # SGD without momentum takes no buffer and no flag; a step that needs a slot names it.
    p = torch.ones(4)
    o = _C.SGDOptions()
    o.lr = 0.5
    _C.sgd_step(o, [p], [torch.ones(4)], [], [])
    assert torch.equal(p, torch.full((4,), 0.5))
    o.momentum = 0.9
    with pytest.raises(ValueError, match="momentum_buffer_ready"):
        _C.sgd_step(o, [p], [torch.ones(4)], [[torch.zeros(4)]], [])
    with pytest.raises(ValueError, match=r"tensors\[0\]\.step is null"):
        _C.adam_step(_C.AdamOptions(), [p], [torch.ones(4)], _args(p)[2], [[]])
    with pytest.raises(ValueError, match="at most 1 state lists and 1 scalar lists"):
        _C.sgd_step(o, [p], [torch.ones(4)], [[]], [[], []])
    assert torch.equal(p, torch.full((4,), 0.5))
