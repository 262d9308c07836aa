"""Every optimizer algorithm is registered everywhere it must be. The list starts from the C++
library (``roundpipe._C.algorithms``: the X-macro of roundpipe/algorithms.hpp, each entry with
its C++ class, or the bindings do not compile), so an algorithm added with one registration
missing fails here: its Python class (exported from ``roundpipe.optim``), its case in
tests/optimizer_cases.py (which runs every generic test against torch.optim), its benchmark row
(``roundpipe.bench.optim.ALGORITHMS``), its row in the docs' algorithm table (README.md or a
page under docs/), its float64-reference C++ test and its C++ source in the build."""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch

import roundpipe.optim as rpo
from roundpipe import _C
from roundpipe.bench.optim import ALGORITHMS as BENCH_ROWS
from roundpipe.optim import CpuOptimizer

from optimizer_cases import CASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPP_ALGORITHMS = sorted(_C.algorithms)                  # C++ class name -> function prefix
CLASSES = sorted((getattr(rpo, n) for n in rpo.__all__
                  if isinstance(getattr(rpo, n), type) and issubclass(getattr(rpo, n), CpuOptimizer)
                  and getattr(rpo, n) is not CpuOptimizer), key=lambda c: c.__name__)


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _doc_rows() -> set[str]:
    """The names in the first column of the docs' markdown tables (``| `Name` | ...``)."""
    rows = set()
    for path in ["README.md"] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        rows.update(re.findall(r"^\| `(\w+)` \|", _read(path), re.M))
    return rows


def test_the_lists_are_read():
    assert len(CPP_ALGORITHMS) >= 11 and "ASGD" in CPP_ALGORITHMS
    assert rpo.AdamW in CLASSES and rpo.SGD in CLASSES
    assert {"Adam", "SGD"} <= _doc_rows()


@pytest.mark.parametrize("name", CPP_ALGORITHMS)
def test_every_cpp_algorithm_has_a_python_class(name):
    ours = [c for c in CLASSES if c._algorithm == name]
    assert ours, (f"no roundpipe.optim class has _algorithm = {name!r} (exported in "
                  "roundpipe/optim/__init__.py's __all__)")
    assert getattr(rpo, name, None) in ours, f"roundpipe.optim.{name} is not its class"


@pytest.mark.parametrize("name", CPP_ALGORITHMS)
def test_every_cpp_algorithm_has_its_cpp_test_and_source(name):
    prefix = _C.algorithms[name]
    assert os.path.exists(os.path.join(ROOT, "cpp_tests", f"test_{prefix}.cpp")), \
        f"cpp_tests/test_{prefix}.cpp (against a float64 reference) is missing"
    assert re.search(rf"^\s*test_{prefix}\.cpp$", _read("cpp_tests/CMakeLists.txt"), re.M), \
        f"test_{prefix}.cpp is not in cpp_tests/CMakeLists.txt"
    assert re.search(rf"^\s*cpp/optim/{prefix}\.cpp$", _read("CMakeLists.txt"), re.M)
    assert re.search(rf'^#include "roundpipe/{prefix}\.hpp"$',
                     _read("cpp/include/roundpipe/roundpipe.hpp"), re.M), \
        f"roundpipe/{prefix}.hpp is not in the umbrella header"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_class_is_a_cpp_algorithm_with_a_case_a_benchmark_row_and_a_docs_row(cls):
    name = cls.__name__
    assert cls._algorithm in _C.algorithms, f"{name}._algorithm {cls._algorithm!r} is not in C++"
    assert any(case.ours is cls for case in CASES), \
        f"no Case for roundpipe.optim.{name} in tests/optimizer_cases.py"
    assert BENCH_ROWS.get(name, (None,))[0] is cls, \
        f"no row for {name} in roundpipe.bench.optim.ALGORITHMS"
    assert name in _doc_rows(), f"no | `{name}` | row in the docs' algorithm table"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_option_field_reads_a_key_of_torchs_param_group(cls):
    """The C++ option fields (``<Name>Options.fields``) and the rename map reach keys that the
    torch.optim class of the same name keeps in its param groups (an independent list)."""
    group = getattr(torch.optim, cls.__name__)([torch.nn.Parameter(torch.zeros(2))]).param_groups[0]
    for field, key, index, _ in cls._option_fields:
        assert key in group, f"{cls.__name__}: C++ field {field} reads group[{key!r}]"
        if index is not None:
            assert index < len(group[key]), f"{cls.__name__}: {field} reads {key}[{index}]"


def test_an_unknown_algorithm_is_refused_when_the_class_is_made():
    with pytest.raises(TypeError, match="_algorithm: 'Nope' is not a C\\+\\+ algorithm"):
        type("Nope", (CpuOptimizer,), {"_algorithm": "Nope"})


# options that make the torch class keep every state slot it has
ALL_SLOTS = {"Adam": dict(amsgrad=True), "RMSprop": dict(momentum=0.9, centered=True),
             "SGD": dict(momentum=0.9)}


@pytest.mark.parametrize("name", CPP_ALGORITHMS)
def test_the_exported_state_names_and_int8_signs_are_torchs(name):
    """``roundpipe._C.<Name>State`` (what the Python tables come from) against torch.optim's own
    state after three steps with random gradients: the same keys; a slot stored with the
    unsigned int8 map never holds a negative value, one given the signed map does."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 5)), torch.nn.Parameter(torch.randn(7))]
    ref = getattr(torch.optim, name)(params, **ALL_SLOTS.get(name, {}))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        ref.step()
    state = getattr(_C, f"{name}State")
    keys = set().union(*(ref.state[p].keys() for p in params))
    # SGD's one 0-dim slot is the kernel's momentum-buffer flag, not a state key of torch's
    scalars = set() if name == "SGD" else set(state.scalar_names)
    assert keys == set(state.state_names) | scalars
    if state.int8_signed is None:
        return
    assert len(state.int8_signed) == len(state.state_names)
    for key, is_signed in zip(state.state_names, state.int8_signed):
        values = torch.cat([ref.state[p][key].flatten() for p in params if key in ref.state[p]])
        assert bool((values < 0).any()) == is_signed, f"{name}.{key}: int8_signed {is_signed}"
