"""The optimizer side: one thread that consumes gradient downloads and runs optimizer steps,
in the order they were queued, with per-layer gates so the pipeline waits only for the layers
being written.

Jobs, in queue order:

- *consume* (one per backward stage visit, queued by the pass in descending stage order):
  waits for the download, adds it into the accumulated gradients (the first one since a step
  is taken without a copy where possible); in exact overlapped mode, steps the parameters
  whose gradients are now final straight from the download (fused step: gradient in, model
  copy out) and releases their layers;
- *asynchronous step* (``step(..., is_async=True)``): first writes into the model copies
  the values of the step before (the weights every call until the next step computes with:
  one step of staleness), layer by layer, releasing each, then steps the optimizer copies
  without touching the model copies;
- *synchronous step*: run on the caller's thread once the queue is empty.

An error in a background job is kept and raised at the next call into the wrapper
(:meth:`OptimizerSide.raise_error`), once everything queued before has finished.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils._pytree import tree_map

from .context import OptimizerCtx
from .optim import CpuOptimizer
from .param_copies import ParamCopies
from .pipeline.threads import LayerGates, Worker
from .stats import Stats
from .transfer import DeviceIO, GradDownload


class ExactStep:
    """Exact overlapped mode for one call: the optimizer, a snapshot of its hyperparameters
    taken when the call started, and the parameters it holds."""

    def __init__(self, opt: CpuOptimizer) -> None:
        self.opt = opt
        self.snapshot = snapshot(opt)
        self.owned = {id(p) for g in opt.param_groups for p in g["params"]}


def snapshot(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow twin of ``opt`` sharing its state and parameters but holding a copy of each
    param group's hyperparameters as they are now (tensors cloned, e.g. a tensor ``lr`` that
    an LR scheduler changes in place): the optimizer thread steps through it, so a scheduler
    changing ``opt.param_groups`` meanwhile affects only the next step."""
    twin = object.__new__(type(opt))
    twin.__dict__.update(opt.__dict__)
    twin.param_groups = [
        {k: (v if k == "params" else tree_map(
            lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, v))
         for k, v in g.items()}
        for g in opt.param_groups]
    twin.__dict__.pop("_group_index_cache", None)
    return twin


