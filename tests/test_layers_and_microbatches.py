"""What the pipeline does with layers and microbatches (what stays on a device:
test_device_bound.py): inference and eval mode (BatchNorm statistics per microbatch), layer decisions kept for
the recomputation, splitting and merging microbatches (and a custom split), repeated layers,
Sequential subclasses and tied weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import RoundPipe

from pipeline_models import batchnorm, data, loss_fn, mlp


def test_inference_forward_and_eval_mode():
    torch.manual_seed(0)
    net = batchnorm()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, num_microbatch=3)
    x, _ = data("batchnorm", 0)
    model.eval()
    ref.eval()
    assert not net.training
    torch.testing.assert_close(model(x), ref(x))
    # train-mode forward updates the host's BatchNorm statistics per microbatch
    model.train()
    ref.train()
    model(x)
    with torch.no_grad():
        for xm in torch.tensor_split(x, 3):
            ref(xm)
    torch.testing.assert_close(net[1].running_mean, ref[1].running_mean)

class Router(nn.Module):
    """Takes one of two paths, chosen by a counter that changes on every call: the
    recomputation must reuse the first run's choice, which it keeps with save_for_recompute."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        if roundpipe.doing_recompute():
            (choice,) = roundpipe.get_recompute_data()
        else:
            self.calls += 1
            choice = self.calls % 2
            roundpipe.save_for_recompute(choice)
        return self.a(x) if choice else self.b(x)

def test_recompute_helpers_keep_layer_decisions():
    net = nn.Sequential(Router(), nn.ReLU(), nn.Linear(8, 4))
    model = RoundPipe(net, num_microbatch=2)
    x, y = data("mlp", 0)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    grads = model.accumulated_grads()
    # microbatch 0 took path a (calls=1), microbatch 1 path b (calls=2): both got gradients
    assert grads["0.a.weight"] is not None and grads["0.b.weight"] is not None
    with pytest.raises(RuntimeError, match="outside"):
        roundpipe.save_for_recompute(1)
    with pytest.raises(RuntimeError, match="outside"):
        roundpipe.get_recompute_data()
    assert not roundpipe.doing_recompute()

def test_microbatch_split_and_merge_and_custom_split():
    args = (torch.arange(10).reshape(5, 2), "flag", torch.ones(3))
    parts = roundpipe.split_microbatches(args, {"mask": torch.zeros(5)}, torch.arange(5), 2)
    assert [p[0][0].shape[0] for p in parts] == [3, 2]
    assert parts[1][0][1] == "flag" and parts[1][0][2].shape == (3,)   # not batched: replicated
    assert torch.equal(parts[1][2], torch.tensor([3, 4]))
    assert len(roundpipe.split_microbatches(args, {}, None, 9)) == 5     # at most one row each
    merged = roundpipe.merge_outputs([{"a": torch.ones(2, 1)}, {"a": torch.zeros(1, 1)}])
    assert merged["a"].shape == (3, 1)
    seen = []

    def split_fn(a, k, label, n):
        seen.append(n)
        return roundpipe.split_microbatches(a, k, label, n)

    model = RoundPipe(mlp(), split_fn=split_fn, num_microbatch=3)
    x, y = data("mlp", 0)
    loss, out = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn,
                                       return_outputs=True)
    assert seen == [3] and out.shape == (6, 4)

def test_repeated_layers_sequential_subclasses_and_tied_weights():
    x = torch.randn(4, 8)
    shared = nn.Linear(8, 8)
    net = nn.Sequential(shared, nn.Tanh(), shared)            # one module, run twice
    model = RoundPipe(net)
    model.eval()
    torch.testing.assert_close(model(x), net(x))

    class Residual(nn.Sequential):                             # its own forward: one layer
        def forward(self, x):
            return x + super().forward(x)

    res = Residual(nn.Linear(8, 8), nn.Tanh())
    model = RoundPipe(res)
    model.eval()
    torch.testing.assert_close(model(x), res(x))

    emb = nn.Embedding(16, 8)
    head = nn.Linear(8, 16, bias=False)
    head.weight = emb.weight                                   # tied across stages
    model = RoundPipe(nn.Sequential(emb, nn.Tanh(), head).to(torch.bfloat16),
                      optim_dtype=torch.float32)
    with torch.no_grad():
        next(model.optim_parameters()).add_(1e-3)              # not representable in bf16
    sd = model.state_dict()
    assert sd["0.weight"].dtype == torch.float32 and torch.equal(sd["0.weight"], sd["2.weight"])


def test_a_weight_tied_inside_one_layer_trains_through_both_uses_as_in_pytorch():
    """One layer holding one parameter in two submodules (and one buffer in two): RoundPipe
    swaps the device copy in at both places, so the gradient sums over both uses and the
    buffer both read is the one uploaded, as plain PyTorch computes them."""

    class TiedInside(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.b.weight = self.a.weight
            self.a.register_buffer("shift", torch.full((8,), 0.25))
            self.b.register_buffer("shift", self.a.shift)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x) + self.a.shift)) - self.b.shift

    torch.manual_seed(0)
    net = nn.Sequential(TiedInside(), nn.Linear(8, 4))
    ref = copy.deepcopy(net)
    model = RoundPipe(net, num_microbatch=2)
    opt = roundpipe.optim.SGD(model.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = data("mlp", step)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(opt)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach())
    model.synchronize()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    assert net[0].b.weight is net[0].a.weight  # the tie survives the calls
