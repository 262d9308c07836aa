"""RoundPipe's overlapped modes and several devices, on the CPU (CPU worker threads exercise the
same scheduler as GPUs):

- several devices give the same results as one (bit for bit, fixed number of microbatches);
- the exact overlapped mode (``forward_backward(optimizer=opt)``) equals the plain loop;
- the asynchronous step equals a plain PyTorch loop that applies one-step-stale updates;
- errors in the background or on a worker reach the caller; nothing deadlocks.
"""

from __future__ import annotations

import copy
import gc
import threading
import subprocess
import sys
import time
import traceback

import pytest
import torch
from torch import nn

import roundpipe
import roundpipe.optim as rpo
from roundpipe import OptimizerCtx, RoundPipe

from pipeline_models import (assert_params_equal, data, loss_fn, mlp, reference_forward_backward,
                             transformer)


def tied():
    """Embedding and output head share one weight, in the first and the last stage."""
    emb = nn.Embedding(16, 8)
    head = nn.Linear(8, 4, bias=False)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), head)
    net[0].weight = nn.Parameter(torch.randn(8, 8))
    net[2].weight = net[0].weight                  # tied across stages
    return net


MODELS = {"mlp": mlp, "transformer": transformer, "tied": tied}


def _data(name, step):
    return data("transformer" if name == "transformer" else "mlp", step)


def _train(name, devices, steps=3, num_microbatch=3, mode="plain", opt_fn=None, dtype=None,
           layers_per_stage=1):
    """Trains a fresh model; returns (losses, RoundPipe). mode: plain (forward_backward + step
    with a lambda), object (step(opt)), exact (forward_backward(optimizer=opt))."""
    torch.manual_seed(0)
    net = MODELS[name]()
    if dtype is not None:
        net = net.to(dtype)
    model = RoundPipe(net, optim_dtype=torch.float32, device=devices,
                      num_microbatch=num_microbatch, layers_per_stage=layers_per_stage)
    with OptimizerCtx():
        opt = (opt_fn or (lambda ps: rpo.Adam(ps, lr=1e-2, eps=1e-2)))(model.parameters())
    losses = []
    for step in range(steps):
        x, y = _data(name, step)
        if dtype is not None:
            x = x.to(dtype)
        torch.manual_seed(step)
        if mode == "exact":
            loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=opt)
        else:
            loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            model.step(opt if mode == "object" else (lambda: (opt.step(), opt.zero_grad())))
        losses.append(loss.item())
    model.synchronize()
    return losses, model


def _assert_identical(a: RoundPipe, b: RoundPipe):
    for (name, p), (_, q) in zip(a.optim_named_parameters(), b.optim_named_parameters()):
        assert torch.equal(p, q), name
    for (name, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q), name
    for (name, p), (_, q) in zip(a.named_buffers(), b.named_buffers()):
        assert torch.equal(p, q), name


# --- several devices ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_one_two_and_three_cpu_devices_give_identical_results(name):
    losses1, one = _train(name, "cpu")
    x, _ = _data(name, 9)
    one.eval()
    out1 = one(x)
    for n in (2, 3):
        losses, many = _train(name, ["cpu"] * n)
        assert losses == losses1
        _assert_identical(one, many)
        many.eval()
        assert torch.equal(many(x), out1)       # inference too


def test_several_devices_match_the_plain_pytorch_loop():
    torch.manual_seed(0)
    net = transformer()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, device=["cpu", "cpu"], num_microbatch=3, layers_per_stage=2)
    assert [s.device for s in model._stages] == [torch.device("cpu")] * 3
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.01, momentum=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.5)
    for step in range(4):
        x, y = data("transformer", step)
        torch.manual_seed(step)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(opt)
        torch.manual_seed(step)
        ref_loss = reference_forward_backward(ref, x, y, 3, roundpipe.pipeline.execute.draw_call_seed())
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
        assert_params_equal(model, ref)


