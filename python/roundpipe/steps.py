"""The optimizer side of a RoundPipe, behind one door: the wrapper enters it once per training
call (:meth:`Steps.call`), once per pass (:meth:`Steps.begin_pass`) and once per step
(:meth:`Steps.step`); everything about the optimizer thread, its layer gates, the loss scale of
a call and exact overlapped mode is decided here.

Exact overlapped mode (``forward_backward(..., optimizer=opt)``), read top to bottom:
:meth:`Steps.call` checks ``opt`` and decides per call between stepping each stage as its
gradients become final (:class:`ExactStep`, when ``opt`` can be stepped layer by layer and the
call has no loss scale or clipping) and one step after the backward (otherwise); the pass
hands each backward visit's download to the call's gradient sink (:meth:`Steps._grad_sink`),
which queues :meth:`Steps._consume`: accumulate, then ``fused_step`` the parameters final at
that stage straight from the download (:meth:`Steps._fused`, the kernel in
:mod:`roundpipe.optim`) and release their layers; the step after the backward is
:meth:`Steps._step_after_backward` (layer by layer) or a synchronous :meth:`Steps.step`.

The work, run on the optimizer thread (:mod:`roundpipe.optimizer_thread`)
or, for a synchronous step, on the caller's thread once that queue is empty:

- *consume* (one job per backward stage visit, queued by the pass in descending stage order):
  waits for the download and adds it into the accumulated gradients (the first one since a
  step is taken without a copy where possible), with the squared norm the device computed;
  in exact overlapped mode it also steps the parameters whose gradients are now final
  straight from the download (fused step: gradient in, model copy out) and releases their
  layers;
- *step* (``RoundPipe.step``; exact mode with a loss scaler or clipping, after the backward):
  the verdict first — the global gradient norm from the per-parameter squared norms gathered
  during the pass, overflow (a non-finite norm), the loss scaler's update, the clipping
  coefficient — then, unless the step is skipped, the update: layer by layer through the
  fused kernel (unscale and clip folded into its gradient scale) or, for optimizers that are
  not stepped layer by layer, by unscaling and clipping the gradients in place as torch does
  and calling the optimizer. An asynchronous step first writes into each layer's model copy
  the weights of the step before (every call of the next iteration computes with those: one
  step of staleness) and releases the layer, then updates the optimizer copies only.

Loss scaling is fixed per step (:meth:`Steps._begin_call`): the calls between two steps use
the scale in force when the first of them started, and the step unscales by that scale.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import guards
from .clipping import Clip, total_norm
from .context import OptimizerCtx
from .distributed import Reduction
from .grad_scaler import GradScaler
from .optim import Adafactor as CpuAdafactor
from .optim import CpuOptimizer, frozen_copy
from .optimizer_thread import OptimizerThread
from .param_copies import ParamCopies
from .threads import LayerGates, check_not_forked
from .stats import Stats
from .torch_private import mark_stepped, step_hooks, tensor_version
from .transfer import DeviceIO, GradDownload


@dataclass(frozen=True)
class StepReport:
    """What the last completed step saw (``RoundPipe.last_step_stats()``).

    Attributes:
        grad_norm: global L2 norm of the unscaled gradients before clipping (NaN when nothing
            measured it: an optimizer stepped whole without a scaler or clipping).
        skipped: the step was skipped (a gradient was inf or NaN under a loss scaler).
        scale: the loss scale its gradients were unscaled by (1.0 without a scaler).
    """

    grad_norm: float = math.nan
    skipped: bool = False
    scale: float = 1.0


def snapshot(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` with its hyperparameters as they are now (:func:`roundpipe.optim.frozen_copy`;
    :meth:`CpuOptimizer.frozen_copy` for ours): the optimizer thread steps through it, so a
    scheduler changing ``opt.param_groups`` meanwhile affects only the next step."""
    return opt.frozen_copy() if isinstance(opt, CpuOptimizer) else frozen_copy(opt)


# optimizers whose update of an element reads other elements (not for sharded copies)
_NOT_ELEMENTWISE = tuple(c for c in (getattr(torch.optim, "Adafactor", None), torch.optim.LBFGS)
                         if c is not None) + (CpuAdafactor,)


def _owned(opt: torch.optim.Optimizer) -> set[int]:
    return {id(p) for g in opt.param_groups for p in g["params"]}


