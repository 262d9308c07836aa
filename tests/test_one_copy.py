"""One copy of the weights: ``RoundPipe(model, optim_dtype=<the model's dtype>)`` steps the model
copy itself (bfloat16 master weights: 2 bytes per weight on the host, no float32 copy).

- the optimizer's parameters *are* the module's parameters; a parameter of another dtype keeps
  a separate copy;
- float32 with one copy trains exactly as a plain PyTorch loop, in every step mode — an
  asynchronous step included, which with one copy is not stale (the next pass waits for each
  layer's update);
- bfloat16 master weights with stochastic rounding: updates far below half a bfloat16 step,
  which ``torch.optim`` on a bfloat16 parameter (round to nearest) loses entirely, move the
  weights by their expected amount through the wrapper;
- state_dict, load_state_dict and deepcopy keep the one copy.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

import roundpipe
import roundpipe.optim as rpo
from roundpipe import RoundPipe

from pipeline_models import data, loss_fn, mlp, reference_forward_backward


def test_the_optimizer_steps_the_model_parameters_themselves():
    net = mlp()
    model = RoundPipe(net, optim_dtype=torch.float32)
    assert [id(p) for p in model.optim_parameters()] == [id(p) for p in net.parameters()]
    bf16 = mlp().to(torch.bfloat16)
    model = RoundPipe(bf16, optim_dtype=torch.bfloat16)
    assert [id(p) for p in model.optim_parameters()] == [id(p) for p in bf16.parameters()]
    # default (None): a separate copy even of the same dtype (an asynchronous step computes
    # with the older one meanwhile)
    model = RoundPipe(mlp())
    assert not {id(p) for p in model.optim_parameters()} & {id(p) for p in model.module.parameters()}
    # a parameter of another dtype keeps its own copy in optim_dtype
    mixed = mlp().to(torch.bfloat16)
    mixed[4].float()
    model = RoundPipe(mixed, optim_dtype=torch.bfloat16)
    same = [o is p for o, p in zip(model.optim_parameters(), mixed.parameters())]
    assert same == [True, True, True, True, False, False]
    assert all(o.dtype == torch.bfloat16 for o in model.optim_parameters())


def _train_call(model, opt, x, y, exact: bool) -> None:
    """One training call: exact mode (the step in the backward), or forward_backward + step."""
    if exact:
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=opt)
    else:
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(opt)


class SlowAdam(rpo.Adam):
    """Adam whose per-layer steps start late: the next pass would overtake an ungated step."""

    def fused_step(self, *args, **kwargs):
        time.sleep(0.02)
        return super().fused_step(*args, **kwargs)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("mode", ["lambda", "object", "async", "async-lambda", "exact"])
def test_float32_one_copy_trains_as_plain_pytorch_in_every_mode(mode, devices):
    torch.manual_seed(0)
    net = mlp()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, optim_dtype=torch.float32, device=["cpu"] * devices, num_microbatch=2)
    opt = SlowAdam(model.optim_parameters(), lr=1e-2, eps=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=1e-2)
    for step in range(5):
        x, y = data("mlp", step)
        torch.manual_seed(step)
        if mode == "exact":
            loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=opt)
        else:
            loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            fn = (lambda: (opt.step(), opt.zero_grad())) if mode.endswith("lambda") else opt
            model.step(fn, is_async=mode.startswith("async"))
        torch.manual_seed(step)
        ref_loss = reference_forward_backward(ref, x, y, 2,
                                              roundpipe.pipeline.execute.draw_call_seed())
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss, rel=1e-5), step
    model.synchronize()
    for p, r in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)


def test_gradients_accumulated_over_calls_and_a_skipped_step_leave_the_weights_alone():
    torch.manual_seed(0)
    net = mlp()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, optim_dtype=torch.float32, num_microbatch=2)
    opt = rpo.SGD(model.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = roundpipe.GradScaler(init_scale=2.0**8)
    for step in range(3):
        for call in range(2):
            x, y = data("mlp", 10 * step + call)
            torch.manual_seed(call)
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, grad_scaler=scaler)
            torch.manual_seed(call)
            reference_forward_backward(ref, x, y, 2, roundpipe.pipeline.execute.draw_call_seed())
        model.step(opt, is_async=True, grad_scaler=scaler)
        ref_opt.step()
        ref_opt.zero_grad()
    model.synchronize()
    for p, r in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = data("mlp", 99)
    model.forward_backward(input_args=(x,), label=y, grad_scaler=scaler,
                           loss_fn=lambda o, t: loss_fn(o, t) * float("inf"))
    model.step(opt, grad_scaler=scaler)
    assert model.last_step_stats().skipped
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def _constant_gradient_layer(n: int, value: float) -> nn.Linear:
    layer = nn.Linear(n, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.fill_(value)
    return layer


def test_bfloat16_master_weights_keep_updates_below_half_a_bfloat16_step():
    """loss = sum(w) over a batch of ones: every gradient is 1, each SGD step moves w by -lr =
    1/16 of a bfloat16 step at 1.0 (2^-7): round to nearest never moves, stochastic rounding
    moves the mean by steps * lr (its rounding noise shrinks with n elements)."""
    n, steps, lr = 4096, 64, 2.0**-7 / 16
    x = torch.ones(1, n, dtype=torch.bfloat16)
    plain = _constant_gradient_layer(n, 1.0)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=lr)
    layer = _constant_gradient_layer(n, 1.0)
    model = RoundPipe(nn.Sequential(layer), optim_dtype=torch.bfloat16, num_microbatch=1)
    opt = rpo.SGD(model.optim_parameters(), lr=lr, stochastic_rounding=True, seed=0)
    for step in range(steps):
        plain(x).float().sum().backward()
        plain_opt.step()
        plain_opt.zero_grad()
        model.forward_backward(input_args=(x,), loss_fn=lambda out: out.float().sum())
        model.step(opt, is_async=step % 2 == 1)
    model.synchronize()
    assert torch.all(plain.weight == 1.0)                     # round to nearest lost every update
    moved = 1.0 - layer.weight.double().mean().item()
    expected = steps * lr                                     # 0.0313
    assert layer.weight.dtype == torch.bfloat16
    assert abs(moved - expected) < 0.02 * expected, (moved, expected)


def test_state_dict_load_state_dict_and_deepcopy_keep_one_copy():
    torch.manual_seed(0)
    model = RoundPipe(mlp(), optim_dtype=torch.float32, num_microbatch=2)
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)
    x, y = data("mlp", 0)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(opt, is_async=True)
    sd = model.state_dict()                                   # waits for the step
    assert all(torch.equal(sd[n], p) for n, p in model.module.named_parameters())
    fresh = RoundPipe(mlp(), optim_dtype=torch.float32, num_microbatch=2)
    fresh.load_state_dict(sd)
    for (n, p), o in zip(fresh.module.named_parameters(), fresh.optim_parameters()):
        assert o is p and torch.equal(p, sd[n])
    twin = copy.deepcopy(fresh)
    assert [id(p) for p in twin.optim_parameters()] == [id(p) for p in twin.module.parameters()]
    assert not {id(p) for p in twin.optim_parameters()} & {id(p) for p in fresh.optim_parameters()}


def test_bfloat16_one_copy_sums_gradients_over_calls_in_float32():
    """300 calls before one SGD step, each adding a gradient of 1: a bfloat16 sum would stop
    at 256; the step moves the weight by lr * 300 (up to one stochastic rounding)."""
    layer = _constant_gradient_layer(1, 1.0)
    model = RoundPipe(nn.Sequential(layer), optim_dtype=torch.bfloat16, num_microbatch=1)
    opt = rpo.SGD(model.optim_parameters(), lr=2.0**-10, stochastic_rounding=True, seed=0)
    x = torch.ones(1, 1, dtype=torch.bfloat16)
    for _ in range(300):
        model.forward_backward(input_args=(x,), loss_fn=lambda out: out.float().sum())
    model.step(opt)
    moved = 1.0 - layer.weight.item()
    assert abs(moved - 300 * 2.0**-10) <= 2.0**-8, moved   # one bfloat16 step below 1.0


def test_bfloat16_one_copy_exact_mode_equals_step():
    """Exact mode steps each stage from its float32 download; step(opt) from the float32 sum
    of the same download: the same update, bit for bit, also with several microbatches."""
    results = []
    for exact in (False, True):
        torch.manual_seed(0)
        net = mlp().to(torch.bfloat16)
        model = RoundPipe(net, optim_dtype=torch.bfloat16, num_microbatch=3)
        opt = rpo.AdamW(model.optim_parameters(), lr=1e-2, stochastic_rounding=True, seed=1)
        for step in range(3):
            _train_call(model, opt, *data("mlp", step), exact)
        model.synchronize()
        results.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


class CastIn(nn.Module):
    """A linear layer of its own dtype, its input cast to it."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(x.to(self.lin.weight.dtype))


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("copies", ["one", "separate"])
def test_a_parameter_the_optimizer_cannot_step_is_refused_before_any_layer_steps(copies, exact):
    """bfloat16 optimizer copies — the model's own (one copy), or separate ones of the later
    layers of a model whose first layer is float32 — that roundpipe.optim without
    stochastic_rounding cannot step: the error names the parameter and comes before any layer
    (the float32 one included) is stepped."""
    torch.manual_seed(0)
    net = mlp()
    if copies == "one":
        net = net.to(torch.bfloat16)
        model, name = RoundPipe(net, optim_dtype=torch.bfloat16, num_microbatch=2), "0.weight"
    else:
        for i in (2, 4):
            net[i] = CastIn(net[i].to(torch.bfloat16))
        model, name = RoundPipe(net, num_microbatch=2), "2.lin.weight"
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(TypeError, match=rf"'{name}'.*stochastic_rounding=True"):
        _train_call(model, opt, *data("mlp", 0), exact)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
    assert not opt.state
