"""python -m roundpipe.bench runs end to end in a tiny configuration (speed is not asserted:
the benchmark reports ratios measured in one run; CI machines are too noisy to judge them)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_benchmark_runs_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "--algorithms", "Adam", "SGD",
                        "Rprop", "--scale", "0.0004", "--repeats", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "%floor" in r.stdout and "matmul" in r.stdout
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(row["algorithm"], row["layout"]) for row in rows} == {
        (a, layout) for a in ("Adam", "SGD", "Rprop") for layout in ("50M", "200x250k", "20000x1k")}
    for row in rows:
        assert row["bytes_per_element"] == {"Adam": 28, "SGD": 20, "Rprop": 28}[row["algorithm"]]
        assert {"floor", "roundpipe", "torch foreach=False", "torch foreach=True"} <= set(row["ns_per_param"])
        assert all(v > 0 for v in row["ns_per_param"].values())