def test_default_microbatches_and_device_arguments():
    assert RoundPipe(mlp(), device="cpu").num_microbatch == 2
    assert RoundPipe(mlp(), device=["cpu"] * 3).num_microbatch == 4
    assert RoundPipe(mlp(), device=("cpu", torch.device("cpu"))).devices == [torch.device("cpu")] * 2
    with pytest.raises(ValueError, match="empty"):
        RoundPipe(mlp(), device=[])
    with pytest.raises(ValueError, match="mixes"):
        RoundPipe(mlp(), device=["cpu", "cuda:0"])
    with pytest.raises(ValueError, match="not available"):
        RoundPipe(mlp(), device=f"cuda:{torch.cuda.device_count()}")
    with pytest.raises(ValueError, match="not supported"):
        RoundPipe(mlp(), device="meta")
    with pytest.raises(TypeError, match="device entries"):
        RoundPipe(mlp(), device=[0])
    with pytest.raises(ValueError, match="pin_memory"):
        RoundPipe(mlp(), device="cpu", pin_memory="yes")
    with pytest.raises(ValueError, match="max_resident_bytes"):
        RoundPipe(mlp(), device="cpu", max_resident_bytes=-1)
    model = RoundPipe(mlp(), device="cpu")
    assert model.pin_memory == "off"            # nothing to pin for CPU devices
    with pytest.raises(TypeError, match="step_fn"):
        model.step(3)
    with pytest.raises(TypeError, match="is_async"):
        model.step(lambda: None, is_async=1)
    x, y = data("mlp", 0)
    with pytest.raises(TypeError, match="optimizer"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=lambda: 0)


# --- exact overlapped mode -----------------------------------------------------------------------

OPTS = {
    "sgd": lambda ps: rpo.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: rpo.Adam(ps, lr=1e-2, eps=1e-2),
    "torch.sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("opt", ["sgd", "adam", "torch.sgd"])
@pytest.mark.parametrize("name", ["transformer", "tied"])
def test_exact_overlapped_mode_equals_the_plain_loop(name, opt, devices):
    kw = dict(opt_fn=OPTS[opt], dtype=torch.bfloat16, layers_per_stage=2, steps=4)
    plain_losses, plain = _train(name, "cpu", mode="plain", **kw)
    losses, exact = _train(name, ["cpu"] * devices, mode="exact", **kw)
    assert losses == plain_losses
    _assert_identical(plain, exact)


@pytest.mark.parametrize("opt", [lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                                 OPTS["adam"]], ids=["torch.SGD", "roundpipe.Adam"])
def test_stepping_with_the_optimizer_object_equals_the_lambda(opt):
    kw = dict(opt_fn=opt, dtype=torch.bfloat16, steps=3)
    _, plain = _train("mlp", "cpu", mode="plain", **kw)
    _, obj = _train("mlp", "cpu", mode="object", **kw)
    _, exact = _train("mlp", "cpu", mode="exact", **kw)   # torch optimizers: stepped at the end
    _assert_identical(plain, obj)
    _assert_identical(plain, exact)


def test_exact_mode_matches_the_reference_loop_and_optimizer_state_is_shared():
    torch.manual_seed(0)
    net = mlp()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, device=["cpu", "cpu"], num_microbatch=3)
    with OptimizerCtx():
        opt = rpo.AdamW(model.parameters(), lr=1e-2, eps=1e-2)
    ref_opt = rpo.AdamW(ref.parameters(), lr=1e-2, eps=1e-2)
    for step in range(5):
        x, y = data("mlp", step)
        torch.manual_seed(step)
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=opt)
        torch.manual_seed(step)
        reference_forward_backward(ref, x, y, 3, roundpipe.pipeline.execute.draw_call_seed())
        ref_opt.step()
        ref_opt.zero_grad()
    model.synchronize()
    assert_params_equal(model, ref)
    sd = opt.state_dict()
    assert all(float(s["step"]) == 5 for s in sd["state"].values())


# --- asynchronous step -------------------------------------------------------------------------

def _stale_reference(steps, opt_fn, sched_fn=None):
    """Plain PyTorch with one-step-stale updates written out: the gradients of iteration t are
    computed with the weights from before step t-1 (W[t-1]) and applied to W[t]."""
    torch.manual_seed(0)
    master = mlp()
    compute = copy.deepcopy(master)
    opt = opt_fn(master.parameters())
    sched = sched_fn(opt) if sched_fn else None
    weights_used = copy.deepcopy(master.state_dict())
    losses = []
    for step in range(steps):
        compute.load_state_dict(weights_used)
        x, y = data("mlp", step)
        torch.manual_seed(step)
        losses.append(reference_forward_backward(compute, x, y, 2,
                                                 roundpipe.pipeline.execute.draw_call_seed()))
        weights_used = copy.deepcopy(master.state_dict())
        for p, c in zip(master.parameters(), compute.parameters()):
            p.grad, c.grad = c.grad, None
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return losses, master


