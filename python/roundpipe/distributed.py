"""Data parallelism over ``torch.distributed``: one RoundPipe per rank (a process driving its
machine's or socket's devices), the gradients reduced across ranks on the optimizer side.

- **Replicated** (``shard_optimizer=False``): every rank keeps every optimizer copy and its
  state; each layer's gradient is all-reduced once it is final (at the step, layer by layer,
  the next layer's reduction in flight while a layer is stepped; in exact mode per stage, while
  the earlier stages' backward runs), then every rank applies the same update.
- **Sharded** (``shard_optimizer=True``): every rank keeps the model copy whole, but the
  optimizer copies, gradients and optimizer state of only its rows of each parameter (dim 0
  split as ``torch.chunk`` splits it, so ``DTensor``'s ``Shard(0)`` describes it; 0-dim
  parameters are replicated). Each stage's downloaded gradient is reduce-scattered as it
  arrives (every rank receives its rows, summed), the rank steps its rows and writes them into
  its model copy, and the model copy's rows are all-gathered to every rank before the layer is
  uploaded again.

Every collective is issued by the optimizer thread, in the same order on every rank (stages in
descending order within a pass, then steps in call order), so ranks never wait on each other in
different orders. A rank that received no gradient for a parameter still takes part (with
zeros, and a presence flag that keeps a parameter no rank trained without a gradient).

**A failing rank.** RoundPipe's collectives run on a gloo group of its own, made with the
timeout of the user's group, so every wait is bounded by that timeout. When a call fails on one
rank (its ``loss_fn`` or a layer raises, a step fails, a collective errs), that rank abandons
the group (:meth:`Comm.abort`): its own pending waits end at once, and the reason is written to
the group's store, which every rank's waits poll (every :data:`POLL_S` seconds), so the other
ranks raise too, naming the failed rank, well within the timeout (gloo itself has no abort that
ends a peer's wait). An abandoned group is not used again: every later call of the wrapper on
any rank that saw it raises; the ranks must be restarted (as after a failed DDP step).

**A rank whose process ends.** The usual script does not catch: the exception ends the
process, and with it the gloo connections (the others' waits would end with gloo's "Connection
closed by peer", naming no rank) and, on the rank that started the store (rank 0 without
torchrun's agent), the store that holds the reason. So an uncaught exception (``sys.excepthook``,
chained once a group is made) abandons every live group of the process with that error, and the
process then stays until every other rank has read why or left (each rank acknowledges in the
store once it knows, :meth:`Comm.linger`), at most the group's timeout; a process leaving with a
group it abandoned (``sys.exit`` after a failure) does the same at exit. A rank whose wait ends
with an error of gloo's looks for the reason in the store before it raises; when there is none
(the process was killed, or ended by ``os._exit``, with the store gone or not), the ranks whose
processes are gone are named from what each rank told at the start (host, PID namespace, PID:
known for the ranks on this host).
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import math
import os
import socket
import sys
import threading
import time
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import threads
from .stats import Stats
from .torch_private import group_timeout

REDUCTIONS = ("mean", "sum")
PIECE = 1 << 20  # elements per rank in one collective
POLL_S = 0.05  # how often a wait on a collective looks for another rank's abort
_ABORT_KEY = "roundpipe/aborted"
_ACK_KEY = "roundpipe/knows/{}"  # rank {} knows why the group was abandoned
LINGER_NOTE_S = 1.0  # a failed rank says that it waits for the others after this many seconds
# RoundPipe's gloo groups made by this process, and the collectives abandoned on them after a
# failure: torn down at exit (_close_groups), never before (destroying a group while the
# ranks still make new ones would give them different group names)
_groups: list = []
_abandoned: list = []
_comms: "weakref.WeakSet[Comm]" = weakref.WeakSet()
_PID = os.getpid()  # a fork()-ed child inherits these lists: they are not its own


@atexit.register
def _close_groups() -> None:
    """At interpreter exit, once RoundPipe's threads have finished their queued work
    (:func:`roundpipe.threads._stop_workers`), RoundPipe's gloo groups are torn down while the
    interpreter is still whole: the collectives abandoned after a failure are waited for (each
    ends within its group's timeout), each group is destroyed and let go of, which joins its
    gloo threads. A gloo thread that outlives this (a group left to the interpreter's
    finalisation) may drop the last reference to a tensor Python made, which takes the GIL:
    during finalisation that aborts the process ("terminate called without an active
    exception"). Not in a ``fork()``-ed child, whose copies are the parent's."""
    threads._stop_workers()
    if os.getpid() != _PID:
        return
    for comm in list(_comms):  # a group this process abandoned: the others learn why first
        if comm.aborted is not None and comm.store is not None:
            comm.linger()
    for work in _abandoned:
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - its error (the timeout) was raised already
            pass
    _abandoned.clear()
    for comm in list(_comms):  # a wrapper not yet collected would keep them alive
        comm.group, comm.store, comm.user_group = None, None, None
        comm.aborted = comm.aborted or "the interpreter is exiting"
    for group in _groups:
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError, AssertionError):
            pass  # destroyed already (the user's destroy_process_group())
    _groups.clear()


def _identity() -> tuple:
    """This process as the other ranks can check on it: (host name, PID namespace, PID)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux: no way to look at another process's state
        namespace = None
    return socket.gethostname(), namespace, os.getpid()


def _process_gone(ident: tuple) -> bool:
    """Whether the process ``ident`` (:func:`_identity`) has ended: known only for a process
    on this host, in this PID namespace, on Linux (``/proc``: gone, or a zombie); False when it
    cannot be told."""
    host, namespace, pid = ident
    mine = _identity()
    if namespace is None or (host, namespace) != mine[:2]:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


_hook_lock = threading.Lock()
_previous_hook: Any = None


def _install_excepthook() -> None:
    """Chains :func:`_uncaught` before the current ``sys.excepthook`` (once per process)."""
    global _previous_hook
    with _hook_lock:
        if _previous_hook is None:
            _previous_hook = sys.excepthook
            sys.excepthook = _uncaught


def _uncaught(kind: type, error: BaseException, tb: Any) -> None:
    """``sys.excepthook``: the traceback is printed as before; then every live group of this
    process is abandoned with ``error`` (the other ranks' waits raise naming this rank and the
    error) and the process waits until the others know (:meth:`Comm.linger`)."""
    (_previous_hook or sys.__excepthook__)(kind, error, tb)
    if os.getpid() != _PID:
        return
    for comm in list(_comms):
        if comm.store is None or comm.size < 2:
            continue
        comm.abort(error)
        comm.linger()


# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning per call) for this name, the same
# collective; older torch has only the former.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _chunk_rows(rows: int, n: int, r: int) -> tuple[int, int]:
    """Rank ``r``'s rows ``[a, b)`` of ``rows`` split in ``n`` as ``torch.chunk`` splits them."""
    k = -(-rows // n) if rows else 0
    return min(r * k, rows), min((r + 1) * k, rows)


class Comm:
    """One rank's side of a RoundPipe process group.

    Args:
        group: the process group (``torch.distributed.group.WORLD`` or a subgroup this rank
            belongs to).
        reduction: ``"mean"`` (gradients averaged over the ranks, as DDP) or ``"sum"``.
        shard: shard the optimizer copies and state by rows (see the module docstring).
        stats: where communication seconds are counted (``comm_s``).

    Attributes:
        group: RoundPipe's own gloo group over ``group``'s ranks (None once torn down at exit).
        timeout: ``group``'s timeout (a ``datetime.timedelta``), which ``self.group`` has too.
        aborted: why the group was abandoned (:meth:`abort`), or None.

    Raises:
        RuntimeError: torch.distributed is not initialised, or this rank is not in ``group``.
        ValueError: ``reduction`` is not one of :data:`REDUCTIONS`.
    """

    def __init__(self, group: Any, reduction: str, shard: bool, stats: Stats) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("RoundPipe: process_group was given but torch.distributed is not "
                               "initialised (call torch.distributed.init_process_group first)")
        if reduction not in REDUCTIONS:
            raise ValueError(f"RoundPipe: grad_reduction must be one of {REDUCTIONS}, got "
                             f"{reduction!r}")
        rank = dist.get_rank(group)
        if rank < 0:
            raise RuntimeError("RoundPipe: this process is not a member of process_group")
        self.user_group, self.rank, self.size = group, rank, dist.get_world_size(group)
        self.mean, self.shard, self.stats = reduction == "mean", shard, stats
        self.backend = dist.get_backend(group)
        # RoundPipe's collectives run on a gloo group of their own over the same ranks (every
        # rank of the group creates it here, in the same order): the gradients are reduced on
        # the host, and the user's own collectives on ``group`` (logging an all-reduced loss,
        # global_num_items) never interleave with the optimizer thread's. It has the timeout of
        # the user's group: a failing rank reaches the others within it (module docstring).
        self.timeout: datetime.timedelta = group_timeout(group)
        self.group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                    use_local_synchronization=True, timeout=self.timeout)
        self.store = self.group.get_group_store()
        self.aborted: Optional[str] = None  # why the group was abandoned
        _groups.append(self.group)
        # every rank's process (_identity), to name a rank whose process ended without a word
        self.processes: list = [None] * self.size
        dist.all_gather_object(self.processes, _identity(), group=self.group)
        _comms.add(self)
        _install_excepthook()

    # --- construction --------------------------------------------------------------------------

    def check_and_broadcast(self, module: nn.Module, settings: Optional[dict] = None) -> None:
        """Every rank wraps the same architecture (names, shapes, dtypes compared) with the
        same settings (``shard_optimizer``, ``grad_reduction`` and each entry of ``settings``,
        e.g. ``optim_dtype``, ``layers_per_stage``: values compared by their ``repr``), and
        starts from rank 0's parameters and buffers (as DDP).

        Raises:
            ValueError: on every rank, naming the first setting that differs (with each rank's
                value), or saying that the models differ.
        """
        mine = {"shard_optimizer": self.shard, "grad_reduction": "mean" if self.mean else "sum"}
        mine.update({k: repr(v) for k, v in (settings or {}).items()})
        every: list = [None] * self.size
        dist.all_gather_object(every, mine, group=self.group)
        for key in mine:
            values = [theirs.get(key) for theirs in every]
            if any(v != values[0] for v in values):
                raise ValueError(f"RoundPipe: the ranks of process_group wrap with different "
                                 f"{key} (per rank: {values}); every rank must pass the same")
        desc = [(n, tuple(t.shape), str(t.dtype), t.requires_grad)
                for n, t in list(module.named_parameters()) + list(module.named_buffers())]
        digest = hashlib.sha256(repr(desc).encode()).hexdigest()
        digests: list = [None] * self.size
        dist.all_gather_object(digests, digest, group=self.group)
        if len(set(digests)) != 1:
            raise ValueError("RoundPipe: the ranks of process_group wrap different models "
                             "(parameter or buffer names, shapes, dtypes or requires_grad "
                             f"differ: digests {digests})")
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src, group=self.group)

    def rows(self, shape: torch.Size) -> tuple[int, int]:
        """This rank's rows ``[a, b)`` of a parameter of ``shape`` (all of a 0-dim one)."""
        if not self.shard or len(shape) == 0:
            return (0, shape[0] if len(shape) else 1)
        return _chunk_rows(shape[0], self.size, self.rank)

    def sharded(self, shape: torch.Size) -> bool:
        return self.shard and len(shape) > 0

    # --- a failing rank --------------------------------------------------------------------------

    def abort(self, error: BaseException) -> None:
        """Abandons the group after ``error`` on this rank (idempotent): this rank's pending and
        later waits raise at once, and the other ranks' within :data:`POLL_S` (the reason is
        written to the group's store; if the store cannot be reached, their waits end with the
        group's timeout)."""
        if self.aborted is not None:
            return
        reason = f"rank {self.rank} failed: {type(error).__name__}: {error}"
        self.aborted = reason
        try:  # the first rank's reason stays (a rank that saw it fails next, for that reason)
            self.store.compare_set(_ABORT_KEY, "", reason)
        except Exception:  # noqa: BLE001 - best effort: the timeout still bounds the others
            pass
        self._knows()

    def check(self) -> None:
        """Raises ``RuntimeError`` when the group was abandoned (this rank's own failure, or
        another rank's seen by a wait); nothing is issued on it any more."""
        if self.aborted is not None:
            raise self._abandoned()

    def _abandoned(self) -> RuntimeError:
        return RuntimeError(f"RoundPipe: the process group's collectives were abandoned "
                            f"({self.aborted}); the ranks cannot train on together: restart "
                            "them (e.g. from the last checkpoint)")

    def _knows(self) -> None:
        """Tells the other ranks (the store) that this one knows the group was abandoned."""
        try:
            self.store.set(_ACK_KEY.format(self.rank), "1")
        except Exception:  # noqa: BLE001 - unreachable store: nobody waits to read it
            pass

    def _remote_abort(self) -> None:
        """Marks the group abandoned when another rank wrote why to the store."""
        try:
            if not self.store.check([_ABORT_KEY]):
                return
            reason = self.store.get(_ABORT_KEY).decode(errors="replace")
        except Exception:  # noqa: BLE001 - unreachable store: gloo's own timeout still holds
            return
        self.aborted = reason
        self._knows()

    def _explain(self) -> bool:
        """After an error of gloo's (a peer closed its connection): marks the group abandoned
        for the reason another rank wrote to the store, else naming the ranks whose processes
        are gone (:func:`_process_gone`); False when neither is known."""
        self._remote_abort()
        if self.aborted is not None:
            return True
        gone = [r for r, ident in enumerate(self.processes)
                if r != self.rank and ident is not None and _process_gone(ident)]
        if not gone:
            return False
        which = ", ".join(f"rank {r} (PID {self.processes[r][2]})" for r in gone)
        self.aborted = (f"{which} left: its process ended without saying why (killed, "
                        "os._exit or a crash, or its reason could not be read)")
        self._knows()
        return True

    def linger(self) -> None:
        """This rank abandoned the group and its process is about to end: waits until every
        other rank knows why (it acknowledged in the store, or its process is gone), polling
        every :data:`POLL_S` seconds, at most the group's timeout, so that the reason can be
        read (from the store, which may live in this process) and the others' waits end with
        it rather than with gloo's "Connection closed by peer". Says on stderr that it waits
        when that takes more than :data:`LINGER_NOTE_S` seconds. Returns at once when the
        store cannot be reached (nothing can be read from it then)."""
        start = time.monotonic()
        noted = False
        pending = [r for r in range(self.size) if r != self.rank]
        while pending:
            try:
                pending = [r for r in pending if not _process_gone(self.processes[r])
                           and not self.store.check([_ACK_KEY.format(r)])]
            except Exception:  # noqa: BLE001 - the store is gone
                return
            waited = time.monotonic() - start
            if not pending or waited > self.timeout.total_seconds():
                return
            if not noted and waited > LINGER_NOTE_S:
                noted = True
                print(f"RoundPipe: rank {self.rank} waits (at most {self.timeout}) for rank(s) "
                      f"{pending} to learn why it failed before its process ends",
                      file=sys.stderr, flush=True)
            time.sleep(POLL_S)

    def _finish(self, work) -> None:
        """Waits for one collective, looking for an abort every :data:`POLL_S` seconds; its
        error (a peer gone, the group's timeout) abandons the group. (gloo's collectives used
        here all honour ``wait(timeout)``; its reduce-scatter does not, it runs inside
        ``wait()``: see :meth:`reduce_scatter_rows`.)"""
        poll = datetime.timedelta(seconds=POLL_S)
        try:
            while True:
                self.check()
                try:
                    work.wait(timeout=poll)
                    return
                except RuntimeError:
                    if work.is_completed():  # done meanwhile, or failed: its own result
                        work.wait()
                        return
                self._remote_abort()
        except RuntimeError as e:
            if not work.is_completed():
                _abandoned.append(work)  # it ends with the timeout; waited for at exit
            if self.aborted is None and self._explain():  # gloo's error: who left, and why
                raise self._abandoned() from e
            self.abort(e)
            raise

    def _timed(self, fn, *args, **kwargs):
        """``fn(*args, async_op=True, **kwargs)`` on the group, waited for (see :meth:`_finish`),
        counted in ``comm_s``."""
        self.check()
        start = time.perf_counter()
        try:
            self._finish(fn(*args, async_op=True, **kwargs))
        finally:
            self.stats.add("comm_s", time.perf_counter() - start)

    # --- collectives -----------------------------------------------------------------------------

    def smallest(self, value: int) -> int:
        """The smallest of every rank's ``value`` (a collective every rank calls)."""
        every: list = [None] * self.size
        dist.all_gather_object(every, value, group=self.group)
        return min(every)

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object), on every rank: a collective every rank
        calls at the same point, from the caller's thread with no optimizer work pending (the
        stage plan of ``layers_per_stage="auto"``, which every rank's collectives follow)."""
        box = [value]
        dist.broadcast_object_list(box, dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def present(self, flags: Sequence[bool]) -> list[bool]:
        """Which of a fixed list of parameters received a gradient on any rank."""
        if not flags:
            return []
        t = torch.tensor([1.0 if f else 0.0 for f in flags])
        self._timed(dist.all_reduce, t, group=self.group)
        return [v > 0 for v in t.tolist()]

    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> list:
        """Starts summing each tensor in place over the ranks; returns the works to wait for."""
        self.check()
        return [dist.all_reduce(t, group=self.group, async_op=True) for t in tensors]

    def wait(self, works: list) -> None:
        start = time.perf_counter()
        try:
            for w in works:
                self._finish(w)
        finally:
            self.stats.add("comm_s", time.perf_counter() - start)

    def sum_scalar(self, x: float) -> float:
        """``x`` summed over the ranks (float64; inf and NaN propagate)."""
        t = torch.tensor([x], dtype=torch.float64)
        self._timed(dist.all_reduce, t, group=self.group)
        return float(t)

    def reduce_scatter_rows(self, grads: Sequence[Optional[torch.Tensor]],
                            shapes: Sequence[torch.Size], pool) -> list[torch.Tensor]:
        """Sums full gradients (None: zeros) over the ranks and returns this rank's rows of
        each, fp32 buffers of ``pool``. Each parameter goes in pieces of at most
        :data:`PIECE` elements per rank: the pieces of every rank's rows packed side by side
        into one reused buffer, then one collective, so no transient allocation (ours or the
        transport's) is larger than a piece — large freed blocks would otherwise stay in
        the C allocator's heap, measured at several bytes per parameter.

        The collective is an all-to-all (each rank receives every rank's piece of its rows)
        and the sum is taken here, in rank order: gloo's reduce-scatter runs inside its
        ``wait()``, which no timeout or abort can end early (:meth:`_finish`); the bytes sent
        are the same."""
        out = []
        for g, shape in zip(grads, shapes):
            k, w = self._k_w(shape)
            a, b = self.rows(shape)
            seg = k * w
            mine = pool.take((seg,), torch.float32)
            flat = None if g is None else g.reshape(-1)
            for lo in range(0, seg, PIECE):
                q = min(PIECE, seg - lo)
                send = pool.take((self.size * q,), torch.float32)
                for r in range(self.size):
                    start, stop = r * seg + lo, min(r * seg + lo + q, shape[0] * w)
                    dst = send[r * q:(r + 1) * q]
                    n = max(0, stop - start) if flat is not None else 0
                    if n:
                        dst[:n].copy_(flat[start:stop])
                    if n < q:
                        dst[n:].zero_()
                got = pool.take((self.size * q,), torch.float32)
                self._timed(dist.all_to_all_single, got, send, group=self.group)
                torch.sum(got.view(self.size, q), dim=0, out=mine[lo:lo + q])
                pool.give(got)
                pool.give(send)
            out.append(mine[:(b - a) * w].view(b - a, *shape[1:]))
        return out

    def all_gather_rows(self, params: Sequence[torch.Tensor]) -> None:
        """Each rank's rows of each (model-copy) parameter, written by that rank, copied into
        every rank's whole parameter, in pieces of at most :data:`PIECE` elements per rank
        (see :meth:`reduce_scatter_rows`)."""
        for p in params:
            k, w = self._k_w(p.shape)
            seg = k * w
            flat = p.data.view(-1)
            a = self.rows(p.shape)[0]
            for lo in range(0, seg, PIECE):
                q = min(PIECE, seg - lo)
                mine = torch.zeros(q, dtype=p.dtype)
                start, stop = a * w + lo, min(a * w + lo + q, self.rows(p.shape)[1] * w)
                if stop > start:
                    mine[:stop - start].copy_(flat[start:stop])
                gathered = torch.empty(self.size * q, dtype=p.dtype)
                self._timed(_all_gather, gathered, mine, group=self.group)
                with torch.no_grad():
                    for r in range(self.size):
                        start, stop = r * seg + lo, min(r * seg + lo + q, p.shape[0] * w)
                        if stop > start:
                            flat[start:stop].copy_(gathered[r * q:r * q + stop - start])

    def gather_rows(self, shard: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The whole tensor of ``shape`` from every rank's rows ``shard`` (for a consolidated
        state dict)."""
        full = torch.empty(shape, dtype=shard.dtype)
        full.data[self.rows(shape)[0]:self.rows(shape)[1]].copy_(shard)
        self.all_gather_rows([full])
        return full

    def segment(self, shapes: Sequence[torch.Size]) -> int:
        """Elements of one rank's (padded) segment for ``shapes``."""
        return sum(k * w for k, w in (self._k_w(s) for s in shapes))

    def _k_w(self, shape: torch.Size) -> tuple[int, int]:
        rows = shape[0]
        width = math.prod(shape[1:])
        return -(-rows // self.size) if rows else 0, width


def global_num_items(labels: torch.Tensor, group: Any = None, ignore_index: int = -100) -> int:
    """The number of target tokens of a causal-LM batch summed over the ranks of ``group``
    (labels shifted by one as HF's loss does; ``ignore_index`` not counted): pass it as
    ``num_items_in_batch`` with ``grad_reduction="sum"`` for the exact token mean of the global
    batch (HF Trainer's ``num_items_in_batch`` across ranks).

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    count = torch.tensor([(labels[..., 1:] != ignore_index).sum().item()], dtype=torch.int64)
    dist.all_reduce(count, group=group)
    return int(count)


class Reduction:
    """What the optimizer side does with gradients, one process (no ranks): downloads are
    accumulated as they come, steps use them as they are. :class:`ReplicatedReduction` and
    :class:`ShardedReduction` override it for a process group. Runs on the optimizer thread.

    Args:
        copies: the :class:`roundpipe.param_copies.ParamCopies`.
    """

    divisor = 1.0  # gradients are divided by this (the number of ranks for a mean)
    device_norms = True  # the squared norms measured on the device hold for the step
    sharded = False  # each rank steps only its rows of the optimizer copies
    comm: Optional[Comm] = None  # the ranks' side, with a process group

    def __init__(self, copies) -> None:
        self.copies = copies

    def abort(self, error: BaseException) -> None:
        """A call failed on this rank with ``error``: with ranks, the group is abandoned on
        every rank (:meth:`Comm.abort`)."""
        if self.comm is not None:
            self.comm.abort(error)

    def check(self) -> None:
        """Raises ``RuntimeError`` when the ranks' group was abandoned (:meth:`Comm.check`)."""
        if self.comm is not None:
            self.comm.check()

    def consume(self, stage: int, got: dict[int, torch.Tensor], norms: dict[int, float],
                owned: bool, keep: set[int]) -> dict[int, torch.Tensor]:
        """A stage visit's downloaded gradients ``got`` (index -> host tensor, with squared
        norms ``norms``): those in ``keep`` that are the first since the step are returned to
        be stepped from directly (exact mode), the others accumulated."""
        direct = {}
        for i, g in got.items():
            if i in keep and not self.copies.has_grad(i):
                direct[i] = g
            else:
                self.copies.accumulate(i, g, owned, norms.get(i))
        return direct

    def stage_always(self, stage: int) -> bool:
        """Whether a stage visit without gradients is consumed anyway (collectives)."""
        return False

    def exact_ready(self, indices: list[int], grads: dict) -> dict:
        """Exact mode: the gradients of the parameters final at a stage, made global."""
        return grads

    def layers_ready(self, grads: list, layers: list[list[int]], all_first: bool):
        """Yields each layer index once its parameters' gradients in ``grads`` are global
        (all layers first when ``all_first``: a verdict needs every norm)."""
        yield from range(len(layers))

    def norm_sq(self, norms: list[Optional[float]]) -> float:
        """The global squared norm from the known per-parameter squared norms."""
        return math.fsum(n for n in norms if n is not None)

    def written(self, indices: list[int]) -> None:
        """Model copies ``indices`` were written from their optimizer copies."""


class ReplicatedReduction(Reduction):
    """Every rank keeps everything; gradients are all-reduced at the step (per layer, the next
    layer's reduction in flight while a layer is stepped), in exact mode per stage."""

    device_norms = False  # the step's norms are those of the reduced gradients

    def __init__(self, copies, comm: Comm) -> None:
        super().__init__(copies)
        self.comm = comm
        self.divisor = float(comm.size) if comm.mean else 1.0

    def _start(self, indices: list[int], grads) -> tuple:
        """Starts all-reducing ``grads[i]`` (zeros where absent) and a presence flag each."""
        flags = torch.tensor([0.0 if grads[i] is None else 1.0 for i in indices])
        tensors = []
        for i in indices:
            g = grads[i]
            if g is None:
                g = grads[i] = self.copies.pool.take(self.copies.optim[i].shape,
                                                     self.copies.optim[i].dtype).zero_()
            tensors.append(g)
        return self.comm.all_reduce(tensors + [flags]), flags

    def _finish(self, indices: list[int], grads, started: tuple) -> None:
        works, flags = started
        self.comm.wait(works)
        for i, present in zip(indices, flags.tolist()):
            if not present:  # no rank trained it: no gradient, as in one process
                self.copies.pool.give(grads[i])
                grads[i] = None

    def exact_ready(self, indices: list[int], grads: dict) -> dict:
        self._finish(indices, grads, self._start(indices, grads))
        return grads

    def layers_ready(self, grads: list, layers: list[list[int]], all_first: bool):
        started = {}
        todo = [[i for i in ids] for ids in layers]
        if all_first:
            for li, ids in enumerate(todo):
                started[li] = self._start(ids, grads)
            for li, ids in enumerate(todo):
                self._finish(ids, grads, started.pop(li))
            yield from range(len(layers))
            return
        if todo:
            started[0] = self._start(todo[0], grads)
        for li, ids in enumerate(todo):
            if li + 1 < len(todo):
                started[li + 1] = self._start(todo[li + 1], grads)
            self._finish(ids, grads, started.pop(li))
            yield li


class ShardedReduction(Reduction):
    """Each rank keeps its rows of every parameter: a stage's downloads are reduce-scattered
    as they arrive, steps update the rank's rows, the model copy's rows are all-gathered."""

    sharded = True
    device_norms = False  # the step's norms are those of this rank's reduced rows

    def __init__(self, copies, comm: Comm) -> None:
        super().__init__(copies)
        self.comm = comm
        self.divisor = float(comm.size) if comm.mean else 1.0

    def stage_always(self, stage: int) -> bool:
        return bool(self.copies.index.stage_params[stage])

    def consume(self, stage, got, norms, owned, keep):
        copies, comm = self.copies, self.comm
        indices = copies.index.stage_params[stage]
        rows = [i for i in indices if copies.index.rows[i] is not None]
        whole = [i for i in indices if copies.index.rows[i] is None]
        present = comm.present([i in got for i in indices])
        shards = comm.reduce_scatter_rows([got.get(i) for i in rows],
                                          [copies.model[i].shape for i in rows], copies.pool)
        small = {i: got[i].float().clone() if i in got else torch.zeros(copies.model[i].shape)
                 for i in whole}
        comm.wait(comm.all_reduce(list(small.values())))
        reduced = dict(zip(rows, shards)) | small
        for i, ok in zip(indices, present):
            if ok:  # ours (pool buffers or fresh): taken as the gradient without a copy
                copies.accumulate(i, reduced[i], True)
            else:
                copies.pool.give(reduced[i])
        if owned:
            for g in got.values():
                copies.pool.give(g)
        return {}

    def norm_sq(self, norms):
        rows = math.fsum(n for i, n in enumerate(norms)
                         if n is not None and self.copies.index.rows[i] is not None)
        whole = math.fsum(n for i, n in enumerate(norms)
                          if n is not None and self.copies.index.rows[i] is None)
        return self.comm.sum_scalar(rows) + whole

    def written(self, indices: list[int]) -> None:
        self.comm.all_gather_rows([self.copies.model[i] for i in self.copies.index.sharded(indices)])
