"""RMSprop-specific behaviour; what every optimizer shares is in test_optimizers.py."""

from __future__ import annotations

import pytest
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


def test_momentum_switched_on_later_is_torchs_key_error():
    # torch creates momentum_buffer only with the rest of a parameter's state: switching momentum
    # on later is KeyError('momentum_buffer') there, and here, before anything changes.
    errors = []
    for cls in (rpo.RMSprop, torch.optim.RMSprop):
        (p,) = make_params([(5,)])
        opt = cls([p], lr=0.01)
        p.grad = torch.ones(5)
        opt.step()
        opt.param_groups[0]["momentum"] = 0.9
        before = p.detach().clone()
        with pytest.raises(KeyError) as err:
            opt.step()
        assert torch.equal(p.detach(), before)
        errors.append(err.value.args)
    assert errors[0] == errors[1] == ("momentum_buffer",)
