"""The device-memory bound, held on the CPU device where CI runs: what the pipeline keeps alive
of what it put on a device is logic, not CUDA, so it is counted here with weak references on
every tensor the device I/O returned, and a GPU run only confirms it (``tests/test_gpu.py``).

The rule (docs/overlap.md): on each device, at most two stages' weights (the one computing and
the next one's prefetch), one stage's gradient sums and one microbatch's activations (the one
being issued, beside the one computing) are alive, plus what the stages that do not recompute
keep from their forward visit to their backward visit (their weights and every microbatch's
input and saved tensors); nothing a call put on a device outlives the call, and nothing
accumulates call after call. Python's cyclic collector is switched off while
a test runs, so a reference cycle (which frees device memory only whenever the collector happens
to run) counts as retention, as it does on a GPU.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections import defaultdict

import pytest
import torch
from torch import nn

import roundpipe.optim as rpo
import roundpipe.staging
from roundpipe import RoundPipe
from roundpipe.transfer import base as transfer_base

from pipeline_models import causal_lm, small_device


class Uploads:
    """Weak references, per device, to the tensors of every stage upload and every activation
    copy the device I/O made (the CPU device's gradient sums are host memory handed to the
    optimizer side, so they are not counted here); at each new upload, the number of earlier
    ones still alive on the same device is recorded (its maximum is what a test bounds)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refs: dict[str, list[list[weakref.ref]]] = defaultdict(list)  # "kind@device" -> groups
        self.most_alive: dict[str, int] = defaultdict(int)

    @staticmethod
    def _alive(group: list) -> bool:
        return any(r() is not None for r in group)

    def add(self, kind: str, io, tensors) -> None:
        key = f"{kind}@{id(io)}"
        group = [weakref.ref(t) for t in tensors]
        with self.lock:
            earlier = sum(self._alive(g) for g in self.refs[key])
            self.most_alive[kind] = max(self.most_alive[kind], earlier)
            self.refs[key].append(group)

    def alive(self, kind: str) -> int:
        with self.lock:
            return sum(self._alive(g) for key, groups in self.refs.items()
                       if key.startswith(kind + "@") for g in groups)

    def total(self, kind: str) -> int:
        return sum(len(groups) for key, groups in self.refs.items() if key.startswith(kind + "@"))


@pytest.fixture
def uploads(monkeypatch):
    """Counts what :class:`DeviceIO` puts on a device (see :class:`Uploads`), with the cyclic
    garbage collector off."""
    seen = Uploads()
    upload, to_device = transfer_base.DeviceIO.upload, transfer_base.DeviceIO.to_device

    def counted_upload(io, layers, with_grad):
        weights, event = upload(io, layers, with_grad)
        seen.add("weights", io, [t for placed in weights.layers for _, t in placed])
        return weights, event

    def counted_to_device(io, tree, event, kind):
        out = to_device(io, tree, event, kind)
        if kind == "activation":
            leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            seen.add("activation", io, leaves)
        return out

    monkeypatch.setattr(transfer_base.DeviceIO, "upload", counted_upload)
    monkeypatch.setattr(transfer_base.DeviceIO, "to_device", counted_to_device)
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield seen
    finally:
        if enabled:
            gc.enable()


def _mlp(layers: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(layers - 1)],
                         nn.Linear(32, 4))


def _train(model: RoundPipe, mode: str, calls: int, x, y, loss_fn, per_call=None) -> None:
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-3, eps=1e-3)
    for _ in range(calls):
        if mode == "exact":
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=opt)
        else:
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            model.step(opt, is_async=mode == "async")
        if per_call is not None:
            per_call()
    model.synchronize()


MODES = ("sync", "async", "exact")


def _kept_per_device(model: RoundPipe) -> int:
    """The most stages one device keeps from their forward visit to their backward visit."""
    plan, D = model.plan(), len(model.devices)
    kept = [0] * D
    for s in range(len(plan.sizes) - 1):
        kept[s % D] += not plan.recomputes(s)
    return max(kept)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("microbatches", [1, 3])
@pytest.mark.parametrize("devices,prefetch", [(["cpu"], False), (["cpu"], True),
                                              (["cpu", "cpu"], True)])
