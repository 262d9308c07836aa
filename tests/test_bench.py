"""python -m roundpipe.bench runs end to end in a tiny configuration (speed is not asserted:
the benchmark reports ratios measured in one run; CI machines are too noisy to judge them),
with its medians, ranges, real sizes and thread setup; and the measuring helpers shared by
the benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from roundpipe.bench import Figure, compare, interleave, paired_ratio

from launcher import child_env


def test_benchmark_runs_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "--algorithms", "Adam", "SGD",
                        "Rprop", "--scale", "0.0004", "--repeats", "5", "--threads", "1",
                        "--peers", "none", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "%floor" in r.stdout and "matmul" in r.stdout
    assert "roundpipe.optim pool 1, torch intra-op 1" in r.stdout      # the thread setup
    assert "B/el        bytes the step must move per element" in r.stdout  # the legend
    result = json.loads(out.read_text())
    assert result["threads"]["torch_intra_op"] == result["threads"]["roundpipe_pool"] == 1
    rows = result["rows"]
    # the real sizes under --scale, not the full-size names
    assert {(row["algorithm"], row["layout"], row["label"]) for row in rows} == {
        (a, layout, label) for a in ("Adam", "SGD", "Rprop")
        for layout, label in (("50M", "20k"), ("200x250k", "250k"), ("20000x1k", "8x1k"))}
    for row in rows:
        assert row["label"] in r.stdout
        assert row["bytes_per_element"] == {"Adam": 28, "SGD": 20, "Rprop": 28}[row["algorithm"]]
        assert {"floor", "roundpipe", "torch foreach=False", "torch foreach=True"} <= set(row["ns_per_param"])
        for k, samples in row["ns_per_param_samples"].items():
            assert len(samples) == 5 and all(v > 0 for v in samples)
            lo, hi = row["ns_per_param_range"][k]
            assert lo == min(samples) <= row["ns_per_param"][k] <= hi == max(samples)
        assert row["speedup"]["min"] <= row["speedup"]["median"] <= row["speedup"]["max"]
    mixed = result["mixed"]
    assert [row["algorithm"] for row in mixed] == ["Adam", "SGD", "Rprop"]
    for row in mixed:
        # bf16 gradient and copy: 2 + 2 bytes instead of a float32 gradient, a conversion
        # (2 + 4) and a copy (4 + 2)
        fp32 = {"Adam": 28, "SGD": 20, "Rprop": 28}[row["algorithm"]]
        assert row["fused_bytes_per_element"] == fp32
        assert row["separate_bytes_per_element"] == fp32 + 12
        assert set(row["ns_per_param"]) == {"floor", "fused", "separate"}
        assert all(v > 0 for v in row["ns_per_param"].values())


def test_adafactor_rows_are_matrices_with_their_floor_and_the_header_names_the_cpu(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "--algorithms", "Adafactor",
                        "--layouts", "200x250k", "--scale", "0.01", "--repeats", "5",
                        "--peers", "none", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["threads"]["cpu"] in r.stdout.splitlines()[0]
    (row,) = result["rows"]
    assert row["bytes_per_element"] == 24  # three passes: 8 + 4 + 12 (roundpipe/adafactor.hpp)
    assert result["mixed"] == []           # not a one-pass step: not in the fused table


def test_header_names_the_machine_and_the_kernels_choices_and_the_layout_gap_is_printed(tmp_path):
    """The CPU's vendor and model, the ISA and the prefetch distance (with how it was chosen) in
    the header and at the end; one tensor against the same elements in several, per algorithm."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "--algorithms", "Adam",
                        "--layouts", "50M", "200x250k", "--scale", "0.01", "--repeats", "5",
                        "--peers", "none", "--mixed-layout", "none", "--clock", "thread",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env=child_env(ROUNDPIPE_PREFETCH="1024"))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    lines = r.stdout.splitlines()
    machine = f"{result['threads']['cpu_vendor']} {result['threads']['cpu']}"
    assert machine in lines[0] and f"ISA {result['isa']}" in lines[0]
    assert "prefetch 1024 B ahead (ROUNDPIPE_PREFETCH)" in lines[0]
    assert result["prefetch"]["bytes"] == 1024
    assert result["clock"] == "thread" and "the calling thread CPU time" in lines[0]
    assert f"kernels' choices on {machine}: ISA {result['isa']}, prefetch 1024 B ahead" in r.stdout
    (gap,) = result["gaps"]
    assert (gap["algorithm"], gap["one"], gap["many"]) == ("Adam", "500k", "2x250k")
    one, many = result["rows"]
    assert gap["time_ratio"] == pytest.approx(
        one["ns_per_param"]["roundpipe"] / many["ns_per_param"]["roundpipe"])
    assert "Adam      one tensor (500k) / 2x250k: " in r.stdout


def test_fewer_than_five_repeats_are_refused():
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "--repeats", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "at least 5 repeats" in r.stderr


def test_thread_clock_needs_one_thread():
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "--clock", "thread",
                        "--threads", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--clock thread needs --threads 1" in r.stderr


def test_help_explains_every_column():
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for column in ("layout", "B/el", "floor ns", "ours ns", "spr", "GB/s", "%floor",
                   "torch best", "speed-up", "separate", "configuration", "peer", "ours faster",
                   "WRONG"):
        assert f"\n  {column} " in r.stdout, column


def test_figures_ratios_and_noise():
    f = Figure.of([3.0, 1.0, 2.0, 10.0, 2.5])
    assert (f.median, f.low, f.high) == (2.5, 1.0, 10.0) and f.spread == pytest.approx(3.6)
    r = paired_ratio([2.0, 4.0, 3.0], [1.0, 2.0, 1.0])   # per round: 2, 2, 3
    assert (r.median, r.low, r.high) == (2.0, 2.0, 3.0)
    assert not compare(r, "x").endswith("within noise")
    assert compare(paired_ratio([1.1, 0.9], [1.0, 1.0]), "x").endswith(": within noise")
    order = []
    out = interleave({k: (lambda k=k: order.append(k) or k) for k in "abc"}, 3)
    assert order == list("abcbcacab") and out == {k: [k] * 3 for k in "abc"}
