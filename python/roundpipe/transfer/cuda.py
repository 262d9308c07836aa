"""CUDA compute devices: pinned host memory of exact size, one stream per kind of traffic,
events between them, backpressure, and a pinned staging ring for gradient downloads.

Importing it touches no CUDA state (the wrapper reads :data:`PIN_MODES` from here for any
device); CUDA is first used when a CUDA device is given to ``RoundPipe``, so CPU-only use never
touches it. Per device (:class:`CudaIO`, used by that device's worker,
and by the optimizer side to wait for and release gradient downloads):

- ``weights`` stream: uploads of stage weights and buffers from the pinned host model copy,
  and the dequantization of a quantized frozen base's weights right behind their upload;
- ``acts`` stream: uploads of stage inputs, labels and input gradients;
- ``compute`` stream: the layers, forward and backward (autograd runs a backward op on the
  stream of its forward op), and the sums of parameter gradients over microbatches;
- ``down`` stream: stage outputs, input gradients, losses (into pinned blocks of torch's host
  allocator), parameter gradients (into the staging ring, once per stage visit) and buffers a
  layer changed (straight into the pinned host buffer).

Streams are ordered by events only; the host waits (on events created with
``blocking=True``: the thread sleeps instead of spinning) where the host itself reads data
(the optimizer side consuming a gradient download, the loss at the end of a call) and for
backpressure: before issuing a microbatch, the host waits until the device has finished the
microbatch before the previous one, so it is at most one microbatch ahead and freed memory is
reused instead of piling up behind ``record_stream``. The next stage's weights are prefetched
only once the device is done with the stage before the current one: at most two stages of
weights, one stage's gradient sums and one microbatch's activations (plus the one being
issued) live on a device. ``record_stream`` is only ever called on device tensors.

Pinned memory (``pin_memory``): ``"alloc"`` (and ``"auto"``) moves the parameters and buffers
into one host arena of exactly their size, 512-byte aligned, registered once with
``cudaHostRegister`` (torch's pinned allocator would round every block up to a power of two);
``"register"`` registers the existing memory in place (its pages, coalesced); ``"off"``
leaves it pageable. Registration runs with the model's device current and clears the CUDA
error state when it fails, then falls back to pageable memory with a warning.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
import warnings
import weakref
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..torch_private import module_buffers
from ..threads import POLL_S, Aborted
from .base import DeviceIO, Done, GradDownload, nbytes

ALIGN = 512
PAGE = 4096
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _clear_cuda_error() -> None:
    """Resets the CUDA runtime's last error after a failed call that torch does not check,
    so the next checked call (e.g. a kernel launch) does not report it. Uses the cudart
    library torch has loaded; does nothing if it cannot be found."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def _register(ptr: int, size: int) -> int:
    """``cudaHostRegister`` of ``[ptr, ptr + size)``; returns the error code (0: success)."""
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        _clear_cuda_error()
    return code


def _unregister(pointers: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for ptr in pointers:
        cudart.cudaHostUnregister(ptr)
    if pointers:
        _clear_cuda_error()  # an already freed range is not an error worth reporting later


class HostArena:
    """Pageable host memory of exactly ``size`` bytes, handed out as typed views."""

    pinned = False

    def __init__(self, size: int) -> None:
        self.size = size
        self.buffer = torch.empty(max(size, 1), dtype=torch.uint8)

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """``like``'s dtype and shape at byte ``offset`` (a multiple of :data:`ALIGN`)."""
        return self.buffer[offset:offset + nbytes(like)].view(like.dtype).view(like.shape)


class PinnedArena(HostArena):
    """Host memory of exactly ``size`` bytes (plus alignment), page-locked with
    ``cudaHostRegister`` while the object lives.

    Raises:
        RuntimeError: registration failed (the CUDA error state is cleared).
    """

    pinned = True

    def __init__(self, size: int, device: torch.device) -> None:
        super().__init__(size)
        with torch.cuda.device(device):
            code = _register(self.buffer.data_ptr(), self.buffer.numel())
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed (error {code})")
        weakref.finalize(self, _unregister, [self.buffer.data_ptr()])


def host_arena(size: int, device: torch.device, pin: bool, what: str) -> HostArena:
    """An arena of ``size`` bytes for ``what``: pinned when ``pin`` (the model's host copy is
    pinned) and registration succeeds, else pageable (copies are then synchronous and
    slower, results the same), with a ``UserWarning`` when pinning failed."""
    if pin:
        try:
            return PinnedArena(size, device)
        except RuntimeError as e:
            warnings.warn(f"RoundPipe: could not pin {what} ({e}); using pageable memory "
                          "(copies are synchronous and slower)", UserWarning, stacklevel=3)
    return HostArena(size)


def _pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor from torch's caching host allocator (small, reused blocks:
    stage outputs, input gradients, losses)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


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
        for name, b in module_buffers(module).items():
            if b is not None:
                buffers.setdefault(id(b), []).append((module, name))
    return params, buffers


