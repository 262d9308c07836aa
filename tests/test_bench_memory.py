"""python -m roundpipe.bench memory runs end to end in a tiny configuration (its figures are
not asserted here: tests/test_memory_ladder.py holds the bytes per parameter to the issue's
bounds at a real size), with its table, JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys


def test_memory_ladder_runs_and_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "ladder.json"
    r = subprocess.run(
        [sys.executable, "-m", "roundpipe.bench", "memory", "--hidden", "64", "--elements",
         "40000", "--repeats", "5", "--conv-steps", "2", "--conv-hidden", "64", "--conv-layers",
         "1", "--conv-chars", "200000", "--configs", "fp32 AdamW", "int8 state",
         "bf16 master + int8 state", "--skip-loading", "--skip-lora", "--out",
         str(tmp_path / "runs"), "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| configuration | floor B/param | measured B/param |" in r.stdout
    result = json.loads(out.read_text())
    assert set(result["memory"]) == {"fp32 AdamW", "int8 state", "bf16 master + int8 state"}
    memory = result["memory"]
    assert 14 <= memory["fp32 AdamW"] and 8 <= memory["int8 state"]
    assert 4 <= memory["bf16 master + int8 state"] < memory["int8 state"]
    for name in ("fp32 AdamW", "int8 state", "bf16 master + int8 state"):
        s = result["speed"][name]
        assert s["ns"]["min"] <= s["ns"]["median"] <= s["ns"]["max"] and s["ns"]["min"] > 0
        conv = result["convergence"][name]
        assert len(conv["history"]["loss"]) == 2 and conv["val_loss_after"] > 0
    assert (tmp_path / "runs" / "memory_ladder.png").stat().st_size > 0


def test_loading_rows_run_and_write_json(tmp_path):
    """The rows of peak RSS while loading through roundpipe.hf.from_pretrained, at a tiny
    size (tests/test_loading.py holds the NF4 peak below half the bf16 size at a real size)."""
    out = tmp_path / "loading.json"
    r = subprocess.run(
        [sys.executable, "-m", "roundpipe.bench", "memory", "--skip-memory", "--skip-speed",
         "--skip-convergence", "--load-layers", "2", "--load-hidden", "128", "--load-kinds",
         "nf4", "bf16", "--skip-lora", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| base | peak RSS increase / bf16 size | after loading / bf16 size |" in r.stdout
    rows = json.loads(out.read_text())["loading"]
    assert set(rows["kinds"]) == {"nf4", "bf16"} and rows["bf16_bytes"] > 0
    for row in rows["kinds"].values():
        assert 0 < row["after"]["median"] and row["peak"]["min"] <= row["peak"]["max"]
