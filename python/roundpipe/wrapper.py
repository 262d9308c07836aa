"""``RoundPipe``: the model wrapper, a thin facade over the parts the data flows through.

Reading order: plan.py (layers, stages, devices) -> threads.py (workers and waits) ->
param_copies.py (the host model and optimizer copies) -> transfer/ (moving tensors to a device
and back, counting bytes: the CPU device, CUDA) -> pipeline/ (schedule.py: each device's order
of stage visits; stage.py: a stage on one microbatch; fetch.py: weights and prefetch; run.py: a
pass, slots between stages) -> optimizer_thread.py (the optimizer thread's queue
and layer gates) -> steps.py (consuming gradients; synchronous, asynchronous and exact
overlapped steps; loss scaling and clipping with grad_scaler.py and clipping.py) -> stats.py
-> this file.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from . import guards
from . import microbatch as mb
from .context import OptimizerCtx
from .clipping import Clip
from .distributed import REDUCTIONS, Comm, ReplicatedReduction, ShardedReduction
from .grad_scaler import GradScaler
from .host_buffers import tune_malloc
from .disk import StateStore
from .param_copies import ParamCopies
from .pipeline.execute import draw_call_seed, in_layer
from .quant import (check_frozen_dtype, frozen_linears, quantize_frozen_linears,
                    refuse_foreign_quantization)
from .pipeline.run import Layout, Pass
from .pipeline.stage import AutocastState, PassSpec
from .threads import Worker, check_not_forked
from .plan import (check_layers, device_index, make_stages, parse_devices, shared_modules,
                   split_layers)
from . import staging
from .planner import StagePlan
from .stats import Stats
from .steps import StepReport, Steps
from .torch_private import tree_map
from .transfer import CpuIO
from .transfer.cuda import PIN_MODES


class RoundPipe(nn.Module):
    """Wraps a model so that it trains with its weights in CPU memory and only a stage's
    weights at a time on the compute device.

    The model's layers are the children of an ``nn.Sequential`` (any other module is a single
    layer) or the modules given as ``layers``; consecutive layers form a stage, planned under a
    device-memory budget on CUDA or fixed (``layers_per_stage``). The model stays on the host in the dtype it has (the *model copy*: fp16, bf16 or
    fp32; it is what the device computes in). Every trainable parameter also gets an
    *optimizer copy* in ``optim_dtype`` (default: the model's dtype), created once here:
    optimizers work on those (:meth:`optim_parameters`, or :meth:`parameters` inside
    :class:`roundpipe.OptimizerCtx`). Given explicitly and equal to a parameter's dtype,
    ``optim_dtype`` keeps *one* copy of it: the optimizer steps the model copy itself (bfloat16
    master weights, ``RoundPipe(net.to(torch.bfloat16), optim_dtype=torch.bfloat16)`` with a
    ``roundpipe.optim`` optimizer built with ``stochastic_rounding=True``: 2 bytes per weight
    instead of 2 + 4). An asynchronous step (``step(opt, is_async=True)``) then has no older
    copy to compute with: the next call's forward waits for each layer's update (it still
    overlaps the step layer by layer) and computes with the new weights, as after a
    synchronous step.

    Training::

        model = RoundPipe(net.to(torch.bfloat16), optim_dtype=torch.float32)
        with OptimizerCtx():
            opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-4)
        for x, y in loader:
            loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            model.step(opt)

    Args:
        model: the network, with all parameters and buffers on the CPU.
        optim_dtype: floating dtype of the optimizer copies (default: a separate copy in each
            parameter's dtype; a parameter already of ``optim_dtype`` has one copy).
        device: compute device(s): one device, or a non-empty list of them (default:
            ``cuda:0`` when CUDA is available, else the CPU, which runs the very same code
            path). Stage ``s`` runs on ``device[s % len(device)]``; each device has a worker
            thread, so ``["cpu", "cpu"]`` is two CPU workers (the scheduler runs for real
            without a GPU) and ``["cuda:0", "cuda:1"]`` two GPUs. CPU and CUDA are not mixed.
        layers_per_stage: how layers form stages (see :mod:`roundpipe.staging`): ``"auto"``
            (planned by :func:`roundpipe.planner.plan_stages` from layer costs measured during
            the first training calls, under ``memory_budget``), an int ``N`` (``N`` consecutive
            layers per stage) or a sequence of ints (the layers of each stage: a pinned plan,
            e.g. ``plan().sizes``). Default (None): ``"auto"`` on CUDA, 1 on the CPU device.
            :meth:`plan` says which plan is in effect and why.
        memory_budget: with ``"auto"`` (stages or ``recompute``), the device memory the
            pipeline may use on each device: a fraction of the smallest device's memory
            (default 0.6; CUDA: its total memory times the process's memory fraction; the CPU
            device: the machine's RAM; a float, ``1.0`` for all of it) or bytes (an int, at
            least 1 MiB: ``memory_budget=1`` is refused, not taken as one byte). Each stage
            holds at most half of it (weights, gradient sums, one microbatch's activations),
            so the next stage uploads while one computes; stages that do not recompute hold
            theirs, and the saved tensors of every microbatch, on top, within the budget.
        recompute: which stages recompute their forward in the backward pass (see
            :mod:`roundpipe.staging`): ``"auto"`` (default: after the first training call,
            which recomputes and measures, the planner keeps autograd's saved tensors of the
            stages it can within ``memory_budget`` and recomputes the rest; on the CPU device,
            whose budget is a share of the machine's RAM, a model that fits trains without
            recomputing), ``True`` (every stage but the last recomputes: the least device
            memory), ``False`` (no stage does) or, with fixed ``layers_per_stage``, one bool per
            stage (``recompute=plan().recompute`` pins a plan with ``layers_per_stage=
            plan().sizes``). Results do not depend on it, bit for bit. :meth:`plan` says which
            stages recompute and why.
        num_microbatch: default number of microbatches per call (default: number of devices + 1,
            at most the batch size). Results do not depend on the number of devices, for a
            given number of microbatches.
        split_fn: custom split of ``(args, kwargs, label, n)`` into microbatches, with the
            signature and contract of :func:`roundpipe.microbatch.split_microbatches`.
        pin_memory: CUDA only: the host model copy in page-locked memory, ``"auto"`` /
            ``"alloc"`` (moved into one registered arena of exactly its size), ``"register"``
            (``cudaHostRegister`` in place) or ``"off"``; when pinning fails, pageable memory
            with a warning. The mode in effect is ``self.pin_memory`` (``"off"`` for CPU).
        prefetch: upload the next stage's weights while the current one computes (at most
            two stages of weights resident per device; on the CPU device the same logic runs,
            with copies that are synchronous).
        max_resident_bytes: no prefetch when the current and the next stage's
            weights together exceed this many bytes (default: no cap).
        layers: the pipeline's layers, run in order, instead of ``model``'s split (e.g. the
            embeddings, decoder layers and head of a Hugging Face model). ``model`` stays the
            module the wrapper presents (``state_dict`` keys, parameter names); every
            parameter and buffer of the layers must belong to it. A parameter used by several
            layers (tied embeddings) is one parameter with one optimizer copy.
        process_group: data parallelism over ``torch.distributed`` (see
            :mod:`roundpipe.distributed`): each rank of the group wraps the same model (rank 0's
            weights are broadcast here), feeds its own data, and every step applies the
            gradient reduced over the ranks, so all ranks keep identical weights.
            ``forward_backward`` returns this rank's loss. None (default): one process.
        shard_optimizer: with a group, each rank keeps the optimizer copies, gradients and
            optimizer state of only its rows of each parameter (``optim_parameters()`` is
            this rank's share; elementwise optimizers work unchanged, Adafactor and LBFGS are
            refused by ``step`` and exact mode with a ``ValueError``).
        grad_reduction: ``"mean"`` (default, as DDP) or ``"sum"`` of the ranks' gradients.
        frozen_dtype: ``"nf4"`` (QLoRA's 4-bit NormalFloat), ``"nf4-dq"`` (the same with
            QLoRA's double quantization of the absmax) or ``"int8"`` (blockwise absmax): the weights of ``nn.Linear`` modules that do not require grad are kept on
            the host in that format, uploaded packed and dequantized on the device once per
            stage visit, right behind the upload (see :mod:`roundpipe.quant`); biases, norms, embeddings, tied or
            output embeddings and every trainable parameter stay as they are. Raises
            ``ValueError`` when the model has no frozen linear. None (default): no quantization.
        optimizer_dir: a folder on a local disk (an NVMe SSD) for the optimizer copies and the
            optimizer state (see docs/host_memory.md, "Optimizer state on a disk"): they live
            in files in ``<optimizer_dir>/rank<r>`` (``r``: the rank, 0 without a process
            group; created if missing, taken by this RoundPipe alone, removed when it is
            deleted or the process exits normally), and host memory holds only a window of a
            few stages' worth while they are stepped (read and written with direct I/O, read
            ahead of the step). Results are those of the same optimizer in memory, bit for
            bit. The step must be a ``roundpipe.optim`` optimizer stepped by RoundPipe
            (``step(opt)``, exact mode); between steps the optimizer copies and state view
            their files (reading them works, through the page cache). None (default): host
            memory.

    Concurrency: one call at a time per wrapper (``forward``, ``forward_backward``, ``step``,
    ``load_state_dict``): calls from other threads wait for the running one; a call from
    inside the running one (from ``loss_fn``, a layer or a step function of this same model)
    raises ``RuntimeError``. Independent wrappers are independent, and a layer may call another
    RoundPipe (e.g. a frozen teacher). Threads: one worker per device and one optimizer
    thread, daemon threads started on first use; errors on them reach the caller (see
    :meth:`forward_backward`, :meth:`step`); at interpreter exit, pending optimizer work
    finishes first.

    Raises:
        ValueError: a parameter or buffer is not on the CPU, ``optim_dtype`` is not a floating
            dtype, ``layers_per_stage`` is not ``"auto"``, an int >= 1 or layer counts summing
            to the number of layers (or puts a layer the model needs out of the last stage
            there), ``memory_budget`` is not a fraction or bytes (an int under 1 MiB),
            ``recompute`` is not ``"auto"``, True, False or one bool per fixed stage (the last
            False), a layer alone needs more than half of the budget (with ``"auto"``, at the
            call that plans; with ``recompute=False``, the kept stages together more than the
            budget),
            ``num_microbatch`` is < 1, ``device`` is an empty
            list, names an unsupported device type or mixes CPU and CUDA, ``pin_memory`` is
            not one of the modes, ``max_resident_bytes`` < 0, ``layers`` is empty or holds a
            tensor that is not ``model``'s, ``shard_optimizer`` without ``process_group``,
            ``grad_reduction`` not "mean"/"sum", or the ranks wrap different models or with
            different ``shard_optimizer``, ``grad_reduction``, ``optim_dtype``,
            ``layers_per_stage`` or numbers of ``layers`` (the message names the setting).
        TypeError: ``model`` or an entry of ``layers`` is not a module, a ``device`` entry is
            not a str or device, ``prefetch`` or ``shard_optimizer`` is not a bool,
            ``optimizer_dir`` is not a path.
        roundpipe.disk.StateDiskError: (an ``OSError``) ``optimizer_dir`` cannot be used: it
            is in use by another process or RoundPipe, holds files that are not RoundPipe's,
            or the disk cannot hold the optimizer copies (the message names the folder and
            the cause).
        RuntimeError: ``process_group`` without torch.distributed initialised, or this process
            is not in it.
    """

    def __init__(self, model: nn.Module, optim_dtype: Optional[torch.dtype] = None, *,
                 device: Any = None, layers_per_stage: Any = None, memory_budget: Any = 0.6,
                 num_microbatch: Optional[int] = None,
                 split_fn: Optional[Callable[..., list]] = None,
                 pin_memory: str = "auto", prefetch: bool = True,
                 max_resident_bytes: Optional[int] = None,
                 layers: Optional[Sequence[nn.Module]] = None, process_group: Any = None,
                 shard_optimizer: bool = False, grad_reduction: str = "mean",
                 frozen_dtype: Optional[str] = None, optimizer_dir: Any = None,
                 recompute: Any = "auto") -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"RoundPipe: model must be an nn.Module, got {type(model).__name__}")
        refuse_foreign_quantization(model, "RoundPipe")
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
        if not isinstance(shard_optimizer, bool):
            raise TypeError("RoundPipe: shard_optimizer must be a bool, got "
                            f"{type(shard_optimizer).__name__}")
        if optimizer_dir is not None and not isinstance(optimizer_dir, (str, os.PathLike)):
            raise TypeError("RoundPipe: optimizer_dir must be None or a path (str), got "
                            f"{type(optimizer_dir).__name__}")
        if shard_optimizer and process_group is None:
            raise ValueError("RoundPipe: shard_optimizer=True needs a process_group")
        check_frozen_dtype(frozen_dtype, "RoundPipe")
        if frozen_dtype is not None:
            frozen_linears(model, frozen_dtype)  # raises when there is nothing to quantize
        checked = check_layers(model, layers) if layers is not None else None
        devices = parse_devices(device)
        num_layers = len(checked) if checked is not None else len(split_layers(model))
        fixed, _ = staging.parse(layers_per_stage, memory_budget, num_layers, devices[0].type)
        staging.parse_recompute(recompute, fixed)
        self._comm = None
        if process_group is not None:
            self._comm = Comm(process_group, grad_reduction, shard_optimizer, Stats())
            self._comm.check_and_broadcast(model, {  # the settings every rank must share
                "optim_dtype": optim_dtype, "layers_per_stage": layers_per_stage,
                "memory_budget": memory_budget, "recompute": recompute,
                "layers": None if layers is None else len(layers)})
        elif grad_reduction not in REDUCTIONS:
            raise ValueError(f"RoundPipe: grad_reduction must be one of {REDUCTIONS}, got "
                             f"{grad_reduction!r}")
        self.process_group, self.shard_optimizer = process_group, shard_optimizer
        self.grad_reduction = grad_reduction
        tune_malloc()
        self.module = model
        self.devices = devices
        self.device = self.devices[0]
        self.prefetch = prefetch
        self.max_resident_bytes = max_resident_bytes
        self.frozen_dtype = frozen_dtype
        if frozen_dtype is not None:  # after every check: it replaces modules of ``model``
            new = quantize_frozen_linears(model, frozen_dtype)
            checked = None if checked is None else [new.get(id(m), m) for m in checked]
        self._layers = checked if checked is not None else split_layers(model)
        fence, why = self._last_stage_fence(self._layers)
        self._staging = staging.Staging(self._layers, self.devices, layers_per_stage,
                                        memory_budget, fence, why, recompute)
        self._stages = make_stages(self._staging.plan.sizes, self.devices)
        self.num_microbatch = num_microbatch or len(self.devices) + 1
        self._split = split_fn or mb.split_microbatches
        self.pin_memory, self._pinned_bytes = "off", 0
        if self.devices[0].type == "cuda":
            from .transfer.cuda import pin_host_model
            self.pin_memory, self._pinned_bytes = pin_host_model(model, pin_memory, self.devices[0])
        if self._comm is not None and self._staging.auto:  # every rank plans under the same
            self._staging.budget_bytes = self._comm.smallest(self._staging.budget_bytes)
        store = None
        if optimizer_dir is not None:
            store = StateStore(optimizer_dir, self._comm.rank if self._comm is not None else 0)
        try:
            self._copies = ParamCopies(model, self._layers, self._stages, optim_dtype,
                                       self._comm, store)
        except BaseException:
            if store is not None:
                store.close()
            raise
        self.optimizer_dir = optimizer_dir
        self._build_layout()
        self._runtime_init()

    def _last_stage_fence(self, layers: list[nn.Module]) -> tuple[int, str]:
        """The first layer the last stage may start at (0: any), and why (for the error a
        fixed plan that breaks it gets); a subclass whose last stage must hold only some
        layers overrides it."""
        return 0, ""

    def plan(self) -> StagePlan:
        """The stage plan in effect: layers per stage (``plan().sizes``, which
        ``layers_per_stage=`` accepts to pin it), which stages recompute
        (``plan().recompute``), its predicted call time and device bytes per stage when
        planned, and the reason, recomputation included (see :mod:`roundpipe.staging`)."""
        return self._staging.plan

    def _set_plan(self, plan: StagePlan) -> None:
        """Makes ``plan`` the stages of the next pass (between calls, with no optimizer work
        pending: queued work refers to stage numbers)."""
        self._steps.thread.wait()
        self._stages = make_stages(plan.sizes, self.devices)
        self._copies.set_stages(self._stages)
        self._build_layout()
        self._stats.add("plan_revisions", 1)
        self._stats.set("stages", len(self._stages))

    def _revise_plan(self, mbs: list) -> None:
        """With ``layers_per_stage="auto"``, before a training call: the plan made from what
        was measured so far, if it changes (see :mod:`roundpipe.staging`)."""
        agree = None
        if self._comm is not None:
            agree = self._comm.agree
            if self._staging.planning():
                self._steps.thread.wait()  # the optimizer thread's collectives done, on every rank
        plan = self._staging.revise(
            mbs, lambda: staging.measured_link(self.pipeline_stats(), self.devices[0].type),
            agree)
        if plan is not None:
            self._set_plan(plan)

    def _build_layout(self) -> None:
        """The pipeline's maps over the layers (:func:`roundpipe.plan.shared_modules`)."""
        maps = shared_modules(self._layers, self._stages, self._copies.index.position)
        self._locks, self._buffer_deps = maps.locks, maps.buffer_deps
        self._stage_bytes, self._grad_numels = maps.stage_bytes, maps.grad_numels

    def _runtime_init(self) -> None:
        """Threads, per-device transfer state and synchronisation: rebuilt after unpickling or
        ``copy.deepcopy`` (never copied)."""
        self._stats = Stats()
        self._stats.set("pinned_bytes", self._pinned_bytes)
        self._stats.set("stages", len(self._stages))
        self._workers = [Worker(f"roundpipe-{d}-{i}") for i, d in enumerate(self.devices)]
        reduction = None
        if self._comm is not None:
            self._comm.stats = self._stats
            reduction = (ShardedReduction if self._comm.shard else ReplicatedReduction)(
                self._copies, self._comm)
        self._steps = Steps(self._copies, len(self._layers), self._stats, reduction)
        guards.register_copies(self._copies.optim, [m for m, o in zip(
            self._copies.model, self._copies.optim) if m is not o], self._steps,
            f"{type(self).__name__}({type(self.module).__name__}) at {id(self):#x}")
        if self.devices[0].type == "cuda":
            from .transfer.cuda import CudaIO, HostWrites
            writes = HostWrites()
            self._ios = [CudaIO(d, self._stats, self.prefetch, self._grad_numels, writes,
                                pin=self.pin_memory != "off") for d in self.devices]
        else:
            self._ios = [CpuIO(d, self._stats, self._copies.pool, self.prefetch)
                         for d in self.devices]
        self._call_lock = threading.Lock()
        self._call_owner: Optional[threading.Thread] = None
        self._call_name = ""
        closers = [w.close for w in self._workers] + [self._steps.close]
        if self._copies.store is not None:  # its files go with the wrapper
            closers.append(self._copies.store.close)
        # threads end with the wrapper (at exit, threads._stop_workers ends them)
        weakref.finalize(self, lambda: [close() for close in closers]).atexit = False

    _RUNTIME = ("_stats", "_workers", "_steps", "_ios", "_call_lock", "_call_owner", "_call_name",
                "_locks", "_comm", "process_group")

    def __getstate__(self):
        """Pickling and ``copy.deepcopy`` wait for pending optimizer work, write every layer
        back, and leave the threads and device state out (the copy makes its own)."""
        self._steps.synchronize()
        return {k: v for k, v in self.__dict__.items() if k not in self._RUNTIME}

    def __setstate__(self, state) -> None:
        """After ``copy.deepcopy`` or unpickling the parameters are new objects: the maps over
        them and the threads are rebuilt."""
        super().__setstate__(state)
        self._comm, self.process_group = None, None  # a copy is one process
        self._build_layout()
        self._runtime_init()

    # --- parameters: model copies, or optimizer copies inside OptimizerCtx -----------------

    def optim_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, optimizer copy)`` of every trainable parameter, with the model's names."""
        return iter(zip(self._copies.index.names, self._copies.optim))

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        """The optimizer copies (``optim_dtype``, on the host) of every trainable parameter."""
        return iter(self._copies.optim)

    def optim_shard_rows(self) -> dict[str, Optional[tuple[int, int]]]:
        """Which rows of each trainable parameter this rank's optimizer copy holds, under the
        names of :meth:`optim_named_parameters`: ``(start, stop)`` along dim 0 with
        ``shard_optimizer=True`` (the rows ``[start, stop)`` of the whole parameter; a rank may
        hold none, ``start == stop``), None where the optimizer copy is the whole parameter
        (always without ``shard_optimizer``; also for parameters too small to shard)."""
        return dict(zip(self._copies.index.names, self._copies.index.rows))

    @property
    def host_process_group(self) -> Any:
        """The ``gloo`` process group over the ranks of ``process_group`` that RoundPipe's own
        host-side collectives use (gradients, rows of sharded copies; a checkpoint's
        ``DeviceMesh``), or None without a ``process_group`` (and in a copy made by
        ``copy.deepcopy`` or unpickling, which is one process)."""
        return None if self._comm is None else self._comm.group

    def sync_model_copies(self) -> None:
        """Every model copy takes the value of its optimizer copy (rounded to the model dtype;
        with ``shard_optimizer=True`` each rank writes its rows and they are all-gathered, a
        collective every rank of the group must call): for optimizer copies changed in place
        outside a step, e.g. loaded from a checkpoint (:func:`roundpipe.load_checkpoint`).
        Waits for pending optimizer work first (:meth:`synchronize`)."""
        with self._call("sync_model_copies"):
            self._steps.synchronize()
            self._copies.write_back_all()

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
        """What ``nn.Module.to`` / ``cpu`` / ``cuda`` / ``float`` / ``half`` / ``type`` /
        ``share_memory`` ... call. The model copy stays on the host in the dtype it was
        given, so a call that would leave every tensor as it is (``model.to("cpu")``,
        ``model.cpu()``, ``model.float()`` on an fp32 model) does nothing and returns the
        model, as in PyTorch; any other raises ``TypeError`` before anything changes.

        ``fn`` is tried on a small stand-in of each parameter and buffer (same dtype, device,
        dimensions and stride order; never on the tensors themselves): it is a no-op when it
        returns the stand-in itself, with the same storage."""
        for name, t in list(self.module.named_parameters()) + list(self.module.named_buffers()):
            order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
            strides = [0] * t.dim()
            for k, d in enumerate(order):
                strides[d] = 2 ** (t.dim() - 1 - k)
            probe = torch.empty_strided((2,) * t.dim(), strides, dtype=t.dtype, device=t.device)
            before = (probe.untyped_storage().data_ptr(), probe.is_shared())
            try:
                result = fn(probe)
            except Exception as e:  # e.g. .cuda() without CUDA: the message below says more
                raise TypeError(_MOVE_MESSAGE.format(name=name, t=t, to="something else")) from e
            if not (result is probe and before == (probe.untyped_storage().data_ptr(),
                                                   probe.is_shared())):
                to = "something else"
                if isinstance(result, torch.Tensor):
                    to = (f"{result.dtype} on {result.device}"
                          if (result.dtype, result.device) != (t.dtype, t.device)
                          else "other memory (a copy, shared memory or another layout)")
                raise TypeError(_MOVE_MESSAGE.format(name=name, t=t, to=to))
        return self

    # --- calls ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _call(self, name: str):
        """One call at a time (see the class docstring)."""
        check_not_forked(self._workers, f"RoundPipe.{name}()")
        self._steps.check_not_forked(f"RoundPipe.{name}()")
        me = threading.current_thread()
        if (self._call_owner is me or self._steps.is_current()
                or any(w.is_current() for w in self._workers)):
            raise RuntimeError(
                f"RoundPipe.{name}() was called from inside this model's own "
                f"{self._call_name or 'step'}() (from loss_fn, a layer or a step function); a "
                "RoundPipe runs one call at a time: compute what loss_fn needs before the call, "
                "or use a separate model")
        with self._call_lock:
            self._call_owner, self._call_name = me, name
            try:
                yield
            finally:
                self._call_owner, self._call_name = None, ""

    def _microbatches(self, args, kwargs, label, num_microbatch) -> list:
        """The call's inputs split into microbatches. Floating-point input tensors (in
        ``args`` and ``kwargs``, not the label) are first cast to the model copy's dtype
        (that of the first floating parameter of the layers, in order) when theirs differs,
        as FSDP's ``MixedPrecisionPolicy(cast_forward_inputs=True)`` does; the caller's
        tensors are left as they are."""
        n = num_microbatch if num_microbatch is not None else self.num_microbatch
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"RoundPipe: num_microbatch must be an int >= 1, got {n!r}")
        args, kwargs = tuple(args), dict(kwargs or {})
        if "_input_dtype" not in self.__dict__:  # parameters keep their dtype (see _apply)
            self._input_dtype = next((p.dtype for layer in self._layers
                                      for p in layer.parameters() if p.is_floating_point()), None)
        dtype = self._input_dtype

        def needs_cast(t) -> bool:
            return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype

        # the usual flat call needs no tree walk: only nested inputs or a cast do
        if dtype is not None and any(isinstance(v, (tuple, list, dict)) or needs_cast(v)
                                     for v in (*args, *kwargs.values())):
            args, kwargs = tree_map(lambda t: t.to(dtype) if needs_cast(t) else t, (args, kwargs))
        return self._split(args, kwargs, label, n)

    def _layout(self) -> Layout:
        refs = self._copies.refs()
        trainable = [any(r.index is not None and r.host.requires_grad
                         for li in st.layers for r in refs[li]) for st in self._stages]
        return Layout(self._layers, refs, self._stages, trainable, self._locks,
                      self._buffer_deps, self._stage_bytes, self.max_resident_bytes,
                      self._staging.plan.recompute)

    def _run_pass(self, spec: PassSpec, grad_sink=None) -> Pass:
        """Runs a pass: on this thread with one device in use, or when called from inside
        another RoundPipe's layer; on the device workers otherwise."""
        gates = self._steps.begin_pass()
        run = Pass(spec, self._layout(), self._ios, gates, self._stats, grad_sink)
        used = {device_index(v.stage, len(self.devices)) for v in run.order}
        start = time.perf_counter()
        try:
            run.run(None if len(used) == 1 or in_layer() else self._workers)
        finally:
            elapsed = time.perf_counter() - start
            self._stats.add("wall_s", elapsed)
            self._stats.add("device_s", len(used) * elapsed)
        return run

    def forward(self, *args: Any, num_microbatch: Optional[int] = None, **kwargs: Any) -> Any:
        """Inference and evaluation: runs the model on ``(*args, **kwargs)`` in microbatches,
        stage by stage, without autograd, and returns the merged outputs on the host. In
        training mode, buffers (e.g. BatchNorm running statistics) are updated on the host.
        Layers still being updated by the optimizer side are waited for, each on its own.
        After an asynchronous step and before :meth:`synchronize`, this computes with the
        weights the next ``forward_backward`` computes with (one step behind).

        ``torch.compile(model)`` / ``model.compile()`` do not compile a RoundPipe (its pipeline
        of threads and transfers cannot be traced, and ``forward_backward`` is not even seen
        by them): the call runs eagerly, with a warning. Compile the layers before wrapping
        them instead (see docs/training.md, "torch.compile").

        In training mode with gradients enabled, the floating outputs are
        :class:`roundpipe.guards.Finished` tensors (the same memory): ``.backward()`` from
        them raises an error naming :meth:`forward_backward` (training runs through it: this
        pass keeps no graph); under ``torch.no_grad()`` or in eval mode they are plain
        tensors."""
        if torch.compiler.is_compiling():  # traced by torch.compile: run eagerly, say so
            return _uncompiled()(self, args, num_microbatch, kwargs)
        with self._call("forward"):
            spec = PassSpec(self._microbatches(args, kwargs, None, num_microbatch), False,
                            call_seed=draw_call_seed(), autocast=AutocastState.capture())
            try:
                run = self._run_pass(spec)
            finally:
                spec.store.clear()
            out = mb.merge_outputs([slot.get(None)[0] for slot in run.acts[-1]])
        if self.training and torch.is_grad_enabled() and not in_layer():
            out = guards.finished(out)  # .backward() from it raises, naming forward_backward
        return out

    def forward_backward(self, input_args: tuple = (), input_kwargs: Optional[dict] = None,
                         label: Any = None, loss_fn: Callable[..., torch.Tensor] = None,
                         return_outputs: bool = False, num_microbatch: Optional[int] = None,
                         optimizer: Optional[torch.optim.Optimizer] = None, *,
                         grad_scaler: Optional[GradScaler] = None,
                         max_grad_norm: Optional[float] = None, norm_type: float = 2.0,
                         error_if_nonfinite: bool = False, loss_reduction: Any = "mean"):
        """One forward and backward pass over a batch, in microbatches.

        The batch is split into microbatches (dim 0 of every batched tensor of ``input_args``,
        ``input_kwargs`` and ``label``, or ``split_fn``). The forward pass runs stage by stage,
        each stage's weights copied to its device for the stage and dropped after, keeping only
        the stage inputs (on the host), except for the stages that keep their weights and
        autograd's saved tensors to their backward (``recompute``, :meth:`plan`). The backward
        pass runs the stages in reverse, recomputing each other stage's forward (same
        randomness) before its backward. The loss of microbatch ``i``
        is ``loss_fn(output_i, label_i)`` (``loss_fn(output_i)`` when ``label`` is None). With
        several devices, stage ``s`` runs on ``devices[s % len(devices)]``, all microbatches of
        it there, and the devices work on different stages at the same time (a pipeline).
        The caller's ``torch.autocast`` state applies to the layers and ``loss_fn``. Every
        tensor a layer receives is its own copy (in-place operations on inputs are safe).

        **Loss convention** (``loss_reduction``): write ``loss_fn`` as for plain PyTorch, the
        mean over its microbatch (``F.mse_loss(out, y)``, ``F.cross_entropy(...)``). Each
        microbatch's loss is weighted by its share of the batch before its backward, so the
        returned loss and the gradients are those of the loss over the whole batch, for any
        number of microbatches and devices:

        - ``"mean"`` (default): shares by rows (a microbatch's leading dimension);
        - ``"token_mean"``: shares by the label's elements not equal to -100 (a token mean
          such as ``F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)``,
          the label aligned with the output); a batch with no such element gives a zero loss
          and zero gradients;
        - a callable: ``loss_reduction(label_i)`` is microbatch ``i``'s number of items
          (e.g. ``lambda y: (y[:, 1:] != -100).sum()`` for a loss that shifts its labels);
        - ``"sum"``: no weighting, the gradients are those of the *sum* of the microbatch
          losses, and that sum is returned (for a ``loss_fn`` that returns its microbatch's
          share itself, e.g. a sum divided by a count over the whole batch, as before 0.2).

        With data parallelism the mean is this rank's; ``grad_reduction="mean"`` over ranks
        of equal batches then gives the mean over every rank's batch, as DDP. Hugging Face
        models wrapped by :func:`roundpipe.wrap_model_to_roundpipe` without ``loss_fn`` keep
        HF's token mean over the whole batch.

        The returned loss is a :class:`roundpipe.guards.Finished` tensor: detached, and its
        ``backward()`` raises an error naming this method (the backward already ran in this
        call: ``loss.backward()`` is the habit of a plain loop, and would otherwise fail with
        torch's generic message); ``.item()``, ``.numpy()``, ``+=`` work as on any tensor.

        Gradients: each stage's parameter gradients are summed over the call's microbatches on
        its device (fp32, in microbatch order) and downloaded once; on the host they
        accumulate, in the optimizer dtype, across calls until :meth:`step`. If the call
        raises, the gradients accumulated since the last step are discarded (as by
        :meth:`zero_grad`), so a partial gradient is never applied, and the wrapper stays
        usable.

        **Exact overlapped mode** (``optimizer=opt``): equivalent to this call followed by
        ``step(opt)`` — bit for bit — but each stage's parameters are stepped on the optimizer
        thread as soon as their gradients are final (right after the stage's backward, straight
        from the download), while the earlier stages' backward runs; the call returns without
        waiting for the last updates (the next call waits for each layer's own update). With a
        :class:`roundpipe.optim.CpuOptimizer` that holds only this wrapper's optimizer copies
        and has no step hooks, the fused entry point is used (gradients in, model copy out, per
        stage); any other optimizer (a ``torch.optim`` one, one that also holds parameters from
        outside the wrapper, or one with step hooks) is stepped once, after the whole backward.
        The optimizer's hyperparameters are read when the call starts. If the call raises, the
        stages already stepped stay stepped. With ``grad_scaler`` or ``max_grad_norm`` the
        step needs every gradient's verdict first (overflow, the global norm): it runs after
        the backward instead, in the background (the next call waits for each layer's own
        update), counted in ``pipeline_stats()["exact_deferred_calls"]`` — still bit for bit
        ``forward_backward`` + ``step(opt, grad_scaler=..., max_grad_norm=...)``.

        **Loss scaling** (``grad_scaler``, a :class:`roundpipe.GradScaler`): each microbatch's
        loss is multiplied by the step's scale before its backward (the scale in force when
        the step's first call started: every call of one step uses the same one; see
        :meth:`step`); the returned loss is not scaled. Pass the same scaler to :meth:`step`.

        Returns:
            The loss of the batch (weighted as ``loss_reduction`` says: by default the whole
            batch's mean; a 0-dim float32 :class:`~roundpipe.guards.Finished` tensor on the
            host, detached), or ``(loss, outputs)`` with
            ``return_outputs=True`` (outputs merged over microbatches, on the host).

        Args (besides the batch): ``max_grad_norm``, ``norm_type``, ``error_if_nonfinite``:
            clipping of exact mode's step, as in :meth:`step`; ``loss_reduction``: see the
            loss convention above.

        Raises:
            TypeError: ``loss_fn`` is missing or returns something else than a 1-element
                tensor, ``optimizer`` is not a torch optimizer or holds no optimizer copy of
                this model (see :meth:`step`), ``grad_scaler`` is not a roundpipe.GradScaler,
                ``max_grad_norm`` is given without ``optimizer``, or ``"token_mean"`` is given
                with a label that is not a tensor.
            ValueError: a bad ``max_grad_norm`` / ``norm_type`` or ``loss_reduction``, or the
                calls of one step use different grad scalers.
            RuntimeError: the loss does not require grad; or the call was made from inside
                this model's own call (see the class docstring).
            The error of a failed asynchronous step (see :meth:`step`). Exceptions from the
            layers and ``loss_fn`` propagate unchanged, also when raised on a worker thread.
        """
        if loss_fn is None:
            raise TypeError("RoundPipe.forward_backward: loss_fn is required")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("RoundPipe.forward_backward: optimizer must be a torch.optim."
                            f"Optimizer, got {type(optimizer).__name__}")
        clip = Clip.make(max_grad_norm, norm_type, error_if_nonfinite, "RoundPipe.forward_backward")
        mb.check_loss_reduction(loss_reduction, "RoundPipe.forward_backward")
        if clip is not None and optimizer is None:
            raise TypeError("RoundPipe.forward_backward: max_grad_norm clips a step: pass it to "
                            "step(), or give optimizer= (exact overlapped mode)")
        with self._call("forward_backward"):
            mbs = self._microbatches(input_args, input_kwargs, label, num_microbatch)
            shares = mb.loss_shares(mbs, loss_reduction)
            self._revise_plan(mbs)
            # the optimizer side's policy for this call (loss scale, exact mode, discarding
            # the gradients if it fails, the step after the backward): steps.py
            with self._steps.call(optimizer, grad_scaler, clip) as call:
                spec = PassSpec(mbs, True, loss_fn, label is not None, return_outputs,
                                draw_call_seed(), AutocastState.capture(), loss_scale=call.scale,
                                want_norms=call.want_norms, loss_weights=shares,
                                meter=self._staging.meter_for(mbs))
                try:
                    run = self._run_pass(spec, call.grad_sink)
                    self._staging.fold(spec.meter)
                    total = torch.zeros((), dtype=torch.float64)
                    for t, _ in run.losses:
                        total += t
                    outputs = [tree for tree, _ in run.outputs] if return_outputs else []
                finally:
                    spec.store.clear()
        loss = guards.finished(total.to(torch.float32))
        return (loss, mb.merge_outputs(outputs)) if return_outputs else loss

    # --- the optimizer side --------------------------------------------------------------------------

    def step(self, step_fn: Any, is_async: bool = False, *,
             grad_scaler: Optional[GradScaler] = None, max_grad_norm: Optional[float] = None,
             norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Any:
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
          hyperparameters are read when ``step`` is called (a snapshot, tensors included), so
          ``scheduler.step()`` right after ``step`` affects the next step, as in a synchronous
          loop; its ``step``, ``state_dict`` and ``load_state_dict`` wait for a pending update.

        The gradients are cleared in both cases.

        **Asynchronous step** (``is_async=True``) returns at once (``None``); the update runs
        on the optimizer thread while the caller goes on with the next iteration, whose calls
        all compute with the weights from before the step: the update computed from iteration
        t's gradients is applied while iteration t+1 runs (one step of staleness:
        ``W[t+1] = W[t] - update(grad(W[t-1]))``, as in delayed parameter updates), for any
        number of ``forward_backward`` calls per step. The optimizer thread first writes into
        each layer's model copy the weights of the step before (releasing the layer for the
        next pass at once), then updates its optimizer copy. :meth:`synchronize` (also called
        by a synchronous step, ``state_dict``, ``load_state_dict`` and pickling) waits and
        writes every layer's current weights back: the copies agree and there is no staleness
        after it. Rules while an update is pending: what ``step_fn`` touches belongs to the
        optimizer thread (with a callable, do LR scheduling and logging of optimizer state
        inside ``step_fn`` or after :meth:`synchronize`; an optimizer passed directly is
        protected as said above); change weights only after :meth:`synchronize`. An exception
        in the background is re-raised, with its traceback, at the next call into the wrapper
        (``forward``, ``forward_backward``, ``step``, ``synchronize``, ``state_dict``,
        ``load_state_dict``; at the latest by the end of the next ``forward_backward``, which
        waits for the step before it returns), which then discards the gradients accumulated
        since; the wrapper stays usable (the model copies are written back as usual). A
        parameter with one copy (``optim_dtype`` equal to its dtype) is not stale: its layer
        waits in the next pass until the step has written it.

        **Loss scaling and clipping** (``grad_scaler``: the :class:`roundpipe.GradScaler` the
        calls since the last step used; ``max_grad_norm``: clip by the global L2 norm over every
        trainable parameter). First the verdict: the norm of the unscaled gradients, from the
        squared norms gathered while the gradients were summed on the device (one read of a
        gradient only when it was summed over several calls); with a scaler, a non-finite norm
        **skips the whole step** (no parameter, no optimizer state, no step count changes) and
        the scaler backs off, otherwise the step counts toward growth; with ``max_grad_norm``,
        ``clip_coef = max_grad_norm / (norm + 1e-6)`` clamped at 1, in float32 as
        ``torch.nn.utils.clip_grad_norm_``. Then the update: the gradients multiplied by
        ``float32(1 / scale)`` and by ``clip_coef`` (two roundings, as ``GradScaler.unscale_``
        then ``clip_grad_norm_``), inside the fused kernel for optimizers stepped layer by
        layer, in place before ``opt.step()`` / ``step_fn()`` otherwise (a skipped step does
        not call them). With a synchronous step this is ``torch.amp.GradScaler``'s sequence
        exactly; with ``is_async=True`` the verdict of step t decides the scale from step t+2
        on (the calls of step t+1 started before it was known), and an overflow backs off
        from the scale that overflowed, so one episode halves the scale once.
        ``error_if_nonfinite`` and ``norm_type`` (2.0 only) as in torch.
        :meth:`last_step_stats` reports the norm, the skip and the scale.

        Returns:
            What ``step_fn`` returns (None for an optimizer, with ``is_async=True``, and for a
            skipped step).

        Raises:
            TypeError: ``step_fn`` is neither callable nor an optimizer, ``is_async`` is not
                a bool, ``grad_scaler`` is not a roundpipe.GradScaler, or the optimizer holds
                a model copy (built on ``model.parameters()`` outside :class:`OptimizerCtx`
                while the optimizer copies are separate) or none of this model's optimizer
                copies: it would train nothing.
            ValueError: ``grad_scaler`` is not the one the calls since the last step used, or a
                bad ``max_grad_norm`` / ``norm_type``.
            RuntimeError: called from inside this model's own call (e.g. a closure optimizer
                whose closure calls ``forward_backward``).

        A callable ``step_fn`` that changed none of the optimizer copies that had a gradient
        (it trained nothing, or only read them) gets a ``UserWarning``, once per model.
        Stepping an optimizer over this model's optimizer copies outside ``step`` (a plain
        loop's ``opt.step()``) raises ``RuntimeError`` naming ``model.step(opt)``, the
        accumulated gradients kept for it; stepping one over the model copies, anywhere,
        raises ``TypeError``.
        """
        if not isinstance(is_async, bool):
            raise TypeError(f"RoundPipe.step: is_async must be a bool, got {type(is_async).__name__}")
        if not isinstance(step_fn, torch.optim.Optimizer) and not callable(step_fn):
            raise TypeError("RoundPipe.step: step_fn must be a callable or a torch.optim."
                            f"Optimizer, got {type(step_fn).__name__}")
        clip = Clip.make(max_grad_norm, norm_type, error_if_nonfinite, "RoundPipe.step")
        with self._call("step"):
            return self._steps.step(step_fn, is_async, grad_scaler, clip)

    def last_step_stats(self) -> StepReport:
        """The last completed step's ``grad_norm`` (global L2 norm of the unscaled gradients
        before clipping), ``skipped`` and ``scale`` (see :class:`roundpipe.steps.StepReport`);
        after an asynchronous step, the one before it until it completes. Reads what the step
        recorded: no host synchronisation, cheap enough for every iteration's progress bar."""
        return self._steps.report

    def synchronize(self) -> None:
        """Waits until all optimizer work handed to the background (consuming gradients,
        asynchronous steps, exact overlapped mode) is done and the model copies hold every
        update, then raises the background error if there was one (see :meth:`step`). Does
        nothing when called on the optimizer thread (inside an asynchronous step function)."""
        self._steps.synchronize()

    def accumulated_grads(self) -> dict[str, Optional[torch.Tensor]]:
        """The gradients accumulated since the last :meth:`step` (what the next step will
        apply), for inspection and debugging: ``{name: tensor or None}`` under the model's
        parameter names, one entry per trainable parameter (the first name of a tied one),
        each a copy on the host in float32 (or the optimizer dtype when wider), shaped like
        its optimizer copy; None for a parameter that got no gradient. Reading them changes
        nothing (a step function that only reads ``.grad`` consumes them).

        They are as accumulated: multiplied by the loss scale when the calls used a
        :class:`roundpipe.GradScaler`; with a process group, this rank's own (replicated:
        not yet reduced over the ranks; ``shard_optimizer=True``: this rank's rows, already
        reduced). Exact overlapped mode steps each parameter's gradient as soon as it is
        final, so none is left after such a call. Waits for pending gradient consumption
        first and raises the background error if there was one (see :meth:`step`).
        """
        with self._call("accumulated_grads"):
            return self._steps.accumulated_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discards the gradients accumulated since the last :meth:`step` (waits for pending
        optimizer work first: that work owns the gradients it was given). Called inside an
        asynchronous ``step_fn``, it clears only that step's gradients (``.grad`` of the
        optimizer copies), not those the next pass is accumulating."""
        self._steps.zero_grad()

    # --- measurements ------------------------------------------------------------------------------

    def pipeline_stats(self, reset: bool = False) -> dict[str, float]:
        """Seconds and bytes accumulated since construction (or the last reset); the keys are
        described in :mod:`roundpipe.stats` (times, ``h2d_<kind>_bytes`` / ``d2h_<kind>_bytes``
        per kind of data, the byte floors of what was run, ``pinned_bytes``, the stage inputs
        the last call held on the host at once, ``host_stage_input_bytes``). On CUDA this
        waits for the timing events it reads (a host synchronisation): call it between
        iterations, not inside the steady state you measure."""
        for io in self._ios:
            for key, value in io.collect().items():
                self._stats.add(key, value)
        store = self._copies.store
        if store is not None:
            for key, value in store.collect().items():
                self._stats.add(key, value)
            self._stats.set("disk_window_bytes", store.stats["window_peak_bytes"])
        return self._stats.snapshot(reset)

    # --- checkpoints -------------------------------------------------------------------------------

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped model's state dict, with the model's keys; trainable parameters at full
        precision (from the optimizer copies), buffers and frozen parameters from the model.
        Waits for pending optimizer work first (:meth:`synchronize`)."""
        self._steps.synchronize()
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return self._copies.state_dict(sd, prefix, keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a state dict with the model's keys (e.g. from :meth:`state_dict` or from the
        unwrapped model) into both copies: the model copy rounded to its dtype, the optimizer
        copies at the precision given (a parameter under several names takes the value of the
        name loaded last, in both copies). ``assign=True`` is not supported. RoundPipe is meant
        to be the outermost module: save and load its own state dict, not one of a module that
        contains it. Waits for pending optimizer work first (:meth:`synchronize`)."""
        if assign:
            raise ValueError("RoundPipe.load_state_dict: assign=True is not supported")
        with self._call("load_state_dict"):
            self._steps.synchronize()
            result = self.module.load_state_dict(state_dict, strict=strict)
            self._copies.load(state_dict)
            return result


def _forward_uncompiled(model: RoundPipe, args: tuple, num_microbatch: Optional[int],
                        kwargs: dict) -> Any:
    warnings.warn(
        "torch.compile(model) and model.compile() do not compile a RoundPipe: its pipeline "
        "(threads, transfers) runs eagerly, and forward_backward is not compiled by them. "
        "Compile the layers before wrapping them instead (e.g. block.compile() for each "
        "block of the model, or torch.compile on the layers' forward); RoundPipe then runs "
        "each compiled layer in the forward pass, the recomputation and the backward pass",
        UserWarning, stacklevel=3)
    # RoundPipe.forward itself, not a subclass override that called it (HFRoundPipe.forward)
    return RoundPipe.forward(model, *args, num_microbatch=num_microbatch, **kwargs)


_UNCOMPILED = None


def _uncompiled():
    """:func:`_forward_uncompiled` behind ``torch.compiler.disable``, made on first use: only
    ever called while torch.compile traces, so ``import roundpipe`` does not import dynamo
    (seconds of import time, and threads and exit handlers of its own)."""
    global _UNCOMPILED
    if _UNCOMPILED is None:
        _UNCOMPILED = torch.compiler.disable(
            _forward_uncompiled, reason="RoundPipe's pipeline (threads, transfers) runs eagerly; "
                                        "compile the layers before wrapping them")
    return _UNCOMPILED


_MOVE_MESSAGE = (
    "RoundPipe keeps the model on the host in the dtype it was given ({name!r}: {t.dtype} on "
    "{t.device}); this call would make it {to}. Convert the model before wrapping it (e.g. "
    "RoundPipe(net.to(torch.bfloat16), ...)) and choose the compute device with "
    "RoundPipe(..., device=...); calls that change nothing (model.to('cpu'), model.cpu()) are "
    "accepted")
