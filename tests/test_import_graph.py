"""The package's import graph only goes down: read from the source with ``ast`` (every import
statement, module level or inside a function), it has no cycle, and no module imports one of a
higher layer. The layers are defined here, lowest first; the package face
(``roundpipe/__init__.py``, lazy: PEP 562) is outside them, and an import of it (``import
roundpipe``, ``from roundpipe import RoundPipe``) counts as no edge.

A new module must be placed in a layer (the test names it otherwise)."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(ROOT, "python", "roundpipe")
FACE = "roundpipe"

# Lowest first. A module may import modules of its own layer or below. A name covers the module
# and everything under it (a package's modules).
LAYERS = [
    # leaves: the C++ extension and modules that import no other part of roundpipe
    ["roundpipe._C", "roundpipe.host_buffers", "roundpipe.stats", "roundpipe.threads",
     "roundpipe.plan", "roundpipe.context", "roundpipe.guards", "roundpipe.recompute",
     "roundpipe.microbatch", "roundpipe.clipping", "roundpipe.grad_scaler", "roundpipe.quant",
     "roundpipe.torch_private", "roundpipe.known_warnings", "roundpipe.fused_dequant",
     "roundpipe.disk", "roundpipe.exit_gate"],
    ["roundpipe.optim"],                    # the optimizers: usable without the wrapper
    ["roundpipe.transfer"],                 # moving tensors to a device and back
    ["roundpipe.pipeline"],                 # the schedule, stages, passes
    ["roundpipe.param_copies", "roundpipe.distributed", "roundpipe.optimizer_thread",
     "roundpipe.planner", "roundpipe.staging"],  # staging: what the planner is given, measured
    ["roundpipe.steps"],                    # the optimizer side of a call
    ["roundpipe.wrapper"],                  # RoundPipe
    ["roundpipe.checkpoint", "roundpipe.hf"],
    ["roundpipe.bench", "roundpipe.sizing"],  # benchmarks and sizing: use everything
]


def _modules() -> dict[str, tuple[str, bool]]:
    """Module name -> (source path, whether it is a package's ``__init__``)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(PACKAGE_DIR):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = os.path.relpath(dirpath, os.path.dirname(PACKAGE_DIR)).split(os.sep)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            if name == "__init__.py":
                out[".".join(rel)] = (os.path.join(dirpath, name), True)
            else:
                out[".".join(rel + [name[:-3]])] = (os.path.join(dirpath, name), False)
    return out


MODULES = _modules()
KNOWN = set(MODULES) | {"roundpipe._C"}


def _imports(module: str) -> set[str]:
    """The roundpipe modules ``module`` imports (the face excluded)."""
    path, is_package = MODULES[module]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            for a in node.names:  # a submodule by name, else a name of the module
                found.add(f"{target}.{a.name}" if f"{target}.{a.name}" in KNOWN else target)
    return {m for m in found if m in KNOWN and m != FACE and m != module}


GRAPH = {m: _imports(m) for m in MODULES if m != FACE}


def _layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_import_graph.py: place it")


def test_the_graph_is_read():
    # the reading itself: known edges are found (relative, absolute, inside functions)
    assert "roundpipe.threads" in GRAPH["roundpipe.transfer.base"]
    assert "roundpipe._C" in GRAPH["roundpipe.optim._base"]
    assert "roundpipe.optim" in GRAPH["roundpipe.bench.optim"]
    assert "roundpipe.hf.model" in GRAPH["roundpipe.hf.wrap"]
    assert "roundpipe.transfer.cuda" in GRAPH["roundpipe.wrapper"]
    assert len(GRAPH) > 50


def test_every_module_is_in_a_layer():
    unplaced = []
    for m in GRAPH:
        try:
            _layer(m)
        except AssertionError as e:
            unplaced.append(str(e))
    assert not unplaced, unplaced


def test_no_module_imports_a_higher_layer():
    upward = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
              for m, targets in sorted(GRAPH.items()) for t in sorted(targets)
              if _layer(t) > _layer(m)]
    assert not upward, "\n".join(upward)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or [] when there is none."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_the_graph_has_no_cycle():
    cycle = _cycle(GRAPH)
    assert not cycle, " -> ".join(cycle)


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": {"b"}}, ["b", "b"]),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert _cycle(graph) == expected


def test_the_optimizers_import_only_the_extension_and_host_buffers():
    """What ``import roundpipe.optim`` reaches, statically: the optimizers, the C++ extension,
    the host buffers, torch_private (torch's private API, importing only torch; see
    test_packaging for the modules a fresh interpreter loads) and roundpipe.disk (optimizer
    state kept in files: the standard library and torch only)."""
    reached, todo = set(), ["roundpipe.optim"]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(GRAPH.get(m, ()))
    outside = sorted(m for m in reached if not m.startswith("roundpipe.optim")
                     and m not in ("roundpipe._C", "roundpipe.host_buffers",
                                   "roundpipe.torch_private", "roundpipe.exit_gate")
                     and not m.startswith("roundpipe.disk"))
    assert not outside, outside


def test_import_roundpipe_optim_loads_only_the_optimizers():
    """What a fresh interpreter loads for ``import roundpipe.optim``: the package face (with
    its warning filters, known_warnings), the C++ extension, the host buffers, torch_private,
    roundpipe.disk (state kept in files) and the optimizers, nothing else of roundpipe (no
    wrapper, pipeline, Hugging Face or checkpoint module)."""
    import subprocess
    import sys

    code = ("import sys, roundpipe.optim\n"
            "print(sorted(m for m in sys.modules if m.startswith('roundpipe')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = eval(out.stdout)  # a printed list of module names
    assert "roundpipe.optim.adam" in loaded
    others = [m for m in loaded if m not in ("roundpipe", "roundpipe._C", "roundpipe.host_buffers",
                                             "roundpipe.torch_private", "roundpipe.known_warnings",
                                             "roundpipe.exit_gate")
              and not m.startswith(("roundpipe.optim", "roundpipe.disk"))]
    assert not others, others