PIN_MODES = ("auto", "alloc", "register", "off")  # RoundPipe(pin_memory=...), see above


def pin_host_model(model: nn.Module, mode: str, device: torch.device) -> tuple[str, int]:
    """Puts the host model copy (parameters and buffers) in page-locked memory, so uploads are
    asynchronous DMA copies (see the module docstring for the modes). If pinning fails (e.g.
    the OS limit on locked memory), the model stays pageable and a ``UserWarning`` says so.
    Returns the mode in effect (``"off"`` after a failure) and the bytes pinned."""
    if mode == "off":
        return "off", 0
    params, buffers = _unique_tensors(model)
    tensors = [p.data for p in params] + [module_buffers(h[0][0])[h[0][1]]
                                          for h in buffers.values()]
    todo = [t for t in tensors if t.numel() and not t.is_pinned()]
    try:
        if mode in ("auto", "alloc"):
            offsets, total = [], 0
            for t in todo:
                offsets.append(total)
                total += _align(nbytes(t))
            arena = PinnedArena(total, device)
            views = {}
            with torch.no_grad():
                for t, offset in zip(todo, offsets):
                    views[t.data_ptr(), t.dtype, t.shape] = v = arena.view(offset, t)
                    v.copy_(t)
                for p in params:
                    key = (p.data_ptr(), p.dtype, p.shape)
                    if key in views:
                        p.data = views[key]
                for holders in buffers.values():
                    b = module_buffers(holders[0][0])[holders[0][1]]
                    key = (b.data_ptr(), b.dtype, b.shape)
                    if key in views:
                        for module, name in holders:
                            module_buffers(module)[name] = views[key]
            _keep_alive(model, arena)
            return "alloc", arena.size
        ranges = _page_ranges(todo)
        registered = []
        with torch.cuda.device(device):
            for start, end in ranges:
                code = _register(start, end - start)
                if code == _ALREADY_REGISTERED:
                    continue
                if code != 0:
                    _unregister(registered)
                    raise RuntimeError(f"cudaHostRegister failed (error {code})")
                registered.append(start)
        weakref.finalize(model, _unregister, registered)
        return "register", sum(end - start for start, end in ranges)
    except RuntimeError as e:
        warnings.warn(f"RoundPipe: could not pin the host model copy ({e}); using pageable "
                      "memory (uploads are synchronous and slower)", UserWarning, stacklevel=3)
        return "off", 0


def _keep_alive(model: nn.Module, arena: PinnedArena) -> None:
    """The arena stays registered as long as the model (its tensors are views into it)."""
    arenas = model.__dict__.setdefault("_roundpipe_pinned_arenas", [])
    arenas.append(arena)


