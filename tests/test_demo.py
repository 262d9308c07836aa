"""The main job (examples/train_qwen3.py) on a tiny configuration: it trains, saves, reloads
with plain transformers and generates; an interrupted run resumed from its checkpoint gives the
same losses as the uninterrupted run; --lora trains adapters."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_qwen3.py"
TINY = ["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--vocab", "400",
        "--max-chars", "200000", "--seq", "32", "--batch", "4", "--warmup", "2", "--lr", "1e-2",
        "--sample-tokens", "4", "--dtype", "float32"]


def run(out: pathlib.Path, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "generate() from 'def '" in proc.stdout
    return json.loads((out / "metrics.json").read_text())


def test_resume_continues_exactly(tmp_path):
    full = run(tmp_path / "full", "--steps", "6")
    assert (tmp_path / "full" / "model" / "config.json").exists()
    assert (tmp_path / "full" / "model" / "tokenizer.json").exists()
    assert full["history"]["loss"][-1] < full["history"]["loss"][0]
    part = run(tmp_path / "part", "--steps", "6", "--stop-after", "3")
    assert len(part["history"]["loss"]) == 3
    resumed = run(tmp_path / "part", "--steps", "6", "--resume")
    assert resumed["history"]["loss"] == full["history"]["loss"]
    # LoRA fine-tuning of the checkpoint just written, with its own tokenizer
    lora = run(tmp_path / "lora", "--steps", "2", "--lora", "--lora-r", "2",
               "--model", str(tmp_path / "full" / "model"))
    assert lora["trained_parameters"] < lora["parameters"] / 5
    assert (tmp_path / "lora" / "model" / "adapter_model.safetensors").exists()
    assert (tmp_path / "lora" / "model-merged" / "model.safetensors").exists()