class SlowAdam(rpo.Adam):
    """Adam whose per-layer steps start late: whatever the caller does right after an
    asynchronous step happens while the step is still pending."""

    def fused_step(self, *args, **kwargs):
        time.sleep(0.02)
        return super().fused_step(*args, **kwargs)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("form", ["lambda", "object", "object+scheduler"])
def test_async_step_equals_the_one_step_stale_reference(form, devices):
    opt_fn = lambda ps: (SlowAdam if "scheduler" in form else rpo.Adam)(  # noqa: E731
        ps, lr=1e-2, eps=1e-2)
    sched_fn = (lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)) \
        if "scheduler" in form else None
    ref_losses, ref = _stale_reference(5, opt_fn, sched_fn)
    torch.manual_seed(0)
    model = RoundPipe(mlp(), device=["cpu"] * devices, num_microbatch=2)
    with OptimizerCtx():
        opt = opt_fn(model.parameters())
    sched = sched_fn(opt) if sched_fn else None
    losses = []
    for step in range(5):
        x, y = data("mlp", step)
        torch.manual_seed(step)
        losses.append(model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn).item())
        model.step((lambda: (opt.step(), opt.zero_grad())) if form == "lambda" else opt,
                   is_async=True)
        if sched:
            sched.step()      # right away, while the step may still run: it uses a snapshot
    model.synchronize()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_params_equal(model, ref)
    for p, o in zip(model.module.parameters(), model.optim_parameters()):
        assert torch.equal(p, o)                # synchronize() wrote every layer back


def test_async_step_is_exact_when_synchronized_and_checkpoints_wait():
    torch.manual_seed(0)
    model = RoundPipe(mlp(), num_microbatch=2)
    twin = copy.deepcopy(model)
    opt = rpo.AdamW(model.optim_parameters(), lr=0.1, eps=0.1)
    twin_opt = rpo.AdamW(twin.optim_parameters(), lr=0.1, eps=0.1)
    for step in range(3):
        x, y = data("mlp", step)
        for m, o, is_async in ((model, opt, True), (twin, twin_opt, False)):
            torch.manual_seed(step)
            m.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            m.step(o, is_async=is_async)
        sd = model.state_dict()                  # waits and writes back: no staleness after it
        for k, v in twin.state_dict().items():
            assert torch.equal(sd[k], v), k
        assert set(opt.state_dict()["state"]) == set(twin_opt.state_dict()["state"])
    _assert_identical(model, twin)


def test_optimizer_state_dict_and_step_wait_for_a_pending_async_step():
    torch.manual_seed(0)
    model = RoundPipe(mlp(), num_microbatch=2)
    opt = SlowAdam(model.optim_parameters(), lr=1e-2)
    x, y = data("mlp", 0)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(opt, is_async=True)
    sd = copy.deepcopy(opt.state_dict())   # waits: every parameter has been stepped once
    assert len(sd["state"]) == len(list(model.optim_parameters()))
    assert all(float(s["step"]) == 1 for s in sd["state"].values())
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(opt, is_async=True)
    opt.load_state_dict(sd)          # waits too, so the pending step cannot overwrite it
    assert all(float(s["step"]) == 1 for s in opt.state_dict()["state"].values())
    model.synchronize()


# --- errors and interruptions --------------------------------------------------------------------

class Boom(RuntimeError):
    pass


def test_error_in_a_background_step_surfaces_at_the_next_call_and_training_goes_on():
    torch.manual_seed(0)
    model = RoundPipe(mlp(), device=["cpu", "cpu"], num_microbatch=2)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.optim_parameters(), lr=0.1)
    x, y = data("mlp", 0)

    def bad_step():
        raise Boom("in the background step")

    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(bad_step, is_async=True)
    with pytest.raises(Boom, match="background step") as info:
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    text = "".join(traceback.format_exception(info.value))
    assert "bad_step" in text and "optimizer thread" in text
    model.synchronize()                          # nothing left to raise
    # the wrapper is usable: the next iteration trains as a fresh twin does
    for m, o in ((model, opt), (twin, twin_opt)):
        torch.manual_seed(3)
        m.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        m.step(lambda o=o: (o.step(), o.zero_grad()), is_async=m is model)
    _, model_state = model.synchronize(), model.state_dict()
    for k, v in twin.state_dict().items():
        assert torch.equal(model_state[k], v), k
    # a layer step of the exact mode that fails surfaces the same way
    class Failing(rpo.SGD):
        def fused_step(self, *args, **kwargs):
            raise Boom("in a layer step")

    bad = Failing(model.optim_parameters(), lr=0.1)
    with pytest.raises(Boom, match="layer step"):  # in this call or, at the latest, the next
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=bad)
        model.synchronize()
    model.synchronize()
    assert all(g is None for g in model.accumulated_grads().values())


