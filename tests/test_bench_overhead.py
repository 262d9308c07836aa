"""python -m roundpipe.bench overhead runs end to end in a tiny configuration (speed is not
asserted) and reports every contender's ms per call with its range, and the difference to
plain PyTorch measured in the same rounds."""

from __future__ import annotations

import json
import subprocess
import sys


def test_overhead_benchmark_runs(tmp_path):
    out = tmp_path / "overhead.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "overhead", "--calls", "3",
                        "--repeats", "5", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "threads: torch intra-op 1" in r.stdout and "over torch ms" in r.stdout
    result = json.loads(out.read_text())
    rows = {row["contender"]: row for row in result["rows"]}
    assert list(rows) == ["torch", "M=1", "M=2", "cpu,cpu M=3", "async M=1", "exact M=1"]
    for name, row in rows.items():
        f = row["ms_per_call"]
        assert len(row["samples_ms"]) == 5 and 0 < f["min"] <= f["median"] <= f["max"]
        assert name in r.stdout
        if name != "torch":   # the difference is taken per round, against that round's torch
            diffs = [a - b for a, b in zip(row["samples_ms"], rows["torch"]["samples_ms"])]
            assert row["over_torch_ms"]["min"] == min(diffs)
            assert row["over_torch_ms"]["max"] == max(diffs)