def _page_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The pages the tensors' memory covers, as disjoint ``[start, end)`` byte ranges."""
    spans = sorted((t.data_ptr() // PAGE * PAGE, _align(t.data_ptr() + nbytes(t), PAGE))
                   for t in tensors)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


class HostWrites:
    """Device-to-host copies into the host model copy (changed buffers) still in flight:
    later uploads of those host tensors, on any device, wait for them on the device, and the
    end of a pass waits for them on the host. Shared by the devices of one RoundPipe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[int, tuple[torch.Tensor, Any]] = {}

    def add(self, host: torch.Tensor, event: Any) -> None:
        with self._lock:
            self._events[id(host)] = (host, event)

    def pending(self, host: torch.Tensor) -> Any:
        with self._lock:
            item = self._events.get(id(host))
        return item[1] if item is not None and item[0] is host else None

    def wait_all(self) -> None:
        with self._lock:
            items, self._events = list(self._events.values()), {}
        for _, event in items:
            event.synchronize()


_STREAMS: dict[int, tuple] = {}
_STREAMS_LOCK = threading.Lock()


def device_streams(device: torch.device) -> tuple:
    """The ``compute``, ``weights``, ``acts`` and ``down`` streams of CUDA device ``device``,
    made on first use and shared by every RoundPipe of the process. cuBLAS keeps a workspace
    (32 MiB on recent GPUs) per handle and stream it ran on, for the life of the process:
    streams made per RoundPipe left about 70 MB on the device for each one ever built (two
    handles: the caller's thread and autograd's), whereas shared streams reuse the
    workspaces. Work of several RoundPipes on one device is ordered on the same streams."""
    index = torch.device(device).index or 0
    with _STREAMS_LOCK:
        streams = _STREAMS.get(index)
        if streams is None:
            streams = _STREAMS[index] = tuple(torch.cuda.Stream(index) for _ in range(4))
        return streams


class CudaIO(DeviceIO):
    """:class:`roundpipe.transfer.base.DeviceIO` for one CUDA device (see the module docstring).
    Two gradient downloads may wait to be consumed (the two slots of the staging ring), so
    one lands while the optimizer side reads the other.

    Args:
        device: the CUDA device.
        stats: where bytes and seconds are counted.
        prefetch: upload the next stage's weights while the current one computes.
        grad_numels: per stage, the element counts of its trainable parameters (sizes the
            staging ring's two slots for the largest stage's fp32 gradients; a larger download
            later grows them).
        host_writes: the RoundPipe's :class:`HostWrites`.
        pin: the host model copy is pinned (else the staging ring and the KV cache are
            pageable too: ``pin_memory="off"``, or pinning failed).
    """

    grad_downloads_in_flight = 2

    def __init__(self, device: torch.device, stats, prefetch: bool = True,
                 grad_numels: Sequence[Sequence[int]] = (),
                 host_writes: Optional[HostWrites] = None, pin: bool = True) -> None:
        super().__init__(device, stats)
        self.prefetch = prefetch
        self.pin = pin
        self._slot_size = max((sum(_align(4 * n) for n in stage) for stage in grad_numels),
                              default=0)
        self._host_writes = host_writes or HostWrites()
        self._streams = False
        self._ring: Optional[HostArena] = None
        self._free_slots: list[int] = []
        self._slots = threading.Condition()
        self._issued: collections.deque = collections.deque()  # compute events, oldest first
        self._visit_start = None
        self._timings: list[tuple] = []  # (kind, start event, end event, bytes), in order
        self._totals = {"weights_wait_s": 0.0, "upload_s": 0.0}

    def _event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing, blocking=not timing)

    @contextlib.contextmanager
    def activate(self):
        with torch.cuda.device(self.device):
            if not self._streams:
                self.compute, self.weights, self.acts, self.down = device_streams(self.device)
                self._streams = True
            with torch.cuda.stream(self.compute):
                yield

    # --- copies ----------------------------------------------------------------------------------

    def _device_like(self, host: torch.Tensor, parameter: bool) -> torch.Tensor:
        return torch.empty_like(host, device=self.device)

    def _fill(self, dev: torch.Tensor, host: torch.Tensor, parameter: bool) -> None:
        if host.device.type == "cpu":
            pending = self._host_writes.pending(host)
            if pending is not None:
                torch.cuda.current_stream(self.device).wait_event(pending)
        else:  # a caller's CUDA tensor: made on its device's default stream
            torch.cuda.current_stream(self.device).wait_stream(
                torch.cuda.default_stream(host.device))
        with torch.no_grad():
            dev.copy_(host.detach(), non_blocking=True)
        dev.record_stream(self.compute)  # allocated on a copy stream, used by the compute

    def _copy_to_host(self, t: torch.Tensor) -> torch.Tensor:
        # pinned (from torch's caching host allocator) only where the model copy is: with
        # pin_memory="off", or after pinning failed, the copy is synchronous instead
        h = _pinned_empty(t.shape, t.dtype) if self.pin else torch.empty(t.shape, dtype=t.dtype)
        with torch.no_grad():
            h.copy_(t.detach(), non_blocking=True)
        if t.device.type == "cuda":
            t.record_stream(self.down)
        return h

    def _keep_for_compute(self, t: torch.Tensor) -> None:
        t.record_stream(self.compute)  # made on the weights stream, read by the compute

    @contextlib.contextmanager
    def _upload_stream(self):
        done = Done()
        with torch.cuda.stream(self.weights):
            yield done
            done.event = self._event()
            done.event.record(self.weights)

    @contextlib.contextmanager
    def _timed_copies(self, nbytes: int):
        # the events take their times when the weights stream reaches them: with every
        # allocation made before the start, the span is the copies (and the host's issuing of
        # them, microseconds per tensor), not a first cudaMalloc or a compiler run
        start, end = self._event(True), self._event(True)
        start.record(self.weights)
        yield
        end.record(self.weights)
        self._time("upload", start, end, nbytes)

    def wait_weights(self, event: Any) -> None:
        before, after = self._event(True), self._event(True)
        before.record(self.compute)
        self.compute.wait_event(event)
        after.record(self.compute)
        self._time("wait", before, after, 0)

    def to_device(self, tree: Any, event: Any, kind: str) -> Any:
        done = self._event()
        with torch.cuda.stream(self.acts):
            if event is not None:
                self.acts.wait_event(event)
            out = super().to_device(tree, None, kind)
            done.record(self.acts)
        self.compute.wait_event(done)
        return out

    @contextlib.contextmanager
    def _download_stream(self):
        ready, done = self._event(), Done()
        ready.record(self.compute)
        self.down.wait_event(ready)
        with torch.cuda.stream(self.down):
            yield done
            done.event = self._event()
            done.event.record(self.down)

    def host_wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    # --- gradients and buffers ---------------------------------------------------------------------

    def _take_slot(self, size: int, abort: Optional[threading.Event] = None) -> int:
        """A free slot of the staging ring (two slots; at most two downloads are out, see
        :attr:`grad_downloads_in_flight`) of at least ``size`` bytes: the ring is made on
        first use, and made larger (a new plan's larger stage) once both slots are free.

        Raises:
            Aborted: ``abort`` was set while waiting for the other slot to come back.
        """
        with self._slots:
            while self._ring is None or self._slot_size < size:
                if self._ring is None or len(self._free_slots) == 2:
                    if self._ring is not None and self._ring.pinned:
                        self.stats.add("pinned_bytes", -self._ring.size)
                    self._slot_size = max(self._slot_size, size)
                    self._ring = None  # the old one is freed before the new one is made
                    self._ring = host_arena(2 * self._slot_size, self.device, self.pin,
                                            "the gradient staging ring")
                    self._free_slots = [0, self._slot_size]
                    if self._ring.pinned:
                        self.stats.add("pinned_bytes", self._ring.size)
                    break
                if abort is not None and abort.is_set():
                    raise Aborted()
                self._slots.wait(POLL_S)  # the optimizer side releases the slots it consumes
            return self._free_slots.pop()

    def _give_slot(self, slot: int) -> None:
        with self._slots:
            self._free_slots.append(slot)
            self._slots.notify_all()

    def _download_grads(self, sources, norms_sq, abort=None) -> GradDownload:
        slot = self._take_slot(sum(_align(nbytes(g)) for _, g in sources), abort)
        try:
            with self._download_stream() as done:
                norms_host = None if norms_sq is None else self._copy_to_host(norms_sq)
                items, offset = [], slot
                for i, g in sources:
                    view = self._ring.view(offset, g)
                    offset += _align(nbytes(g))
                    view.copy_(g, non_blocking=True)
                    g.record_stream(self.down)
                    items.append((i, view))
        except BaseException:
            self._give_slot(slot)  # nothing was handed out: the slot is free again
            raise

        def release():
            self._give_slot(slot)
            self._grad_permits.release()

        return GradDownload(items, norms_host, done.event, False, release)

    def kv_host_empty(self, shape: tuple, dtype: torch.dtype, keep: list) -> torch.Tensor:
        like = torch.empty(shape, dtype=dtype, device="meta")
        arena = host_arena(nbytes(like), self.device, self.pin, "the KV cache")
        keep.append(arena)
        if arena.pinned:
            self.stats.add("pinned_bytes", arena.size)
            weakref.finalize(arena, self.stats.add, "pinned_bytes", -arena.size)
        return arena.view(0, like)

    def kv_prefetch(self, host: torch.Tensor, after: Any) -> tuple[torch.Tensor, Any]:
        done = self._event()
        with torch.cuda.stream(self.acts):
            if after is not None:
                self.acts.wait_event(after)
            self._moved("h2d", "kv", nbytes(host))
            dev = self._copy_to_device(host)
            done.record(self.acts)
        return dev, done

    def kv_ready(self, event: Any) -> None:
        if event is not None:
            self.compute.wait_event(event)

    def _copy_into_host(self, dev: torch.Tensor, host: torch.Tensor) -> None:
        with torch.no_grad():
            host.copy_(dev, non_blocking=True)
        dev.record_stream(self.down)

    def _write_back_buffers(self, changed) -> None:
        with self._download_stream() as done:
            for host, dev in changed:
                host.copy_(dev, non_blocking=True)
                dev.record_stream(self.down)
        for host, _ in changed:
            self._host_writes.add(host, done.event)

    def finish(self) -> None:
        """The end of a pass: waits until the device has done everything issued (so the call
        returns with every copy from the host model copy complete) and the changed buffers
        are back in the host model copy."""
        if self._streams:
            with torch.cuda.device(self.device):
                for stream in (self.compute, self.down, self.weights, self.acts):
                    event = self._event()
                    event.record(stream)
                    event.synchronize()
        self._issued.clear()
        self._visit_start = None
        self._host_writes.wait_all()

    # --- backpressure --------------------------------------------------------------------------------

    def begin_visit(self) -> None:
        """A new stage visit starts: marks the end of everything issued before it."""
        self._visit_start = self._event()
        self._visit_start.record(self.compute)

    def throttle(self) -> None:
        event = self._event()
        event.record(self.compute)  # the end of the microbatch issued before this one
        self._issued.append(event)
        while len(self._issued) > 1:  # the device is done with the one before that
            self._issued.popleft().synchronize()

    def done_through_previous_visit(self) -> bool:
        return self._visit_start is None or self._visit_start.query()

    # --- timings -------------------------------------------------------------------------------------

    def _time(self, kind: str, start, end, size: int) -> None:
        """Keeps a measurement; completed ones are folded into the totals as they come (a
        non-blocking query), so the list stays short when nobody collects."""
        self._timings.append((kind, start, end, size))
        while len(self._timings) > 64 and self._timings[0][2].query():
            self._fold(self._timings.pop(0))

    def _fold(self, timing: tuple) -> None:
        kind, a, b, _ = timing
        seconds = a.elapsed_time(b) / 1e3
        self._totals["weights_wait_s" if kind == "wait" else "upload_s"] += seconds

    def mark(self) -> Any:
        """A timing event recorded on the compute stream."""
        event = self._event(True)
        event.record(self.compute)
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def collect(self) -> dict[str, float]:
        timings, self._timings = self._timings, []
        for t in timings:
            t[2].synchronize()
            self._fold(t)
        out, self._totals = self._totals, dict.fromkeys(self._totals, 0.0)
        return out
