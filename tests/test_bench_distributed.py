"""python -m roundpipe.bench distributed runs end to end with 2 gloo ranks on this machine in a
tiny configuration (speed is not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_distributed_benchmark_runs_with_two_ranks(tmp_path):
    out = tmp_path / "dist.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "distributed", "--nproc", "2",
                        "--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "64",
                        "--seq", "8", "--batch", "4", "--iters", "2", "--modes", "step,exact",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hidden" in r.stdout and "MB/rank" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(row["mode"], row["sharded"]) for row in rows] == [
        ("step", False), ("exact", False), ("step", True), ("exact", True)]
    assert all(row["step_s"] > 0 and row["comm_s"] > 0 for row in rows)