@pytest.mark.parametrize("where", ["layer", "loss", "interrupt"])
def test_error_on_a_worker_reaches_the_caller_without_deadlock(where):
    torch.manual_seed(0)
    net = mlp()
    model = RoundPipe(net, device=["cpu"] * 3, num_microbatch=3)
    twin = copy.deepcopy(model)
    x, y = data("mlp", 0)
    calls = {"n": 0}

    def hook(*_):
        calls["n"] += 1
        if calls["n"] == 4:  # in the middle of the pass, while other workers wait for slots
            raise KeyboardInterrupt() if where == "interrupt" else Boom("in a layer")

    def bad_loss(out, target):
        raise Boom("in loss_fn")

    handle = net[2].register_forward_hook(hook) if where != "loss" else None
    expected = KeyboardInterrupt if where == "interrupt" else Boom
    with pytest.raises(expected):
        model.forward_backward(input_args=(x,), label=y,
                               loss_fn=bad_loss if where == "loss" else loss_fn)
    if handle:
        handle.remove()
    assert all(g is None for g in model.accumulated_grads().values())   # the partial gradient was discarded
    for m in (model, twin):
        torch.manual_seed(1)
        m.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        m.step(lambda: None)
    _assert_identical(model, twin)


_EXIT_MIDWAY = r"""
import sys, torch, roundpipe, roundpipe.optim as rpo
from torch import nn
net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
model = roundpipe.RoundPipe(net, device=["cpu", "cpu"], num_microbatch=3)
opt = rpo.Adam(model.optim_parameters(), lr=1e-3)
x = torch.randn(12, 256)
model.forward_backward(input_args=(x,), loss_fn=lambda o: o.square().mean())
model.step(opt, is_async=True)                  # still running when the script ends
model.forward_backward(input_args=(x,), loss_fn=lambda o: o.square().mean(), optimizer=opt)
print("leaving")
"""


def test_the_process_exits_when_the_caller_stops_midway():
    r = subprocess.run([sys.executable, "-c", _EXIT_MIDWAY], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "leaving"


def test_pipeline_stats_are_reported():
    from roundpipe.stats import KEYS
    model = RoundPipe(mlp(), device=["cpu", "cpu"])
    x, y = data("mlp", 0)
    opt = rpo.Adam(model.optim_parameters(), lr=0.1)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=opt)
    model.synchronize()
    stats = model.pipeline_stats(reset=True)
    assert set(stats) == set(KEYS)
    stage_bytes = sum(p.numel() * 4 for p in model.module.parameters())
    last = 4 * (4 * 32 + 4)  # the last stage runs once, in the backward pass
    assert stats["h2d_weight_bytes"] == stats["weight_floor_bytes"] == 2 * stage_bytes - last
    assert stats["wall_s"] > 0 and stats["device_s"] >= stats["wall_s"]
    assert all(v >= 0 for v in stats.values())
    assert model.pipeline_stats()["wall_s"] == 0


def test_cuda_transfer_imports_without_touching_cuda():
    r = subprocess.run([sys.executable, "-c", "import torch, roundpipe.transfer.cuda as c; "
                        "from torch import nn; "
                        "assert c.pin_host_model(nn.Linear(2, 2), 'off', torch.device('cpu')) "
                        "== ('off', 0); "
                        "print(torch.cuda.is_initialized())"], capture_output=True, text=True)
    assert r.stdout.strip() == "False", r.stderr


# --- the CUDA transfer logic, with CUDA faked on the CPU (conftest.fake_cuda) ------------------------

def test_cuda_transfer_logic_with_faked_cuda(fake_cuda, monkeypatch):
    """Runs the CudaIO code (streams, events, prefetch, the pinned staging ring, timing) with
    CUDA replaced by CPU stand-ins: the training must be bit-identical to the CPU path, and
    every event waited for must have been recorded."""
    from conftest import use_fake_cuda_io
    kw = dict(opt_fn=OPTS["adam"], dtype=torch.bfloat16, steps=3)
    for mode in ("plain", "exact"):
        ref_losses, ref = _train("transformer", ["cpu", "cpu"], mode=mode, **kw)
        real_init = RoundPipe._runtime_init

        def fake_init(self):
            real_init(self)
            use_fake_cuda_io(self, fake_cuda)

        monkeypatch.setattr(RoundPipe, "_runtime_init", fake_init)
        losses, faked = _train("transformer", ["cpu", "cpu"], mode=mode, **kw)
        monkeypatch.setattr(RoundPipe, "_runtime_init", real_init)
        assert losses == ref_losses
        _assert_identical(ref, faked)
        stats = faked.pipeline_stats()
        assert stats["upload_s"] > 0 and stats["weights_wait_s"] > 0
        assert stats["h2d_weight_bytes"] == stats["weight_floor_bytes"] > 0
        assert stats["d2h_param_grad_bytes"] == stats["param_grad_floor_bytes"] > 0
        assert all(io._ring is not None for io in faked._ios)  # gradients went through it
        assert stats["pinned_bytes"] == sum(io._ring.size for io in faked._ios)


