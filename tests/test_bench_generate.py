"""python -m roundpipe.bench generate runs end to end in a tiny configuration (speed is not
asserted): every contender's tokens/s with its range, the ratio to transformers taken per
round, the tokens equal to transformers', and the bytes per generated token at their floor."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def test_generate_benchmark_runs(tmp_path):
    out = tmp_path / "generate.json"
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "generate", "--layers", "2",
                        "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--vocab", "64",
                        "--prompt", "5", "--new-tokens", "3", "--batch", "1", "4",
                        "--repeats", "5", "--threads", "1", "--frozen-dtype", "nf4",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "x hf" in r.stdout and "W B/tok" in r.stdout
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(row["batch"], row["contender"]) for row in rows] == [
        (b, c) for b in (1, 4)
        for c in ("transformers", "roundpipe host KV", "roundpipe device KV",
                  "roundpipe nf4 host KV")]
    for row in rows:
        f = row["tokens_per_s"]
        assert len(row["samples_s"]) == 5 and 0 < f["min"] <= f["median"] <= f["max"]
        if row["contender"] == "transformers":
            continue
        assert row["same_tokens"] is True
        assert row["steps"] == 3 and row["generated_tokens"] == 3 * row["batch"]
        # every weight once per step, shared by the rows (the NF4 base: its packed bytes)
        assert row["weight_bytes"] == row["weight_floor_bytes"]
        if row["contender"] == "roundpipe nf4 host KV":
            assert 0 < row["weight_bytes"] < 0.9 * result["weight_bytes"] / row["batch"]
            assert row["x_bf16_base"]["min"] > 0
        else:
            assert row["weight_bytes"] == result["weight_bytes"] / row["batch"]
        assert row["kv_bytes"] == row["kv_floor_bytes"]
        assert (row["kv_bytes"] > 0) == row["contender"].endswith("host KV")
        # the bound max(compute, bytes / link): on the CPU no link, so transformers' own rate,
        # round by round, and the ratio to it is the ratio to transformers
        hf = next(x for x in rows if x["batch"] == row["batch"]
                  and x["contender"] == "transformers")
        assert row["link_s"] == 0.0 and result["pinned_peak_gb_s"] is None
        assert row["bound_tokens_per_s"] == hf["tokens_per_s"]
        assert row["x_bound"] == row["x_transformers"]
    assert "bound tok/s" in r.stdout and "x bound" in r.stdout