class ExactStep:
    """Exact overlapped mode for one call, stepping each stage as it finishes: the optimizer, a
    snapshot of its hyperparameters taken when the call started, the parameters it holds, and
    the norms of the stages stepped so far (for the call's report)."""

    def __init__(self, opt: CpuOptimizer, last_stage: int) -> None:
        self.opt = opt
        self.snapshot = snapshot(opt)
        self.owned = _owned(opt)
        self.last_stage = last_stage
        self.norms_sq: list[float] = []


@dataclass(frozen=True)
class Call:
    """What one ``forward_backward`` pass needs from the optimizer side (:meth:`Steps.call`).

    Attributes:
        scale: the loss scale every microbatch's loss is multiplied by (1.0 without a scaler).
        want_norms: whether the downloads carry the device's squared norms of the gradients.
        grad_sink: ``grad_sink(stage, download, io)``, what the pass hands each backward
            visit's download to (on a worker thread, in descending stage order).
    """

    scale: float
    want_norms: bool
    grad_sink: Callable[[int, Optional[GradDownload], DeviceIO], None]


@dataclass
class _Plan:
    """One step: what to run and how (see :meth:`Steps.step`)."""

    fn: Callable[[], Any]                     # the whole step (not layer by layer)
    twin: Optional[CpuOptimizer]              # stepped layer by layer through fused_step
    write_back: bool                          # model copies take the new values
    behind: list[int]                         # model copies to write back first (async)
    scaler: Optional[GradScaler]
    scale: float
    clip: Optional[Clip]
    verdict: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Decision:
    skip: bool = False
    coef: float = 1.0
    norm: float = math.nan