@pytest.mark.parametrize("recompute", [True, False])
def test_at_most_two_stages_of_weights_and_nothing_after_the_call(uploads, mode, microbatches,
                                                                  devices, prefetch, recompute):
    """8 one-layer stages of a bf16 model with float32 master weights (gradients summed on the
    device in float32 when there are several microbatches). Every stage recomputing: during
    each call at most one earlier stage upload is alive on a device when the next is made
    (two stages resident), one earlier microbatch's activations, and every stage but the last
    is uploaded twice. No stage recomputing: each stage is uploaded once per call, and what
    is alive beyond that is what the kept stages hold (their weights, every microbatch's
    input). After each call and its step nothing is alive, three calls in a row."""
    model = RoundPipe(_mlp().to(torch.bfloat16), optim_dtype=torch.float32, device=devices,
                      num_microbatch=microbatches, prefetch=prefetch, recompute=recompute)
    x, y = torch.randn(12, 32).bfloat16(), torch.randn(12, 4)
    after = []

    def count():
        model.synchronize()
        after.append({k: uploads.alive(k) for k in ("weights", "activation")})

    _train(model, mode, 3, x, y, lambda o, t: ((o.float() - t) ** 2).mean(), count)
    kept = _kept_per_device(model)
    assert kept == (0 if recompute else 7 // len(devices) + (len(devices) == 2))
    assert uploads.total("weights") == 3 * (8 if kept else 15)  # a kept stage: uploaded once
    assert after == [{"weights": 0, "activation": 0}] * 3
    assert uploads.most_alive["weights"] <= kept + (1 if prefetch else 0)
    assert uploads.most_alive["activation"] <= kept * microbatches + 1


@pytest.mark.parametrize("mode", MODES)
def test_the_bound_follows_planned_recomputation(uploads, mode):
    """``recompute="auto"`` (the default) with a budget that holds some of the 8 stages'
    saved tensors but not all: the planner keeps some and recomputes the rest, the plan it
    prints fits the budget, and what is alive follows it (the kept stages' weights and inputs
    beside the usual two stages and one microbatch), nothing after the call."""
    with small_device(45_000):
        model = RoundPipe(_mlp().to(torch.bfloat16), optim_dtype=torch.float32, device="cpu",
                          num_microbatch=3, memory_budget=1.0)
    x, y = torch.randn(12, 32).bfloat16(), torch.randn(12, 4)
    _train(model, mode, 4, x, y, lambda o, t: ((o.float() - t) ** 2).mean())
    plan, kept = model.plan(), _kept_per_device(model)
    assert 0 < kept < 7 and "recompute" in plan.reason and "keep" in plan.reason, plan
    held = [b for s, b in enumerate(plan.stage_bytes[:-1]) if not plan.recomputes(s)]
    streamed = [b for s, b in enumerate(plan.stage_bytes) if plan.recomputes(s)]
    assert sum(held) + 2 * max(streamed + [plan.stage_bytes[-1]]) <= 45_000
    assert uploads.alive("weights") == 0 and uploads.alive("activation") == 0
    assert uploads.most_alive["weights"] <= kept + 1
    assert uploads.most_alive["activation"] <= 3 * kept + 1


@pytest.mark.parametrize("mode", MODES)
def test_the_bound_follows_an_automatic_plan(uploads, mode, monkeypatch):
    """``layers_per_stage="auto"`` with a budget of about three layers (0.6 of a 100 kB
    device): the planned stages (of several layers) obey the same bound as one-layer stages."""
    monkeypatch.setattr(roundpipe.staging, "device_memory", lambda devices: 100_000)
    model = RoundPipe(_mlp().to(torch.bfloat16), optim_dtype=torch.float32, device="cpu",
                      num_microbatch=3, layers_per_stage="auto", memory_budget=0.6)
    x, y = torch.randn(12, 32).bfloat16(), torch.randn(12, 4)
    _train(model, mode, 4, x, y, lambda o, t: ((o.float() - t) ** 2).mean())
    assert 1 < len(model.plan().sizes) < 8 and max(model.plan().sizes) > 1
    assert uploads.alive("weights") == 0 and uploads.alive("activation") == 0
    kept = _kept_per_device(model)
    assert uploads.most_alive["weights"] <= kept + 1
    assert uploads.most_alive["activation"] <= 3 * kept + 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recompute", [True, False])
def test_hugging_face_lora_model_keeps_nothing_after_the_call(uploads, mode, recompute):
    """A tiny Llama with LoRA adapters (frozen base, trainable adapters), bf16, three
    microbatches: the same bound over its embedding, decoder layers and head."""
    peft = pytest.importorskip("peft")
    import roundpipe
    net = causal_lm("llama", num_hidden_layers=3).to(torch.bfloat16)
    net = peft.get_peft_model(net, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model = roundpipe.wrap_model_to_roundpipe(net, torch.float32, num_microbatch=3, device="cpu",
                                              recompute=recompute)
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-3, eps=1e-3)
    ids = torch.randint(0, 101, (6, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        kw = {"input_kwargs": {"input_ids": ids, "labels": ids}}
        if mode == "exact":
            model.forward_backward(**kw, optimizer=opt)
        else:
            model.forward_backward(**kw)
            model.step(opt, is_async=mode == "async")
        model.synchronize()
        assert uploads.alive("weights") == 0
        assert uploads.alive("activation") == 0
    kept = 0 if recompute else 3  # 3 decoder layers; the frozen embedding has no backward visit
    assert model.plan().recompute == ((True,) * 4 if recompute else (False,) * 4) + (False,)
    assert uploads.most_alive["weights"] <= kept + 1
    assert uploads.most_alive["activation"] <= 3 * kept + 1


@pytest.mark.parametrize("recompute", [True, False])
def test_a_failed_call_keeps_nothing(uploads, recompute):
    """A loss_fn raising in the backward of the last stage: the error reaches the caller and
    nothing the call uploaded stays alive (the traceback does not hold the stage)."""
    model = RoundPipe(_mlp().to(torch.bfloat16), optim_dtype=torch.float32, device="cpu",
                      num_microbatch=3, recompute=recompute)
    x, y = torch.randn(12, 32).bfloat16(), torch.randn(12, 4)

    def bad_loss(o, t):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=bad_loss)
    model.synchronize()
    assert uploads.alive("weights") == 0
    assert uploads.alive("activation") == 0
