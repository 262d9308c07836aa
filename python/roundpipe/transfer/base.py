"""The device I/O interface: how a worker moves a stage's weights, activations and gradients
between the host and its compute device, and counts every byte it moves.

:class:`DeviceIO` holds what every device type shares (deduplicating a stage's tensors,
marking the trainable ones, summing a stage's parameter gradients over microbatches on the
device, copying back only the buffers a layer changed, counting bytes by kind); the device
types supply the copies themselves: :class:`roundpipe.transfer.cpu.CpuIO` (synchronous,
the CPU as compute device) and :class:`roundpipe.transfer.cuda.CudaIO` (streams, events,
pinned staging). One instance per device, used by that device's worker only (and by the
optimizer side for :meth:`DeviceIO.host_wait` and the release of gradient downloads).

Gradient data path: parameter gradients stay on the device for the whole stage visit — for
one microbatch the model-dtype gradient itself, for several an fp32 sum added in microbatch
order (fp32 parameters: autograd's own in-place accumulation, which adds in the same order;
other dtypes: added by a hook as soon as autograd has produced each gradient, which is then
freed) — and are downloaded once, after the visit's last microbatch
(``P_stage * min(M * itemsize, 4)`` bytes). At most :attr:`DeviceIO.grad_downloads_in_flight`
stage downloads per device wait for the optimizer side to consume them; the next one waits.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..quant import dequantize_uploaded
from ..threads import Permits
from ..stats import Stats
from ..torch_private import tensor_version, tree_map


class TensorRef(NamedTuple):
    """One tensor a layer computes with, under the layer's name for it (its first in
    ``named_parameters`` / ``named_buffers`` order)."""

    name: str
    host: torch.Tensor          # the host model copy's parameter or buffer
    index: Optional[int]        # optimizer-copy index of a trainable parameter, else None
    is_buffer: bool
    owner: int = 0              # a buffer's module (id): its buffers are written back together
    # every place of the layer's modules holding it: (a module's ``_parameters`` or
    # ``_buffers`` dict, key); more than one where the layer ties it under several names
    sites: tuple = ()


@dataclass
class StageWeights:
    """A stage's tensors on its device.

    Attributes:
        layers: per layer of the stage, ``(sites, device tensor)`` for each of its tensors
            (:attr:`TensorRef.sites`: where the layer's modules hold it, what
            :func:`roundpipe.pipeline.execute.run_layers` swaps); a host tensor used by
            several layers of the stage is one device tensor.
        trainable: ``(optimizer-copy index, device tensor requiring grad)``, each index once.
        buffers: ``(host buffer, device buffer, device version right after the upload, id of
            the module holding it)``.
        grad_sums: fp32 sums over microbatches of non-fp32 parameters' gradients, by index.
        derived: tensors made on the device from the weights for the visit (the dense weights
            of a quantized base), alive as long as the visit.
        nbytes: device bytes of the weights, buffers and derived tensors.
    """

    layers: list[list[tuple[tuple, torch.Tensor]]]
    trainable: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    buffers: list[tuple[torch.Tensor, torch.Tensor, int, int]] = field(default_factory=list)
    grad_sums: dict[int, torch.Tensor] = field(default_factory=dict)
    derived: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0


class GradDownload(NamedTuple):
    """A stage visit's parameter gradients on the host.

    Attributes:
        items: ``(optimizer-copy index, host gradient)``; fp32, or the model dtype when the
            call had one microbatch.
        norms_sq: float64 host vector, the squared L2 norm of each gradient, computed on the
            device before the download (for clipping and overflow checks without reading
            the gradients again on the host); None when not asked for.
        event: ready once the copies are done (``None``: already done); wait for it with the
            device's ``host_wait``.
        owned: the host tensors are fresh and may be kept (else they are staging memory and
            must be copied before :attr:`release`).
        release: call once the gradients were consumed (frees the staging / permit).
    """

    items: list[tuple[int, torch.Tensor]]
    norms_sq: Optional[torch.Tensor]
    event: Any
    owned: bool
    release: Callable[[], None]


def nbytes(t: torch.Tensor) -> int:
    return t.nbytes


def _map(move: Callable[[Any], Any], tree: Any) -> Any:
    """``tree_map(move, tree)``, without the tree walk for what stages hand each other most:
    one tensor, or a flat list of tensors and Nones (input gradients)."""
    if type(tree) is torch.Tensor:
        return move(tree)
    if type(tree) is list and all(x is None or type(x) is torch.Tensor for x in tree):
        return [move(x) for x in tree]
    return tree_map(move, tree)


class Done:
    """What a scope of copies marks (:meth:`DeviceIO._upload_stream`,
    :meth:`DeviceIO._download_stream`): ``event``, set as the scope ends (None: the copies
    are done already, as on the CPU device)."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event: Any = None


