"""Adagrad-specific behaviour: torch.optim.Adagrad creates its state when constructed, from the
constructor's initial_accumulator_value; what every optimizer shares is in
test_optimizers.py."""

from __future__ import annotations

import torch

import roundpipe.optim as rpo
from conftest import make_params


def _same_state(ours_opt, ours_params, ref_opt, ref_params):
    for a, b in zip(ours_params, ref_params):
        sa, sb = ours_opt.state.get(a), ref_opt.state.get(b)
        assert (sa is None) == (sb is None)
        if sb is not None:
            assert sa.keys() == sb.keys()
            for k, v in sb.items():
                assert sa[k].dtype == v.dtype and torch.equal(sa[k], v), k


def test_state_is_created_at_construction_as_torch():
    ours = make_params([(3,), (2, 2), ()])
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    o = rpo.Adagrad(ours, initial_accumulator_value=0.25)
    r = torch.optim.Adagrad(ref, initial_accumulator_value=0.25)
    _same_state(o, ours, r, ref)
    assert o.state_dict()["state"].keys() == r.state_dict()["state"].keys() == {0, 1, 2}
    # A checkpoint taken before any step moves both ways.
    torch.optim.Adagrad(ref, initial_accumulator_value=0.25).load_state_dict(o.state_dict())
    rpo.Adagrad(ours, initial_accumulator_value=0.25).load_state_dict(r.state_dict())


def test_group_initial_accumulator_value_is_ignored_as_torch():
    # torch fills `sum` with the constructor's value, at construction and for a param group
    # added later (at its first step), whatever the group says.
    a, b, c = make_params([(3,), (4,), (5,)])
    ra, rb, rc = (torch.nn.Parameter(p.detach().clone()) for p in (a, b, c))
    o = rpo.Adagrad([{"params": [a]}, {"params": [b], "initial_accumulator_value": 2.0}],
                    initial_accumulator_value=0.5)
    r = torch.optim.Adagrad([{"params": [ra]}, {"params": [rb], "initial_accumulator_value": 2.0}],
                            initial_accumulator_value=0.5, foreach=False)
    o.add_param_group({"params": [c], "initial_accumulator_value": 3.0})
    r.add_param_group({"params": [rc], "initial_accumulator_value": 3.0})
    assert c not in o.state and rc not in r.state
    for p, q in zip((a, b, c), (ra, rb, rc)):
        p.grad = torch.ones(p.shape)
        q.grad = torch.ones(q.shape)
    o.step()
    r.step()
    _same_state(o, [a, b, c], r, [ra, rb, rc])
    assert torch.equal(o.state[b]["sum"], torch.full((4,), 1.5))
    for p, q in zip((a, b, c), (ra, rb, rc)):
        assert torch.equal(p, q)


def test_share_memory_shares_the_sums():
    (p,) = make_params([(6,)])
    o = rpo.Adagrad([p])
    o.share_memory()
    assert o.state[p]["sum"].is_shared()
