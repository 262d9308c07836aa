"""The main job (examples/train_qwen3.py) on a tiny configuration: it trains, measures the
validation loss along the way (loss.png's second curve), saves, reloads with plain transformers
and generates; an interrupted run ends with the command that resumes it, and resumed gives the
same losses as the uninterrupted run; an --out holding a checkpoint is never overwritten
silently, and the refusal comes first and short; --lora trains adapters, and warns without
--model; --help imports nothing heavy; a normal run of the demo (LoRA included) and of a
RoundPipeTrainer script with checkpoints prints no warning that is not about the user's own
code (in the user's environment: without the benchmark peers, see requirements-peers.txt)."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import re
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
# the benchmark peers: not in the user's environment (requirements-peers.txt); scripts/test.sh
# puts them on PYTHONPATH for their own tests, the user's runs here go without that entry
PEERS = ("torchao", "bitsandbytes", "deepspeed")


def _users_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ROUNDPIPE_DEMO_LAUNCHER"}
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p and not any(os.path.isdir(os.path.join(p, peer)) for peer in PEERS)]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


ENV = _users_env()


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
    # the refusal first, and short: not under argparse's twenty lines of usage
    lines = proc.stderr.splitlines()
    assert "holds the checkpoint of an earlier run" in lines[0] and len(lines) <= 2, lines
    assert "--resume" in lines[0] and "--overwrite" in lines[0]
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


# what a warning looks like on stderr: Python's warnings module ("...: UserWarning: ..."),
# torch's logging ("W1204 20:27:48.790000 5465 torch/..."), a library's failed load
_WARNING = re.compile(r"\w+Warning: |^[WE]\d{4} \d\d:\d\d:\d\d|Failed to load|No module named")


def warning_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are warnings (progress bars and the demo's own messages,
    which are about the user's arguments, are not)."""
    return [line for line in stderr.replace("\r", "\n").splitlines() if _WARNING.search(line)]


def test_warning_lines_recognises_what_the_first_screen_used_to_show():
    before = (
        "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library\n"
        "W1204 20:27:48.790000 5465 torch/utils/_pytree.py:630] <enum 'KernelPreference'> ...\n"
        "/x/torch/distributed/checkpoint/utils.py:485: UserWarning: torch.distributed is disabled\n"
        "/x/transformers/modeling_utils.py:3312: FutureWarning: `is_gradient_checkpointing` ...\n"
        " 50%|#####     | 3/6 [00:02<00:01,  1.51step/s, loss=8.263]\n")
    assert len(warning_lines(before)) == 4


def _peers_installed() -> list[str]:
    code = "import importlib.util as u; print(' '.join(p for p in %r if u.find_spec(p)))" % (PEERS,)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=ENV)
    return proc.stdout.split()


_TRAINER = r"""
import sys, torch, transformers
from roundpipe.hf import RoundPipeTrainer
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64))
rows = torch.randint(0, 96, (16, 12))
data = [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r} for r in rows]
args = transformers.TrainingArguments(sys.argv[1], per_device_train_batch_size=4, max_steps=4,
                                      save_steps=2, logging_steps=2, report_to="none",
                                      disable_tqdm=True)
trainer = RoundPipeTrainer(model=model, args=args, train_dataset=data,
                           roundpipe_kwargs={"num_microbatch": 2, "device": "cpu"})
trainer.train()
trainer.train(resume_from_checkpoint=sys.argv[1] + "/checkpoint-2")
trainer.save_model(sys.argv[1] + "/final")
"""


def test_a_normal_run_prints_no_warning_about_other_code(tmp_path):
    """The demo with LoRA (peft, training, checkpoint, save_pretrained, generate, reload) and a
    RoundPipeTrainer script (checkpoints saved and resumed, save_model): nothing on stderr but
    progress and the demo's own word on its arguments."""
    peers = _peers_installed()
    if peers:
        pytest.skip(f"{', '.join(peers)} installed in this environment (a setup before "
                    "requirements-peers.txt; bash scripts/setup.sh removes them): transformers "
                    "and peft import them and print their load errors")
    _, proc = run(tmp_path / "demo", "--steps", "2", "--lora", "--lora-r", "2")
    assert warning_lines(proc.stderr) == [], proc.stderr[-3000:]
    proc = start([sys.executable, "-c", _TRAINER, str(tmp_path / "trainer")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert warning_lines(proc.stderr) == [], proc.stderr[-3000:]
