"""Logic of the CUDA device I/O that needs no GPU (the copies themselves are in
``tests/test_gpu.py``): the gradient staging ring honours a pageable host model copy
(``pin_memory="off"``, or pinning that failed) and grows for a larger stage only once both of
its slots are free, without losing a slot in flight, nor one whose download failed, and its
waits can be aborted; with a pageable model copy nothing else is pinned either; an upload's
time (the planner's link bandwidth) is its copies alone; generation waits for an upload it
made ahead and did not use before it returns."""

from __future__ import annotations

import threading

import pytest
import torch

import roundpipe.transfer.base as tb
import roundpipe.transfer.cpu as tcpu
import roundpipe.transfer.cuda as ct
from roundpipe.stats import Stats
from roundpipe.threads import Aborted
from roundpipe.transfer import TensorRef


def _io(pin: bool, monkeypatch, grad_numels=((100,),)):
    registered = []
    monkeypatch.setattr(ct, "_register", lambda ptr, size: registered.append(size) or 0)
    monkeypatch.setattr(ct, "_unregister", lambda pointers: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: _Nothing())
    io = ct.CudaIO(torch.device("cuda", 0), Stats(), grad_numels=grad_numels, pin=pin)
    return io, registered


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_pageable_model_gets_a_pageable_ring(monkeypatch):
    io, registered = _io(False, monkeypatch)
    io._take_slot(400)
    assert registered == [] and not io._ring.pinned
    assert io.stats.snapshot()["pinned_bytes"] == 0


def test_a_pinned_model_gets_a_pinned_ring_of_two_slots(monkeypatch):
    io, registered = _io(True, monkeypatch)
    slots = {io._take_slot(400), io._take_slot(400)}
    assert io._ring.pinned and len(registered) == 1
    assert slots == {0, ct._align(400)}  # two slots, each sized for the largest stage
    assert io.stats.snapshot()["pinned_bytes"] == io._ring.size


def test_failed_pinning_of_the_ring_warns_and_stays_pageable(monkeypatch):
    io, _ = _io(True, monkeypatch)
    monkeypatch.setattr(ct, "_register", lambda ptr, size: 2)
    with pytest.warns(UserWarning, match="staging ring.*pageable"):
        io._take_slot(400)
    assert not io._ring.pinned


def test_the_ring_grows_only_once_both_slots_are_free(monkeypatch):
    io, registered = _io(True, monkeypatch)
    first = io._take_slot(400)
    old = io._ring
    got = []
    worker = threading.Thread(target=lambda: got.append(io._take_slot(4000)), daemon=True)
    worker.start()
    worker.join(0.3)
    assert worker.is_alive() and io._ring is old  # one slot still out: no new ring yet
    with io._slots:  # what a download's release does
        io._free_slots.append(first)
        io._slots.notify_all()
    worker.join(10)
    assert not worker.is_alive()
    assert io._ring is not old and io._slot_size >= 4000 and len(registered) == 2
    assert got[0] in (0, io._slot_size) and len(io._free_slots) == 1
    assert io.stats.snapshot()["pinned_bytes"] == io._ring.size  # the old ring's bytes went


def _take_in_thread(io, size, abort=None):
    """``io._take_slot(size)`` on a thread; returns the thread and what it got or raised."""
    got = []

    def take():
        try:
            got.append(io._take_slot(size, abort))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got.append(e)

    worker = threading.Thread(target=take, daemon=True)
    worker.start()
    return worker, got


def test_a_download_that_fails_gives_its_slot_back(monkeypatch):
    """A failure after the slot was taken (a pinned allocation, a device OOM of a copy) must
    not lose the slot: a later ring growth waits for both slots and would wait forever."""
    io, _ = _io(False, monkeypatch)

    def failing():
        raise RuntimeError("injected download failure")

    monkeypatch.setattr(io, "_download_stream", failing)
    with pytest.raises(RuntimeError, match="injected"):
        io._download_grads([(0, torch.ones(100))], None)
    assert sorted(io._free_slots) == [0, io._slot_size]
    worker, got = _take_in_thread(io, 4000)  # a larger stage: the ring grows at once
    worker.join(10)
    assert not worker.is_alive() and isinstance(got[0], int) and io._slot_size >= 4000


def test_waiting_for_a_slot_can_be_aborted(monkeypatch):
    io, _ = _io(False, monkeypatch)
    io._take_slot(400)
    io._take_slot(400)  # both out: a growth must wait for them
    abort = threading.Event()
    worker, got = _take_in_thread(io, 4000, abort)
    worker.join(0.2)
    assert worker.is_alive()
    abort.set()  # another worker failed: the pass is aborted
    worker.join(10)
    assert not worker.is_alive() and isinstance(got[0], Aborted)


@pytest.mark.parametrize("pin", [True, False])
def test_host_copies_are_pinned_only_with_a_pinned_model(monkeypatch, pin):
    """Stage outputs, input gradients, losses and norms go to pinned blocks of torch's host
    allocator only where the model copy is pinned: with ``pin_memory="off"`` (or after
    pinning failed) nothing is pinned, so a machine that cannot pin still trains."""
    io, _ = _io(pin, monkeypatch)
    pinned = []

    def pinned_empty(shape, dtype):
        pinned.append(shape)
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(ct, "_pinned_empty", pinned_empty)
    x = torch.arange(6.0).view(2, 3)  # stands for a device tensor
    h = io._copy_to_host(x)
    assert torch.equal(h, x) and h.data_ptr() != x.data_ptr()
    assert pinned == ([x.shape] if pin else [])


class _Clock:
    """A clock that moves only when told to (what the upload's timing reads)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_upload_time_is_the_copies_alone(monkeypatch):
    """``upload_s`` (from which the planner takes the link's bandwidth) spans an upload's
    copies: not the allocations made before them (a first cudaMalloc), nor the dequantization
    of a quantized base after them (whose first call compiles its kernel: seconds). The
    compute waits for all of it (``weights_wait_s`` on the CPU device). A stubbed clock moves
    1 s per allocation, 0.25 s per copy, 5 s for the dequantization."""
    clock = _Clock()
    monkeypatch.setattr(tcpu.time, "perf_counter", clock)
    io = tcpu.CpuIO(torch.device("cpu"), Stats())
    like, fill = io._device_like, io._fill

    def device_like(host, parameter):
        clock.now += 1.0
        return like(host, parameter)

    def fill_(dev, host, parameter):
        clock.now += 0.25
        fill(dev, host, parameter)

    def dequantize(layers, copies):
        clock.now += 5.0
        return []

    monkeypatch.setattr(io, "_device_like", device_like)
    monkeypatch.setattr(io, "_fill", fill_)
    monkeypatch.setattr(tb, "dequantize_uploaded", dequantize)
    layer = torch.nn.BatchNorm1d(4)
    refs = [TensorRef(name, t, None, name.startswith("running") or name.startswith("num"),
                      sites=((layer._buffers if name in layer._buffers else layer._parameters,
                              name),))
            for name, t in list(layer.named_parameters()) + list(layer.named_buffers())]
    io.upload([refs], with_grad=False)
    stats = io.stats.snapshot()
    assert stats["upload_s"] == 0.25 * len(refs)
    assert stats["weights_wait_s"] == 1.25 * len(refs) + 5.0
