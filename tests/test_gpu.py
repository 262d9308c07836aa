"""CUDA checks, skipped without a GPU: the same training on the GPU as on the CPU path, inputs
given on the host, and device memory bounded by one stage's weights plus activations; for the
overlapped pipeline: the synchronous, asynchronous and exact modes on CUDA against the CPU path,
two GPUs against one, peak memory within two stages plus activations (prefetch on and off), no
host synchronisation in the steady state, the pinned-memory modes and their fallback, upload
bandwidth measured.

    pytest tests/test_gpu.py        # on a machine with CUDA
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import roundpipe.optim as rpo
from roundpipe import OptimizerCtx, RoundPipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)],
                         nn.Linear(256, 8))


def _train(device, steps=5):
    model = RoundPipe(_model(), device=device, num_microbatch=3)
    with OptimizerCtx():
        opt = rpo.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x, y = torch.randn(12, 256, generator=g), torch.randn(12, 8, generator=g)  # on the host
        torch.manual_seed(step)
        loss = model.forward_backward(input_args=(x,), label=y,
                                      loss_fn=lambda o, t: ((o - t) ** 2).mean() / 3)
        model.step(lambda: (opt.step(), opt.zero_grad()))
        losses.append(loss.item())
    return losses, model


def test_cuda_training_matches_the_cpu_path():
    cpu_losses, cpu_model = _train("cpu")
    gpu_losses, gpu_model = _train("cuda")
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)  # TF32 off by default for matmul
    for (_, a), (_, b) in zip(cpu_model.optim_named_parameters(), gpu_model.optim_named_parameters()):
        assert b.device.type == "cpu"
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_device_memory_holds_one_stage_at_a_time():
    net = _model()
    stage_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in net)
    total_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    model = RoundPipe(net, device="cuda", num_microbatch=2)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    x, y = torch.randn(8, 256), torch.randn(8, 8)
    model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    peak = torch.cuda.max_memory_allocated() - base
    activations = 8 * 256 * 4 * 16  # generous: a few activations and their gradients
    assert peak <= 2 * stage_bytes + activations < total_bytes, (peak, stage_bytes, total_bytes)


# --- overlapped modes, streams, pinned memory, several GPUs (issue #8) --------------------------

def _train_mode(device, mode, steps=4, **kwargs):
    """plain: forward_backward + step(opt); async: step(opt, is_async=True); exact:
    forward_backward(optimizer=opt). bf16 model, fp32 master weights."""
    model = RoundPipe(_model().to(torch.bfloat16), optim_dtype=torch.float32, device=device,
                      num_microbatch=3, **kwargs)
    with OptimizerCtx():
        opt = rpo.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(12, 256, generator=g).bfloat16()
        y = torch.randn(12, 8, generator=g)
        torch.manual_seed(step)
        kw = dict(input_args=(x,), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean() / 3)
        if mode == "exact":
            loss = model.forward_backward(**kw, optimizer=opt)
        else:
            loss = model.forward_backward(**kw)
            model.step(opt, is_async=mode == "async")
        losses.append(loss.item())
    model.synchronize()
    return losses, model


@pytest.mark.parametrize("mode", ["plain", "async", "exact"])
def test_cuda_overlapped_modes_match_the_cpu_path(mode):
    cpu_losses, cpu = _train_mode("cpu", mode)
    gpu_losses, gpu = _train_mode("cuda", mode)
    assert gpu.pin_memory == "alloc"
    assert all(p.is_pinned() for p in gpu.module.parameters())
    assert gpu_losses == pytest.approx(cpu_losses, rel=2e-2)   # bf16 compute on two backends
    for (_, a), (_, b) in zip(cpu.optim_named_parameters(), gpu.optim_named_parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_give_the_one_gpu_results():
    one_losses, one = _train_mode("cuda:0", "exact")
    two_losses, two = _train_mode(["cuda:0", "cuda:1"], "exact")
    assert two_losses == pytest.approx(one_losses, rel=1e-6)
    for (_, a), (_, b) in zip(one.optim_named_parameters(), two.optim_named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("prefetch", [True, False])
def test_peak_memory_within_two_stages_plus_activations(prefetch):
    net = _model()
    stage_bytes = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in net)
    total_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    model = RoundPipe(net, device="cuda", num_microbatch=2, prefetch=prefetch)
    opt = rpo.SGD(model.optim_parameters(), lr=0.01)
    x, y = torch.randn(8, 256), torch.randn(8, 8)
    kw = dict(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    model.forward_backward(**kw, optimizer=opt)        # warm-up: streams, pinned buffers
    model.synchronize()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model.forward_backward(**kw)
    model.step(opt, is_async=True)
    model.forward_backward(**kw)
    model.synchronize()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    activations = 8 * 256 * 4 * 16
    assert peak <= 2 * stage_bytes + activations < total_bytes, (peak, stage_bytes, total_bytes)


def test_no_host_synchronisation_in_the_steady_state():
    model = RoundPipe(_model().to(torch.bfloat16), optim_dtype=torch.float32, device="cuda",
                      num_microbatch=3)
    with OptimizerCtx():
        opt = rpo.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    x, y = torch.randn(12, 256).bfloat16(), torch.randn(12, 8)
    kw = dict(input_args=(x,), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean())
    for _ in range(2):                                  # warm-up
        model.forward_backward(**kw)
        model.step(opt, is_async=True)
    model.synchronize()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")             # a synchronising CUDA call raises
    try:
        for _ in range(2):
            model.forward_backward(**kw)                # its errors reach us from the workers
            model.step(opt, is_async=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    model.synchronize()


@pytest.mark.parametrize("mode", ["alloc", "register", "off"])
def test_pin_memory_modes(mode):
    net = _model()
    model = RoundPipe(net, device="cuda", pin_memory=mode)
    assert model.pin_memory == mode
    assert all(p.is_pinned() == (mode != "off") for p in net.parameters())
    x, y = torch.randn(4, 256), torch.randn(4, 8)
    model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean())


def test_pinning_failure_falls_back_to_pageable_with_a_warning(monkeypatch):
    def fail(self, *a, **k):
        raise RuntimeError("no pinned memory left")

    monkeypatch.setattr(torch.Tensor, "pin_memory", fail)
    with pytest.warns(UserWarning, match="pageable"):
        model = RoundPipe(_model(), device="cuda")
    assert model.pin_memory == "off"
    x, y = torch.randn(4, 256), torch.randn(4, 8)
    model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean())


def test_upload_bandwidth_is_measured():
    model = RoundPipe(_model(), device="cuda")
    x, y = torch.randn(4, 256), torch.randn(4, 8)
    model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    stats = model.pipeline_stats()
    assert stats["upload_bytes"] > 0 and stats["upload_s"] > 0
