"""Every ```python block of README.md and of docs/*.md runs as pasted: each in a fresh
interpreter (its own subprocess, in an empty working directory, on the CPU:
CUDA_VISIBLE_DEVICES is emptied), bounded by a timeout, and each must print something (its loss
going down, or what it demonstrates). There is no way to exclude a block: make it complete (a
model, data, ``loss_fn``, small sizes). A block that is a script for ``torchrun`` says so on its
first line, ``# NAME.py, started ... by torchrun ...``: it is saved as NAME.py and started as the
page starts it, by torchrun, with two processes on this machine. A test's id names the page, the
section and the block's first line (``docs/training.md-torch-compile-line113``).

The pages' other blocks are checked elsewhere: the C++ library's (docs/cpp.md: the ```bash
build and install lines, the ```cmake find_package lines and the ```cpp use of
``RoundPipe::optim``) by scripts/test_install.sh, which installs the library into a temporary
prefix and builds and runs examples/cpp against it with nothing but find_package; the README's
quick-start ```bash lines are what CI runs (scripts/test.sh) and tests/test_demo.py covers the
demo; of the torchrun ```bash lines (docs/distributed.md), the one-machine line is what this
test runs (the two-machine line needs two hosts). tests/test_docs.py checks the pages' links.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(page: Path) -> list[tuple[str, str]]:
    """``(id, code)`` of every ```python block of ``page``, the id naming the page (relative to
    the repository), its section and the block's first line."""
    name = page.relative_to(ROOT).as_posix()
    blocks, heading, fence, code, start = [], "top", None, [], 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if fence is None and line.startswith("```"):
            fence, code, start = line[3:].strip(), [], number
        elif fence is not None and line.startswith("```"):
            if fence == "python":
                section = re.sub(r"\W+", "-", heading).strip("-").lower()
                blocks.append((f"{name}-{section}-line{start}", "\n".join(code) + "\n"))
            fence = None
        elif fence is not None:
            code.append(line)
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
    assert fence is None, f"{name}: the block opened on line {start} is not closed"
    return blocks


BLOCKS = [block for page in PAGES for block in python_blocks(page)]


def test_the_pages_have_python_blocks():
    assert len(python_blocks(ROOT / "README.md")) >= 2, "the README's loops are gone"
    assert len(BLOCKS) >= 15, [name for name, _ in BLOCKS]


_TORCHRUN = re.compile(r"# (\w+\.py), started .*torchrun")


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_block_runs_as_pasted(code, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    script = _TORCHRUN.match(code)
    if script:
        (tmp_path / script.group(1)).write_text(code)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", script.group(1)]
    else:
        command = [sys.executable, "-c", code]
    r = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    # a block shows what it did (its loss going down, what it demonstrates): silence proves
    # nothing to the reader who pastes it
    assert r.stdout.strip(), "the block prints nothing: make it show that it trained"
