"""RMSprop-specific behaviour; what every optimizer shares is in test_optimizers.py."""

from __future__ import annotations

import torch

import roundpipe.optim as rpo
from conftest import make_params


def test_negative_centered_variance_gives_nan_where_torch_does():
    # square_avg - grad_avg**2 < 0 (rounding can cause it; here a loaded state does): torch
    # takes the square root unclamped, and so do we.
    results = []
    for cls in (rpo.RMSprop, torch.optim.RMSprop):
        (p,) = make_params([(19,)])
        opt = cls([p], lr=0.1, alpha=0.9, centered=True)
        p.grad = torch.zeros(19)
        p.grad[:10] = 5.0
        opt.step()  # creates the state
        opt.state[p]["grad_avg"].fill_(1.0)
        opt.state[p]["square_avg"].zero_()
        opt.step()
        results.append(p.detach().clone())
    ours, ref = results
    assert torch.equal(ours.isnan(), ref.isnan()) and ours.isnan().any() and not ours.isnan().all()
    torch.testing.assert_close(ours, ref, equal_nan=True)


def test_momentum_switched_on_later_creates_its_buffer():
    # torch raises KeyError('momentum_buffer') here; we create the buffer (zeros, as torch would
    # have at the first step), which gives torch's results for a state that had it.
    (a,) = make_params([(5,)])
    b = torch.nn.Parameter(a.detach().clone())
    opt = rpo.RMSprop([a], lr=0.01)
    ref = torch.optim.RMSprop([b], lr=0.01, foreach=False)
    a.grad, b.grad = torch.ones(5), torch.ones(5)
    opt.step()
    ref.step()
    opt.param_groups[0]["momentum"] = 0.9
    ref.param_groups[0]["momentum"] = 0.9
    ref.state[b]["momentum_buffer"] = torch.zeros(5)
    opt.step()
    ref.step()
    assert torch.equal(opt.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"])
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
