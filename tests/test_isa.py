"""ISA selection from Python and through the ROUNDPIPE_ISA environment variable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import roundpipe.optim as rpo

from launcher import child_env

# A fresh interpreter that trains with ROUNDPIPE_ISA set and checks against torch.optim.Adam.
_CHILD = r"""
import torch, roundpipe.optim as rpo
from conftest import assert_same_training
print(rpo.active_isa())
assert_same_training(rpo.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1))
"""


def _run(isa):
    return subprocess.run([sys.executable, "-c", _CHILD], env=child_env(ROUNDPIPE_ISA=isa),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("isa", rpo.supported_isas())
def test_environment_variable_forces_each_supported_isa(isa):
    r = _run(isa)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == isa


def test_unknown_or_unsupported_isa_is_a_clear_error():
    unsupported = [i for i in ("avx2", "avx512", "neon") if i not in rpo.supported_isas()]
    for isa in ["sse9"] + unsupported:
        r = _run(isa)
        assert r.returncode != 0
        assert "ROUNDPIPE_ISA" in r.stderr and "supported: scalar" in r.stderr, r.stderr


def test_set_isa_and_query():
    before = rpo.active_isa()
    assert before == rpo.supported_isas()[-1] or "ROUNDPIPE_ISA" in os.environ
    with pytest.raises(ValueError, match="unknown ISA"):
        rpo.set_isa("sse9")
    rpo.set_isa("scalar")
    assert rpo.active_isa() == "scalar"
    rpo.set_isa(before)
    assert rpo.active_isa() == before


def test_thread_count():
    before = rpo.num_threads()
    with pytest.raises(ValueError, match=r"n must be in \[1, 1024\]"):
        rpo.set_num_threads(1025)
    with pytest.raises(ValueError, match=r"n must be in \[1, 1024\]"):
        rpo.set_num_threads(0)
    rpo.set_num_threads(1)
    assert rpo.num_threads() == 1
    rpo.set_num_threads(before)
