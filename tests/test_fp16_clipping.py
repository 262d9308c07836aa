"""fp16 training and clipping built into the step, against references written here:

- ``roundpipe.GradScaler``'s scale sequence against torch's own update kernel
  (``torch._amp_update_scale_``), and its hysteresis, floor, back-off rule and checkpoint;
- synchronous ``step`` and exact mode against a hand-written mixed-precision loop (fp16 model
  copy, fp32 master weights, ``torch.amp.GradScaler("cpu")`` on the master gradients,
  ``torch.nn.utils.clip_grad_norm_``), 14 steps with an overflow injected by a layer and the
  scale growing within the run, clipping active on some steps and not others;
- the asynchronous step against the same loop made one step stale (weights and scale);
- a skipped step changes nothing; resuming from the scaler's state dict continues identically.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import roundpipe
import roundpipe.optim as rpo
from roundpipe import GradScaler, RoundPipe, layer_seed



# --- the scaler alone ---------------------------------------------------------------------------

def test_default_scaler_follows_torchs_update_kernel():
    gen = torch.Generator().manual_seed(0)
    flags = (torch.rand(300, generator=gen) < 0.15).tolist()
    ours = GradScaler(init_scale=2.0**10, growth_interval=4)
    scale = torch.full((), 2.0**10)
    tracker = torch.zeros((), dtype=torch.int32)
    for inf in flags:
        used = ours.get_scale()
        assert used == scale.item()
        skipped = ours.apply_verdict(inf, used)
        torch._amp_update_scale_(scale, tracker, torch.full((), float(inf)), 2.0, 0.5, 4)
        assert skipped == inf
    assert ours.get_scale() == scale.item() and ours.state_dict()["_growth_tracker"] == tracker.item()


def test_scaler_hysteresis_floor_and_backoff_from_the_overflowed_scale():
    s = GradScaler(init_scale=64.0, hysteresis=2, min_scale=8.0, growth_interval=100)
    assert s.apply_verdict(True, 64.0) and s.get_scale() == 64.0   # first overflow: skipped only
    assert not s.apply_verdict(False, 64.0)                        # success resets the count
    assert s.apply_verdict(True, 64.0) and s.get_scale() == 64.0
    assert s.apply_verdict(True, 64.0) and s.get_scale() == 32.0   # second in a row: backs off
    for _ in range(6):
        s.apply_verdict(True, s.get_scale())
        s.apply_verdict(True, s.get_scale())
    assert s.get_scale() == 8.0                              # the floor
    # two steps in flight that both saw an overflow at 1024 halve it once
    s = GradScaler(init_scale=1024.0)
    s.apply_verdict(True, 1024.0)
    s.apply_verdict(True, 1024.0)
    assert s.get_scale() == 512.0


def test_scaler_arguments_state_dict_and_disabled():
    for kwargs, name in [({"init_scale": 0.0}, "init_scale"), ({"growth_factor": 1.0}, "growth_factor"),
                         ({"backoff_factor": 1.0}, "backoff_factor"),
                         ({"growth_interval": 0}, "growth_interval"),
                         ({"hysteresis": 0}, "hysteresis"), ({"min_scale": -1.0}, "min_scale")]:
        with pytest.raises(ValueError, match=name):
            GradScaler(**kwargs)
    a = GradScaler(init_scale=256.0, growth_interval=3, hysteresis=2)
    for inf in (False, True, False, False):
        a.apply_verdict(inf, a.get_scale())
    b = GradScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    torch_sd = torch.amp.GradScaler("cpu", init_scale=128.0).state_dict()
    c = GradScaler()
    c.load_state_dict(torch_sd)                              # torch's checkpoints load too
    assert c.get_scale() == 128.0
    off = GradScaler(enabled=False)
    assert off.get_scale() == 1.0 and off.state_dict() == {} and not off.apply_verdict(True, 1.0)


# --- the training references --------------------------------------------------------------------

B, M, STEPS, MAX_NORM = 6, 2, 14, 0.9


class MaybeInf(nn.Module):
    """Multiplies by inf while ``on`` (forward and recomputation alike): an overflow."""

    on = False

    def forward(self, x):
        return x * float("inf") if MaybeInf.on else x


def make_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), MaybeInf(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, 8, generator=g) * (1 + step % 4), torch.randn(B, 4, generator=g)


def loss_fn(out, target):
    return ((out.float() - target) ** 2).sum() / B


OVERFLOW_AT = 5


def _grads_fp32(net16, x, y, seed, scale_loss):
    """Plain loop over microbatches (layers seeded as RoundPipe documents) on the fp16 model,
    each loss scaled by ``scale_loss``: the per-microbatch fp16 gradients summed in fp32, in
    microbatch order."""
    sums = [None] * len(list(net16.parameters()))
    for m, (xm, ym) in enumerate(zip(torch.tensor_split(x, M), torch.tensor_split(y, M))):
        h = xm.half()
        for i, layer in enumerate(net16):
            with torch.random.fork_rng():
                torch.manual_seed(layer_seed(seed, i, m))
                h = layer(h)
        scale_loss(loss_fn(h, ym)).backward()
        for k, p in enumerate(net16.parameters()):
            g = p.grad.float()
            sums[k] = g if sums[k] is None else sums[k] + g
            p.grad = None
    return sums


def reference(stale: bool, clip: bool = True):
    """The hand-written loop: fp16 model, fp32 master, the gradients unscaled, checked,
    clipped with clip_grad_norm_, the step skipped on overflow. Synchronous: torch.amp.
    GradScaler("cpu") does the scaling. ``stale``: the asynchronous contract written out —
    iteration t computes with the weights from before step t-1 and the scale decided by
    step t-2, an overflow backs off from the scale that overflowed."""
    master = make_net()
    net16 = copy.deepcopy(master).half()
    with torch.no_grad():
        for p, q in zip(master.parameters(), net16.parameters()):
            p.copy_(q)                                       # the master starts at fp16 values
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, eps=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    own_scale, tracker, scales_after = 2.0**12, 0, []       # the stale rule's scale
    compute16 = copy.deepcopy(net16.state_dict())           # the weights iteration t uses
    history = []
    for step in range(STEPS):
        if stale:
            scale = 2.0**12 if step < 2 else scales_after[step - 2]
            net16.load_state_dict(compute16)
        else:
            scale = scaler.get_scale()
        MaybeInf.on = step == OVERFLOW_AT
        x, y = batch(step)
        torch.manual_seed(step)
        scale_loss = scaler.scale if not stale else (
            lambda loss: loss * torch.full((), scale, dtype=torch.float32))
        sums = _grads_fp32(net16, x, y, roundpipe.pipeline.execute.draw_call_seed(), scale_loss)
        MaybeInf.on = False
        for p, g in zip(master.parameters(), sums):
            p.grad = g
        if stale:
            compute16 = {k: v.half() for k, v in master.state_dict().items()}  # W[t], fp16
            inv = torch.full((), 1.0 / scale, dtype=torch.float32)
            found = any(not torch.isfinite(p.grad).all() for p in master.parameters())
            norm = None
            if not found:
                for p in master.parameters():
                    p.grad.mul_(inv)
                if clip:
                    norm = torch.nn.utils.clip_grad_norm_(master.parameters(), MAX_NORM)
                opt.step()
            opt.zero_grad()
            if found:
                own_scale, tracker = min(own_scale, scale * 0.5), 0
            else:
                tracker += 1
                if tracker == 3:
                    own_scale, tracker = own_scale * 2.0, 0
            scales_after.append(own_scale)
        else:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(master.parameters(), MAX_NORM) if clip else None
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            with torch.no_grad():
                for p, q in zip(master.parameters(), net16.parameters()):
                    q.copy_(p)
        history.append((scale, None if norm is None else float(norm)))
    return master, opt, history


def train_roundpipe(mode: str, clip: bool = True, steps: int = STEPS, scaler=None, start=0,
                    model=None, opt=None, sync_each: bool = True):
    if model is None:
        net = make_net()
        model = RoundPipe(net.half(), optim_dtype=torch.float32, num_microbatch=M)
        opt = torch.optim.AdamW(model.optim_parameters(), lr=1e-2, eps=1e-3) if mode == "torch" \
            else rpo.AdamW(model.optim_parameters(), lr=1e-2, eps=1e-3)
    scaler = scaler or GradScaler(init_scale=2.0**12, growth_interval=3)
    history = []
    kw = dict(max_grad_norm=MAX_NORM) if clip else {}
    for step in range(start, start + steps):
        MaybeInf.on = step == OVERFLOW_AT
        x, y = batch(step)
        torch.manual_seed(step)
        if mode == "exact":
            model.forward_backward(input_args=(x.half(),), label=y, loss_fn=loss_fn,
                                   optimizer=opt, grad_scaler=scaler, **kw, loss_reduction="sum")
        else:
            model.forward_backward(input_args=(x.half(),), label=y, loss_fn=loss_fn,
                                   grad_scaler=scaler, loss_reduction="sum")
            model.step(opt, is_async=mode == "async", grad_scaler=scaler, **kw)
        MaybeInf.on = False
        if mode != "async" and sync_each:
            model.synchronize()
            r = model.last_step_stats()
            history.append((r.scale, r.skipped, r.grad_norm))
    model.synchronize()
    return model, opt, scaler, history


def _assert_close_training(model, opt, master, ref_opt, rtol=2e-5, atol=2e-6):
    for (name, p), q in zip(model.optim_named_parameters(), master.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], rtol=1e-4,
                                       atol=1e-9, msg=f"{name} {key}")
        assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"])
    for p, q in zip(model.module.parameters(), master.parameters()):
        torch.testing.assert_close(p.float(), q.half().float(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("mode", ["step", "exact", "torch"])
def test_synchronous_and_exact_modes_follow_torchs_grad_scaler_and_clipping(mode):
    master, ref_opt, ref_history = reference(stale=False)
    model, opt, scaler, history = train_roundpipe(mode)
    # the scale sequence and the skipped step: exactly torch's
    assert [h[0] for h in history] == [h[0] for h in ref_history]
    assert [h[1] for h in history] == [s == OVERFLOW_AT for s in range(STEPS)]
    assert len({h[0] for h in history}) >= 3                 # backed off and grew in the run
    # clipping was active on some steps and not others
    clipped = [n is not None and n > MAX_NORM for _, n in ref_history]
    assert any(clipped) and not all(clipped)
    for (_, skipped, norm), (_, ref_norm) in zip(history, ref_history):
        if not skipped:
            assert norm == pytest.approx(ref_norm, rel=1e-5)
    _assert_close_training(model, opt, master, ref_opt)
    if mode == "exact":
        assert model.pipeline_stats()["exact_deferred_calls"] == STEPS


def test_exact_mode_without_waiting_between_calls_trains_the_same():
    """Each call waits only for the previous call's verdict (its scale) and for each layer's
    own update, never for the whole step."""
    master, ref_opt, _ = reference(stale=False)
    model, opt, scaler, _ = train_roundpipe("exact", sync_each=False)
    _assert_close_training(model, opt, master, ref_opt)


def test_the_asynchronous_step_is_the_one_step_stale_loop():
    master, ref_opt, ref_history = reference(stale=True)
    model, opt, scaler, _ = train_roundpipe("async")
    _assert_close_training(model, opt, master, ref_opt)


def test_a_skipped_step_changes_nothing():
    torch.manual_seed(0)
    model = RoundPipe(make_net().half(), optim_dtype=torch.float32, num_microbatch=M)
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=2.0**8)
    x, y = batch(0)
    model.forward_backward(input_args=(x.half(),), label=y, loss_fn=loss_fn, grad_scaler=scaler, loss_reduction="sum")
    model.step(opt, grad_scaler=scaler)
    before = ([p.clone() for p in model.optim_parameters()], copy.deepcopy(opt.state_dict()),
              [p.clone() for p in model.module.parameters()])
    MaybeInf.on = True
    try:
        model.forward_backward(input_args=(x.half(),), label=y, loss_fn=loss_fn, grad_scaler=scaler, loss_reduction="sum")
    finally:
        MaybeInf.on = False
    model.step(opt, grad_scaler=scaler, max_grad_norm=1.0)
    assert model.last_step_stats().skipped and scaler.get_scale() == 2.0**7
    for a, b in zip(model.optim_parameters(), before[0]):
        assert torch.equal(a, b)
    after = opt.state_dict()
    for k, v in before[1]["state"].items():
        for key, t in v.items():
            assert torch.equal(after["state"][k][key], t), key
    for a, b in zip(model.module.parameters(), before[2]):
        assert torch.equal(a, b)


def test_scaler_state_dict_resume_continues_identically():
    straight = train_roundpipe("step", steps=10)
    first = train_roundpipe("step", steps=6)
    model, opt, scaler, _ = first
    sd = {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}
    model2 = RoundPipe(make_net().half(), optim_dtype=torch.float32, num_microbatch=M)
    opt2 = rpo.AdamW(model2.optim_parameters(), lr=1e-2, eps=1e-3)
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["opt"])
    scaler2 = GradScaler()
    scaler2.load_state_dict(sd["scaler"])
    resumed = train_roundpipe("step", steps=4, scaler=scaler2, start=6, model=model2, opt=opt2)
    assert resumed[2].get_scale() == straight[2].get_scale()
    for a, b in zip(resumed[0].optim_parameters(), straight[0].optim_parameters()):
        assert torch.equal(a, b)


def test_clipping_without_a_scaler_and_the_documented_errors():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    model = RoundPipe(net, num_microbatch=2)
    opt = rpo.SGD(model.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step)
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, loss_reduction="sum")
        model.step(opt, max_grad_norm=0.05)
        for xm, ym in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)):
            loss_fn(ref(xm), ym).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        assert model.last_step_stats().grad_norm == pytest.approx(float(ref_norm), rel=1e-5)
        assert model.last_step_stats().scale == 1.0
    for p, q in zip(model.optim_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    x, y = batch(0)
    with pytest.raises(TypeError, match="max_grad_norm"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, max_grad_norm=1.0, loss_reduction="sum")
    with pytest.raises(ValueError, match="norm_type"):
        model.step(opt, max_grad_norm=1.0, norm_type=1)
    with pytest.raises(ValueError, match="max_grad_norm"):
        model.step(opt, max_grad_norm=-1.0)
    with pytest.raises(TypeError, match="GradScaler"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn,
                               grad_scaler=torch.amp.GradScaler("cpu"), loss_reduction="sum")
    scaler = GradScaler()
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, grad_scaler=scaler, loss_reduction="sum")
    with pytest.raises(ValueError, match="grad_scaler"):
        model.step(opt)                                      # the gradients are scaled
    with pytest.raises(ValueError, match="same grad_scaler"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, loss_reduction="sum")
    model.step(opt, grad_scaler=scaler)
    MaybeInf.on = False
    inf_net = nn.Sequential(nn.Linear(8, 8), MaybeInf(), nn.Linear(8, 4))
    inf_model = RoundPipe(inf_net)
    MaybeInf.on = True
    try:
        inf_model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, loss_reduction="sum")
    finally:
        MaybeInf.on = False
    with pytest.raises(RuntimeError, match="non-finite"):
        inf_model.step(rpo.SGD(inf_model.optim_parameters(), lr=0.1), max_grad_norm=1.0,
                       error_if_nonfinite=True)
