"""python -m roundpipe.bench memory's LoRA rows (bf16 / int8 / NF4 frozen base, issue 25 item 4)
run end to end in a tiny configuration, so they cannot rot. The host bytes and upload ratios are
checked against the packed sizes computed here from the formats (not against earlier output);
speeds only for being measured (timings are never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_lora_rows_run_and_report_bytes_uploads_and_speeds(tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "lora.json"
    r = subprocess.run(
        [sys.executable, "-m", "roundpipe.bench", "memory", "--skip-memory", "--skip-speed",
         "--skip-convergence", "--lora-hidden", "64", "--lora-layers", "1", "--lora-seq", "8",
         "--dequant-values", "70000", "--repeats", "5", "--skip-loading", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| base | host B/param (linears; target) |" in r.stdout
    assert "| nf4 | " in r.stdout and "kernel speed-up |" in r.stdout
    lora = json.loads(out.read_text())["lora"]
    rows = lora["rows"]
    assert set(rows) == {"bf16", "int8", "nf4", "nf4-dq"}
    # hidden 64: every projection's weight is a whole number of 64-value blocks
    assert rows["bf16"]["host_bytes_per_param"] == 2.0
    assert rows["int8"]["host_bytes_per_param"] == 1 + 4 / 64
    assert rows["nf4"]["host_bytes_per_param"] == 0.5 + 4 / 64
    assert 0.5 + 1 / 64 < rows["nf4-dq"]["host_bytes_per_param"] < 0.5 + 4 / 64
    # uploads: the bf16 base's bytes less each linear's saving (same steps, same stages)
    bf16 = rows["bf16"]["upload_bytes_per_step"]
    for name in ("int8", "nf4"):
        saved = rows[name]["linear_params"] * (2 - rows[name]["host_bytes_per_param"])
        assert 0 < rows[name]["upload_bytes_per_step"] < bf16
        assert (bf16 - rows[name]["upload_bytes_per_step"]) % saved == 0  # whole uploads
        assert rows[name]["upload_vs_bf16"] == rows[name]["upload_bytes_per_step"] / bf16
    for row in rows.values():
        t = row["tokens_per_s"]
        assert 0 < t["min"] <= t["median"] <= t["max"]
    d = lora["dequant"]
    assert d["values"] == 70000 // 4096 * 4096
    for kind in ("nf4", "int8"):
        for who in ("kernel", "torch"):
            assert d[f"{kind} {who} Gvalues/s"]["min"] > 0


def test_qlora_command_names_its_configurations_and_the_packed_floor(tmp_path):
    """``python -m roundpipe.bench qlora`` (what scripts/gpu_check.sh runs on CUDA) on the CPU
    device, two configurations: per configuration the bf16 and NF4 rows, the NF4 uploads equal
    to their packed floor (each stage's weights once per visit), and the floors differing by
    the linears' packed saving a whole number of times (the same visits)."""
    pytest.importorskip("peft")
    out = tmp_path / "qlora.json"
    r = subprocess.run(
        [sys.executable, "-m", "roundpipe.bench", "qlora", "--device", "cpu", "--hidden", "64",
         "--layers", "1", "--configs", "1x8", "2x8", "--repeats", "5", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| config | base | tokens/s | vs bf16 | upload B/step | packed floor B/step |" in r.stdout
    result = json.loads(out.read_text())
    assert [(c["batch"], c["seq"]) for c in result["configs"]] == [(1, 8), (2, 8)]
    for c in result["configs"]:
        rows = c["rows"]
        assert list(rows) == ["bf16", "nf4"]
        for row in rows.values():
            assert row["upload_bytes_per_step"] == row["weight_floor_bytes_per_step"]
            assert row["upload_vs_floor"] == 1.0
        saved = rows["nf4"]["linear_params"] * (2 - 0.5 - 4 / 64)
        gap = rows["bf16"]["weight_floor_bytes_per_step"] - rows["nf4"]["weight_floor_bytes_per_step"]
        assert gap > 0 and gap % saved == 0
        assert rows["nf4"]["upload_vs_bf16"] == pytest.approx(
            rows["nf4"]["upload_bytes_per_step"] / rows["bf16"]["upload_bytes_per_step"])
    assert "layer" not in result  # the layer's CUDA timings only on CUDA
    bad = subprocess.run([sys.executable, "-m", "roundpipe.bench", "qlora", "--configs", "4by512"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "BATCHxSEQ" in bad.stderr
