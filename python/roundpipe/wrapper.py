"""``RoundPipe``: the model wrapper. Host-resident weights (a low-precision model copy and a
full-precision optimizer copy), stages streamed to the compute device, microbatches,
activation recomputation, gradients accumulated on the host in the optimizer dtype.

Reading order: plan.py (stages, devices) -> transfer.py (moving tensors; cuda_transfer.py for
CUDA: pinned memory, streams, events, prefetch) -> execute.py (a stage on a microbatch) ->
schedule.py (worker threads, slots between stages, per-layer gates) -> this file (the passes
over stages and microbatches, and the optimizer side: synchronous, asynchronous and exact
overlapped steps on the optimizer thread).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch import nn
from torch.utils._pytree import tree_flatten

from . import microbatch as mb
from .context import OptimizerCtx
from .execute import draw_call_seed, run_stage
from .optim import CpuOptimizer
from .plan import PIN_MODES, Stage, make_stages, parse_devices, split_layers
from .schedule import LayerGates, Slot, Worker, run_all
from .transfer import HostIO, LayerWeights


def _leaves(tree: Any) -> list:
    return tree_flatten(tree)[0]


class _Pass:
    """One ``forward`` or ``forward_backward`` call, run by one worker thread per device.

    Stage ``s`` runs on device ``s % len(devices)``; each worker runs its stages in order
    (forward pass ascending, then backward pass descending), each stage over all microbatches
    in order. Stages hand their results to each other through :class:`Slot` s on the host:
    ``acts[s][m]`` is what stage ``s`` receives for microbatch ``m`` (a host tree and the event
    of its copy), ``grads[s][m]`` the gradient w.r.t. it. Each worker's order is a subsequence
    of one global order in which every dependency comes first, so the pass cannot deadlock.

    Gradient accumulation order is fixed whatever the number of devices: a layer's gradients
    are added over microbatches in order by the one worker running its stage; a parameter used
    in several stages (tied weights) keeps its per-stage, per-microbatch gradients aside and
    adds them in the single-device order once its last stage (the lowest) is done.
    """

    def __init__(self, owner: "RoundPipe", mbs: list, backward: bool, has_label: bool = False,
                 loss_fn: Optional[Callable] = None, return_outputs: bool = False,
                 optimizer: Any = None) -> None:
        self.owner, self.mbs, self.backward = owner, mbs, backward
        self.has_label, self.loss_fn, self.return_outputs = has_label, loss_fn, return_outputs
        self.optimizer = optimizer  # (optimizer, snapshot) in exact overlapped mode
        self.call_seed = draw_call_seed()
        n, num_stages = len(mbs), len(owner._stages)
        self.acts = [[Slot() for _ in range(n)] for _ in range(num_stages + 1)]
        for m, (a, k, _) in enumerate(mbs):
            self.acts[0][m].set(((a, k), None))
        self.grads = [[Slot() for _ in range(n)] for _ in range(num_stages + 1)]
        self.stage_done = [Slot() for _ in range(num_stages)]
        self.totals: list[Any] = [None] * n    # per microbatch loss (device tensor) and event
        self.outputs: list[Any] = [None] * n
        self.deferred: dict[int, list] = {}    # tied parameter -> [((-stage, m, k), grad)]
        self.lock = threading.Lock()
        stages = owner._stages
        if backward:
            self.ops = [(st, False) for st in stages[:-1]] + [(st, True) for st in reversed(stages)]
        else:
            self.ops = [(st, False) for st in stages]

    # --- one worker -----------------------------------------------------------------------------

    def run_device(self, d: int, abort: threading.Event) -> None:
        owner = self.owner
        io = owner._io[d]
        ops = [op for op in self.ops if op[0].index % len(owner.devices) == d]
        fetcher = _Fetcher(owner, io, ops, abort)
        with io.activate():
            for k, (stage, backward) in enumerate(ops):
                weights = fetcher.get(k)
                fetcher.maybe_prefetch(k)
                if backward:
                    self._backward_stage(io, stage, weights, abort, fetcher, k)
                else:
                    self._forward_stage(io, stage, weights, abort, fetcher, k)
                weights = None  # noqa: F841 - the stage's device tensors die here

    def _forward_stage(self, io, stage: Stage, weights, abort, fetcher, k) -> None:
        """Forward of one stage over all microbatches without autograd; outputs to the host."""
        owner = self.owner
        with torch.no_grad():
            for m in range(len(self.mbs)):
                tree, event = self.acts[stage.index][m].get(abort)
                x = io.to_device(tree, event, False)
                if not self.backward:  # inference: nothing reads this stage input again
                    self.acts[stage.index][m].clear_value()
                tree = None
                y = owner._run(stage, weights, x, m, self.call_seed, recomputing=False)
                x = None
                self.acts[stage.index + 1][m].set(io.to_host(y))
                fetcher.maybe_prefetch(k)
        if owner.training:
            io.download_buffers(weights)

    def _backward_stage(self, io, stage: Stage, weights, abort, fetcher, k) -> None:
        """Recomputes the stage on each microbatch with autograd and runs its backward (from
        the loss for the last stage, from the next stage's input gradients otherwise)."""
        owner = self.owner
        is_last = stage.index == len(owner._stages) - 1
        pending = None  # the previous microbatch's gradients, added once the next is queued
        for m in range(len(self.mbs)):
            tree, event = self.acts[stage.index][m].get(abort)
            grad_output = None if is_last else self.grads[stage.index + 1][m].get(abort)
            x = io.to_device(tree, event, leaf_grad=stage.index > 0)
            self.acts[stage.index][m].clear_value()  # host copies no longer needed
            if not is_last:
                self.grads[stage.index + 1][m].clear_value()
            tree = None
            with torch.enable_grad():
                y = owner._run(stage, weights, x, m, self.call_seed, recomputing=not is_last)
                if is_last:
                    label = io.to_device(self.mbs[m][2], None, False)
                    loss = self.loss_fn(y, label) if self.has_label else self.loss_fn(y)
                    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                        raise TypeError("RoundPipe.forward_backward: loss_fn must return a "
                                        f"1-element tensor, got {type(loss).__name__}")
                    self.totals[m] = io.scalar_to_host(loss.detach().reshape(()).double())
                    if self.return_outputs:
                        self.outputs[m] = io.to_host(y)
                    if loss.requires_grad:
                        loss.backward()
                else:
                    g_tree, g_event = grad_output
                    pairs = [(t, g) for t, g in zip(_leaves(y), g_tree)
                             if isinstance(t, torch.Tensor) and t.requires_grad and g is not None]
                    if pairs:
                        grads = io.to_device([g for _, g in pairs], g_event, False)
                        torch.autograd.backward([t for t, _ in pairs], grads)
            y = None
            grads_m = io.grads_to_host(weights, m % 2)
            if pending is not None:
                self._accumulate(stage, *pending)
            pending = (m, grads_m)
            if stage.index > 0:
                self.grads[stage.index][m].set(io.to_host(
                    [t.grad if isinstance(t, torch.Tensor) else None for t in _leaves(x)]))
            x = None
            fetcher.maybe_prefetch(k)
        if pending is not None:
            self._accumulate(stage, *pending)
        if is_last and owner.training:
            io.download_buffers(weights)
        self._finish_stage(stage, abort)

    def _accumulate(self, stage: Stage, m: int, grads_m: tuple) -> None:
        """Adds one microbatch's downloaded gradients of a stage into the host buffers."""
        owner = self.owner
        items, event = grads_m
        owner._io[stage.index % len(owner.devices)].host_wait(event)
        for k, (name, host, g) in enumerate(items):
            i = owner._index.get(id(host))
            if i is None:
                raise RuntimeError(
                    f"RoundPipe: parameter {name!r} requires grad but was frozen when the model "
                    "was wrapped, so it has no optimizer copy; set requires_grad before wrapping "
                    "(parameters frozen after wrapping are simply not trained)")
            if i in owner._multi_stage:
                with self.lock:
                    self.deferred.setdefault(i, []).append(((-stage.index, m, k), g.clone()))
            else:
                owner._add_grad(i, g)

    def _finish_stage(self, stage: Stage, abort) -> None:
        """Once this stage and all later ones are done: the tied parameters whose lowest stage
        this is get their gradients, and in exact overlapped mode the parameters final here
        are handed to the optimizer thread."""
        owner = self.owner
        if stage.index + 1 < len(owner._stages):
            self.stage_done[stage.index + 1].get(abort)
        final = owner._final_params[stage.index]
        for i in final:
            with self.lock:
                parts = sorted(self.deferred.pop(i, []), key=lambda kv: kv[0])
            for _, g in parts:
                owner._add_grad(i, g)
        owner._flush_stale(final)  # an asynchronous step's update, now that the pass is past it
        if self.optimizer is not None and final:
            owner._submit_exact_step(self.optimizer, final)
        self.stage_done[stage.index].set(True)


class _Fetcher:
    """A worker's stage weights: uploaded when needed, or earlier (prefetch) when the device
    supports it, the layers are ready and the memory cap allows: at most two stages resident."""

    def __init__(self, owner: "RoundPipe", io, ops: list, abort) -> None:
        self.owner, self.io, self.ops, self.abort = owner, io, ops, abort
        self.next: Optional[tuple] = None  # (op position, (weights, event))

    def _upload(self, k: int):
        stage, backward = self.ops[k]
        return self.io.upload([self.owner._layers[i] for i in stage.layers], backward)

    def get(self, k: int) -> list[LayerWeights]:
        stage = self.ops[k][0]
        if self.next is not None and self.next[0] == k:
            weights, event = self.next[1]
            self.next = None
        else:
            self.owner._stats_add("optimizer_wait_s",
                                  self.owner._gates.wait(list(stage.layers), self.abort))
            weights, event = self._upload(k)
        self.io.wait_weights(event)
        return weights

    def maybe_prefetch(self, k: int) -> None:
        if not self.io.prefetch or self.next is not None or k + 1 >= len(self.ops):
            return
        stage = self.ops[k + 1][0]
        cap = self.owner.max_resident_bytes
        sizes = self.owner._stage_bytes
        if cap is not None and sizes[self.ops[k][0].index] + sizes[stage.index] > cap:
            return
        if self.owner._gates.ready(stage.layers):
            self.next = (k + 1, self._upload(k + 1))


class RoundPipe(nn.Module):
    """Wraps a model so that it trains with its weights in CPU memory and only one stage's
    weights on the compute device at a time.

    The model's layers are the children of an ``nn.Sequential`` (any other module is a single
    layer); ``layers_per_stage`` consecutive layers form a stage. The model stays on the host in
    the dtype it has (the *model copy*: fp16, bf16 or fp32; it is what the device computes in).
    Every trainable parameter also gets an *optimizer copy* in ``optim_dtype`` (default: the
    model's dtype), created once here: optimizers work on those (:meth:`optim_parameters`, or
    :meth:`parameters` inside :class:`roundpipe.OptimizerCtx`).

    Training::

        model = RoundPipe(net.to(torch.bfloat16), optim_dtype=torch.float32)
        with OptimizerCtx():
            opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-4)
        for x, y in loader:
            loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            model.step(lambda: (opt.step(), opt.zero_grad()))

    Args:
        model: the network, with all parameters and buffers on the CPU.
        optim_dtype: floating dtype of the optimizer copies (default: each parameter's dtype).
        device: compute device(s): one device, or a non-empty list of them (default:
            ``cuda:0`` when CUDA is available, else the CPU, which runs the very same code
            path). Stage ``s`` runs on ``device[s % len(device)]``; each device has a worker
            thread, so ``["cpu", "cpu"]`` is two CPU workers (the scheduler runs for real
            without a GPU) and ``["cuda:0", "cuda:1"]`` two GPUs. CPU and CUDA are not mixed.
        layers_per_stage: consecutive layers per stage (default 1).
        num_microbatch: default number of microbatches per call (default: number of devices + 1,
            at most the batch size). Results do not depend on the number of devices, for a
            given number of microbatches.
        split_fn: custom split of ``(args, kwargs, label, n)`` into microbatches, with the
            signature and contract of :func:`roundpipe.microbatch.split_microbatches`.
        pin_memory: CUDA only: the host model copy in page-locked memory, ``"auto"`` /
            ``"alloc"`` (pinned copies of the tensors), ``"register"`` (``cudaHostRegister`` in
            place) or ``"off"``; when pinning fails, pageable memory with a warning. The mode
            in effect is ``self.pin_memory`` (``"off"`` for CPU devices).
        prefetch: CUDA only: upload the next stage's weights while the current one computes
            (at most two stages resident per device).
        max_resident_bytes: CUDA only: no prefetch when the current and the next stage's
            weights together exceed this many bytes (default: no cap).
        layers: the pipeline's layers, run in this order, instead of the entries of ``model``
            (a sequence of modules; see :func:`roundpipe.wrap_model_to_roundpipe`, which builds
            them for Hugging Face models). ``model`` stays the module the wrapper presents
            (``state_dict`` keys, parameter names, attributes); every parameter and buffer of
            the layers must be one of ``model``'s. A parameter used by several layers (tied
            embeddings) is one parameter with one optimizer copy.

    Threads: one worker per device and one optimizer thread, all daemon threads, started on
    first use; errors on them reach the caller (see :meth:`forward_backward`, :meth:`step`).

    Raises:
        ValueError: a parameter or buffer is not on the CPU, ``optim_dtype`` is not a floating
            dtype, ``layers_per_stage`` / ``num_microbatch`` is < 1, ``device`` is an empty
            list, names an unsupported device type or mixes CPU and CUDA, ``pin_memory`` is
            not one of the modes, ``max_resident_bytes`` < 0, ``layers`` is empty or holds a
            parameter or buffer that is not ``model``'s.
        TypeError: ``model`` is not a module, a ``layers`` entry is not a module, a ``device`` entry is not a str or device,
            ``prefetch`` is not a bool.
    """

    def __init__(self, model: nn.Module, optim_dtype: Optional[torch.dtype] = None, *,
                 device: Any = None, layers_per_stage: int = 1,
                 num_microbatch: Optional[int] = None,
                 split_fn: Optional[Callable[..., list]] = None,
                 pin_memory: str = "auto", prefetch: bool = True,
                 max_resident_bytes: Optional[int] = None,
                 layers: Optional[Sequence[nn.Module]] = None) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"RoundPipe: model must be an nn.Module, got {type(model).__name__}")
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.device.type != "cpu":
                raise ValueError(f"RoundPipe: {name!r} is on {t.device}; the model must be on "
                                 "the CPU (RoundPipe moves each stage to the device itself)")
        if optim_dtype is not None and not (isinstance(optim_dtype, torch.dtype)
                                            and optim_dtype.is_floating_point):
            raise ValueError(f"RoundPipe: optim_dtype must be a floating torch.dtype, got {optim_dtype!r}")
        if num_microbatch is not None and (not isinstance(num_microbatch, int)
                                           or isinstance(num_microbatch, bool) or num_microbatch < 1):
            raise ValueError(f"RoundPipe: num_microbatch must be an int >= 1, got {num_microbatch!r}")
        if pin_memory not in PIN_MODES:
            raise ValueError(f"RoundPipe: pin_memory must be one of {PIN_MODES}, got {pin_memory!r}")
        if not isinstance(prefetch, bool):
            raise TypeError(f"RoundPipe: prefetch must be a bool, got {type(prefetch).__name__}")
        if max_resident_bytes is not None and (not isinstance(max_resident_bytes, int)
                                               or max_resident_bytes < 0):
            raise ValueError("RoundPipe: max_resident_bytes must be None or an int >= 0, got "
                             f"{max_resident_bytes!r}")
        if layers is not None:
            layers = list(layers)
            _check_layers(model, layers)
        self.module = model
        self.devices = parse_devices(device)
        self.device = self.devices[0]
        self.prefetch = prefetch
        self.max_resident_bytes = max_resident_bytes
        self._layers = layers if layers is not None else split_layers(model)
        self._stages = make_stages(len(self._layers), layers_per_stage, self.devices)
        self.num_microbatch = num_microbatch or len(self.devices) + 1
        self._split = split_fn or mb.split_microbatches
        self.pin_memory = "off"
        if self.devices[0].type == "cuda":
            from .cuda_transfer import pin_host_model
            self.pin_memory = pin_host_model(model, pin_memory)

        # The optimizer copies: one per unique trainable parameter, in named_parameters() order.
        self._names: list[str] = []
        self._model_params: list[nn.Parameter] = []
        self._optim_params: list[nn.Parameter] = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            dtype = optim_dtype or p.dtype
            if not p.dtype.is_floating_point:
                raise ValueError(f"RoundPipe: trainable parameter {name!r} has dtype {p.dtype}")
            self._names.append(name)
            self._model_params.append(p)
            self._optim_params.append(nn.Parameter(p.detach().to(dtype, copy=True)))
        self._index = {id(p): i for i, p in enumerate(self._model_params)}
        self._grads: list[Optional[torch.Tensor]] = [None] * len(self._model_params)
        self._synced = [self._version(p) for p in self._model_params]
        self._recompute_store: dict = {}
        self._stale: set[int] = set()  # model copies behind their optimizer copies (async step)
        self._build_maps()
        self._runtime_init()

    def _build_maps(self) -> None:
        """Which trainable parameters each layer holds, which stages use each, and for each
        stage the parameters whose gradients are final once its backward is done (those whose
        lowest stage it is)."""
        self._layer_params: list[list[int]] = []
        stages_of: dict[int, set[int]] = {}
        for li, layer in enumerate(self._layers):
            ids = []
            for p in layer.parameters():
                i = self._index.get(id(p))
                if i is not None and i not in ids:
                    ids.append(i)
            self._layer_params.append(ids)
        for st in self._stages:
            for li in st.layers:
                for i in self._layer_params[li]:
                    stages_of.setdefault(i, set()).add(st.index)
        self._multi_stage = {i for i, s in stages_of.items() if len(s) > 1}
        self._final_params: list[list[int]] = [[] for _ in self._stages]
        for i in range(len(self._model_params)):
            if i in stages_of:
                self._final_params[min(stages_of[i])].append(i)
        self._param_layers: list[list[int]] = [[] for _ in self._model_params]
        for li, ids in enumerate(self._layer_params):
            for i in ids:
                self._param_layers[i].append(li)
        self._stage_bytes = [sum(t.numel() * t.element_size()
                                 for li in st.layers
                                 for t in list(self._layers[li].parameters())
                                 + list(self._layers[li].buffers()))
                             for st in self._stages]

    def _runtime_init(self) -> None:
        """Threads, per-device transfer state and synchronisation: rebuilt after unpickling or
        ``copy.deepcopy`` (never copied)."""
        self._workers = [Worker(f"roundpipe-{d}-{i}") for i, d in enumerate(self.devices)]
        self._bg = Worker("roundpipe-optimizer")
        self._bg_futures: list = []
        self._bg_error: Optional[BaseException] = None
        self._bg_lock = threading.Lock()
        self._gates = LayerGates(len(self._layers))
        self._hooked = weakref.WeakSet()
        self._stats = dict.fromkeys(STAT_KEYS, 0.0)
        if self.devices[0].type == "cuda":
            from .cuda_transfer import CudaIO
            self._io = [CudaIO(d, self.prefetch) for d in self.devices]
        else:
            self._io = [HostIO(d) for d in self.devices]
        workers, bg = self._workers, self._bg
        # threads end with the wrapper (at exit, schedule._stop_workers ends them)
        weakref.finalize(self, lambda: [w.close() for w in workers + [bg]]).atexit = False

    # --- parameters: model copies, or optimizer copies inside OptimizerCtx -----------------

    def optim_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, optimizer copy)`` of every trainable parameter, with the model's names."""
        return iter(zip(self._names, self._optim_params))

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        """The optimizer copies (``optim_dtype``, on the host) of every trainable parameter."""
        return iter(self._optim_params)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters under its own names; inside ``OptimizerCtx``, the optimizer
        copies (trainable parameters only)."""
        if OptimizerCtx.is_active():
            return ((prefix + ("." if prefix else "") + n, p) for n, p in self.optim_named_parameters())
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The model's parameters; inside ``OptimizerCtx``, the optimizer copies."""
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped model's buffers (host tensors, the model's dtype) under its own names."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def _apply(self, fn, recurse=True):
        raise TypeError("RoundPipe keeps the model on the host in the dtype it was given: convert "
                        "the model (e.g. net.to(torch.bfloat16)) before wrapping it, and choose "
                        "the compute device with RoundPipe(device=...)")

    _RUNTIME = ("_workers", "_bg", "_bg_futures", "_bg_error", "_bg_lock", "_gates", "_hooked",
                "_stats", "_io")

    def __getstate__(self):
        """Pickling and ``copy.deepcopy`` wait for pending optimizer work and leave the threads
        and device state out (the copy makes its own)."""
        self._flush_stale(range(len(self._model_params)))
        self._wait_background()
        return {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}

    def __setstate__(self, state) -> None:
        """After ``copy.deepcopy`` or unpickling the parameters are new objects: rebuild the
        identity index over them, and the threads."""
        super().__setstate__(state)
        self._index = {id(p): i for i, p in enumerate(self._model_params)}
        self._synced = [self._version(p) for p in self._model_params]
        self._build_maps()
        self._runtime_init()

    # --- keeping the two copies consistent -------------------------------------------------

    @staticmethod
    def _version(p: torch.Tensor) -> tuple[int, int]:
        return (p.data_ptr(), p._version)

    def _refresh_optim_copies(self) -> None:
        """A model-copy parameter changed behind our back (e.g. ``load_state_dict`` on the
        wrapped model after wrapping): the optimizer copy takes its value, so the next step
        trains what was loaded. Only called while no optimizer work is pending."""
        with torch.no_grad():
            for i, p in enumerate(self._model_params):
                if self._version(p) != self._synced[i]:
                    self._optim_params[i].copy_(p)
                    self._synced[i] = self._version(p)

    def _write_back_param(self, i: int) -> None:
        """Model copy ``i`` takes its optimizer copy's value, rounded to the model dtype."""
        with torch.no_grad():
            self._model_params[i].copy_(self._optim_params[i])
        self._synced[i] = self._version(self._model_params[i])

    # --- gradients -----------------------------------------------------------------------------

    def _add_grad(self, i: int, g: torch.Tensor) -> None:
        """Adds a host gradient (any floating dtype) into parameter ``i``'s buffer (optimizer
        dtype); ``g`` is not kept (copied when the buffer is created)."""
        g32 = g.to(self._optim_params[i].dtype)
        if self._grads[i] is None:
            self._grads[i] = g32.clone() if g32 is g else g32
        else:
            self._grads[i].add_(g32)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discards the gradients accumulated since the last :meth:`step` (waits for pending
        optimizer work first: that work owns the gradients it was given). Called inside an
        asynchronous ``step_fn``, it clears only that step's gradients (``.grad`` of the
        optimizer copies), not those the next pass is accumulating."""
        self._wait_background()
        if not self._bg.is_current():
            self._grads = [None] * len(self._model_params)
        for o in self._optim_params:
            o.grad = None

    # --- the passes ------------------------------------------------------------------------------

    def _microbatches(self, args, kwargs, label, num_microbatch) -> list:
        n = num_microbatch if num_microbatch is not None else self.num_microbatch
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"RoundPipe: num_microbatch must be an int >= 1, got {n!r}")
        return self._split(tuple(args), dict(kwargs or {}), label, n)

    def _run(self, stage: Stage, weights: list[LayerWeights], stage_input: Any, m: int,
             call_seed: int, recomputing: bool) -> Any:
        layers = [self._layers[i] for i in stage.layers]
        return run_stage(layers, stage.start, weights, stage_input, m, call_seed, stage.device,
                         self._recompute_store, recomputing)

    def _run_pass(self, run: _Pass) -> None:
        """Runs a pass on the device workers (only those that have stages) and waits for it."""
        used = sorted({st.index % len(self.devices) for st, _ in run.ops})
        start = time.perf_counter()
        try:
            run_all([self._workers[d] for d in used],
                    [functools.partial(run.run_device, d) for d in used])
        finally:
            self._stats_add("wall_s", time.perf_counter() - start)
            self._stats_add("device_s", len(used) * (time.perf_counter() - start))

    def forward(self, *args: Any, num_microbatch: Optional[int] = None, **kwargs: Any) -> Any:
        """Inference and evaluation: runs the model on ``(*args, **kwargs)`` in microbatches,
        stage by stage, without autograd, and returns the merged outputs on the host. In
        training mode, buffers (e.g. BatchNorm running statistics) are updated on the host.
        Layers still being updated by an asynchronous step are waited for, each on its own."""
        self._raise_background_error()
        if self._background_idle():
            self._refresh_optim_copies()
        mbs = self._microbatches(args, kwargs, None, num_microbatch)
        run = _Pass(self, mbs, backward=False)
        try:
            self._run_pass(run)
        finally:
            self._recompute_store.clear()  # nothing is recomputed after inference
        outs = []
        for slot in run.acts[-1]:
            tree, event = slot.get(threading.Event())
            self._io[0].host_wait(event)
            outs.append(tree)
        return mb.merge_outputs(outs)

    def forward_backward(self, input_args: tuple = (), input_kwargs: Optional[dict] = None,
                         label: Any = None, loss_fn: Callable[..., torch.Tensor] = None,
                         return_outputs: bool = False, num_microbatch: Optional[int] = None,
                         optimizer: Optional[torch.optim.Optimizer] = None):
        """One forward and backward pass over a batch, in microbatches.

        The batch is split into microbatches (dim 0 of every batched tensor of ``input_args``,
        ``input_kwargs`` and ``label``, or ``split_fn``). The forward pass runs stage by stage,
        each stage's weights copied to its device for the stage and dropped after, keeping only
        the stage inputs (on the host). The backward pass runs the stages in reverse, recomputing
        each stage's forward (same randomness) before its backward. The loss of microbatch ``i``
        is ``loss_fn(output_i, label_i)`` (``loss_fn(output_i)`` when ``label`` is None). With
        several devices, stage ``s`` runs on ``devices[s % len(devices)]``, all microbatches of
        it there, and the devices work on different stages at the same time (a pipeline).

        Loss convention: the gradients are those of the *sum* of the microbatch losses, and
        that sum is returned. For a mean over the whole batch, make ``loss_fn`` return its
        microbatch's share (e.g. a sum-reduced loss divided by the total number of samples).

        Gradients accumulate on the host, in the optimizer dtype, across microbatches and calls,
        until :meth:`step`. If the call raises, the gradients accumulated since the last step are
        discarded (as by :meth:`zero_grad`), so a partial gradient is never applied, and the
        wrapper stays usable.

        **Exact overlapped mode** (``optimizer=opt``): equivalent to this call followed by
        ``step(opt)``, i.e. ``step(lambda: (opt.step(), opt.zero_grad()))`` — bit for bit —
        but each stage's parameters are stepped on the optimizer thread as soon as their
        gradients are final (right after the stage's backward), while the earlier stages'
        backward runs; the call returns without waiting for the last updates (the next call
        waits for each layer's own update). With a :class:`roundpipe.optim.CpuOptimizer` that
        holds only this wrapper's optimizer copies and has no step hooks, the fused entry point
        is used (gradients in, model copy out, per stage); any other optimizer (a
        ``torch.optim`` one, one that also holds parameters from outside the wrapper, or one
        with step hooks) is stepped once, after the whole backward. The optimizer's hyperparameters are read
        when the call starts. Not possible in this mode: clipping by the global gradient norm
        (use :meth:`step`). If the call raises, the stages already stepped stay stepped.

        Returns:
            The summed loss (0-dim tensor on the host, detached), or ``(loss, outputs)`` with
            ``return_outputs=True`` (outputs merged over microbatches, on the host).

        Raises:
            TypeError: ``loss_fn`` is missing, or ``optimizer`` is not a torch optimizer.
            The error of a failed asynchronous step (see :meth:`step`). Exceptions from the
            layers and ``loss_fn`` propagate unchanged, also when raised on a worker thread.
        """
        if loss_fn is None:
            raise TypeError("RoundPipe.forward_backward: loss_fn is required")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("RoundPipe.forward_backward: optimizer must be a torch.optim."
                            f"Optimizer, got {type(optimizer).__name__}")
        self._raise_background_error()
        if self._background_idle():
            self._refresh_optim_copies()
        mbs = self._microbatches(input_args, input_kwargs, label, num_microbatch)
        exact = None
        if optimizer is not None:
            self._hook_optimizer(optimizer)
            if self._layerwise(optimizer):
                exact = (optimizer, _snapshot(optimizer))
        run = _Pass(self, mbs, True, label is not None, loss_fn, return_outputs, exact)
        with self._bg_lock:
            earlier = list(self._bg_futures)  # the previous step, if still running
        try:
            self._run_pass(run)
            # that step's error (if any) surfaces in this call, whatever the timing
            cf.wait(earlier)
            self._raise_background_error()
            total = torch.zeros((), dtype=torch.float64)
            for t, event in run.totals:
                self._io[0].host_wait(event)
                total += t
            outputs = []
            for tree, event in run.outputs if return_outputs else ():
                self._io[0].host_wait(event)
                outputs.append(tree)
        except BaseException:
            self._grads = [None] * len(self._model_params)
            raise
        finally:
            self._recompute_store.clear()
        if optimizer is not None and exact is None:
            self.step(optimizer)
        loss = total.to(torch.float32)
        return (loss, mb.merge_outputs(outputs)) if return_outputs else loss

    # --- the optimizer side ------------------------------------------------------------------------

    def step(self, step_fn: Any, is_async: bool = False) -> Any:
        """Applies the accumulated gradients.

        ``step_fn`` is either a callable or an optimizer over the optimizer copies:

        - a callable: the gradients become the optimizer copies' ``.grad``, ``step_fn()`` runs
          with :class:`OptimizerCtx` active (so ``clip_grad_norm_(model.parameters(), ...)``
          inside it sees the optimizer copies and their gradients), then the model copies take
          the updated values (rounded to the model dtype) — also when ``step_fn`` raises, so
          the two copies never disagree;
        - an optimizer ``opt``: the same as ``lambda: (opt.step(), opt.zero_grad())``, bit for
          bit (a :class:`roundpipe.optim.CpuOptimizer` over this wrapper's optimizer copies only,
          without step hooks, is stepped layer by layer through its fused entry point). Its
          hyperparameters are read when ``step`` is called (a snapshot), so
          ``scheduler.step()`` right after ``step`` affects the next step, as in a synchronous
          loop; its ``step``, ``state_dict`` and ``load_state_dict`` wait for a
          pending update.

        The gradients are cleared in both cases.

        **Asynchronous step** (``is_async=True``) returns at once (``None``); the update runs
        on the optimizer thread while the caller goes on into the next :meth:`forward_backward`,
        which starts immediately: the update computed from iteration t's gradients is applied
        while iteration t+1 runs, so iteration t+1 computes with the weights from before step t
        (one step of staleness: ``W[t+1] = W[t] - update(grad(W[t-1]))``, as in delayed
        parameter updates). Each layer's model copy takes the new values right after that
        layer's backward in iteration t+1 (once its update is done), so iteration t+2's upload
        of a layer waits only for that layer. :meth:`synchronize` (also called by a synchronous
        step, ``state_dict``, ``load_state_dict``, ``zero_grad`` and pickling) waits for the
        update and writes back every layer: the copies agree again and there is no staleness
        after it; ``forward`` (inference) before the next ``forward_backward`` still sees the
        weights from before the step unless :meth:`synchronize` is called. Rules while an
        update is pending: what ``step_fn`` touches belongs to the
        optimizer thread (with a callable, do LR scheduling and logging of optimizer state
        inside ``step_fn`` or after :meth:`synchronize`; an optimizer passed directly is
        protected as said above); change weights only after :meth:`synchronize`. An exception
        in the background is re-raised, with its traceback, at the next call into the wrapper
        (``forward``, ``forward_backward``, ``step``, ``synchronize``, ``state_dict``,
        ``load_state_dict``; at the latest by the end of the next ``forward_backward``, which
        waits for the step before it returns), which then discards the gradients accumulated
        since; the wrapper stays usable (the model copies are written back as usual).

        Returns:
            What ``step_fn`` returns (None for an optimizer, and with ``is_async=True``).

        Raises:
            TypeError: ``step_fn`` is neither callable nor an optimizer, or ``is_async`` is not
                a bool.
        """
        if not isinstance(is_async, bool):
            raise TypeError(f"RoundPipe.step: is_async must be a bool, got {type(is_async).__name__}")
        is_opt = isinstance(step_fn, torch.optim.Optimizer)
        if not is_opt and not callable(step_fn):
            raise TypeError("RoundPipe.step: step_fn must be a callable or a torch.optim."
                            f"Optimizer, got {type(step_fn).__name__}")
        if is_async:
            self._raise_background_error()
        else:
            self.synchronize()
        if self._background_idle():
            self._refresh_optim_copies()
        grads, self._grads = self._grads, [None] * len(self._model_params)
        if is_opt:
            self._hook_optimizer(step_fn)
            job = functools.partial(self._optimizer_job, step_fn, _snapshot(step_fn), grads,
                                    not is_async)
        else:
            job = functools.partial(self._callable_job, step_fn, grads, not is_async)
        if not is_async:
            return self._run_job(job, (), in_background=False)
        self._stale.update(range(len(self._model_params)))
        self._submit(job, ())
        return None

    def synchronize(self) -> None:
        """Waits until all optimizer work handed to the background (asynchronous steps, exact
        overlapped mode) is done and the model copies hold every update, then raises the
        background error if there was one (see :meth:`step`)."""
        self._flush_stale(range(len(self._model_params)))
        self._wait_background()
        self._raise_background_error()

    # background jobs: each gets release(layer) to call as soon as a layer's model copy is final

    def _callable_job(self, step_fn, grads, write_back: bool, release) -> Any:
        for o, g in zip(self._optim_params, grads):
            o.grad = g
        try:
            with OptimizerCtx():
                return step_fn()
        finally:
            for o in self._optim_params:
                o.grad = None
            if write_back:
                self._write_back_layers(range(len(self._layers)), release)

    def _layerwise(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt`` can be stepped layer by layer through ``fused_step`` with the result
        of ``opt.step()``: a ``roundpipe.optim`` optimizer holding only this wrapper's
        optimizer copies and without step hooks (``fused_step`` runs none). Otherwise ``step``
        and exact mode call ``opt.step()`` once all gradients are there."""
        if not isinstance(opt, CpuOptimizer):
            return False
        user_pre_hooks = [h for h in opt._optimizer_step_pre_hooks.values()
                          if not getattr(h, "roundpipe_wait", False)]
        if (user_pre_hooks or opt._optimizer_step_post_hooks
                or _global_optimizer_pre_hooks or _global_optimizer_post_hooks):
            return False
        ours = {id(p) for p in self._optim_params}
        return all(id(p) in ours for g in opt.param_groups for p in g["params"])

    def _optimizer_job(self, opt, snapshot, grads, write_back: bool, release) -> None:
        if not self._layerwise(opt):
            self._callable_job(lambda: (snapshot.step(), snapshot.zero_grad()), grads,
                               write_back, release)
            return
        owned = {id(p) for g in opt.param_groups for p in g["params"]}
        done: set[int] = set()
        try:
            for li in range(len(self._layers)):
                todo = [i for i in self._layer_params[li] if i not in done]
                done.update(todo)
                self._fused_step(snapshot, owned, todo, grads, write_back)
        finally:
            if write_back:
                self._write_back_layers(range(len(self._layers)), release)

    def _fused_step(self, snapshot, owned: set, indices: list[int], grads: list,
                    write_back: bool = True) -> None:
        """``fused_step`` over the parameters ``indices`` that the optimizer holds and that
        have a gradient (with ``write_back``, into their model copies too; the others' model
        copies are then rewritten from their optimizer copies)."""
        step = [i for i in indices
                if grads[i] is not None and id(self._optim_params[i]) in owned]
        if step:
            start = time.perf_counter()
            snapshot.fused_step([self._optim_params[i] for i in step], [grads[i] for i in step],
                                [self._model_params[i] for i in step] if write_back else None)
            self._stats_add("optimizer_s", time.perf_counter() - start)
        if write_back:
            for i in indices:
                if i in step:
                    self._synced[i] = self._version(self._model_params[i])
                else:
                    self._write_back_param(i)

    def _write_back_layers(self, layers, release) -> None:
        """Model copies take the optimizer copies' values, layer by layer in forward order,
        each layer released once written."""
        for li in layers:
            for i in self._layer_params[li]:
                self._write_back_param(i)
            release(li)

    def _flush_stale(self, indices) -> None:
        """After an asynchronous step: queues the write-back of those of ``indices`` whose
        model copy is behind (it runs after the step on the optimizer thread); their layers
        are blocked until written."""
        todo = sorted(self._stale.intersection(indices))
        if not todo:
            return
        self._stale.difference_update(todo)
        layers = sorted({li for i in todo for li in self._param_layers[i]})

        def job(release):
            for i in todo:
                self._write_back_param(i)

        self._submit(job, layers)

    def _submit_exact_step(self, exact: tuple, indices: list[int]) -> None:
        """Exact overlapped mode: hands the parameters ``indices`` (their gradients final) to
        the optimizer thread; their layers are blocked until written."""
        opt, snapshot = exact
        grads = [None] * len(self._model_params)
        for i in indices:
            grads[i], self._grads[i] = self._grads[i], None
        owned = {id(p) for g in opt.param_groups for p in g["params"]}
        layers = sorted({li for i in indices for li in self._param_layers[i]})

        def job(release):
            self._fused_step(snapshot, owned, indices, grads)

        self._submit(job, layers)

    def _run_job(self, job, layers, in_background: bool) -> Any:
        """Runs ``job(release)``; every layer in ``layers`` not released by the job is released
        at the end, whatever happens."""
        remaining = set(layers)

        def release(li: int) -> None:
            if li in remaining:
                remaining.discard(li)
                self._gates.release([li])

        try:
            return job(release)
        except BaseException as e:
            if in_background:
                e.add_note("(raised in RoundPipe's optimizer thread, in a step started earlier)")
            raise
        finally:
            self._gates.release(sorted(remaining))

    def _submit(self, job, layers) -> None:
        """Queues ``job(release)`` on the optimizer thread, ``layers`` blocked until released;
        its error is kept for the next call into the wrapper."""
        layers = list(layers)
        self._gates.block(layers)

        def run():
            try:
                self._run_job(job, layers, in_background=True)
            except BaseException as e:  # noqa: BLE001 - re-raised at the next call
                with self._bg_lock:
                    if self._bg_error is None:
                        self._bg_error = e

        with self._bg_lock:  # workers and the caller both submit
            self._bg_futures = [f for f in self._bg_futures if not f.done()]
            self._bg_futures.append(self._bg.submit(run))

    def _background_idle(self) -> bool:
        with self._bg_lock:
            return all(f.done() for f in self._bg_futures)

    def _wait_background(self) -> None:
        """Waits for the optimizer thread's queued work (no-op on that thread itself)."""
        if self._bg.is_current():
            return
        with self._bg_lock:
            futures = list(self._bg_futures)
        cf.wait(futures)

    def _raise_background_error(self) -> None:
        """Raises the first error of the background work, once all of it queued so far has
        finished (later errors of the same work, e.g. of every stage of an exact-mode pass,
        are dropped with it), and discards the gradients accumulated since."""
        with self._bg_lock:
            if self._bg_error is None:
                return
        self._wait_background()
        with self._bg_lock:
            e, self._bg_error = self._bg_error, None
        self._grads = [None] * len(self._model_params)
        raise e

    def _hook_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """The optimizer's ``step``, ``state_dict`` and ``load_state_dict``, called from another
        thread than the optimizer thread, first wait for pending updates. Also marks it as
        stepped for LR schedulers (what their wrapper of ``opt.step`` records), since the
        wrapper steps it through a snapshot or ``fused_step``."""
        opt._opt_called = True  # read by torch.optim.lr_scheduler's order check
        if opt in self._hooked:
            return
        self._hooked.add(opt)
        me = weakref.ref(self)

        def wait(*_):
            owner = me()
            if owner is not None:
                owner._wait_background()

        wait.roundpipe_wait = True  # not a user hook (see _layerwise)
        opt.register_step_pre_hook(wait)
        opt.register_state_dict_pre_hook(wait)
        opt.register_load_state_dict_pre_hook(wait)

    # --- measurements ------------------------------------------------------------------------------

    def _stats_add(self, key: str, value: float) -> None:
        if value:
            with self._bg_lock:
                self._stats[key] += value

    def pipeline_stats(self, reset: bool = False) -> dict[str, float]:
        """Seconds accumulated since construction (or the last reset) in the passes:
        ``wall_s`` (time in ``forward``/``forward_backward`` passes), ``device_s`` (the same
        times the number of devices in use), ``weights_wait_s`` (compute devices waiting for
        weight uploads; on CUDA measured on the device with events, so only when
        :meth:`synchronize` or a pass completed them), ``optimizer_wait_s`` (devices waiting for
        layers still being updated), ``optimizer_s`` (time in fused optimizer steps),
        ``upload_s`` and ``upload_bytes`` (weight uploads; on CUDA timed on the upload stream).
        On CUDA this waits for the events it reads (a host synchronisation): call it between
        iterations, not inside the steady state you measure."""
        for io in self._io:
            for key, value in io.collect().items():
                self._stats_add(key, value)
        with self._bg_lock:
            out = dict(self._stats)
            if reset:
                self._stats = dict.fromkeys(STAT_KEYS, 0.0)
        return out

    # --- checkpoints -------------------------------------------------------------------------------

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped model's state dict, with the model's keys; trainable parameters at full
        precision (from the optimizer copies), buffers and frozen parameters from the model.
        Waits for pending optimizer work first (:meth:`synchronize`)."""
        self.synchronize()
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        # every name of a parameter, tied ones (one parameter under several names) included
        for name, p in self.module.named_parameters(remove_duplicate=False):
            i = self._index.get(id(p))
            if i is not None:
                o = self._optim_params[i]
                sd[prefix + name] = o if keep_vars else o.detach()
        return sd

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a state dict with the model's keys (e.g. from :meth:`state_dict` or from the
        unwrapped model) into both copies: the model copy rounded to its dtype, the optimizer
        copies at the precision given. ``assign=True`` is not supported. RoundPipe is meant to
        be the outermost module: save and load its own state dict, not one of a module that
        contains it. Waits for pending optimizer work first (:meth:`synchronize`)."""
        if assign:
            raise ValueError("RoundPipe.load_state_dict: assign=True is not supported")
        self.synchronize()
        result = self.module.load_state_dict(state_dict, strict=strict)
        with torch.no_grad():
            for i, (name, o) in enumerate(zip(self._names, self._optim_params)):
                if name in state_dict:
                    o.copy_(state_dict[name])
                self._synced[i] = self._version(self._model_params[i])
        return result


def _check_layers(model: nn.Module, layers: list) -> None:
    """``RoundPipe(layers=...)``: a non-empty list of modules whose parameters and buffers all
    belong to ``model`` (checked by identity)."""
    if not layers:
        raise ValueError("RoundPipe: layers must not be empty")
    own = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"RoundPipe: layers[{i}] must be an nn.Module, got {type(layer).__name__}")
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            if id(t) not in own:
                raise ValueError(f"RoundPipe: layers[{i}] has {name!r}, which is not a parameter "
                                 "or buffer of model (every tensor of the layers must be the model's)")


STAT_KEYS = ("wall_s", "device_s", "weights_wait_s", "optimizer_wait_s", "optimizer_s",
             "upload_s", "upload_bytes")


def _snapshot(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow twin of ``opt`` sharing its state and parameters but holding a copy of each
    param group's hyperparameters as they are now: the optimizer thread steps through it, so
    an LR scheduler changing ``opt.param_groups`` meanwhile affects only the next step."""
    twin = object.__new__(type(opt))
    twin.__dict__.update(opt.__dict__)
    twin.param_groups = [dict(g) for g in opt.param_groups]
    twin.__dict__.pop("_group_index_cache", None)
    return twin
