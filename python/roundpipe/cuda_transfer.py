"""Transfers for CUDA compute devices: pinned host memory, one stream per kind of traffic,
events between them, prefetch of the next stage's weights.

Imported only when a CUDA device is given to ``RoundPipe`` (never at ``import roundpipe``), so
CPU-only use never touches CUDA. Per device (:class:`CudaIO`, used by that device's worker only):

- ``weights`` stream: uploads of stage weights from the (pinned) host model copy;
- ``acts`` stream: uploads of stage inputs, labels and input gradients;
- ``compute`` stream: the layers, forward and backward (autograd runs a backward op on the
  stream of its forward op);
- ``down`` stream: stage outputs, input gradients, parameter gradients and losses to the host,
  into pinned buffers (parameter gradients into reusable ones).

Streams are ordered by events only (``Stream.wait_event``); the host waits on an event only
where the host itself reads the data (adding gradients into the host buffers, the loss and
outputs at the end of the call). Tensors used on another stream than the one that allocated
them are marked with ``record_stream`` so the caching allocator does not reuse their memory
too early. With prefetch the next stage's weights are uploaded while the current stage
computes: at most two stages' weights are resident per device.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .transfer import HostIO, LayerWeights


def _unique_tensors(model: nn.Module) -> tuple[list[nn.Parameter], dict[int, list]]:
    """The model's parameters (each once) and its buffers: id -> every (module, name) that
    holds that tensor (a buffer shared by several modules is replaced in all of them)."""
    params, seen = [], set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    buffers: dict[int, list] = {}
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None:
                buffers.setdefault(id(b), []).append((module, name))
    return params, buffers


def pin_host_model(model: nn.Module, mode: str) -> str:
    """Puts the host model copy (parameters and buffers) in page-locked memory, so uploads are
    asynchronous DMA copies. ``mode``: ``"alloc"`` (copy each tensor into pinned memory;
    ``"auto"`` means this), ``"register"`` (pin the existing memory in place with
    ``cudaHostRegister``; unregistered when the model is garbage collected), ``"off"``
    (pageable). If pinning fails (e.g. the OS limit on locked memory), the rest stays pageable
    and a ``UserWarning`` says so. Returns the mode in effect (``"off"`` after a failure)."""
    if mode == "off":
        return "off"
    params, buffers = _unique_tensors(model)
    try:
        if mode in ("auto", "alloc"):
            with torch.no_grad():
                for p in params:
                    if not p.data.is_pinned():
                        p.data = p.data.pin_memory()
                for holders in buffers.values():
                    b = holders[0][0]._buffers[holders[0][1]]
                    if not b.is_pinned():
                        pinned = b.pin_memory()
                        for module, name in holders:
                            module._buffers[name] = pinned
            return "alloc"
        cudart = torch.cuda.cudart()
        registered = []
        tensors = [p.data for p in params] + [h[0][0]._buffers[h[0][1]] for h in buffers.values()]
        for t in tensors:
            if t.is_pinned() or t.numel() == 0:
                continue
            err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            if int(getattr(err, "value", err)) != 0:
                for ptr in registered:
                    cudart.cudaHostUnregister(ptr)
                raise RuntimeError(f"cudaHostRegister failed ({err})")
            registered.append(t.data_ptr())
        weakref.finalize(model, _unregister, registered)
        return "register"
    except RuntimeError as e:
        warnings.warn(f"RoundPipe: could not pin the host model copy ({e}); using pageable "
                      "memory (uploads are synchronous and slower)", UserWarning, stacklevel=3)
        return "off"


def _pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor (from torch's caching host allocator)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _unregister(pointers: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for ptr in pointers:
        cudart.cudaHostUnregister(ptr)


class CudaIO(HostIO):
    """:class:`roundpipe.transfer.HostIO` for one CUDA device (see the module docstring)."""

    def __init__(self, device: torch.device, prefetch: bool) -> None:
        super().__init__(device)
        self.prefetch = prefetch
        self._streams = None
        self._grad_buffers: dict[tuple, torch.Tensor] = {}
        self._timings: list[tuple] = []  # (kind, start event, end event, bytes), in order
        self._totals = {"weights_wait_s": 0.0, "upload_s": 0.0, "upload_bytes": 0.0}

    def _event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    @contextlib.contextmanager
    def activate(self):
        with torch.cuda.device(self.device):
            if self._streams is None:
                self.compute, self.weights, self.acts, self.down = (
                    torch.cuda.Stream(self.device) for _ in range(4))
                self._streams = True
            with torch.cuda.stream(self.compute):
                yield

    def upload(self, layers: list[nn.Module], with_grad: bool) -> tuple[list[LayerWeights], Any]:
        start, end = self._event(True), self._event(True)
        nbytes = 0
        out = []
        with torch.cuda.stream(self.weights):
            start.record(self.weights)
            for layer in layers:
                tensors, trainable, buffers = {}, [], []
                for name, p in layer.named_parameters():
                    t = torch.empty_like(p, device=self.device)
                    t.copy_(p.detach(), non_blocking=True)
                    nbytes += t.numel() * t.element_size()
                    if with_grad and p.requires_grad:
                        t.requires_grad_(True)
                        trainable.append((name, p))
                    tensors[name] = t
                for name, b in layer.named_buffers():
                    t = torch.empty_like(b, device=self.device)
                    t.copy_(b, non_blocking=True)
                    tensors[name] = t
                    buffers.append((name, b))
                for t in tensors.values():
                    t.record_stream(self.compute)
                out.append(LayerWeights(tensors, trainable, buffers))
            end.record(self.weights)
        self._time("upload", start, end, nbytes)
        return out, end

    def wait_weights(self, event: Any) -> float:
        before, after = self._event(True), self._event(True)
        before.record(self.compute)
        self.compute.wait_event(event)
        after.record(self.compute)
        self._time("wait", before, after, 0)
        return 0.0  # measured on the device: see collect()

    def _time(self, kind: str, start, end, nbytes: int) -> None:
        """Keeps a measurement; completed ones are folded into the totals as they come (a
        non-blocking query), so the list stays short when nobody collects."""
        self._timings.append((kind, start, end, nbytes))
        while len(self._timings) > 64 and self._timings[0][2].query():
            self._fold(self._timings.pop(0))

    def _fold(self, timing: tuple) -> None:
        kind, a, b, nbytes = timing
        seconds = a.elapsed_time(b) / 1e3
        if kind == "wait":
            self._totals["weights_wait_s"] += seconds
        else:
            self._totals["upload_s"] += seconds
            self._totals["upload_bytes"] += nbytes

    def collect(self) -> dict[str, float]:
        """Device-side measurements since the last call (waits for their events): seconds the
        compute stream waited for weights, upload seconds and bytes."""
        timings, self._timings = self._timings, []
        for t in timings:
            t[2].synchronize()
            self._fold(t)
        out, self._totals = self._totals, dict.fromkeys(self._totals, 0.0)
        return out

    def to_device(self, tree: Any, event: Any, leaf_grad: bool) -> Any:
        done = self._event()
        with torch.cuda.stream(self.acts):
            if event is not None:
                self.acts.wait_event(event)

            def move(x):
                if not isinstance(x, torch.Tensor):
                    return x
                t = x.detach().to(self.device, non_blocking=True)
                t.record_stream(self.compute)
                if leaf_grad and t.is_floating_point():
                    t.requires_grad_(True)
                return t

            out = tree_map(move, tree)
            done.record(self.acts)
        self.compute.wait_event(done)
        return out

    def _after_compute(self) -> None:
        ready = self._event()
        ready.record(self.compute)
        self.down.wait_event(ready)

    def to_host(self, tree: Any) -> tuple[Any, Any]:
        self._after_compute()
        done = self._event()
        with torch.cuda.stream(self.down):
            def move(x):
                if not isinstance(x, torch.Tensor):
                    return x
                h = _pinned_empty(x.shape, x.dtype)
                h.copy_(x.detach(), non_blocking=True)
                x.record_stream(self.down)
                return h

            out = tree_map(move, tree)
            done.record(self.down)
        return out, done

    def scalar_to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.to_host(t)

    def grads_to_host(self, weights: list[LayerWeights], parity: int) -> tuple[list, Any]:
        self._after_compute()
        done = self._event()
        out, seen = [], {}
        with torch.cuda.stream(self.down):
            for w in weights:
                for name, host in w.trainable:
                    t = w.tensors[name]
                    if t.grad is None:
                        continue
                    k = seen[id(host)] = seen.get(id(host), -1) + 1
                    key = (id(host), k, parity)
                    buf = self._grad_buffers.get(key)
                    if buf is None or buf.shape != t.grad.shape or buf.dtype != t.grad.dtype:
                        buf = _pinned_empty(t.grad.shape, t.grad.dtype)
                        self._grad_buffers[key] = buf
                    buf.copy_(t.grad, non_blocking=True)
                    t.grad.record_stream(self.down)
                    t.grad = None
                    out.append((name, host, buf))
            done.record(self.down)
        return out, done

    def host_wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def download_buffers(self, weights: list[LayerWeights]) -> None:
        """Buffers (e.g. BatchNorm statistics) go back synchronously: the next upload of the
        layer, possibly on another device, must see them (a host synchronisation, only for
        layers with buffers in training mode)."""
        with torch.no_grad():
            for w in weights:
                for name, host in w.buffers:
                    host.copy_(w.tensors[name])

