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
