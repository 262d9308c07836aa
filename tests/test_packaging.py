"""What the package declares matches what is tested: the Python versions in pyproject.toml are the
ones CI runs the suite on."""

from __future__ import annotations

import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The Python versions CI runs this suite on (.ci/run). Add one only together with its CI run.
TESTED = ["3.11"]


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_declared_python_versions_are_the_tested_ones():
    project = _project()
    assert project["requires-python"] == f">={TESTED[0]}"
    declared = {c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}
    assert declared == set(TESTED)
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in TESTED


def test_the_cmake_build_asks_for_the_same_python():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        cmake = f.read()
    assert re.search(rf"find_package\(Python {re.escape(TESTED[0])} REQUIRED", cmake)


def test_roundpipe_optim_imports_without_the_wrapper():
    """The package face is lazy: the optimizers alone load no wrapper, pipeline, Hugging Face
    or checkpoint module (nor torch.distributed.checkpoint), and every public name of the
    package still resolves."""
    import subprocess
    import sys

    code = ("import sys, roundpipe.optim\n"
            "print(sorted(m for m in sys.modules if m.startswith(('roundpipe.', "
            "'torch.distributed.checkpoint'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = eval(out.stdout)  # a printed list of module names
    heavy = [m for m in loaded if m.split(".")[1] in {"wrapper", "pipeline", "hf", "checkpoint",
                                                      "steps", "transfer", "distributed"}
             or m.startswith("torch.distributed.checkpoint")]
    assert not heavy, heavy
    import roundpipe
    for name in roundpipe.__all__:
        assert getattr(roundpipe, name) is not None, name
    assert roundpipe.optim.AdamW is not None and "RoundPipe" in dir(roundpipe)


def _release(version: str) -> tuple:
    """``"2.8"`` and ``"2.8.0"`` alike: the numbers without trailing zeros."""
    parts = [int(p) for p in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _floors() -> dict[str, str]:
    """requirements-floors.txt's pins: name -> version."""
    pins = {}
    with open(os.path.join(ROOT, "requirements-floors.txt")) as f:
        for line in f:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9.]+)", line.split("#")[0].strip())
            if m:
                pins[m.group(1).lower()] = m.group(2)
    return pins


def test_the_floors_job_installs_every_declared_lower_bound():
    """Each lower bound pyproject.toml declares for a package (dependencies and every extra) is
    what requirements-floors.txt pins, and every pinned package has a declared bound: the job
    scripts/test_floors.sh runs tests the declared range's bottom, not another version."""
    project = _project()
    specs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        specs += extra
    bounds: dict[str, set] = {}
    for spec in specs:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", spec)
        low = re.search(r">=\s*([0-9.]+)", m.group(2))
        if low:
            bounds.setdefault(m.group(1).lower(), set()).add(low.group(1))
    pins = _floors()
    for name, lows in bounds.items():
        if name == "pytest":
            continue
        assert len(lows) == 1, f"{name}: different lower bounds {sorted(lows)}"
        (low,) = lows
        pin = pins.get(name)
        assert pin is not None and _release(pin) == _release(low), \
            f"{name}: declared >= {low}, the floors job pins {pin}"
    assert set(pins) <= set(bounds), set(pins) - set(bounds)
    with open(os.path.join(ROOT, "scripts", "test.sh")) as f:
        assert "bash scripts/test_floors.sh" in f.read()