class Steps:
    """The optimizer side of one RoundPipe (see the module docstring).

    Args:
        copies: the parameter copies it steps and writes back.
        num_layers: number of pipeline layers.
        stats: where optimizer seconds and counts go.
        reduction: what happens to gradients across ranks (:mod:`roundpipe.distributed`;
            default: one process).
    """

    def __init__(self, copies: ParamCopies, num_layers: int, stats: Stats,
                 reduction: Optional[Reduction] = None) -> None:
        self.copies, self.stats = copies, stats
        self.reduction = reduction or Reduction(copies)
        self.thread = OptimizerThread(num_layers, on_error=self._failed)
        self._hooked: "weakref.WeakSet" = weakref.WeakSet()
        self._reaching: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._warned_idle = False                   # a step function that changed nothing
        self.report = StepReport()
        self._called = False                        # forward_backward since the last step
        self._verdicts = False                      # a step with clipping or scaling ran
        self._scaler: Optional[GradScaler] = None   # of the calls since the last step
        self._scale: Optional[float] = None         # their loss scale
        self._next_scale: Optional[float] = None    # set by an asynchronous step
        self._verdict: Optional[threading.Event] = None  # of the last background step

    # --- the door ----------------------------------------------------------------------------------

    def is_current(self) -> bool:
        """Whether the calling thread is the optimizer thread (inside a step function)."""
        return self.thread.is_current()

    def check_not_forked(self, where: str) -> None:
        """Raises ``RuntimeError`` (naming ``where``) in a ``fork()``-ed child of the process
        that started the optimizer thread (see :func:`roundpipe.threads.check_not_forked`)."""
        check_not_forked([self.thread.worker], where)

    def synchronize(self) -> None:
        """Waits for the queued work, writes back the model copies an asynchronous step left
        behind, then raises the background error if there was one (a no-op on the optimizer
        thread itself)."""
        if self.is_current():
            return
        self.thread.wait()
        self.copies.write_back_stale()
        self.thread.raise_error()
        if self.copies.store is not None:  # the disk's writes have ended (a failed one: the
            self.copies.store.wait_writes()  # next step raises or retries it)

    def close(self) -> None:
        """Ends the optimizer thread once its queued work is done."""
        self.thread.close()

    def begin_pass(self) -> LayerGates:
        """Before a pass: raises the background error if there was one, picks up model copies
        changed behind the wrapper's back when no optimizer work is pending, and returns the
        layer gates the pass's uploads wait on (a layer being written by a step is blocked)."""
        self.thread.raise_error()
        if self.thread.idle():
            self.copies.refresh_from_model()
        return self.thread.gates

    @contextlib.contextmanager
    def call(self, opt: Optional[torch.optim.Optimizer], scaler: Optional[GradScaler],
             clip: Optional[Clip]):
        """One ``forward_backward`` call's policy, around its pass: yields the :class:`Call`
        (loss scale, device norms wanted, gradient sink); on leaving, waits for the step that
        was running when the call began (its error surfaces in this call); if the call raised,
        waits for the queued work and discards the gradients accumulated since the last step;
        otherwise, with ``opt`` in exact mode and no stage-by-stage step, steps ``opt`` now (in
        the background after the backward when it can be stepped layer by layer, else
        synchronously). Arguments already checked by the caller except as raised here.

        Raises:
            TypeError: ``opt`` holds none of this wrapper's optimizer copies or a model copy
                (:meth:`check_reaches`), or ``scaler`` is not a roundpipe.GradScaler.
            ValueError: the calls of one step use different grad scalers; ``opt`` cannot step
                sharded optimizer copies; a layer-by-layer ``opt`` holds a parameter of a dtype
                it cannot step (TypeError), raised before the pass.
        """
        self.reduction.check()
        if opt is not None:
            self.check_reaches(opt, "RoundPipe.forward_backward")
        scale = self._begin_call(scaler, exact=opt is not None)
        scaling = scaler is not None and scaler.is_enabled()
        exact = None
        if opt is not None and clip is None and scale == 1.0 and not scaling:
            exact = self._begin_exact(opt, self.copies.index.first_trainable_stage())
        deferred = opt is not None and exact is None
        want = self._want_norms(scaler, deferred and (clip is not None or scale != 1.0))
        earlier = self.thread.pending()  # the step before this call, if still running
        try:
            yield Call(scale, want, self._grad_sink(exact))
            self.thread.wait(earlier)  # that step's error surfaces in this call
            self.thread.raise_error()
        except BaseException as e:
            self.reduction.abort(e)  # with ranks: theirs and this rank's waits end now
            self.thread.wait()
            if self.copies.store is not None:
                self.copies.store.wait_writes()  # a failed one is raised by the next step
            self.discard()
            raise
        if deferred:
            if self.layerwise(opt):
                self._step_after_backward(opt, scaler, clip)
            else:
                self.step(opt, False, scaler, clip)

    def accumulated_grads(self) -> dict[str, Optional[torch.Tensor]]:
        """``RoundPipe.accumulated_grads``: waits for pending gradient consumption, raises the
        background error if there was one, then copies of the accumulated gradients."""
        self.thread.wait()
        self.thread.raise_error()
        return self.copies.accumulated()

    def zero_grad(self) -> None:
        """``RoundPipe.zero_grad``: waits for pending work (it owns the gradients it was given),
        discards the accumulated gradients unless called on the optimizer thread (inside an
        asynchronous step function: only that step's ``.grad`` are cleared), and clears the
        optimizer copies' ``.grad``."""
        self.thread.wait()
        if not self.thread.is_current():
            self.discard()
        for o in self.copies.optim:
            o.grad = None

    def discard(self) -> None:
        """The gradients accumulated since the last step are dropped (a failed call, a
        background error, zero_grad): the next call starts the step afresh."""
        self.copies.clear_grads()
        self._scaler, self._scale, self._called = None, None, False

    def _failed(self, error: BaseException) -> None:
        """Background work failed with ``error`` (raised now): with ranks, their collectives
        are abandoned (:mod:`roundpipe.distributed`); the gradients are discarded."""
        self.reduction.abort(error)
        self.discard()

    # --- loss scale of a call --------------------------------------------------------------------------

    def _begin_call(self, scaler: Optional[GradScaler], exact: bool) -> float:
        """The loss scale of a ``forward_backward`` call: the step's scale, fixed by its first
        call (after an asynchronous step, the scale in force when that step was submitted;
        in exact mode, after waiting for the previous call's verdict).

        Raises:
            TypeError: ``scaler`` is not a GradScaler.
            ValueError: the calls of one step use different scalers (or some none).
        """
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError("RoundPipe: grad_scaler must be a roundpipe.GradScaler (torch's "
                            "cannot follow an asynchronous step), got "
                            f"{type(scaler).__name__}")
        if self._called:
            if scaler is not self._scaler:
                raise ValueError("RoundPipe: every forward_backward call of one step must use "
                                 "the same grad_scaler (the gradients accumulated since the "
                                 "last step were scaled differently)")
        self._called = True
        if scaler is None or not scaler.is_enabled():
            self._scaler, self._scale = scaler, None
            return 1.0
        if self._scale is None:
            if exact and self._verdict is not None:
                self._verdict.wait()
            scale, self._next_scale = self._next_scale, None
            self._scaler, self._scale = scaler, scale if scale is not None else scaler.get_scale()
        return self._scale

    def _want_norms(self, scaler: Optional[GradScaler], exact_deferred: bool) -> bool:
        """Whether a call's downloads carry device-side squared norms: when its step will need
        a verdict (a loss scaler, exact mode with clipping, or the last step had one: clipping
        is given to the step only) and the norms survive the reduction across ranks."""
        if not self.reduction.device_norms:
            return False
        scaling = scaler is not None and scaler.is_enabled()
        return scaling or exact_deferred or self._verdicts

    def _take_scale(self, scaler: Optional[GradScaler], where: str) -> float:
        """The loss scale of the gradients a step applies; the next step starts afresh."""
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(f"{where}: grad_scaler must be a roundpipe.GradScaler, got "
                            f"{type(scaler).__name__}")
        if scaler is not self._scaler and self._called:
            raise ValueError(f"{where}: the gradients were {'not ' if self._scaler is None else ''}"
                             "scaled by this grad_scaler; pass the grad_scaler given to "
                             "forward_backward")
        scale = self._scale if self._scale is not None else 1.0
        self._scaler, self._scale, self._called = None, None, False
        return scale

    # --- gradients from the pipeline ---------------------------------------------------------------

    def _grad_sink(self, exact: Optional[ExactStep]) -> Callable[[int, Optional[GradDownload], DeviceIO], None]:
        """The function a pass hands each backward visit's download to (on a worker thread,
        in descending stage order): queues its consumption, and with ``exact`` the step of the
        parameters final at that stage."""
        copies, index = self.copies, self.copies.index
        caller = threading.current_thread()

        def sink(stage: int, download: Optional[GradDownload], io: DeviceIO) -> None:
            final = index.final_params[stage] if exact is not None else ()
            if download is None and not final and not self.reduction.stage_always(stage):
                return
            if final:
                copies.will_write(final)
            job = functools.partial(self._consume, stage, download, io, exact, final,
                                    exact is not None and stage == exact.last_stage)
            if (exact is None and not self.reduction.sharded
                    and threading.current_thread() is caller
                    and (download is None or download.event is None) and self.thread.idle()):
                # nothing queued to wait for and little to overlap with (the download is
                # complete, the pass runs on this thread, consuming it is keeping or adding
                # it, without collectives): consumed here, without a hand-off to the thread
                # and back (measured: about 0.25 ms of a call's fixed cost)
                self.thread.run_here(job)
            else:
                self.thread.submit(job, index.layers_of(final))

        return sink

    def _consume(self, stage: int, download: Optional[GradDownload], io: DeviceIO,
                 exact: Optional[ExactStep], final: tuple[int, ...], last: bool,
                 release) -> None:
        copies = self.copies
        direct: dict[int, torch.Tensor] = {}
        owned = download is not None and download.owned
        try:
            got, norms = {}, {}
            if download is not None:
                io.host_wait(download.event)
                got = dict(download.items)
                if download.norms_sq is not None:
                    norms = dict(zip(got, download.norms_sq.tolist()))
            direct = self.reduction.consume(stage, got, norms, owned,
                                            set(final) if exact is not None else set())
            got = None
            if exact is not None and final:
                grads = self.reduction.exact_ready(final, copies.take_final(final, direct))
                exact.norms_sq.append(self._fused(exact.snapshot, exact.owned, final, grads,
                                                  True, self.reduction.divisor, want_norm=True))
                self.reduction.written(final)
                for i in final:
                    if grads[i] is not None and (i not in direct or owned):
                        copies.pool.give(grads[i])
            if last:
                self.report = StepReport(total_norm(exact.norms_sq))
                if copies.store is not None:  # the step's last writes, once its layers are free
                    for li in copies.index.layers_of(final):
                        release(li)
                    copies.store.flush()
        finally:
            direct = None  # noqa: F841
            if download is not None:
                download.release()

    # --- steps ---------------------------------------------------------------------------------------

    def layerwise(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt`` can be stepped layer by layer through ``fused_step`` with the result
        of ``opt.step()``: a ``roundpipe.optim`` optimizer holding only this wrapper's
        optimizer copies and without step hooks (``fused_step`` runs none). Otherwise ``step``
        and exact mode call ``opt.step()`` once all gradients are there."""
        if not isinstance(opt, CpuOptimizer):
            return False
        pre, post = step_hooks(opt)
        if guards.user_hooks(pre) or post:
            return False
        ours = {id(p) for p in self.copies.optim}
        return all(id(p) in ours for g in opt.param_groups for p in g["params"])

    def _begin_exact(self, opt: torch.optim.Optimizer, last_stage: int) -> Optional[ExactStep]:
        """Exact overlapped mode stepping each stage as it finishes, if ``opt`` can be stepped
        layer by layer, else None (then it is stepped after the backward)."""
        self.check_reaches(opt, "RoundPipe.forward_backward")
        self.hook_optimizer(opt)
        layerwise = self.check_optimizer(opt, "RoundPipe.forward_backward")
        return ExactStep(opt, last_stage) if layerwise else None

    def check_reaches(self, opt: torch.optim.Optimizer, where: str) -> None:
        """Checks that ``opt`` steps this wrapper's optimizer copies: an optimizer built on the
        model copies (``model.parameters()`` outside :class:`OptimizerCtx`) would be given no
        gradient and train nothing. Cached per optimizer until its parameter lists change.

        Raises:
            TypeError: ``opt`` holds a model copy that has a separate optimizer copy, or none
                of this wrapper's optimizer copies.
        """
        key = tuple((id(g["params"]), len(g["params"])) for g in opt.param_groups)
        if self._reaching.get(opt) == key:
            return
        copies = self.copies
        optim = {id(o) for o in copies.optim}
        models = {id(m): n for m, o, n in zip(copies.model, copies.optim, copies.index.names)
                  if m is not o}
        held = [p for g in opt.param_groups for p in g["params"]]
        how = guards.HOW
        for p in held:
            if id(p) in models and id(p) not in optim:
                raise TypeError(
                    f"{where}: {type(opt).__name__} holds the model copy of {models[id(p)]!r} "
                    "(built on model.parameters() outside OptimizerCtx), which is only what the "
                    "devices compute with: it gets no gradient and stepping it would train "
                    f"nothing; {how}")
        if not any(id(p) in optim for p in held):
            raise TypeError(
                f"{where}: {type(opt).__name__} holds none of this model's optimizer copies, so "
                f"the step would train nothing; {how}")
        try:
            self._reaching[opt] = key
        except TypeError:
            pass

    def check_optimizer(self, opt: torch.optim.Optimizer, where: str) -> bool:
        """Whether ``opt`` is stepped layer by layer (:meth:`layerwise`), after checking what
        would otherwise fail halfway through a step, with some layers already updated.

        Raises:
            ValueError: the optimizer copies are sharded over ranks and ``opt``'s update of an
                element depends on other elements (Adafactor's factored second moments,
                LBFGS): a rank sees only its rows.
            TypeError: a layer-by-layer optimizer holds a parameter whose dtype it cannot step
                (bfloat16 without ``stochastic_rounding=True``, float16).
        """
        if self.copies.store is not None and not self.layerwise(opt):
            raise ValueError(
                f"{where}: with optimizer_dir (the optimizer copies and state in files), the "
                "step must run stage by stage through the window: a roundpipe.optim optimizer "
                "over this model's optimizer copies only, without step hooks; "
                f"{type(opt).__name__} would be stepped whole, its state in host memory")
        if self.reduction.sharded and isinstance(opt, _NOT_ELEMENTWISE):
            raise ValueError(
                f"{where}: {type(opt).__name__} cannot step optimizer copies sharded over ranks "
                "(shard_optimizer=True): its update of an element depends on whole rows and "
                "columns, and each rank holds only some rows; use shard_optimizer=False")
        if not self.layerwise(opt):
            return False
        for g in opt.param_groups:
            opt.check_group(g)
        accepted = {torch.float32, torch.bfloat16} if opt.stochastic_rounding else {torch.float32}
        if self.copies.index.optim_dtypes <= accepted:  # the usual case: no loop over parameters
            return True
        names = {id(o): n for n, o in zip(self.copies.index.names, self.copies.optim)}
        for g in opt.param_groups:
            for p in g["params"]:
                if p.dtype not in accepted:
                    hint = ("build the optimizer with stochastic_rounding=True"
                            if p.dtype == torch.bfloat16 else "use optim_dtype=torch.float32")
                    raise TypeError(
                        f"{where}: parameter {names[id(p)]!r} has a {p.dtype} optimizer copy, "
                        f"which {type(opt).__name__} cannot step ({hint}, or wrap with "
                        "optim_dtype=torch.float32 for float32 master weights)")
        return True

    def _plan(self, step_fn: Any, write_back: bool, behind: list[int],
              scaler: Optional[GradScaler], scale: float, clip: Optional[Clip],
              now: bool = False) -> _Plan:
        """What a step runs. An optimizer is stepped through a snapshot of its hyperparameters
        (a scheduler changing them while the step is queued affects the next step only),
        except layer by layer in a step run ``now`` on the caller's thread: nothing can change
        them before it ends, so it steps the optimizer itself."""
        twin = None
        if isinstance(step_fn, torch.optim.Optimizer):
            self.check_reaches(step_fn, "RoundPipe.step")
            self.hook_optimizer(step_fn)
            if self.check_optimizer(step_fn, "RoundPipe.step"):
                if now:
                    return _Plan(step_fn.step, step_fn, write_back, behind, scaler, scale, clip)
                twin = shot = snapshot(step_fn)
            else:
                shot = snapshot(step_fn)
            fn = lambda: (shot.step(), shot.zero_grad())  # noqa: E731
        else:
            fn = step_fn
        return _Plan(fn, twin, write_back, behind, scaler, scale, clip)

    def step(self, step_fn: Any, is_async: bool, scaler: Optional[GradScaler] = None,
             clip: Optional[Clip] = None) -> Any:
        """``RoundPipe.step`` (arguments already checked)."""
        copies = self.copies
        if copies.store is not None and not isinstance(step_fn, torch.optim.Optimizer):
            raise TypeError(
                "RoundPipe.step: with optimizer_dir (the optimizer copies and state in files), "
                "step takes the optimizer itself (model.step(opt): stepped stage by stage "
                "through the window), not a function, which would read every optimizer copy "
                "at once")
        self.reduction.check()
        if is_async:
            self.thread.raise_error()
        else:
            self.synchronize()
        scale = self._take_scale(scaler, "RoundPipe.step")
        if self.thread.idle():
            copies.refresh_from_model()
        if not is_async:
            plan = self._plan(step_fn, True, [], scaler, scale, clip, now=True)
            try:
                return self.thread.run_now(functools.partial(self._step_job, plan), ())
            except BaseException as e:
                self.reduction.abort(e)  # with ranks: the others must not wait for this one
                raise
        shared = [i for i in range(len(copies)) if copies.index.shared[i]]
        behind = copies.begin_async_step()
        plan = self._plan(step_fn, False, behind, scaler, scale, clip)
        if scaler is not None and scaler.is_enabled():
            self._next_scale = scaler.get_scale()  # this step's verdict counts one step later
        self._verdict = plan.verdict
        self.thread.submit(functools.partial(self._step_job, plan),
                           copies.index.layers_of(behind + shared))
        return None

    def _step_after_backward(self, opt: torch.optim.Optimizer, scaler: Optional[GradScaler],
                             clip: Optional[Clip]) -> None:
        """Exact mode with a loss scaler or clipping: the verdict needs every gradient, so the
        step is queued after the backward (in the background; each layer is released to the
        next call as soon as it is written). Counted in ``exact_deferred_calls``."""
        copies = self.copies
        scale = self._take_scale(scaler, "RoundPipe.forward_backward")
        copies.will_write()  # every model copy is written by this step
        plan = self._plan(opt, True, [], scaler, scale, clip)
        self._verdict = plan.verdict
        self.stats.add("exact_deferred_calls", 1)
        self.thread.submit(functools.partial(self._step_job, plan), range(len(copies.layers)))

    def _step_job(self, plan: _Plan, release) -> Any:
        copies, reduction, index = self.copies, self.reduction, self.copies.index
        grads, norms = copies.take_grads()
        if not reduction.device_norms:
            norms = [None] * len(norms)
        try:
            if plan.behind:
                behind = set(plan.behind)
                for li in range(len(copies.layers)):
                    mine = [i for i in index.own_params[li] if i in behind]
                    copies.write_back_many(mine)
                    reduction.written(mine)
                    if not any(index.shared[i] for i in index.layer_params[li]):
                        release(li)  # else when this step has written it
            verdict = plan.clip is not None or (plan.scaler is not None
                                                 and plan.scaler.is_enabled())
            layers = reduction.layers_ready(grads, index.own_params,
                                            verdict or plan.twin is None)
            if verdict or plan.twin is None:
                layers = list(layers)  # every gradient global before the verdict / the step
            try:
                decision = self._decide(grads, norms, plan)
            finally:
                plan.verdict.set()
            if decision.skip:
                self.report = StepReport(decision.norm, True, plan.scale)
                return None
            if plan.twin is not None:
                decision.norm = self._step_layers(plan, grads, decision, layers, release)
                result = None
            else:
                result = self._step_whole(plan, grads, decision)
                grads = [None] * len(grads)  # the step function may keep them: not reused
            if plan.twin is None:
                for li in range(len(copies.layers)):
                    written = [i for i in index.own_params[li]
                               if plan.write_back or index.shared[i]]
                    for i in written:
                        copies.write_back(i)
                    reduction.written(written)
                    release(li)
            self.report = StepReport(decision.norm, False, plan.scale)
            if copies.store is not None:
                copies.store.flush()  # the step's last writes: a failure is this step's error
            return result
        finally:
            for g in grads:
                if g is not None:
                    copies.pool.give(g)

    def _decide(self, grads: list, norms: list, plan: _Plan) -> _Decision:
        if plan.clip is not None or (plan.scaler is not None and plan.scaler.is_enabled()):
            self._verdicts = True
        return self._verdict_of(grads, norms, plan)

    def _verdict_of(self, grads: list, norms: list, plan: _Plan) -> _Decision:
        """Overflow, the scaler's update and the clipping coefficient, from the squared norms
        gathered during the pass (a norm the pass could not give — a gradient summed over
        several calls or across ranks — is computed here, one read of that gradient)."""
        scaling = plan.scaler is not None and plan.scaler.is_enabled()
        if plan.clip is None and not scaling:
            return _Decision()
        for i, g in enumerate(grads):
            if g is not None and norms[i] is None:
                norms[i] = float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2
        norm = math.sqrt(self.reduction.norm_sq(norms)) / (plan.scale * self.reduction.divisor)
        coef = plan.clip.coefficient(norm) if plan.clip is not None else 1.0
        skip = plan.scaler.apply_verdict(not math.isfinite(norm), plan.scale) if scaling else False
        return _Decision(skip, coef, norm)

    def _step_layers(self, plan: _Plan, grads: list, decision: _Decision, layers,
                     release) -> float:
        """The update layer by layer (as ``layers`` yields them: their gradients global)
        through ``fused_step``; returns the gradient norm (the kernel's when the verdict did
        not need one)."""
        copies, index = self.copies, self.copies.index
        owned = _owned(plan.twin)
        want = math.isnan(decision.norm)
        parts: list[float] = []
        for li in layers:
            todo = index.own_params[li]
            parts.append(self._fused(plan.twin, owned, todo, {i: grads[i] for i in todo},
                                     plan.write_back, plan.scale * self.reduction.divisor,
                                     decision.coef, want))
            for i in todo:
                if grads[i] is not None:
                    copies.pool.give(grads[i])
                    grads[i] = None
            self.reduction.written([i for i in todo if plan.write_back or index.shared[i]])
            release(li)
        return total_norm(parts) if want else decision.norm

    def _step_whole(self, plan: _Plan, grads: list, decision: _Decision) -> Any:
        """An optimizer stepped whole, or a step function: the gradients unscaled and clipped
        in place as torch's GradScaler.unscale_ and clip_grad_norm_ do, set as the optimizer
        copies' ``.grad``, then ``fn()`` inside OptimizerCtx."""
        copies = self.copies
        with torch.no_grad():
            scale = plan.scale * self.reduction.divisor
            if scale != 1.0:
                inv = torch.tensor(1.0 / scale, dtype=torch.float32)
                for g in grads:
                    if g is not None:
                        g.mul_(inv)
            if decision.coef != 1.0:
                coef = torch.tensor(decision.coef, dtype=torch.float32)
                for g in grads:
                    if g is not None:
                        g.mul_(coef)
        for o, g in zip(copies.optim, grads):  # a torch optimizer's .grad: the param's dtype
            o.grad = g if g is None or g.dtype == o.dtype else g.to(o.dtype)
        # what tells whether the step changed anything: version counters, and one value per
        # tensor for writes through .data (which no version counter sees)
        before = ([] if self._warned_idle else
                  [(o, tensor_version(o), o.detach().reshape(-1)[:1].clone())
                   for o, g in zip(copies.optim, grads) if g is not None])
        try:
            with OptimizerCtx(), guards.inside_step(self):
                result = plan.fn()
        finally:
            for o in copies.optim:
                o.grad = None
        if before and all(tensor_version(o) == v and torch.equal(o.detach().reshape(-1)[:1], first)
                          for o, v, first in before):
            self._warned_idle = True
            warnings.warn(
                "RoundPipe.step: the step function changed none of the optimizer copies that "
                "had a gradient, so this step trained nothing (its gradients are consumed). "
                "Fine if it only read them (model.accumulated_grads() reads them without "
                "consuming them); to train, it must step an optimizer built on "
                "model.optim_parameters() (or on model.parameters() inside "
                "roundpipe.OptimizerCtx): model.step(opt), or model.step(lambda: (opt.step(), "
                "opt.zero_grad())). Warned once per model", UserWarning, stacklevel=2)
        return result

    def _fused(self, twin, owned: set, indices: list[int], grads: dict, write_back: bool,
               scale: float = 1.0, clip: float = 1.0, want_norm: bool = False) -> float:
        """``fused_step`` over the parameters ``indices`` that the optimizer holds and that
        have a gradient (with ``write_back``, into their model copies too; the others' model
        copies are then rewritten from their optimizer copies; a parameter with one copy is
        its model copy). Returns the squared norm of the unscaled gradients stepped (0.0
        unless ``want_norm``)."""
        copies, shared = self.copies, self.copies.index.shared
        step = [i for i in indices if grads.get(i) is not None and id(copies.optim[i]) in owned]
        norm_sq = 0.0
        start = time.perf_counter()
        for out in (True, False):  # with a separate model copy to write, then without
            part = [i for i in step if (write_back and not shared[i]) == out]
            if part:
                result = twin.fused_step([copies.optim[i] for i in part], [grads[i] for i in part],
                                         [copies.model_rows(i) for i in part] if out else None,
                                         grad_scale=scale, clip_factor=clip, grad_norm=want_norm)
                norm_sq += result.grad_norm_sq or 0.0
        if step:
            self.stats.add("optimizer_s", time.perf_counter() - start)
        stepped = set(step)
        for i in indices:
            if i in stepped and (write_back or shared[i]):
                copies.mark_synced(i)
            elif write_back:
                copies.write_back(i)
        return norm_sq

    def hook_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """The optimizer's ``step``, ``state_dict`` and ``load_state_dict``, called from another
        thread than the optimizer thread, first wait for pending updates. Also marks it as
        stepped for LR schedulers (what their wrapper of ``opt.step`` records), since the
        wrapper steps it through a snapshot or ``fused_step``."""
        mark_stepped(opt)  # read by torch.optim.lr_scheduler's order check
        if opt in self._hooked:
            return
        self._hooked.add(opt)
        me = weakref.ref(self)

        def wait(*_):
            steps = me()
            if steps is not None:
                steps.thread.wait()

        wait.roundpipe_wait = True  # not a user hook (see layerwise)
        opt.register_step_pre_hook(wait)
        opt.register_state_dict_pre_hook(wait)
        opt.register_load_state_dict_pre_hook(wait)
        # zero_grad has no hooks: an instance attribute that waits first (a pending step of an
        # optimizer stepped whole reads the .grad it set; pickling drops the attribute)
        zero_grad, ref = type(opt).zero_grad, weakref.ref(opt)

        def waiting_zero_grad(*args, **kwargs):
            wait()
            return zero_grad(ref(), *args, **kwargs)

        opt.zero_grad = waiting_zero_grad
