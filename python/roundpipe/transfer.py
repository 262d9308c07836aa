"""Transfer: moving a stage's weights to its compute device and its results back to the host.

A stage's weights are copied from the host model copy for the time the stage runs and dropped
afterwards; nothing of a stage stays on the device between uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LayerWeights:
    """One layer's tensors on the compute device, keyed by the layer's own names."""

    tensors: dict[str, torch.Tensor]
    # (name, host parameter) of the trainable parameters whose device copies require grad
    trainable: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    buffers: list[tuple[str, torch.Tensor]] = field(default_factory=list)


def upload_layer(layer: nn.Module, device: torch.device, with_grad: bool) -> LayerWeights:
    """Copies a layer's parameters and buffers to ``device`` (always a new tensor, also on the
    CPU). With ``with_grad``, copies of trainable parameters require grad, so a backward pass
    leaves their gradients in ``.grad``."""
    tensors: dict[str, torch.Tensor] = {}
    trainable = []
    for name, p in layer.named_parameters():
        t = p.detach().to(device, copy=True)
        if with_grad and p.requires_grad:
            t.requires_grad_(True)
            trainable.append((name, p))
        tensors[name] = t
    buffers = []
    for name, b in layer.named_buffers():
        tensors[name] = b.detach().to(device, copy=True)
        buffers.append((name, b))
    return LayerWeights(tensors, trainable, buffers)


def download_buffers(stage_weights: list[LayerWeights]) -> None:
    """Writes a stage's (possibly updated, e.g. BatchNorm running statistics) device buffers
    back into the host model copy."""
    with torch.no_grad():
        for weights in stage_weights:
            for name, host in weights.buffers:
                host.copy_(weights.tensors[name])
