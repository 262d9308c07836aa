"""python -m roundpipe.bench disk runs end to end in a tiny configuration, with its table and
JSON (its figures are not asserted: a benchmark shows speed, tests/test_disk_state.py holds the
window's bound with counted allocations), and removes its folder; its peak-RSS section runs
once, on the disk (the benchmark takes at least 5 repeats of both)."""

from __future__ import annotations

import json
import subprocess
import sys

from roundpipe.bench.disk import rss_runs


def test_the_disk_benchmark_runs_and_writes_its_json(tmp_path):
    out = tmp_path / "disk.json"
    r = subprocess.run(
        [sys.executable, "-m", "roundpipe.bench", "disk", "--disk-mib", "8", "--hidden", "64",
         "--layers", "2", "--tokens", "8", "--exact-hidden", "64", "--configs", "fp32 AdamW", "int8 state",
         "--skip-rss", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| configuration | step s on disk | in memory |" in r.stdout
    assert "x max(compute, disk)" in r.stdout and "load average" in r.stdout
    result = json.loads(out.read_text())
    assert set(result["step"]) == {"fp32 AdamW", "int8 state"}
    for row in result["step"].values():
        assert row["write_bytes"]["median"] > 0 and row["share_of_disk"]["median"] > 0
    assert result["exact"]["tokens"] == 8
    assert [p.name for p in tmp_path.iterdir()] == ["disk.json"]  # its folders are gone


def test_the_peak_rss_run_on_the_disk(tmp_path):
    """The RSS section's fresh process on the disk, once: the window it reports stays within
    its limit and the whole peak is measured."""
    run, = rss_runs(str(tmp_path), 64, 4, 1, kinds=("disk",))["disk"]
    assert 0 < run["window"] <= run["window_limit"] and run["peak"] > run["window"]