class OptimizerSide:
    """The optimizer thread of one RoundPipe (see the module docstring).

    Args:
        copies: the parameter copies it steps and writes back.
        num_layers: number of pipeline layers (for the gates).
        stats: where optimizer seconds are counted.
    """

    def __init__(self, copies: ParamCopies, num_layers: int, stats: Stats) -> None:
        self.copies, self.stats = copies, stats
        self.worker = Worker("roundpipe-optimizer")
        self.gates = LayerGates(num_layers)
        self._futures: list[cf.Future] = []
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._hooked: "weakref.WeakSet" = weakref.WeakSet()

    # --- the queue ---------------------------------------------------------------------------------

    def is_current(self) -> bool:
        return self.worker.is_current()

    def submit(self, job: Callable[[Callable[[int], None]], Any], layers) -> None:
        """Queues ``job(release)``, the layers ``layers`` blocked until it releases them (at
        the latest when it ends); its error is kept for :meth:`raise_error`."""
        layers = list(layers)
        self.gates.block(layers)

        def run():
            try:
                self.run_now(job, layers, in_background=True)
            except BaseException as e:  # noqa: BLE001 - re-raised at the next call
                with self._lock:
                    if self._error is None:
                        self._error = e
                del e

        with self._lock:  # workers and the caller both submit
            self._futures = [f for f in self._futures if not f.done()]
            self._futures.append(self.worker.submit(run))

    def run_now(self, job, layers, in_background: bool = False) -> Any:
        """Runs ``job(release)`` here; every layer in ``layers`` it did not release is
        released at the end, whatever happens."""
        remaining = set(layers)

        def release(li: int) -> None:
            if li in remaining:
                remaining.discard(li)
                self.gates.release([li])

        try:
            return job(release)
        except BaseException as e:
            if in_background:
                e.add_note("(raised in RoundPipe's optimizer thread, in a step started earlier)")
            raise
        finally:
            self.gates.release(sorted(remaining))

    def pending(self) -> list[cf.Future]:
        with self._lock:
            return list(self._futures)

    def idle(self) -> bool:
        with self._lock:
            return all(f.done() for f in self._futures)

    def wait(self, futures: Optional[list] = None) -> None:
        """Waits for the queued work (or ``futures``); nothing to wait for on the thread itself."""
        if self.is_current():
            return
        cf.wait(self.pending() if futures is None else futures)

    def raise_error(self) -> None:
        """Raises the first error of the background work once all of it queued so far has
        finished (later errors of the same work are dropped with it), and discards the
        gradients accumulated since."""
        with self._lock:
            if self._error is None:
                return
        self.wait()
        with self._lock:
            e, self._error = self._error, None
        self.copies.clear_grads()
        try:
            raise e
        finally:
            e = None  # noqa: F841 - no reference cycle through this frame

    def synchronize(self) -> None:
        """Waits for the queued work, writes back the model copies an asynchronous step left
        behind, then raises the background error if there was one."""
        if self.is_current():
            return
        self.wait()
        self.copies.write_back_stale()
        self.raise_error()

    # --- gradients from the pipeline ---------------------------------------------------------------

    def grad_sink(self, exact: Optional[ExactStep]) -> Callable[[int, Optional[GradDownload], DeviceIO], None]:
        """The function a pass hands each backward visit's download to (on a worker thread,
        in descending stage order): queues its consumption, and in exact mode the step of the
        parameters final at that stage."""
        copies = self.copies

        def sink(stage: int, download: Optional[GradDownload], io: DeviceIO) -> None:
            final = copies.final_params[stage] if exact is not None else []
            if download is None and not final:
                return
            layers = copies.layers_of(final)
            if final:
                with copies.lock:
                    copies.stale.difference_update(final)
            self.submit(functools.partial(self._consume, download, io, exact, final), layers)

        return sink

    def _consume(self, download: Optional[GradDownload], io: DeviceIO,
                 exact: Optional[ExactStep], final: list[int], release) -> None:
        copies = self.copies
        direct: dict[int, torch.Tensor] = {}
        try:
            if download is not None:
                io.host_wait(download.event)
                final_set = set(final)
                for i, g in download.items:
                    if i in final_set and copies.grads[i] is None:
                        direct[i] = g  # stepped straight from the download
                    else:
                        copies.accumulate(i, g, download.owned)
            if exact is not None and final:
                grads = {i: direct[i] if i in direct else copies.grads[i] for i in final}
                for i in final:
                    copies.grads[i] = None
                self._fused_step(exact.snapshot, exact.owned, final, grads, write_back=True)
                for i in final:
                    if grads[i] is not None and (i not in direct or download.owned):
                        copies.pool.give(grads[i])
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
        user_pre_hooks = [h for h in opt._optimizer_step_pre_hooks.values()
                          if not getattr(h, "roundpipe_wait", False)]
        if (user_pre_hooks or opt._optimizer_step_post_hooks
                or _global_optimizer_pre_hooks or _global_optimizer_post_hooks):
            return False
        ours = {id(p) for p in self.copies.optim}
        return all(id(p) in ours for g in opt.param_groups for p in g["params"])

    def begin_exact(self, opt: torch.optim.Optimizer) -> Optional[ExactStep]:
        """Exact overlapped mode for ``opt`` if it can be stepped layer by layer, else None
        (the wrapper then steps it whole after the pass)."""
        self.hook_optimizer(opt)
        return ExactStep(opt) if self.layerwise(opt) else None

    def step(self, step_fn: Any, is_async: bool) -> Any:
        """``RoundPipe.step`` (arguments already checked)."""
        copies = self.copies
        is_opt = isinstance(step_fn, torch.optim.Optimizer)
        if is_async:
            self.raise_error()
        else:
            self.synchronize()
        if self.idle():
            copies.refresh_from_model()
        layerwise = False
        if is_opt:
            self.hook_optimizer(step_fn)
            layerwise = self.layerwise(step_fn)
            twin = snapshot(step_fn)
            fn = lambda: (twin.step(), twin.zero_grad())  # noqa: E731
        else:
            fn = step_fn
        if not is_async:
            grads = copies.take_grads()
            if layerwise:
                return self.run_now(functools.partial(self._layerwise_job, twin, grads, True), ())
            return self.run_now(functools.partial(self._callable_job, fn, grads), ())
        with copies.lock:
            behind, copies.stale = sorted(copies.stale), set(range(len(copies)))
        job = functools.partial(self._async_job, twin if layerwise else None, fn, behind)
        self.submit(job, copies.layers_of(behind))
        return None

    def _async_job(self, twin, fn, behind: list[int], release) -> None:
        copies = self.copies
        grads = copies.take_grads()
        behind_set = set(behind)
        if twin is None:  # a callable, or an optimizer stepped whole
            for li in range(len(copies.layers)):
                for i in copies.layer_params[li]:
                    if i in behind_set:
                        copies.write_back(i)
                release(li)
            self._callable_job(fn, grads, release, write_back=False)
            return
        owned = {id(p) for g in twin.param_groups for p in g["params"]}
        done: set[int] = set()
        for li in range(len(copies.layers)):
            for i in copies.layer_params[li]:
                if i in behind_set:
                    copies.write_back(i)
            release(li)
            todo = [i for i in copies.layer_params[li] if i not in done]
            done.update(todo)
            self._fused_step(twin, owned, todo, {i: grads[i] for i in todo}, write_back=False)
            self._give_back(grads, todo)

    def _callable_job(self, step_fn, grads, release, write_back: bool = True) -> Any:
        copies = self.copies
        for o, g in zip(copies.optim, grads):
            o.grad = g
        try:
            with OptimizerCtx():
                return step_fn()
        finally:
            for o in copies.optim:
                o.grad = None
            if write_back:
                for li in range(len(copies.layers)):
                    for i in copies.layer_params[li]:
                        copies.write_back(i)
                    release(li)

    def _layerwise_job(self, twin, grads, write_back: bool, release) -> None:
        copies = self.copies
        owned = {id(p) for g in twin.param_groups for p in g["params"]}
        done: set[int] = set()
        for li in range(len(copies.layers)):
            todo = [i for i in copies.layer_params[li] if i not in done]
            done.update(todo)
            self._fused_step(twin, owned, todo, {i: grads[i] for i in todo}, write_back)
            self._give_back(grads, todo)
            release(li)

    def _give_back(self, grads: list, indices: list[int]) -> None:
        """The gradients ``indices`` were consumed by a fused step: their buffers are reused."""
        for i in indices:
            if grads[i] is not None:
                self.copies.pool.give(grads[i])
                grads[i] = None

    def _fused_step(self, twin, owned: set, indices: list[int], grads: dict,
                    write_back: bool) -> None:
        """``fused_step`` over the parameters ``indices`` that the optimizer holds and that
        have a gradient (with ``write_back``, into their model copies too; the others' model
        copies are then rewritten from their optimizer copies)."""
        copies = self.copies
        step = [i for i in indices
                if grads.get(i) is not None and id(copies.optim[i]) in owned]
        if step:
            start = time.perf_counter()
            twin.fused_step([copies.optim[i] for i in step], [grads[i] for i in step],
                            [copies.model[i] for i in step] if write_back else None)
            self.stats.add("optimizer_s", time.perf_counter() - start)
        if write_back:
            stepped = set(step)
            for i in indices:
                if i in stepped:
                    copies.mark_synced(i)
                else:
                    copies.write_back(i)

    def hook_optimizer(self, opt: torch.optim.Optimizer) -> None:
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
            side = me()
            if side is not None:
                side.wait()

        wait.roundpipe_wait = True  # not a user hook (see layerwise)
        opt.register_step_pre_hook(wait)
        opt.register_state_dict_pre_hook(wait)
        opt.register_load_state_dict_pre_hook(wait)

    def close(self) -> None:
        self.worker.close()
