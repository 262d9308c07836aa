"""SGD-specific behaviour: torch.optim.SGD keeps no step and creates momentum_buffer only at a
parameter's first step with momentum; what every optimizer shares is in test_optimizers.py."""

from __future__ import annotations

import copy

import pytest
import torch

import roundpipe.optim as rpo
from conftest import make_params


def _pair(shapes, **kwargs):
    ours = make_params(shapes)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, ref, rpo.SGD(ours, **kwargs), torch.optim.SGD(ref, foreach=False, **kwargs)


def _assert_same(ours, ref, o, r):
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
        assert o.state.get(a, {}).keys() == r.state.get(b, {}).keys()
        for k, v in r.state.get(b, {}).items():
            assert torch.equal(o.state[a][k], v), k


def test_without_momentum_no_state_exists():
    ours, ref, o, r = _pair([(3,), (4,)], lr=0.1, weight_decay=0.1)
    for p in ours + ref:
        p.grad = torch.ones(p.shape)
    o.step()
    r.step()
    _assert_same(ours, ref, o, r)
    assert len(o.state) == 0 and o.state_dict()["state"] == r.state_dict()["state"] == {}


def test_buffer_appears_at_first_momentum_step_as_the_decayed_gradient():
    # Dampening is not applied to the first step: the buffer is a copy of g + wd * p.
    ours, ref, o, r = _pair([(5,)], lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.25)
    (p,) = ours
    g = torch.randn(5)
    expected = g + 0.25 * p.detach()
    for q in ours + ref:
        q.grad = g.clone()
    o.step()
    r.step()
    _assert_same(ours, ref, o, r)
    torch.testing.assert_close(o.state[p]["momentum_buffer"], expected, rtol=0, atol=1e-7)


def test_momentum_switched_on_later_and_params_first_stepped_later():
    ours, ref, o, r = _pair([(6,), (7,)], lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        if step == 1:
            for opt in (o, r):
                opt.param_groups[0]["momentum"] = 0.8
        for i, (a, b) in enumerate(zip(ours, ref)):
            g = None if (i == 1 and step < 2) else torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g, None if g is None else g.clone()
        o.step()
        r.step()
        _assert_same(ours, ref, o, r)
    assert all("momentum_buffer" in o.state[p] for p in ours)


def test_failed_step_leaves_no_unfilled_buffer():
    ours, ref, o, r = _pair([(4,), (4,)], lr=0.1, momentum=0.9)
    good, bad = ours
    good.grad = torch.ones(4)
    saved = bad.data
    bad.data = saved.double()
    bad.grad = torch.ones(4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"params\[1\] must be float32"):
        o.step()
    assert "momentum_buffer" not in o.state.get(good, {})
    assert torch.equal(good, ref[0])
    bad.data = saved
    bad.grad = torch.ones(4)
    for p in ref:
        p.grad = torch.ones(4)
    o.step()
    r.step()
    _assert_same(ours, ref, o, r)


def test_torch_checkpoint_with_some_buffers_missing_continues_alike():
    ours, ref, o, r = _pair([(3,), (3,)], lr=0.1, momentum=0.9, nesterov=True)
    ref[0].grad = torch.ones(3)
    r.step()  # only ref[0] has a buffer now
    with torch.no_grad():
        for a, b in zip(ours, ref):
            a.copy_(b)
    # A copy: load_state_dict keeps the tensors it is given, which would share the buffer.
    o.load_state_dict(copy.deepcopy(r.state_dict()))
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(3, generator=gen)
            b.grad = a.grad.clone()
        o.step()
        r.step()
        _assert_same(ours, ref, o, r)


def test_tensor_weight_decay_as_torch():
    ours, ref, o, r = _pair([(9,)], lr=0.1, momentum=0.5, weight_decay=torch.tensor(0.1))
    for p in ours + ref:
        p.grad = torch.full(p.shape, 0.5)
    for _ in range(2):
        o.step()
        r.step()
    _assert_same(ours, ref, o, r)


def test_the_shared_ready_flag_is_never_written():
    from roundpipe.optim.sgd import _READY

    ours, ref, o, r = _pair([(4,), (5,)], lr=0.1, momentum=0.9)
    for p in ours:
        p.grad = torch.ones(p.shape)
    for _ in range(3):
        o.step()
    assert _READY.item() == 1.0
