"""Adam-specific behaviour; what every optimizer shares is in test_optimizers.py."""

from __future__ import annotations

import pytest
import torch

import roundpipe.optim as rpo
from conftest import make_params


def test_amsgrad_switched_on_later_is_torchs_key_error():
    # A group added with amsgrad gets max_exp_avg_sq with the rest of its state; switching amsgrad
    # on for a parameter that already has state is KeyError('max_exp_avg_sq') in torch, and here,
    # before anything changes.
    errors = []
    for cls in (rpo.Adam, torch.optim.Adam):
        a, b = make_params([(5,), (6,)])
        opt = cls([a], lr=0.1)
        opt.add_param_group({"params": [b], "lr": 0.2, "amsgrad": True})
        a.grad, b.grad = torch.ones(5), torch.ones(6)
        opt.step()
        assert "max_exp_avg_sq" in opt.state[b] and "max_exp_avg_sq" not in opt.state[a]
        opt.param_groups[0]["amsgrad"] = True
        before = a.detach().clone()
        with pytest.raises(KeyError) as err:
            opt.step()
        assert torch.equal(a.detach(), before)
        errors.append(err.value.args)
    assert errors[0] == errors[1] == ("max_exp_avg_sq",)


def test_adamw_is_adam_with_decoupled_weight_decay():
    (p,) = make_params([(7,)])
    opt = rpo.AdamW([p])
    assert isinstance(opt, rpo.Adam)
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    assert opt.param_groups[0]["weight_decay"] == 1e-2
