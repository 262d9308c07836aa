"""Transfer: moving a stage's weights to its compute device and its results back to the host.

A stage's weights are copied from the host model copy for the time the stage runs and dropped
afterwards; nothing of a stage stays on the device between uses.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from . import microbatch as mb


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


class HostIO:
    """How a worker moves tensors between the host and its compute device. This class is the
    CPU compute device: every copy is synchronous, nothing is prefetched and every event is
    ``None``; :class:`roundpipe.cuda_transfer.CudaIO` is the CUDA device (streams, events,
    pinned buffers, prefetch). One instance per device, used by that device's worker only.
    """

    prefetch = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._upload_s = 0.0
        self._upload_bytes = 0

    def activate(self):
        """Context the worker runs a pass in (CUDA: its device and compute stream)."""
        return contextlib.nullcontext()

    def upload(self, layers: list[nn.Module], with_grad: bool) -> tuple[list[LayerWeights], Any]:
        """The stage's weights on the device (see :func:`upload_layer`) and an event marking
        the end of their copy (``None`` here)."""
        start = time.perf_counter()
        weights = [upload_layer(layer, self.device, with_grad) for layer in layers]
        self._upload_s += time.perf_counter() - start
        self._upload_bytes += sum(t.numel() * t.element_size()
                                  for w in weights for t in w.tensors.values())
        return weights, None

    def collect(self) -> dict[str, float]:
        """Measurements since the last call: seconds the device waited for weights (here the
        synchronous copies), seconds and bytes of weight uploads."""
        out = {"weights_wait_s": self._upload_s, "upload_s": self._upload_s,
               "upload_bytes": float(self._upload_bytes)}
        self._upload_s, self._upload_bytes = 0.0, 0
        return out

    def wait_weights(self, event: Any) -> float:
        """Makes the compute wait for an :meth:`upload`; returns the seconds of device time
        spent waiting when that is measured (0 here: the copy already happened)."""
        return 0.0

    def to_device(self, tree: Any, event: Any, leaf_grad: bool) -> Any:
        """A host tree (made ready by ``event``) on the device. With ``leaf_grad`` its floating
        tensors are detached leaves that require grad (a stage input in the backward pass)."""
        if not leaf_grad:
            return mb.to_device(tree, self.device)
        x = mb.detach_to(tree, self.device)
        for t in tree_flatten(x)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.requires_grad_(True)
        return x

    def to_host(self, tree: Any) -> tuple[Any, Any]:
        """A device tree detached and copied to the host, and the event marking the copy."""
        return mb.detach_to(tree, torch.device("cpu")), None

    def grads_to_host(self, weights: list[LayerWeights], parity: int) -> tuple[list, Any]:
        """``[(host parameter, gradient on the host)]`` for every trainable device tensor that
        has a gradient (clearing it), in layer order, and the event marking the copies. The
        host gradients are only valid until the call after next with the same ``parity``."""
        out = []
        for w in weights:
            for name, host in w.trainable:
                t = w.tensors[name]
                if t.grad is not None:
                    out.append((name, host, t.grad.to("cpu")))
                    t.grad = None
        return out, None

    def host_wait(self, event: Any) -> None:
        """Blocks the calling thread until a device-to-host copy marked by ``event`` is done."""

    def scalar_to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return t.to("cpu"), None

    def download_buffers(self, weights: list[LayerWeights]) -> None:
        """Writes the stage's device buffers back into the host model copy (see
        :func:`download_buffers`)."""
        download_buffers(weights)
