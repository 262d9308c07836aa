"""The wrapper attacked as a hostile user would: re-entrant and concurrent calls, exit with a
pending step, failed calls and their garbage, asynchronous steps with gradient accumulation
and failures, losses that train nothing, modules shared across devices, tied weights loaded
with two values, tensor hyperparameters changed by schedulers, replaced parameters. Hangs are
bounded by timeouts (subprocesses or thread joins)."""

from __future__ import annotations

import copy
import gc
import pickle
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
from torch import nn

import roundpipe
import roundpipe.optim as rpo
from roundpipe import RoundPipe

from pipeline_models import data, loss_fn, mlp, reference_forward_backward


def _run_bounded(fn, timeout=60):
    """Runs ``fn`` on a thread; fails the test if it has not finished within ``timeout``."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung"
    if "error" in result:
        raise result["error"]
    return result.get("value")


# --- 1. re-entrant and concurrent use ------------------------------------------------------------

@pytest.mark.parametrize("devices", [1, 2])
def test_calling_the_model_from_its_own_loss_fn_raises_promptly(devices):
    model = RoundPipe(mlp(), device=["cpu"] * devices, num_microbatch=2)
    x, y = data("mlp", 0)

    def bad_loss(out, target):
        model(x)
        return loss_fn(out, target)

    with pytest.raises(RuntimeError, match="inside this model's own"):
        _run_bounded(lambda: model.forward_backward(input_args=(x,), label=y, loss_fn=bad_loss))
    # still usable
    _run_bounded(lambda: model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn))


@pytest.mark.parametrize("devices", [1, 2])
def test_a_layer_may_call_another_roundpipe_model(devices):
    torch.manual_seed(0)
    teacher_net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 8))
    teacher = RoundPipe(copy.deepcopy(teacher_net), device=["cpu"] * devices)
    teacher.eval()

    class Distill(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) + teacher(x)

    net = nn.Sequential(Distill(), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(net)
    model = RoundPipe(net, device=["cpu"] * devices, num_microbatch=2)
    x, y = data("mlp", 0)
    loss = _run_bounded(lambda: model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn))
    model.synchronize()
    teacher_net.eval()
    with torch.no_grad():
        t_out = teacher_net(x)
    ref_out = ref[2](ref[1](ref[0].lin(x) + t_out))
    assert loss.item() == pytest.approx(loss_fn(ref_out, y).item(), rel=1e-5)


def test_a_closure_optimizer_calling_forward_backward_inside_step_raises():
    model = RoundPipe(mlp(), num_microbatch=2)
    x, y = data("mlp", 0)
    opt = torch.optim.LBFGS(model.optim_parameters(), max_iter=2)

    def closure():
        return model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)

    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    with pytest.raises(RuntimeError, match="inside this model's own"):
        _run_bounded(lambda: model.step(lambda: opt.step(closure)))
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(lambda: opt.step(closure), is_async=True)
    with pytest.raises(RuntimeError, match="inside this model's own"):
        _run_bounded(model.synchronize)


@pytest.mark.parametrize("devices", [1, 2])
def test_two_threads_on_one_wrapper_are_serialised_and_exact(devices):
    """Two threads each run forward_backward calls on one wrapper: no deadlock, no mixing
    (each call's loss equals the plain reference for its batch)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    model = RoundPipe(net, device=["cpu"] * devices, num_microbatch=3)
    losses = {}

    def worker(k):
        for i in range(6):
            x, y = data("mlp", 100 * k + i)
            losses[(k, i)] = model.forward_backward(input_args=(x,), label=y,
                                                    loss_fn=loss_fn).item()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "deadlock"
    assert len(losses) == 12
    for (k, i), loss in losses.items():
        x, y = data("mlp", 100 * k + i)
        expected = loss_fn(ref(x), y).item()  # the whole batch's mean, whatever the split
        assert loss == pytest.approx(expected, rel=1e-5)
    # the gradients of all 12 calls, accumulated
    model.synchronize()
    for i in range(6):
        for k in range(2):
            x, y = data("mlp", 100 * k + i)
            loss_fn(ref(x), y).backward()
    for g, (name, p) in zip(model.accumulated_grads().values(), ref.named_parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6, msg=name)


# --- 2, 5. exit and garbage ------------------------------------------------------------------------

_EXIT_PENDING = r"""
import torch, roundpipe, roundpipe.optim as rpo
from torch import nn

class LongAdam(rpo.Adam):
    # one layer step made of seconds of optimizer kernels (C++): the interpreter reaches exit
    # while the optimizer thread is inside one
    def fused_step(self, *a, **k):
        for _ in range(1500):
            result = super().fused_step(*a, **k)
        print("stepped", flush=True)
        return result

model = roundpipe.RoundPipe(nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 8)))
opt = LongAdam(model.optim_parameters(), lr=1e-6)
model.forward_backward(input_args=(torch.randn(4, 2048),), loss_fn=lambda o: o.square().mean())
model.step(opt, is_async=True)          # still running when the script ends
print("leaving")
"""


def test_exit_with_a_pending_asynchronous_step_waits_and_exits_cleanly():
    r = subprocess.run([sys.executable, "-c", _EXIT_PENDING], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "terminate" not in r.stderr
    assert r.stdout.split() == ["leaving", "stepped", "stepped"]  # both layers' steps finished


@pytest.mark.parametrize("devices", [1, 2])
def test_a_failed_call_does_not_keep_the_wrapper_alive(devices):
    gc.collect()
    gc.disable()
    try:
        refs = []
        for _ in range(5):
            model = RoundPipe(mlp(), device=["cpu"] * devices, num_microbatch=2)
            x, y = data("mlp", 0)
            try:
                model.forward_backward(input_args=(x,), label=y,
                                       loss_fn=lambda o, t: 1 / 0)
            except ZeroDivisionError:
                pass
            refs.append(weakref.ref(model))
            del model
        assert [r() for r in refs] == [None] * 5
    finally:
        gc.enable()


# --- 6, 7. asynchronous step: accumulation and failures ----------------------------------------------

def _stale_reference_with_accumulation(steps, calls, opt_fn):
    """W[t+1] = W[t] - update(sum over the calls of iteration t of grad(W[t-1]))."""
    torch.manual_seed(0)
    master = mlp()
    compute = copy.deepcopy(master)
    opt = opt_fn(master.parameters())
    used = copy.deepcopy(master.state_dict())
    for step in range(steps):
        compute.load_state_dict(used)
        for call in range(calls):
            x, y = data("mlp", 10 * step + call)
            torch.manual_seed(call)
            reference_forward_backward(compute, x, y, 2,
                                       roundpipe.pipeline.execute.draw_call_seed())
        used = copy.deepcopy(master.state_dict())
        for p, c in zip(master.parameters(), compute.parameters()):
            p.grad, c.grad = c.grad, None
        opt.step()
        opt.zero_grad()
    return master


@pytest.mark.parametrize("devices", [1, 2])
def test_async_step_with_gradient_accumulation_uses_one_weight_version_per_step(devices):
    opt_fn = lambda ps: rpo.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    ref = _stale_reference_with_accumulation(4, 3, opt_fn)
    torch.manual_seed(0)
    model = RoundPipe(mlp(), device=["cpu"] * devices, num_microbatch=2)
    opt = opt_fn(model.optim_parameters())
    for step in range(4):
        for call in range(3):
            x, y = data("mlp", 10 * step + call)
            torch.manual_seed(call)
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(opt, is_async=True)
    model.synchronize()
    for (name, p), r in zip(model.optim_named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("recompute", [True, False])
def test_a_failed_pass_in_asynchronous_mode_changes_nothing(recompute):
    torch.manual_seed(0)
    model = RoundPipe(mlp(), device=["cpu", "cpu"], num_microbatch=2, recompute=recompute)
    twin = copy.deepcopy(model)
    opts = [rpo.Adam(m.optim_parameters(), lr=1e-2, eps=1e-2) for m in (model, twin)]
    fail = {"on": False}
    # fails in the first stage's backward visit (its recomputation, or with its saved tensors
    # kept, its backward): every later stage's backward is done
    boom = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))  # noqa: E731
    if recompute:
        hook = model.module[0].register_forward_hook(
            lambda *a: boom() if fail["on"] and roundpipe.doing_recompute() else None)
    else:
        hook = model.module[0].register_full_backward_hook(
            lambda *a: boom() if fail["on"] else None)
    for step in range(4):
        x, y = data("mlp", step)
        for m, o in zip((model, twin), opts):
            if m is model and step == 2:
                fail["on"] = True
                with pytest.raises(RuntimeError, match="boom"):
                    m.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
                fail["on"] = False
            torch.manual_seed(step)
            m.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            m.step(o, is_async=True)
    hook.remove()
    for m in (model, twin):
        m.synchronize()
    for (name, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), name


# --- 9. a loss that trains nothing ------------------------------------------------------------------

def test_a_loss_that_does_not_require_grad_raises_like_backward():
    model = RoundPipe(mlp(), num_microbatch=2)
    x, y = data("mlp", 0)
    with pytest.raises(RuntimeError, match="does not require grad"):
        model.forward_backward(input_args=(x,), label=y,
                               loss_fn=lambda o, t: loss_fn(o, t).detach())
    frozen = RoundPipe(mlp().requires_grad_(False))
    with pytest.raises(RuntimeError, match="does not require grad"):
        frozen.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    with pytest.raises(RuntimeError):  # plain PyTorch agrees
        loss_fn(mlp().requires_grad_(False)(x), y).backward()


# --- 10. a module repeated on different devices --------------------------------------------------------

def test_a_module_repeated_in_stages_on_different_devices_trains_as_on_one():
    def build():
        torch.manual_seed(0)
        shared = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
        return nn.Sequential(nn.Linear(8, 16), shared, nn.Tanh(), shared, nn.Linear(16, 4))

    results = []
    for devices in (1, 2, 3):
        model = RoundPipe(build(), device=["cpu"] * devices, num_microbatch=3)
        opt = rpo.SGD(model.optim_parameters(), lr=0.05)
        for step in range(8):
            x, y = data("mlp", step)
            x = torch.cat([x, x])
            y = torch.cat([y, y])
            torch.manual_seed(step)
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            model.step(opt)
        results.append(model.state_dict())
    for other in results[1:]:
        for k, v in results[0].items():
            assert torch.equal(v, other[k]), k
    assert int(results[0]["1.1.num_batches_tracked"]) == 8 * 3 * 2


# --- 11. tied weights loaded with two values -------------------------------------------------------------

def test_tied_weights_loaded_under_two_names_take_the_last_value_in_both_copies():
    emb = nn.Embedding(16, 8)
    head = nn.Linear(8, 16, bias=False)
    head.weight = emb.weight
    net = nn.Sequential(emb, nn.Tanh(), head).to(torch.bfloat16)
    plain = copy.deepcopy(net)
    model = RoundPipe(net, optim_dtype=torch.float32)
    sd = {"0.weight": torch.randn(16, 8), "2.weight": torch.randn(16, 8)}
    model.load_state_dict(sd)
    plain.load_state_dict(sd)
    (o,) = list(model.optim_parameters())
    assert torch.equal(net[0].weight, plain[0].weight)      # the model copy: as torch loads it
    assert torch.equal(o.to(torch.bfloat16), net[0].weight)  # the optimizer copy agrees
    assert torch.equal(o, sd["2.weight"])                    # at full precision


# --- 13. tensor hyperparameters and schedulers ---------------------------------------------------------------

@pytest.mark.parametrize("mode", ["async", "exact"])
def test_a_scheduler_changing_a_tensor_lr_in_place_affects_only_the_next_step(mode):
    def run(tensor_lr):
        torch.manual_seed(0)
        model = RoundPipe(mlp(), num_microbatch=2)

        class SlowSGD(rpo.SGD):
            def fused_step(self, *a, **k):
                time.sleep(0.01)
                return super().fused_step(*a, **k)

        lr = torch.tensor(0.1) if tensor_lr else 0.1
        opt = SlowSGD(model.optim_parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
        for step in range(3):
            x, y = data("mlp", step)
            torch.manual_seed(step)
            if mode == "exact":
                model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=opt)
            else:
                model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
                model.step(opt, is_async=True)
            sched.step()
        model.synchronize()
        return [p.detach().clone() for p in model.optim_parameters()]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


# --- 14. a replaced parameter ------------------------------------------------------------------------------------

def test_a_parameter_replaced_after_wrapping_is_named_in_the_error():
    net = mlp()
    model = RoundPipe(net)
    net[2].weight = nn.Parameter(torch.zeros(32, 32))
    x, y = data("mlp", 0)
    with pytest.raises(RuntimeError, match="replaced after the model was wrapped"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)


def test_zero_grad_right_after_an_asynchronous_step_does_not_lose_the_update():
    """A torch.optim optimizer is stepped whole on the optimizer thread from the .grad the
    step sets; the user's habitual opt.zero_grad() right after step(is_async=True) waits
    for it instead of clearing those gradients first. The waiting zero_grad is not part of
    the optimizer's pickled state."""
    torch.manual_seed(0)
    net = mlp()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, num_microbatch=2)
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    opt.register_step_pre_hook(lambda *_: time.sleep(0.1))     # still pending at zero_grad
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data("mlp", 0)
    torch.manual_seed(0)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(opt, is_async=True)
    opt.zero_grad()
    model.synchronize()
    assert "zero_grad" not in pickle.loads(pickle.dumps(opt)).__dict__
    torch.manual_seed(0)
    reference_forward_backward(ref, x, y, 2, roundpipe.pipeline.execute.draw_call_seed())
    ref_opt.step()
    for p, r in zip(model.optim_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
