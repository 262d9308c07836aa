"""python -m roundpipe.bench pipeline runs end to end on CPU worker devices in a tiny
configuration (speed is not asserted), prints its thread setup, medians and ranges, gives the
torch reference the workers' CPUs, and rejects bad sizes and too few repeats."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq", "8",
        "--batch", "3", "--iters", "1"]


def test_pipeline_benchmark_runs_on_cpu_workers(tmp_path):
    out = tmp_path / "pipeline.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "pipeline", "--devices", "cpu,cpu",
                        *TINY, "--threads", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tokens/s (min-max)" in r.stdout and "wait optimizer" in r.stdout
    # two workers share the two CPUs, the reference gets both, as recorded inside the layers
    assert ("2 RoundPipe device worker(s) with 1 torch intra-op thread(s) each (seen in the "
            "layers: [1]); the torch reference 2 (seen: [2])") in r.stdout
    result = json.loads(out.read_text())
    assert result["threads"]["torch_per_worker"] == 1 and result["threads"]["torch_reference"] == 2
    rows = result["rows"]
    assert [row["mode"] for row in rows] == ["off", "sync", "async", "exact", "exact+clip",
                                             "torch", "torch+recompute"]
    for row in rows:
        assert len(row["repeats"]) == 5
        lo, hi = row["tokens_per_s_range"]
        assert 0 < lo <= row["tokens_per_s"] <= hi
        if not row["mode"].startswith("torch"):
            assert 0 <= row["wait_weights_pct"] <= 100 and 0 <= row["wait_optimizer_pct"] <= 100
            assert row["weights_vs_floor"] == row["grads_vs_floor"] == 1.0
    for mode in ("sync", "async", "exact", "exact+clip", "torch"):
        assert f"{mode}: " in r.stdout and "the tokens/s of overlap off (" in r.stdout
    assert "off: " in r.stdout and "the tokens/s of torch with the same recomputation (" in r.stdout
    assert "sync: " in r.stdout and "the tokens/s of plain torch (no recomputation) (" in r.stdout
    # the CPU device's default: one layer per stage, none recomputing once measured
    assert "sync: stages [1, 1, 1, 1, 1], recomputing none" in r.stdout
    # the same training as plain PyTorch (fp32 on the CPU; async is one step stale)
    loss = {row["mode"]: row["final_loss"] for row in rows}
    assert loss["off"] == pytest.approx(loss["torch"], rel=1e-4)
    assert loss["sync"] == pytest.approx(loss["torch"], rel=1e-4)
    assert loss["exact"] == pytest.approx(loss["torch"], rel=1e-4)
    # recomputation changes no value (no dropout in the model)
    assert loss["torch+recompute"] == pytest.approx(loss["torch"], rel=1e-5)
    # each RoundPipe mode's bound, from the same run's compute, host step and bytes
    for mode in ("off", "sync", "async", "exact"):
        b = result["bounds"][mode]
        assert b["compute_s"] > 0 and b["step_s"] > 0 and b["tokens_per_s"] > 0
        want = 3 * 8 / ((b["compute_s"] + b["step_s"]) if mode in ("off", "sync")
                        else max(b["compute_s"], b["step_s"]))
        assert b["tokens_per_s"] == pytest.approx(want)  # no PCIe on the CPU device
        assert f"{mode}: bound " in r.stdout


def test_llama_against_fsdp2_offload_with_one_model(tmp_path):
    """--model llama --one-model with FSDP2's CPU offload beside it (on the CPU device: FSDP2
    over a one-process gloo group, without the offload itself): every contender trains."""
    pytest.importorskip("transformers")
    out = tmp_path / "llama.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "pipeline", "--model", "llama",
                        "--layers", "2", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
                        "--vocab", "64", "--seq", "8", "--batch", "4", "--iters", "1",
                        "--microbatches", "2", "--devices", "cpu", "--one-model", "--modes",
                        "sync", "exact", "torch+recompute", "fsdp2-offload", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"sync", "exact", "torch+recompute", "fsdp2-offload"}
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    assert rows["sync"]["plan"] == [1, 1, 1, 1]  # the CPU device's default
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "pipeline", "--one-model"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "leave out the mode off" in r.stderr


def test_pipeline_benchmark_rejects_bad_sizes_and_too_few_repeats():
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "pipeline", "--hidden", "30",
                        "--heads", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "multiple of --heads" in r.stderr
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "pipeline", "--repeats", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "at least 5 repeats" in r.stderr


def test_pipeline_help_explains_every_column():
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "pipeline", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for column in ("tokens/s", "wait weights", "wait optimizer", "weights/floor", "grads/floor",
                   "upload GB/s", "% of peak", "reserved GiB", "bound"):
        assert f"\n  {column} " in r.stdout, column
