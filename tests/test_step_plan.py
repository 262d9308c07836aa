"""step() through a param group's cached StepPlan (bindings/step_plan.hpp: tensors checked once,
re-checked only where they can change) keeps every drop-in guarantee: each change a user can make
between steps is seen, and the results stay those of torch.optim (which reads everything afresh
at every step) — replaced .data, state tensors, state dicts, param lists and groups, gradients
replaced or reused, bad tensors refused before anything changes. (State tensors are known by
identity: replacing one in its dict is seen, resizing one in place is not — see the plan's
header.)"""

from __future__ import annotations

import copy

import pytest
import torch

import roundpipe.optim as rpo
from conftest import ieee_sqrt

KINDS = [("Adam", dict(lr=1e-2, weight_decay=0.1)), ("SGD", dict(lr=1e-2, momentum=0.9)),
         ("NAdam", dict(lr=1e-2)), ("Adafactor", dict(lr=1e-2))]


def pair(name, kwargs, shapes=((5, 4), (7,), (3, 3))):
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return (ours, getattr(rpo, name)(ours, **kwargs)), (ref, getattr(torch.optim, name)(ref, **kwargs))


def step_both(a, b, gen, grads=None, set_grads=True):
    (pa, oa), (pb, ob) = a, b
    if set_grads:
        for x, y in zip(pa, pb):
            g = torch.randn(x.shape, generator=gen) if grads is None else grads(x)
            x.grad, y.grad = g.clone(), g.clone()
    oa.step()
    with ieee_sqrt():
        ob.step()


def assert_same(a, b):
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(pa, pb):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        for k, v in ob.state[y].items():
            torch.testing.assert_close(oa.state[x][k], v, rtol=1e-5, atol=1e-6, msg=k)


def run(name, kwargs, change, steps_after=3):
    a, b = pair(name, kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        step_both(a, b, gen)
    change(a)
    change(b)
    for _ in range(steps_after):
        step_both(a, b, gen)
        assert_same(a, b)


@pytest.mark.parametrize("name,kwargs", KINDS, ids=[k[0] for k in KINDS])
def test_replaced_data_is_stepped(name, kwargs):
    def change(side):
        params, _ = side
        params[0].data = params[0].detach() * 2 + 1      # new storage, same shape

    run(name, kwargs, change)


@pytest.mark.parametrize("name,kwargs", KINDS[:3], ids=[k[0] for k in KINDS[:3]])
def test_replaced_state_tensors_and_dicts_are_used(name, kwargs):
    def change(side):
        params, opt = side
        key = next(k for k, v in opt.state[params[0]].items() if v.dim() > 0)
        opt.state[params[0]][key] = opt.state[params[0]][key].clone() * 0.5
        opt.state[params[1]] = {k: v.clone() for k, v in opt.state[params[1]].items()}
        del opt.state[params[2]]                           # created afresh, as torch does

    run(name, kwargs, change)


@pytest.mark.parametrize("name,kwargs", KINDS, ids=[k[0] for k in KINDS])
def test_load_state_dict_and_add_param_group(name, kwargs):
    a, b = pair(name, kwargs)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        step_both(a, b, gen)
    a[1].load_state_dict(copy.deepcopy(b[1].state_dict()))  # torch's state into ours (a copy:
    # loading keeps float32 tensors as they are, which would share them with torch's optimizer)
    extra = [torch.nn.Parameter(torch.randn(6, 2, generator=gen))]
    a[0].append(extra[0])
    a[1].add_param_group({"params": extra})
    twin = torch.nn.Parameter(extra[0].detach().clone())
    b[0].append(twin)
    b[1].add_param_group({"params": [twin]})
    for _ in range(3):
        step_both(a, b, gen)
        assert_same(a, b)


@pytest.mark.parametrize("name,kwargs", KINDS, ids=[k[0] for k in KINDS])
def test_param_lists_changed_in_place(name, kwargs):
    gen = torch.Generator().manual_seed(3)

    def change(side):
        params, opt = side
        group = opt.param_groups[0]["params"]
        group[1] = params[1] = torch.nn.Parameter(torch.ones(7) * 3)   # replaced in place
        group.pop(2)
        params.pop(2)

    run(name, kwargs, change)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("name,kwargs", KINDS, ids=[k[0] for k in KINDS])
def test_gradients_new_or_reused(name, kwargs, set_to_none):
    # real backward passes: new gradient tensors, or the same ones accumulated in place
    a, b = pair(name, kwargs)
    gen = torch.Generator().manual_seed(4)
    for _ in range(4):
        x = torch.randn(3, generator=gen)
        for params, opt in (a, b):
            opt.zero_grad(set_to_none=set_to_none)
            loss = sum((p.flatten()[:3] * x).sum() ** 2 for p in params)
            loss.backward()
        step_both(a, b, gen, set_grads=False)
        assert_same(a, b)


def test_gradients_that_come_and_go():
    a, b = pair("Adam", dict(lr=1e-2))
    gen = torch.Generator().manual_seed(5)
    for k in range(6):
        step_both(a, b, gen)
        for params, _ in (a, b):
            params[k % 3].grad = None                       # skipped, as in torch
        a[1].step()
        with ieee_sqrt():
            b[1].step()
        assert_same(a, b)


@pytest.mark.parametrize("bad", ["noncontiguous_grad", "param_transposed", "param_float64",
                                 "param_resized"])
def test_bad_changes_are_refused_before_anything_changes(bad):
    gen = torch.Generator().manual_seed(6)
    params = [torch.nn.Parameter(torch.randn(4, 5, generator=gen)) for _ in range(2)]
    opt = rpo.Adam(params, lr=1e-2)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    p = params[1]
    if bad == "noncontiguous_grad":
        p.grad = torch.randn(5, 4, generator=gen).t()
    elif bad == "param_transposed":
        with torch.no_grad():
            p.t_()                                          # an in-place view op: non-contiguous
    elif bad == "param_float64":
        p.data = p.detach().double()
    else:
        p.data = torch.randn(3, generator=gen)              # its state no longer fits
    before = [(q.detach().clone(), {k: v.clone() for k, v in opt.state[q].items()}) for q in params]
    with pytest.raises((TypeError, ValueError)):
        opt.step()
    for q, (value, state) in zip(params, before):
        assert torch.equal(q.detach(), value)
        assert all(torch.equal(opt.state[q][k], v) for k, v in state.items())


def test_autograd_sees_each_planned_step():
    p = torch.nn.Parameter(torch.randn(4))
    opt = rpo.SGD([p], lr=0.1)
    for _ in range(3):
        y = (p * 2).sum()                                   # saves nothing of p: fine
        z = (p * p).sum()                                   # saves p
        p.grad = torch.ones(4)
        opt.step()
        y.backward()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.backward()


def test_a_plan_survives_pickling_and_copies():
    import pickle

    a, b = pair("Adam", dict(lr=1e-2))
    gen = torch.Generator().manual_seed(7)
    step_both(a, b, gen)
    assert "_plans" in a[1].__dict__
    clone = copy.deepcopy(a[1])
    assert "_plans" not in clone.__dict__
    pickle.loads(pickle.dumps(a[1]))
