"""The machine-dependent choices of the kernels (roundpipe/tuning.hpp) change no result: every
software prefetch distance, the calibration by the first large steps, ROUNDPIPE_PREFETCH; and
the page offsets at which roundpipe.optim places a large parameter's float32 state."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import roundpipe.optim as rpo
from roundpipe import _C
from roundpipe.optim.compact import PAGE

from conftest import assert_same_training
from launcher import child_env

# Tensors across chunks (16384 elements), vectors and tails. Every algorithm's kernels are
# checked at every distance in C++ (cpp_tests: PrefetchDistanceDoesNotChangeResults).
SHAPES = [(40_017,), (33, 65), (17,)]
CASES = [
    (rpo.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    (rpo.RMSprop, torch.optim.RMSprop, dict(lr=1e-2, centered=True, momentum=0.9)),
]


@pytest.fixture
def restore_prefetch():
    yield
    rpo.calibrate_prefetch()


@pytest.mark.parametrize("ours,ref,kwargs", CASES, ids=[c[0].__name__ for c in CASES])
def test_every_prefetch_distance_trains_as_torch_with_the_same_bits(ours, ref, kwargs,
                                                                    restore_prefetch):
    results = []
    for bytes_ahead in rpo.prefetch_choice()["candidates"]:
        rpo.set_prefetch_distance(bytes_ahead)
        assert rpo.prefetch_choice()["bytes"] == bytes_ahead
        opt, _ = assert_same_training(ours, ref, kwargs, steps=3, shapes=SHAPES)
        results.append([p.detach().clone() for g in opt.param_groups for p in g["params"]] +
                       [v.clone() for st in opt.state.values() for v in st.values()])
    for bytes_ahead, got in zip(rpo.prefetch_choice()["candidates"][1:], results[1:]):
        for a, b in zip(got, results[0]):  # the same bit patterns
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), \
                f"{bytes_ahead} B ahead vs none"


def test_large_steps_calibrate_and_train_as_torch(restore_prefetch):
    """Steps of at least 2M elements calibrate (rounds that fault pages in, such as the first
    step's over new state, are not counted); training matches torch.optim throughout."""
    rpo.calibrate_prefetch()
    assert rpo.prefetch_choice()["source"] == "default (calibrating)"
    shapes = [(2_100_000,), (1000,)]
    steps = 6
    while True:
        assert_same_training(rpo.AdamW, torch.optim.AdamW, dict(lr=1e-2), steps=steps,
                             shapes=shapes)
        choice = rpo.prefetch_choice()
        if choice["source"] == "calibrated" or steps > 24:
            break
        steps *= 2
    assert choice["source"] == "calibrated", choice
    assert choice["bytes"] in choice["candidates"]
    assert len(choice["relative_time"]) == len(choice["candidates"])
    assert choice["rounds"] >= 8
    assert_same_training(rpo.AdamW, torch.optim.AdamW, dict(lr=1e-2), steps=3, shapes=shapes)


def test_setter_checks_its_argument(restore_prefetch):
    for bad in (100, 16448):
        with pytest.raises(ValueError, match="multiple of 64 bytes"):
            rpo.set_prefetch_distance(bad)
    with pytest.raises(TypeError):
        rpo.set_prefetch_distance(-64)
    rpo.set_prefetch_distance(0)
    assert rpo.prefetch_choice()["source"] == "set_prefetch_distance"


_CHILD = r"""
import torch, roundpipe.optim as rpo
from conftest import assert_same_training
c = rpo.prefetch_choice()
print(c["bytes"], c["source"])
assert_same_training(rpo.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1), steps=3,
                     shapes=[(40_017,), (17,)])
"""


def _child(value: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHILD], env=child_env(ROUNDPIPE_PREFETCH=value),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value", ["0", "4096", "auto"])
def test_environment_variable_sets_the_distance(value):
    r = _child(value)
    assert r.returncode == 0, r.stderr
    want = "2048 default (calibrating)" if value == "auto" else f"{value} ROUNDPIPE_PREFETCH"
    assert r.stdout.splitlines()[0] == want


@pytest.mark.parametrize("value", ["100", "fast"])
def test_a_bad_environment_value_fails_at_import(value):
    r = _child(value)
    assert r.returncode != 0
    assert "ValueError: ROUNDPIPE_PREFETCH: expected 'auto' or a multiple of 64" in r.stderr, \
        r.stderr


def _vm_flags(address: int) -> str | None:
    """The VmFlags line of the mapping holding ``address`` (/proc/self/smaps), or None."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line[len("VmFlags:"):]
    return None


@pytest.mark.parametrize("ours", [rpo.Adam, rpo.Adadelta, rpo.Adagrad])
def test_large_state_sits_at_its_own_page_offsets(ours):
    """A large float32 parameter's state tensors start at page offsets apart from the
    parameter's and from each other's (by a page / (slots + 1)), each in a storage of exactly
    its own bytes, in private memory advised for transparent huge pages."""
    big = torch.nn.Parameter(torch.rand(300_001))
    small = torch.nn.Parameter(torch.rand(17))
    for p in (big, small):
        p.grad = torch.rand_like(p)
    opt = ours([big, small], **({"amsgrad": True} if ours is rpo.Adam else {}))
    opt.step()
    slots = opt.state_keys
    stride = PAGE // (len(slots) + 1) // 64 * 64
    offsets = [big.data_ptr() % PAGE]
    for k, key in enumerate(slots):
        t = opt.state[big][key]
        assert t.is_contiguous() and t.storage_offset() == 0
        assert t.untyped_storage().nbytes() == big.numel() * 4
        assert t.data_ptr() % PAGE == (big.data_ptr() + (k + 1) * stride) % PAGE // 64 * 64
        offsets.append(t.data_ptr() % PAGE)
    assert len(set(offsets)) == len(offsets), offsets
    flags = _vm_flags(opt.state[big][slots[0]].data_ptr())
    if flags is not None:  # Linux: private memory (not shmem), advised for huge pages
        assert "hg" in flags.split() and "sh" not in flags.split(), flags
    # and it trains as torch's own state would: state_dict into torch.optim and back
    ref = getattr(torch.optim, ours.__name__)([torch.nn.Parameter(big.detach().clone()),
                                               torch.nn.Parameter(small.detach().clone())])
    ref.load_state_dict(opt.state_dict())
    for key in slots:
        assert torch.equal(ref.state[ref.param_groups[0]["params"][0]][key], opt.state[big][key])


def test_prefetch_choice_reports_its_fields():
    c = _C.prefetch_choice()
    assert c["candidates"] == [0, 1024, 2048, 4096]
    assert set(c) == {"bytes", "source", "candidates", "relative_time", "ns_per_element",
                      "rounds"}
