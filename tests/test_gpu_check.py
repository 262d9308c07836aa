"""``scripts/gpu_check.sh`` fits the device tool by construction and runs, here, as a dry run.

The device tool runs one command for at most 600 s and returns at most 8 files; a session has
15 minutes of device time in all. So each call of the check (1, 2, 3, plans, long) adds its sections'
time limits and the build up to at most 540 s, and leaves exactly one file under ``$OUT``. With
``SMOKE=1`` every section runs on the CPU at tiny sizes (the scripts, the bench command lines,
the tarball), so a GPU session spends none of its minutes on a typo.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
SECTIONS = ["tests", "capped", "bench8k", "generate", "qlora", "bench64k", "profile", "plans",
            "longseq"]


def _calls() -> dict[str, tuple[list[str], int]]:
    out = subprocess.run(["bash", SCRIPT, "--list"], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    calls = {}
    for line in out.splitlines():
        name, rest = re.match(r"call (\w+):(.*)", line).groups()
        parts = dict(item.split("=") for item in rest.split())
        total = int(parts.pop("total"))
        parts.pop("build")
        calls[name] = (list(parts), total)
    return calls


def test_every_call_fits_one_device_command_and_every_section_is_in_one():
    calls = _calls()
    assert set(calls) == {"1", "2", "3", "plans", "long"}
    for name, (sections, total) in calls.items():
        assert total <= 540, (name, total)            # a command may run 600 s
    assert sorted(s for sections, _ in calls.values() for s in sections) == sorted(SECTIONS)


@pytest.mark.parametrize("section", SECTIONS)
def test_each_section_runs_as_a_dry_run_and_leaves_one_file(section, tmp_path):
    env = dict(os.environ, SMOKE="1", PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               PLANS="auto,1")
    proc = subprocess.run(["bash", SCRIPT, section], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(rf"{section} +exit +0 in", proc.stdout), proc.stdout[-2000:]
    files = os.listdir(tmp_path / "out")
    assert files == [f"gpu_check_{section}.tar.gz"]
    with tarfile.open(tmp_path / "out" / files[0]) as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    assert {f"{section}.txt", "summary.txt"} <= names, names
