"""Logic of the CUDA device I/O that needs no GPU (the copies themselves are in
``tests/test_gpu.py``): the gradient staging ring honours a pageable host model copy
(``pin_memory="off"``, or pinning that failed) and grows for a larger stage only once both of
its slots are free, without losing a slot in flight."""

from __future__ import annotations

import threading

import pytest
import torch

import roundpipe.transfer.cuda as ct
from roundpipe.stats import Stats


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
