"""python -m roundpipe.bench overhead runs end to end in a tiny configuration (speed is not
asserted) and reports every contender's ms per call with its range, and the difference to
plain PyTorch measured in the same rounds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_overhead_benchmark_runs(tmp_path):
    out = tmp_path / "overhead.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "overhead", "--sections", "call",
                        "--calls", "3", "--repeats", "5", "--json", str(out)],
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


def test_the_fit_and_the_issue_rate_at_the_geometry(tmp_path):
    """The per-visit fit over (L, M) with every contender, and the issue rate at the 1.82B
    Llama's layer count and plan, in a tiny configuration; the fit recovers a + b*L + c*L*M
    from exact points; the geometry's plan is the planner's for an H200."""
    from roundpipe.bench.overhead import fit_abc, geometry_plan

    a, b, c = fit_abc([(L, M, 0.5 + 2.0 * L + 3.0 * L * M) for L in (2, 5, 9) for M in (1, 4)])
    assert (a, b, c) == pytest.approx((0.5, 2.0, 3.0))
    plan, parameters = geometry_plan(8192, 4)
    assert sum(plan.sizes) == 26 and 1.8e9 < parameters < 1.85e9
    out = tmp_path / "overhead.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "overhead", "--sections", "fit",
                        "geometry", "--repeats", "5", "--fit-layers", "2", "3",
                        "--fit-microbatches", "1", "2", "--fit-calls", "1",
                        "--geometry-microbatches", "2", "--geometry-calls", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "c us (min-max)" in r.stdout and "% of GPU" in r.stdout and "load average" in r.stdout
    result = json.loads(out.read_text())
    rows = {row["contender"]: row for row in result["fit"]["rows"]}
    assert list(rows) == ["plain", "one layer per stage", "planned", "recompute"]
    for row in rows.values():
        for key in ("wall_a_ms", "wall_b_us", "wall_c_us", "cpu_c_us"):
            assert row[key]["min"] <= row[key]["median"] <= row[key]["max"]
    (geo,) = result["geometry"]["rows"]
    assert geo["microbatches"] == 2 and sum(geo["plan"]) == 26
    assert geo["gpu_compute_ms"] == pytest.approx(6 * geo["parameters"] * 8192 / 266e12 * 1e3)
    assert 0 < geo["planned"]["ms"]["median"] and 0 < geo["one layer per stage"]["pct_of_gpu"]["median"]
