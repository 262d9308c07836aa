"""The stage: one visit of a stage on its device, run one microbatch (*chunk*) at a time by
the schedule's executor (:mod:`roundpipe.pipeline.run`), as ``torch.distributed.pipelining``'s
``forward_one_chunk`` / ``backward_one_chunk``.

- forward visit (:meth:`StageVisit.forward_one_chunk`): the stage's layers on a copy of the
  microbatch's stage input, without autograd; the output goes to the host;
- backward visit (:meth:`StageVisit.backward_one_chunk`): the layers recomputed with autograd
  on a copy of the same input, then the backward from the next stage's input gradient (for
  the last stage: its only forward, the loss of the microbatch and the backward from it);
  parameter gradients are summed on the device over the visit's microbatches and downloaded
  once by :meth:`StageVisit.finish`; the gradient of the stage input goes to the host;
- a *kept* stage (one that does not recompute, :mod:`roundpipe.planner`): its forward visit
  runs the layers with autograd (:meth:`StageVisit.keep_one_chunk`) and the visit, with its
  weights and every microbatch's graph, lives on until its backward visit, which runs only the
  backward (:meth:`StageVisit.backward_kept_chunk`), each microbatch's graph freed after it.

Stage inputs that need a gradient (floating tensors, when an earlier stage has trainable
parameters) become leaves that collect it; the layers see a copy of each made by autograd
(``clone``, whose backward passes the gradient through in C++), so a layer may modify its input
in place as it could in plain PyTorch. (An alias made by a custom ``autograd.Function`` avoided
the copy, but its backward ran Python in the autograd engine for every stage and microbatch: it
cost more than a small layer's compute.)
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from ..plan import Stage
from ..torch_private import run_backward, tree_flatten, tree_unflatten
from ..transfer import DeviceIO, GradDownload, StageWeights, io_scope
from .execute import run_layers
from .meter import PassMeter

if TYPE_CHECKING:
    from .fetch import Carry


@dataclass(frozen=True)
class AutocastState:
    """The caller's ``torch.autocast`` state, entered around every layer forward and loss on
    the worker threads (autocast is thread local)."""

    cpu: tuple[bool, torch.dtype]
    cuda: Optional[tuple[bool, torch.dtype]]
    cache: bool

    @staticmethod
    def capture() -> "AutocastState":
        cpu = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        cuda = None
        if torch.is_autocast_enabled("cuda"):
            cuda = (True, torch.get_autocast_dtype("cuda"))
        return AutocastState(cpu, cuda, torch.is_autocast_cache_enabled())

    def enter(self, device_type: str):
        state = self.cuda if device_type == "cuda" else self.cpu
        if state is None or not state[0]:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=state[1], cache_enabled=self.cache)


@dataclass
class PassSpec:
    """What one call asks of the pipeline.

    Attributes:
        microbatches: ``(args, kwargs, label)`` per microbatch, on the host.
        training: a ``forward_backward`` call (else ``forward``).
        loss_fn: ``loss_fn(output, label)`` (``loss_fn(output)`` without labels).
        has_label: whether a label was given.
        return_outputs: keep the last stage's outputs (training).
        call_seed: the call's seed (see :func:`roundpipe.layer_seed`).
        autocast: the caller's autocast state.
        store: data layers keep for their recomputation (see :mod:`roundpipe.recompute`).
        loss_scale: each microbatch's loss is multiplied by it (a float32, as torch's
            GradScaler) before its backward; the reported loss is not.
        want_norms: compute each downloaded gradient's squared norm on the device (a step
            with a loss scaler or clipping needs them).
        loss_weights: per microbatch, the factor its loss is multiplied by before its
            backward and in the reported loss (its share of the batch; None: 1 for every
            microbatch, the ``"sum"`` convention). A microbatch of weight 0 contributes a
            zero loss and zero gradients even where its ``loss_fn`` is not finite (a
            token mean over no token).
        meter: measures every layer and backward for the stage planner (None: nothing is
            measured; :mod:`roundpipe.pipeline.meter`).
        carry: uploads handed from one pass to the next (generation, whose passes follow one
            another with the same weights), a :class:`roundpipe.pipeline.fetch.Carry`: taken
            by this pass for its first visits; None: none.
        upload_ahead: after this pass, upload each device's first visit of the next pass
            into ``carry`` (its bytes and their floor counted now).
    """

    microbatches: list
    training: bool
    loss_fn: Optional[Callable[..., torch.Tensor]] = None
    has_label: bool = False
    return_outputs: bool = False
    call_seed: int = 0
    autocast: AutocastState = field(default_factory=AutocastState.capture)
    store: dict = field(default_factory=dict)
    loss_scale: float = 1.0
    want_norms: bool = False
    loss_weights: Optional[list[float]] = None
    meter: Optional[PassMeter] = None
    carry: Optional["Carry"] = None
    upload_ahead: bool = False


def _weighted(loss: torch.Tensor, weight: float) -> torch.Tensor:
    """``loss`` times its microbatch's share of the batch, in float32 at least (a bf16 or fp16
    loss would round the share); a share of 0 gives an exact 0 and zero gradients, also for a
    loss that is NaN there (a mean over no token)."""
    loss = loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss
    if weight == 0.0:
        return torch.nan_to_num(loss, 0.0, 0.0, 0.0) * 0.0
    return loss * weight


def _leaves(tree: Any) -> list:
    return [tree] if type(tree) is torch.Tensor else tree_flatten(tree)[0]


class StageVisit:
    """One stage's visit on its device, with its weights uploaded (see the module docstring).

    Args:
        spec: the call.
        stage: the stage.
        layers: its modules, in order.
        weights: its tensors on the device.
        io: the device's I/O.
        input_grad: whether its floating inputs need a gradient.
        locks: per layer of the stage, a lock held while it runs (or None).
        is_last: the model's last stage.
        recomputes: its forward visit is recomputed in a backward visit of this pass (what
            layers keep for it with :func:`roundpipe.save_for_recompute` is kept).
    """

    def __init__(self, spec: PassSpec, stage: Stage, layers: list[nn.Module],
                 weights: StageWeights, io: DeviceIO, input_grad: bool,
                 locks: list, is_last: bool, recomputes: bool = False) -> None:
        self.spec, self.stage, self.layers, self.weights, self.io = spec, stage, layers, weights, io
        self.input_grad, self.locks, self.is_last = input_grad, locks, is_last
        self.recomputes = recomputes
        # a kept stage: per microbatch, (output, input leaves requiring grad, input leaf count)
        self.graphs: list = []

    def begin_backward(self) -> None:
        """Before the first microbatch of a backward visit: gradients are summed on the
        device over the call's microbatches."""
        self.io.sum_grads_over(self.weights, len(self.spec.microbatches))

    def _run(self, x: Any, m: int, recomputing: bool) -> Any:
        meter = None
        if self.spec.meter is not None:
            exclude = {t.untyped_storage().data_ptr()
                       for placed in self.weights.layers for _, t in placed}
            exclude.update(t.untyped_storage().data_ptr() for t in self.weights.derived)
            meter = functools.partial(self.spec.meter.layer, self.io, microbatch=m,
                                      exclude=exclude)
        with self.spec.autocast.enter(self.stage.device.type), io_scope(self.io):
            return run_layers(self.layers, self.stage.start, self.weights.layers, x, m,
                              self.spec.call_seed, self.stage.device,
                              self.spec.store if recomputing or self.recomputes else None,
                              recomputing, self.locks, meter)

    def _measured_backward(self, m: int):
        """Around microbatch ``m``'s backward: timed when the pass is measured."""
        if self.spec.meter is None:
            return contextlib.nullcontext()
        return self.spec.meter.backward(self.io, self.stage.layers, m)

    def forward_one_chunk(self, m: int, host_input: Any, event: Any, kind: str) -> tuple[Any, Any]:
        """The stage on microbatch ``m`` without autograd; returns its output on the host
        (counted as ``kind``) and the event of the copy."""
        x = self.io.to_device(host_input, event, "activation")
        self.io.throttle()
        with torch.no_grad():
            y = self._run(x, m, recomputing=False)
        x = None  # noqa: F841 - the input copy may be freed before the output is copied
        return self.io.to_host(y, kind)

    def _grad_input(self, host_input: Any, event: Any) -> tuple[Any, list, int]:
        """Microbatch input on the device for a run with autograd: with :attr:`input_grad`, its
        floating leaves require grad and the layers see copies of them made by autograd (see
        the module docstring). Returns the tree, ``(leaf index, leaf)`` of the leaves that
        collect a gradient, and the count of leaves."""
        x = self.io.to_device(host_input, event, "activation")
        self.io.throttle()
        if not self.input_grad:
            return x, [], 0
        single = type(x) is torch.Tensor  # the usual stage input: no tree to walk
        leaves, spec_tree = ([x], None) if single else tree_flatten(x)
        grad_leaves = []
        for k, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                grad_leaves.append((k, t.requires_grad_(True)))
                leaves[k] = t.clone()
        return (leaves[0] if single else tree_unflatten(leaves, spec_tree)), grad_leaves, len(leaves)

    def _input_grads(self, grad_leaves: list, num_leaves: int) -> tuple[Any, Any]:
        """The gradient of the stage input on the host (a list aligned with its leaves) and
        the event of the copy."""
        grads = [None] * num_leaves
        for k, t in grad_leaves:
            grads[k] = t.grad
        return self.io.to_host(grads, "input_grad")

    def _backward_from(self, m: int, y: Any, grad_output: tuple) -> None:
        """The backward of microbatch ``m`` from the stage output ``y`` and ``grad_output``,
        the next stage's input gradient (a host list aligned with ``y``'s leaves, and its
        event): one call of the autograd engine for the stage."""
        g_host, g_event = grad_output
        pairs = [(t, g) for t, g in zip(_leaves(y), g_host)
                 if isinstance(t, torch.Tensor) and t.requires_grad and g is not None]
        y = None
        if pairs:
            grads = self.io.to_device([g for _, g in pairs], g_event, "input_grad")
            with self._measured_backward(m):
                run_backward([t for t, _ in pairs], grads)

    def keep_one_chunk(self, m: int, host_input: Any, event: Any, kind: str) -> tuple[Any, Any]:
        """A kept stage's forward on microbatch ``m``: with autograd, the output and what the
        backward needs kept in the visit for :meth:`backward_kept_chunk`; returns the output
        on the host (counted as ``kind``) and the event of the copy."""
        x, grad_leaves, num_leaves = self._grad_input(host_input, event)
        with torch.enable_grad():
            y = self._run(x, m, recomputing=False)
        x = None  # noqa: F841
        if not self.graphs:
            self.graphs = [None] * len(self.spec.microbatches)
        self.graphs[m] = (y, grad_leaves, num_leaves)
        return self.io.to_host(y, kind)

    def backward_kept_chunk(self, m: int, grad_output: tuple) -> dict:
        """A kept stage's backward on microbatch ``m`` from ``grad_output`` (as
        :meth:`backward_one_chunk`), on the graph its forward visit kept, which is freed.
        Returns a dict with ``input_grad`` (only when :attr:`input_grad`)."""
        y, grad_leaves, num_leaves = self.graphs[m]
        self.graphs[m] = None
        self._backward_from(m, y, grad_output)  # the graph is built: no grad mode needed
        y = None  # noqa: F841
        return {"input_grad": self._input_grads(grad_leaves, num_leaves)} if self.input_grad else {}

    def backward_one_chunk(self, m: int, host_input: Any, event: Any,
                           grad_output: Optional[tuple] = None) -> dict:
        """Recomputes the stage on microbatch ``m`` with autograd and runs its backward:
        from ``grad_output`` (the next stage's input gradient: a host list aligned with the
        output's leaves, and its event), or, for the last stage, from the microbatch's loss.
        Parameter gradients are added into the stage's sums on the device.

        Returns a dict with ``input_grad`` (host list aligned with the input's leaves, and
        event; only when :attr:`input_grad`), and for the last stage ``loss`` (0-dim float64
        on the host, and event) and, with ``return_outputs``, ``output``.

        Raises:
            TypeError: ``loss_fn`` does not return a 1-element tensor.
            RuntimeError: the loss does not require grad (nothing would be trained).
        """
        io, spec = self.io, self.spec
        x, grad_leaves, num_leaves = self._grad_input(host_input, event)
        out: dict = {}
        with torch.enable_grad():
            y = self._run(x, m, recomputing=not self.is_last)
            x = None  # noqa: F841
            if self.is_last:
                mb = spec.microbatches[m]
                with spec.autocast.enter(self.stage.device.type):
                    if spec.has_label:
                        label = io.to_device(mb[2], None, "label")
                        loss = spec.loss_fn(y, label)
                    else:
                        loss = spec.loss_fn(y)
                if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                    raise TypeError("RoundPipe.forward_backward: loss_fn must return a "
                                    f"1-element tensor, got {type(loss).__name__}")
                if not loss.requires_grad:
                    raise RuntimeError(
                        "RoundPipe.forward_backward: the loss does not require grad (it was "
                        "detached or computed under no_grad, or nothing in the model is "
                        "trainable), so backward would train nothing; loss.backward() raises "
                        "the same way")
                if spec.loss_weights is not None:
                    loss = _weighted(loss, spec.loss_weights[m])
                out["loss"] = io.to_host(loss.detach().reshape(()).double(), "output")
                if spec.return_outputs:
                    out["output"] = io.to_host(y, "output")
                y = None
                if spec.loss_scale != 1.0:
                    loss = loss * torch.full((), spec.loss_scale, dtype=torch.float32,
                                             device=loss.device)
                with self._measured_backward(m):
                    run_backward([loss], [None])
            else:
                self._backward_from(m, y, grad_output)
                y = None
        if self.input_grad:
            out["input_grad"] = self._input_grads(grad_leaves, num_leaves)
        return out

    def finish(self, backward: bool, abort) -> Optional[GradDownload]:
        """After the visit's last microbatch. A visit that ran the stage's forward for real
        (a forward visit, or the last stage's backward visit) copies back the buffers a layer
        changed; a backward visit downloads the stage's gradient sums once (None if nothing
        got a gradient), waiting while too many earlier downloads are not consumed."""
        if not backward or self.is_last:
            self.io.write_back_buffers(self.weights)
        if backward:
            return self.io.download_grads(self.weights, abort, self.spec.want_norms)
        return None
