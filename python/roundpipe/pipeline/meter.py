"""Per-layer costs measured during training passes, for the stage planner
(:mod:`roundpipe.planner`, ``layers_per_stage="auto"``).

While a :class:`PassMeter` is given to a pass (:attr:`roundpipe.pipeline.stage.PassSpec.meter`),
every layer's run is timed with the device's marks (:meth:`roundpipe.transfer.DeviceIO.mark`:
the host clock on the CPU device, timing events on the compute stream on CUDA), every backward
of a stage's microbatch is timed whole, and every recomputation with autograd counts the bytes
of the tensors autograd saves for the backward (``torch.autograd.graph.saved_tensors_hooks``;
the stage's own weights, which are counted as weights, excluded; each storage once). After the
pass (whose end waits for the devices), :meth:`LayerMeter.fold` turns the marks into seconds.

Everything is kept per *element* of a microbatch (the element count of its first input tensor:
tokens for a Hugging Face model, rows times features for a plain one), so the costs follow the
batch's shape: a call whose microbatches are twice as large is predicted to take twice as long
and to keep twice the activations. A saved tensor whose size does not follow the microbatch
(the chunked loss's float32 gradient of the vocabulary projection, made in its forward: vocabulary
x hidden, whatever the tokens) is marked so by the code that saves it (:func:`fixed_size`) and
kept apart, in bytes per layer.

A layer's backward time is its stage's measured backward time shared among the stage's layers
in proportion to their recomputation times (autograd runs a stage's backward as one call). A
stage that keeps its saved tensors (:mod:`roundpipe.planner`) runs its layers with autograd in
its forward visit: those runs are measured as recomputations (the time keeping saves and the
bytes it holds per microbatch).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional

import torch

from ..torch_private import tree_flatten


_FIXED_SIZE = "_roundpipe_fixed_size"


def fixed_size(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Marks ``t``, a tensor an autograd function saves for its backward, as one whose size
    does not follow the microbatch's (the meter then counts it once per layer instead of per
    element); returns it. None passes through."""
    if t is not None:
        setattr(t, _FIXED_SIZE, True)
    return t


def microbatch_elements(microbatch: Any) -> int:
    """The size of a microbatch ``(args, kwargs, label)`` for the meter: the element count of
    its first input tensor (1 when it has none)."""
    args, kwargs, _ = microbatch
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            return max(leaf.numel(), 1)
    return 1


class PassMeter:
    """What one pass measured (see the module docstring); filled by the workers, read by
    :meth:`LayerMeter.fold` after the pass."""

    def __init__(self, elements: list[int]) -> None:
        self.elements = elements                   # per microbatch
        self._lock = threading.Lock()
        self.layers: list[tuple] = []              # (layer, grad, microbatch, io, start, end)
        self.backwards: list[tuple] = []           # (layers, microbatch, io, start, end)
        # (layer, microbatch) -> (bytes that follow the microbatch, bytes that do not)
        self.saved: dict[tuple[int, int], tuple[int, int]] = {}

    @contextlib.contextmanager
    def layer(self, io, index: int, *, microbatch: int, exclude: set[int]):
        """Around one layer's run on ``io``'s device: times it and, when autograd records,
        counts what it saves (storages in ``exclude``, the stage's weights, left out)."""
        grad = torch.is_grad_enabled()
        start = io.mark()
        if not grad:
            yield
            end = io.mark()
        else:
            seen: set[int] = set()
            total = [0, 0]  # per element, fixed (see fixed_size)

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in exclude and ptr not in seen:
                    seen.add(ptr)
                    total[1 if getattr(t, _FIXED_SIZE, False) else 0] += storage.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
            end = io.mark()
            with self._lock:
                key = (index, microbatch)
                old = self.saved.get(key, (0, 0))
                self.saved[key] = (max(old[0], total[0]), max(old[1], total[1]))
        with self._lock:
            self.layers.append((index, grad, microbatch, io, start, end))

    @contextlib.contextmanager
    def backward(self, io, layers: range, microbatch: int):
        """Around one microbatch's backward of the stage of ``layers``."""
        start = io.mark()
        yield
        end = io.mark()
        with self._lock:
            self.backwards.append((layers, microbatch, io, start, end))


class LayerMeter:
    """Per-layer costs per microbatch element, smoothed over the passes folded in (an
    exponential moving average with weight ``smoothing`` for the newest pass).

    Attributes:
        forward_s: per layer, seconds per element without autograd (None: never measured).
        recompute_s: per layer, seconds per element of a run with autograd.
        backward_s: per layer, its share of its stage's backward, seconds per element.
        act_bytes: per layer, the largest bytes per element autograd kept for it.
        fixed_bytes: per layer, the largest bytes it kept whose size does not follow the
            microbatch (:func:`fixed_size`).
        passes: training passes folded in.
    """

    def __init__(self, num_layers: int, smoothing: float = 0.5) -> None:
        self.smoothing = smoothing
        self.forward_s: list[Optional[float]] = [None] * num_layers
        self.recompute_s: list[Optional[float]] = [None] * num_layers
        self.backward_s: list[Optional[float]] = [None] * num_layers
        self.act_bytes: list[float] = [0.0] * num_layers
        self.fixed_bytes: list[int] = [0] * num_layers
        self.passes = 0

    def _blend(self, old: Optional[float], new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def fold(self, meter: PassMeter) -> None:
        """Turns a finished pass's marks into seconds per element and folds them in."""
        sums: dict[tuple[int, bool], list[float]] = {}
        per_mb: dict[tuple[int, int], float] = {}       # (layer, microbatch) -> recompute s
        for index, grad, m, io, start, end in meter.layers:
            seconds = io.seconds(start, end)
            sums.setdefault((index, grad), []).append(seconds / meter.elements[m])
            if grad:
                per_mb[(index, m)] = seconds
        for (index, grad), values in sums.items():
            value = sum(values) / len(values)
            if grad:
                self.recompute_s[index] = self._blend(self.recompute_s[index], value)
            else:
                self.forward_s[index] = self._blend(self.forward_s[index], value)
        shares: dict[int, list[float]] = {}
        for layers, m, io, start, end in meter.backwards:
            seconds = io.seconds(start, end)
            weights = [per_mb.get((li, m), 0.0) for li in layers]
            total = sum(weights)
            for li, w in zip(layers, weights):
                share = w / total if total > 0 else 1.0 / len(layers)
                shares.setdefault(li, []).append(seconds * share / meter.elements[m])
        for li, values in shares.items():
            self.backward_s[li] = self._blend(self.backward_s[li], sum(values) / len(values))
        for (index, m), (nbytes, fixed) in meter.saved.items():
            self.act_bytes[index] = max(self.act_bytes[index], nbytes / meter.elements[m])
            self.fixed_bytes[index] = max(self.fixed_bytes[index], fixed)
        self.passes += 1

    def measured(self) -> bool:
        """Whether every layer has a time (a forward or a recomputation)."""
        return all(f is not None or r is not None
                   for f, r in zip(self.forward_s, self.recompute_s))
