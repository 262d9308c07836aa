"""The public reads and writes that replaced private access (issue 28): hyperparameter
snapshots, a RoundPipe's shard rows and model-copy write-back, and the fast ``tree_map``, each
against an independent reference (torch.optim, torch's rounding, torch's pytree)."""

import collections

import pytest
import torch
from torch import nn
from torch.utils import _pytree

import roundpipe
import roundpipe.optim as rpo
from roundpipe.torch_private import tree_map


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(5, 3, generator=g)), nn.Parameter(torch.randn(3, generator=g))]


@pytest.mark.parametrize("make", [
    lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
    lambda ps, lr: rpo.AdamW(ps, lr=lr),
], ids=["torch-SGD", "roundpipe-AdamW"])
def test_frozen_copy_steps_with_the_hyperparameters_it_was_made_with(make):
    ps, ref_ps = _params(), _params()
    opt, ref = make(ps, 0.1), make(ref_ps, 0.1)
    twin = opt.frozen_copy() if isinstance(opt, rpo.CpuOptimizer) else rpo.frozen_copy(opt)
    opt.param_groups[0]["lr"] = 5.0                  # a scheduler, after the copy was made
    for step in range(2):
        for p, q in zip(ps, ref_ps):
            g = torch.full_like(p, 0.5 + step)
            p.grad, q.grad = g.clone(), g.clone()
        twin.step()
        ref.step()
    for p, q in zip(ps, ref_ps):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # lr 0.1 both times, shared state
    assert opt.state[ps[0]] is twin.state[ps[0]]
    assert opt.param_groups[0]["lr"] == 5.0


def test_frozen_copy_clones_a_tensor_lr():
    ps = _params()
    opt = torch.optim.SGD(ps, lr=torch.tensor(0.1))
    twin = rpo.frozen_copy(opt)
    opt.param_groups[0]["lr"].fill_(3.0)                 # changed in place
    assert float(twin.param_groups[0]["lr"]) == pytest.approx(0.1)


def test_state_keys_and_rounding_calls_are_public():
    ps = _params()
    ref = torch.optim.AdamW(ps, lr=0.1, amsgrad=True)  # every state tensor the algorithm has
    for p in ps:
        p.grad = torch.ones_like(p)
    ref.step()
    shaped = {k for k, v in ref.state[ps[0]].items() if v.shape == ps[0].shape}
    assert set(rpo.AdamW(_params(), lr=0.1).state_keys) == shaped
    sgd = rpo.SGD(_params(), lr=0.1)
    sgd.rounding_calls = 7
    assert sgd.rounding_calls == 7 and sgd.state_dict()["rounding_calls"] == 7
    with pytest.raises(ValueError, match="rounding_calls"):
        sgd.rounding_calls = -1


def test_optim_shard_rows_without_a_process_group_are_whole():
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = roundpipe.RoundPipe(net)
    rows = model.optim_shard_rows()
    assert list(rows) == [n for n, _ in model.optim_named_parameters()]
    assert all(r is None for r in rows.values())
    assert model.host_process_group is None


def test_sync_model_copies_rounds_the_optimizer_copies_into_the_model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(torch.bfloat16)
    model = roundpipe.RoundPipe(net, optim_dtype=torch.float32)
    with torch.no_grad():
        for _, o in model.optim_named_parameters():
            o.add_(torch.randn_like(o) * 1e-2)
    model.sync_model_copies()
    params = dict(model.module.named_parameters())
    for name, o in model.optim_named_parameters():
        assert torch.equal(params[name], o.detach().to(torch.bfloat16)), name
    # the next step trains from the optimizer copies (not re-read from the model copies)
    x = torch.randn(4, 4, dtype=torch.bfloat16)
    model.forward_backward(input_args=(x,), loss_fn=lambda out: out.float().square().mean())
    before = {n: o.detach().clone() for n, o in model.optim_named_parameters()}
    with pytest.warns(UserWarning, match="changed none"):
        model.step(lambda: None)                        # reads nothing, changes nothing
    for name, o in model.optim_named_parameters():
        assert torch.equal(o, before[name]), name


_NT = collections.namedtuple("_NT", "a b")


@pytest.mark.parametrize("tree", [
    torch.ones(2),
    (torch.ones(1), [2, None, {"b": torch.zeros(1), "a": 3}]),
    None, 5, "s", {"x": (None,)}, [], (), {},
    _NT(torch.ones(1), [1]),
    collections.OrderedDict(a=torch.ones(1), b=[torch.zeros(2)]),
    nn.Parameter(torch.ones(1)),
], ids=lambda t: type(t).__name__)
def test_tree_map_is_pytrees(tree):
    def fn(x):
        return ("leaf", tuple(x.shape) if isinstance(x, torch.Tensor) else x)

    ours, ref = tree_map(fn, tree), _pytree.tree_map(fn, tree)
    assert ours == ref and type(ours) is type(ref)