@pytest.mark.parametrize("cap", [None, 0])
def test_prefetch_keeps_at_most_two_stages_per_device_with_faked_cuda(fake_cuda, monkeypatch, cap):
    """With prefetch, at most one stage's weights are alive on a device when the next one is
    uploaded (two resident); with max_resident_bytes=0 nothing is prefetched (one resident)."""
    import weakref
    from conftest import use_fake_cuda_io

    alive: dict[int, list] = {}
    peak = {}
    real_upload = fake_cuda.CudaIO.upload

    def upload(self, layers, with_grad):
        gc.collect()
        mine = alive.setdefault(id(self), [])
        resident = sum(1 for refs in mine if any(r() is not None for r in refs))
        peak[id(self)] = max(peak.get(id(self), 0), resident)
        weights, event = real_upload(self, layers, with_grad)
        mine.append([weakref.ref(t) for placed in weights.layers for _, t in placed])
        return weights, event

    monkeypatch.setattr(fake_cuda.CudaIO, "upload", upload)
    torch.manual_seed(0)
    model = RoundPipe(transformer(), device=["cpu", "cpu"], num_microbatch=3,
                      max_resident_bytes=cap)
    use_fake_cuda_io(model, fake_cuda)
    x, y = data("transformer", 0)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    assert set(peak.values()) == ({1} if cap is None else {0})


def test_a_wrapper_that_ran_is_freed_with_its_threads():
    import weakref

    refs = []
    for mode in ("forward", "step", "async", "exact"):
        model = RoundPipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), device=["cpu", "cpu"])
        with OptimizerCtx():
            opt = rpo.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 8)
        if mode == "forward":
            model(x)
        else:
            kwargs = {"optimizer": opt} if mode == "exact" else {}
            model.forward_backward(input_args=(x,), label=x,
                                   loss_fn=lambda a, b: ((a - b) ** 2).sum(), **kwargs)
            if mode != "exact":
                model.step(opt, is_async=mode == "async")
            model.synchronize()
        refs.append(weakref.ref(model))
        del model, opt
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    deadline = time.monotonic() + 5
    while any(t.name.startswith("roundpipe-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.05)


@pytest.mark.parametrize("exact", [False, True])
def test_an_optimizer_with_outside_parameters_or_hooks_is_stepped_whole(exact):
    # A temperature used by loss_fn lives outside the wrapper, and a post hook counts steps:
    # step(opt) and exact mode must then do what opt.step() does (update it, run the hook).
    results = []
    for use_lambda in (True, False):
        torch.manual_seed(0)
        model = RoundPipe(mlp(), num_microbatch=2)
        temp = nn.Parameter(torch.ones(()))
        with OptimizerCtx():
            opt = rpo.SGD(list(model.parameters()) + [temp], lr=0.1)
        calls = []
        opt.register_step_post_hook(lambda *a: calls.append(1))
        x, y = data("mlp", 0)
        lf = lambda o, t: (((o - t) ** 2) * temp).sum() / 6  # noqa: E731
        if use_lambda:
            model.forward_backward(input_args=(x,), label=y, loss_fn=lf)
            model.step(lambda: (opt.step(), opt.zero_grad()))
        elif exact:
            model.forward_backward(input_args=(x,), label=y, loss_fn=lf, optimizer=opt)
        else:
            model.forward_backward(input_args=(x,), label=y, loss_fn=lf)
            model.step(opt)
        model.synchronize()
        results.append((temp.detach().clone(), temp.grad, len(calls),
                        [p.detach().clone() for p in model.optim_parameters()]))
    (t0, g0, c0, p0), (t1, g1, c1, p1) = results
    assert torch.equal(t0, t1) and t1.item() != 1.0 and g1 is None and c1 == c0 == 1
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
