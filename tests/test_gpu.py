"""CUDA checks, skipped without a GPU: the same training on the GPU as on the CPU path, inputs
given on the host, and device memory bounded by one stage's weights plus activations.

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
