"""The main job (examples/train_qwen3.py) on a tiny configuration: it trains, measures the
validation loss along the way (loss.png's second curve), saves, reloads with plain transformers
and generates; an interrupted run ends with the command that resumes it, and resumed gives the
same losses as the uninterrupted run; an --out holding a checkpoint is never overwritten
silently; --lora trains adapters, and warns without --model; --help imports nothing heavy."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_qwen3.py"
TINY = ["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--vocab", "400",
        "--max-chars", "200000", "--seq", "32", "--batch", "4", "--warmup", "2", "--lr", "1e-2",
        "--sample-tokens", "4", "--dtype", "float32"]
ENV = {k: v for k, v in os.environ.items() if k != "ROUNDPIPE_DEMO_LAUNCHER"}


def start(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV)


def run(out: pathlib.Path, *extra: str) -> tuple[dict, subprocess.CompletedProcess]:
    proc = start([sys.executable, str(SCRIPT), *TINY, "--out", str(out), *extra])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text()), proc


def test_resume_continues_exactly_from_the_printed_command(tmp_path):
    full, proc = run(tmp_path / "full", "--steps", "6")
    assert "generate() through the pipeline from" in proc.stdout
    # float32: the pipeline's generate() and plain transformers on the reloaded checkpoint
    # sample the same tokens (the checkpoint is standard, the KV-cached pipeline is exact)
    assert "the same sample, token for token" in proc.stdout
    assert "expected about" in proc.stdout  # the calibration's estimate
    assert (tmp_path / "full" / "model" / "config.json").exists()
    assert (tmp_path / "full" / "model" / "tokenizer.json").exists()
    assert full["history"]["loss"][-1] < full["history"]["loss"][0]
    # loss.png's two curves: the training loss of every step, the validation loss measured
    # before the first step and after the last (here every step: --steps / 10 rounds to 1)
    assert full["history"]["val_step"] == list(range(7))
    assert full["history"]["val_loss"][-1] < full["history"]["val_loss"][0]
    assert (tmp_path / "full" / "loss.png").stat().st_size > 0

    part, proc = run(tmp_path / "part", "--steps", "6", "--stop-after", "3")
    assert len(part["history"]["loss"]) == 3
    assert "generate()" not in proc.stdout  # stopped as an interruption would: no final model
    lines = proc.stdout.splitlines()
    assert "To continue this run exactly" in lines[-2], proc.stdout[-2000:]
    command = shlex.split(lines[-1])
    assert command[-1] == "--resume" and "--stop-after" not in command
    proc = start(command)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    resumed = json.loads((tmp_path / "part" / "metrics.json").read_text())
    assert resumed["history"]["loss"] == full["history"]["loss"]
    assert resumed["history"]["val_step"] == full["history"]["val_step"]
    assert resumed["history"]["val_loss"] == full["history"]["val_loss"]
    assert resumed["sample"] == full["sample"]

    # LoRA fine-tuning of the checkpoint just written, with its own tokenizer: no warning
    lora, proc = run(tmp_path / "lora", "--steps", "2", "--lora", "--lora-r", "2",
                     "--model", str(tmp_path / "full" / "model"))
    assert "--lora without --model" not in proc.stderr
    assert lora["trained_parameters"] < lora["parameters"] / 5
    assert (tmp_path / "lora" / "model" / "adapter_model.safetensors").exists()
    assert (tmp_path / "lora" / "model-merged" / "model.safetensors").exists()


def test_an_earlier_run_is_not_overwritten_silently(tmp_path):
    out = tmp_path / "run"
    first, _ = run(out, "--steps", "2")
    state = out / "checkpoint" / "trainer_state.pt"
    before = state.read_bytes()
    proc = start([sys.executable, str(SCRIPT), *TINY, "--out", str(out), "--steps", "2"])
    assert proc.returncode != 0
    assert "holds the checkpoint of an earlier run" in proc.stderr
    assert "--resume" in proc.stderr and "--overwrite" in proc.stderr
    assert state.read_bytes() == before
    proc = start([sys.executable, str(SCRIPT), *TINY, "--out", str(out), "--steps", "2",
                  "--resume", "--overwrite"])
    assert proc.returncode != 0 and "choose one" in proc.stderr
    again, proc = run(out, "--steps", "2", "--seed", "1", "--overwrite")
    assert "--overwrite: deleted the earlier run" in proc.stdout
    assert again["history"]["loss"] != first["history"]["loss"]  # a new run (another seed)


def test_lora_without_model_warns_that_the_base_is_random(tmp_path):
    _, proc = run(tmp_path / "lora", "--steps", "1", "--lora", "--lora-r", "2")
    assert "--lora without --model" in proc.stderr and "RANDOM weights" in proc.stderr


def test_help_imports_nothing_heavy():
    """--help answers before torch, transformers and roundpipe are imported (they take seconds)."""
    code = ("import runpy, sys\n"
            f"sys.argv = [{str(SCRIPT)!r}, '--help']\n"
            "try:\n"
            "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    assert e.code == 0, e.code\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'roundpipe', 'tqdm', 'numpy')\n"
            "               if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    proc = start([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--overwrite" in proc.stdout and "--resume" in proc.stdout


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 only")
def test_auto_dtype_is_float32_when_torch_is_restricted_to_avx2():
    """As docs/demo.md measures an AVX2-only CPU: torch's kernels restricted to AVX2 emulate bf16,
    so the automatic choice is fp32 whatever this CPU has."""
    code = ("import runpy, torch\n"
            f"ns = runpy.run_path({str(SCRIPT)!r})\n"
            "ns['main'].__globals__['torch'] = torch\n"
            "dtype, why = ns['choose_dtype']('auto', torch.device('cpu'))\n"
            "assert dtype == torch.float32, (dtype, why)\n"
            "print(why)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=dict(ENV, ATEN_CPU_CAPABILITY="avx2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
