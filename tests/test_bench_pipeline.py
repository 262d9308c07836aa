"""python -m roundpipe.bench pipeline runs end to end on CPU worker devices in a tiny
configuration (speed is not asserted), and rejects bad sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_pipeline_benchmark_runs_on_cpu_workers(tmp_path):
    out = tmp_path / "pipeline.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "pipeline", "--devices", "cpu,cpu",
                        "--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "64",
                        "--seq", "8", "--batch", "3", "--iters", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout and "wait optimizer" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [row["mode"] for row in rows] == ["off", "async", "exact", "torch"]
    for row in rows:
        assert row["tokens_per_s"] > 0
        if row["mode"] != "torch":
            assert 0 <= row["wait_weights_pct"] <= 100 and 0 <= row["wait_optimizer_pct"] <= 100
    # the same training as plain PyTorch (fp32 on the CPU; async is one step stale)
    loss = {row["mode"]: row["final_loss"] for row in rows}
    assert loss["off"] == pytest.approx(loss["torch"], rel=1e-4)
    assert loss["exact"] == pytest.approx(loss["torch"], rel=1e-4)


def test_pipeline_benchmark_rejects_bad_sizes():
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "pipeline", "--hidden", "30",
                        "--heads", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "multiple of --heads" in r.stderr