_current = threading.local()


def current_io() -> Optional["DeviceIO"]:
    """The :class:`DeviceIO` of the stage visit the calling thread is running layers for
    (None outside one): how code inside a layer (the KV cache of generation) reaches its
    device's transfers."""
    return getattr(_current, "io", None)


class io_scope:
    """Makes ``io`` what :func:`current_io` returns on this thread while the block runs (a
    context manager)."""

    __slots__ = ("io", "outer")

    def __init__(self, io: "DeviceIO") -> None:
        self.io = io

    def __enter__(self) -> None:
        self.outer = getattr(_current, "io", None)
        _current.io = self.io

    def __exit__(self, *exc) -> None:
        _current.io = self.outer


class DeviceIO:
    """Moves tensors between the host and one compute device and counts the bytes (see the
    module docstring). Subclasses implement the ``_copy_*`` primitives and the event methods.

    Args:
        device: the compute device.
        stats: where bytes and seconds are counted.
    """

    prefetch = False
    grad_downloads_in_flight = 1

    def __init__(self, device: torch.device, stats: Stats) -> None:
        self.device = device
        self.stats = stats
        self._grad_permits = Permits(self.grad_downloads_in_flight)
        # bytes moved, by (direction, kind), since the last flush_counts: counted by this
        # device's worker alone while a pass runs, added to the stats once at its end
        self._bytes: dict[tuple[str, str], int] = {}

    def _moved(self, direction: str, kind: str, n: int) -> None:
        """Counts ``n`` bytes moved ``direction`` (``"h2d"`` / ``"d2h"``) as ``kind``."""
        key = (direction, kind)
        self._bytes[key] = self._bytes.get(key, 0) + n

    def flush_counts(self) -> None:
        """Adds the bytes counted since the last call to the stats (after a pass, once its
        workers are done)."""
        counts, self._bytes = self._bytes, {}
        for (direction, kind), n in counts.items():
            self.stats.moved(direction, kind, n)

    # --- primitives of a device type ----------------------------------------------------------

    def activate(self):
        """Context the worker runs a pass in (CUDA: its device and compute stream)."""
        return contextlib.nullcontext()

    def _device_like(self, host: torch.Tensor, parameter: bool) -> torch.Tensor:
        """An uninitialised device tensor for a copy of ``host`` (a parameter's: where
        :meth:`_fill` will put it; the CPU device uses the host memory itself)."""
        raise NotImplementedError

    def _fill(self, dev: torch.Tensor, host: torch.Tensor, parameter: bool) -> None:
        """Copies ``host`` into ``dev`` (from :meth:`_device_like`), asynchronously where the
        device allows (CUDA: on the current stream; read by the compute)."""
        raise NotImplementedError

    def _copy_to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A device copy of host tensor ``t``."""
        dev = self._device_like(t, False)
        self._fill(dev, t, False)
        return dev

    def _copy_to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (which may require grad) detached, on the host."""
        raise NotImplementedError

    def _keep_for_compute(self, t: torch.Tensor) -> None:
        """``t`` was made on the device during an upload and is read by the compute (CUDA:
        its memory is not reused before the compute stream is done with it)."""

    @contextlib.contextmanager
    def _upload_stream(self):
        """Around the whole of a stage's upload (CUDA: on the weights stream); yields a
        :class:`Done` whose ``event`` marks the end of everything issued inside, set when
        the block ends."""
        yield Done()

    @contextlib.contextmanager
    def _timed_copies(self, nbytes: int):
        """Around an upload's copies alone, ``nbytes`` of them (the allocations are made
        before, a quantized base's dequantization after): their time is ``upload_s``, from
        which the planner takes the link's bandwidth."""
        yield

    @contextlib.contextmanager
    def _download_stream(self):
        """Around device-to-host copies (CUDA: on the down stream, after the compute issued so
        far); yields a :class:`Done` whose ``event`` marks the copies, set when the block
        ends."""
        yield Done()

    def host_wait(self, event: Any) -> None:
        """Blocks the calling thread (without spinning) until the copies marked by ``event``
        are done."""

    def wait_weights(self, event: Any) -> None:
        """Makes the compute wait for an upload marked by ``event``."""

    def begin_visit(self) -> None:
        """A stage visit starts on this device (before its weights are fetched)."""

    def throttle(self) -> None:
        """Called before each microbatch is issued: keeps the host at most one microbatch
        ahead of the device (CUDA; nothing to do where copies are synchronous)."""

    def done_through_previous_visit(self) -> bool:
        """Whether the device finished every microbatch of the visits before the current one
        (prefetching the next stage then keeps at most two stages of weights resident)."""
        return True

    def collect(self) -> dict[str, float]:
        """Device-side timings measured since the last call (seconds), by stats key."""
        return {}

    def mark(self) -> Any:
        """A point in the device's work issued so far (to measure what runs between two)."""
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        """The device's seconds between two :meth:`mark` s, once the work between them is
        done (after the pass)."""
        return end - start

    # --- what every device type shares --------------------------------------------------------

    def upload(self, layers: list[list[TensorRef]], with_grad: bool) -> tuple[StageWeights, Any]:
        """A stage's weights on the device (each host tensor copied once, the weights of a
        quantized frozen base dequantized once behind the copies:
        :func:`roundpipe.quant.dequantize_uploaded`); with ``with_grad``,
        copies of trainable parameters (``index`` set and the host parameter still
        ``requires_grad``) require grad and collect it; without, copies of parameters whose
        host parameter requires grad require grad too, as the model's own parameters do (a
        forward visit runs under ``no_grad``, so nothing collects a gradient), because torch's
        kernels choose by it. Returns the weights and the event of the copies."""
        copies: dict[int, torch.Tensor] = {}
        pending: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (host, device, param)
        buffers: list[tuple[torch.Tensor, torch.Tensor, int]] = []     # (host, device, owner)
        weights = StageWeights([])
        with self._upload_stream() as done:
            for refs in layers:
                placed = []
                for ref in refs:
                    t = copies.get(id(ref.host))
                    if t is None:
                        t = copies[id(ref.host)] = self._device_like(ref.host, not ref.is_buffer)
                        pending.append((ref.host, t, not ref.is_buffer))
                        size = nbytes(t)
                        weights.nbytes += size
                        if ref.is_buffer:
                            self._moved("h2d", "buffer", size)
                            buffers.append((ref.host, t, ref.owner))
                        else:
                            self._moved("h2d", "weight", size)
                            if with_grad:
                                if ref.index is not None and ref.host.requires_grad:
                                    t.requires_grad_(True)
                                    weights.trainable.append((ref.index, t))
                            elif ref.host.requires_grad:
                                # as in the user's model (no graph is built: forward visits
                                # run under no_grad). torch.matmul decides on it: a linear on
                                # a non-contiguous 3-d input (batch_first attention's
                                # in_proj) with a weight that does not require grad runs as a
                                # bmm of tiny matrices, several times slower and rounding
                                # differently from the single GEMM plain PyTorch and our
                                # recomputation run.
                                t.requires_grad_(True)
                    placed.append((ref.sites, t))
                weights.layers.append(placed)
            with self._timed_copies(weights.nbytes), torch.no_grad():
                for host, dev, parameter in pending:
                    self._fill(dev, host, parameter)
            # each buffer's version once it holds the upload (write_back_buffers compares)
            weights.buffers = [(host, dev, tensor_version(dev), owner)
                               for host, dev, owner in buffers]
            for dense in dequantize_uploaded(layers, copies):  # behind the copies, see its doc
                weights.nbytes += nbytes(dense)
                weights.derived.append(dense)
                self._keep_for_compute(dense)
        return weights, done.event

    def to_device(self, tree: Any, event: Any, kind: str) -> Any:
        """A copy of every tensor of a host tree (made ready by ``event``) on the device, never
        the host tensor itself (layers may modify their inputs in place)."""
        self._wait_host_copy(event)

        def move(x):
            if not isinstance(x, torch.Tensor):
                return x
            self._moved("h2d", kind, nbytes(x))
            return self._copy_to_device(x)

        return _map(move, tree)

    def _wait_host_copy(self, event: Any) -> None:
        """The next device copies wait for host data made ready by ``event``."""

    def to_host(self, tree: Any, kind: str) -> tuple[Any, Any]:
        """Every tensor of a device tree detached and on the host, and the event marking the
        copies."""
        def move(x):
            if not isinstance(x, torch.Tensor):
                return x
            self._moved("d2h", kind, nbytes(x))
            return self._copy_to_host(x)

        with self._download_stream() as done:
            out = _map(move, tree)
        return out, done.event

    def sum_grads_over(self, weights: StageWeights, microbatches: int) -> None:
        """Before a backward visit over ``microbatches``: with several, the gradient of each
        trainable non-fp32 parameter is added into an fp32 sum on the device (in microbatch
        order) as soon as autograd produces it, and freed. fp32 parameters keep autograd's
        own accumulation in ``.grad`` (the same additions in the same order); with one
        microbatch every gradient stays as it is, in the model dtype."""
        if microbatches == 1:
            return
        for i, t in weights.trainable:
            if t.dtype != torch.float32:
                # the hook refers to the sums, never to ``weights`` (which holds ``t``): a
                # tensor's hooks are not seen by Python's cyclic collector, so a cycle through
                # them would keep the stage's device tensors alive for good
                t.register_post_accumulate_grad_hook(
                    functools.partial(self._add_to_sum, weights.grad_sums, i))

    def _add_to_sum(self, sums: dict[int, torch.Tensor], i: int, t: torch.Tensor) -> None:
        g, t.grad = t.grad, None
        total = sums.get(i)
        if total is None:
            sums[i] = self._new_sum(g)
        else:
            total.add_(g)

    def _new_sum(self, g: torch.Tensor) -> torch.Tensor:
        """An fp32 sum on the device starting at ``g``."""
        return g.float()

    def download_grads(self, weights: StageWeights, abort,
                       want_norms: bool = True) -> Optional[GradDownload]:
        """Downloads the stage's gradient sums once, with (``want_norms``) their squared norms
        computed on the device (waiting while :attr:`grad_downloads_in_flight` earlier downloads of this device
        are not consumed); ``None`` when no parameter got a gradient."""
        sources = []
        for i, t in weights.trainable:
            g = weights.grad_sums.pop(i, None)
            if g is None:
                g = t.grad
            t.grad = None
            if g is not None:
                sources.append((i, g))
        if not sources:
            return None
        norms_sq = None
        if want_norms:
            norms_sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64)
                                    for _, g in sources]).square_()
        self._grad_permits.acquire(abort)
        try:
            for _, g in sources:
                self._moved("d2h", "param_grad", nbytes(g))
            if norms_sq is not None:
                self._moved("d2h", "output", nbytes(norms_sq))
            return self._download_grads(sources, norms_sq, abort)
        except BaseException:
            self._grad_permits.release()
            raise

    def _download_grads(self, sources: list[tuple[int, torch.Tensor]],
                        norms_sq: Optional[torch.Tensor], abort) -> GradDownload:
        """The download of ``sources`` (and ``norms_sq``); the permit is held. Whatever it
        took before raising, it gives back."""
        raise NotImplementedError

    def write_back_buffers(self, weights: StageWeights) -> None:
        """Copies back into the host model copy the buffers of every module that changed one
        of its buffers (its version counter moved since the upload); the others are not
        copied. A module's buffers go back together because some in-place updates do not
        move version counters (BatchNorm's running statistics; its ``num_batches_tracked``,
        updated with them, does)."""
        moved = {owner for _, dev, version, owner in weights.buffers if tensor_version(dev) != version}
        changed = [(host, dev) for host, dev, _, owner in weights.buffers if owner in moved]
        if changed:
            for host, dev in changed:
                self._moved("d2h", "buffer", nbytes(dev))
            self._write_back_buffers(changed)

    def _write_back_buffers(self, changed: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        raise NotImplementedError

    # --- the KV cache of generation (see roundpipe.hf.kv_cache) --------------------------------

    def kv_host_empty(self, shape: tuple, dtype: torch.dtype, keep: list) -> torch.Tensor:
        """An uninitialised host tensor for KV cache entries that this device reads and writes
        (CUDA: page-locked, exact size; objects that must live as long as it are appended to
        ``keep``)."""
        return torch.empty(shape, dtype=dtype)

    def kv_to_device(self, host: torch.Tensor, after: Any) -> torch.Tensor:
        """A device copy of host KV entries (counted as ``h2d_kv_bytes``); the copy first
        waits for ``after``, the event of an earlier :meth:`kv_to_host` into that memory
        (None: nothing pending)."""
        return self.to_device(host, after, "kv")

    def kv_prefetch(self, host: torch.Tensor, after: Any) -> tuple[torch.Tensor, Any]:
        """:meth:`kv_to_device` issued ahead of its use: the device copy and the event the
        compute must wait for (:meth:`kv_ready`) before reading it (CUDA: copied on the
        activations stream without making the compute wait now; elsewhere: done, None)."""
        return self.kv_to_device(host, after), None

    def kv_ready(self, event: Any) -> None:
        """The compute waits for a :meth:`kv_prefetch` marked by ``event`` (None: done)."""

    def kv_to_host(self, dev: torch.Tensor, host: torch.Tensor) -> Any:
        """Copies device KV entries into ``host`` (same shape and dtype; counted as
        ``d2h_kv_bytes``) once the compute issued so far has produced them; returns the event
        of the copy (None: already done). The end of the pass (:meth:`finish`) waits for it."""
        self._moved("d2h", "kv", nbytes(dev))
        with self._download_stream() as done:
            self._copy_into_host(dev, host)
        return done.event

    def _copy_into_host(self, dev: torch.Tensor, host: torch.Tensor) -> None:
        with torch.no_grad():
            host.copy_(dev)

    def finish(self) -> None:
        """At the end of a pass: the host may read everything written back to it."""
