"""Peak host memory while loading a checkpoint through :func:`roundpipe.hf.from_pretrained`
(a row of ``python -m roundpipe.bench memory``): a random Llama saved in bf16 safetensors
shards is loaded with LoRA on an NF4, int8 and bf16 (``frozen_dtype=None``) base, each in a
fresh process; the figure is the peak resident size (``VmHWM``, reset just before) minus the
resident size before the load, over the checkpoint's bf16 bytes on disk (what transformers'
own ``from_pretrained`` holds at least). The fixed costs are paid first by loading a tiny
checkpoint (imports, threads, oneDNN), then the allocator's free memory is returned
(``malloc_trim``), so the baseline holds no free memory the load could reuse: the quantizer's
temporaries count in the peak.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from . import Figure

KINDS = ("nf4", "int8", "bf16")

_SCRIPT = r"""
import ctypes, gc, sys
import torch, peft
import roundpipe.hf

path, warm, kind = sys.argv[1:4]

def load(p):
    cfg = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    return roundpipe.hf.from_pretrained(p, frozen_dtype=None if kind == "bf16" else kind,
                                        peft_config=cfg, torch_dtype=torch.bfloat16,
                                        device="cpu")

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

w = load(warm)
del w
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
w = load(path)
print(status("VmHWM") - base, status("VmRSS") - base)
"""


def save_checkpoint(path: pathlib.Path, layers: int, hidden: int, vocab: int = 1000,
                    shard: str = "40MB") -> int:
    """A random Llama (``layers`` decoder layers of width ``hidden``, MLP ``8/3 hidden``,
    grouped-query attention with a third of the heads for keys and values) saved in bf16
    safetensors shards of at most ``shard``; returns the bytes of its safetensors files."""
    import torch
    import transformers

    heads = max(1, hidden // 64)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=8 * hidden // 3 // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 3) if heads % 3 == 0 else heads,
        max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(path, max_shard_size=shard)
    return sum(f.stat().st_size for f in pathlib.Path(path).glob("*.safetensors"))


def measure_load(path: pathlib.Path, warm: pathlib.Path, kind: str) -> tuple[int, int]:
    """``(peak, after)``: bytes of resident-size increase while loading ``path`` with LoRA on a
    ``kind`` base in a fresh process (see the module docstring), and once loaded."""
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), str(warm), kind],
                       capture_output=True, text=True, timeout=1800,
                       env=dict(os.environ, TQDM_DISABLE="1"))
    if r.returncode != 0:
        raise RuntimeError(f"loading run ({kind}) failed:\n{r.stderr[-2000:]}")
    peak, after = r.stdout.split()[-2:]
    return int(peak), int(after)


def measure_loading(workdir: pathlib.Path, layers: int, hidden: int, repeats: int,
                    kinds=KINDS) -> dict:
    """The loading rows: the checkpoint's bf16 bytes and, per kind, the peak and after-load
    increases over them (min/median/max over ``repeats`` fresh processes)."""
    big, warm = workdir / "checkpoint", workdir / "warm-up"
    size = save_checkpoint(big, layers, hidden)
    save_checkpoint(warm, 1, 64, vocab=128)
    out: dict = {"bf16_bytes": size, "layers": layers, "hidden": hidden, "kinds": {}}
    for kind in kinds:
        runs = [measure_load(big, warm, kind) for _ in range(repeats)]
        out["kinds"][kind] = {"peak": Figure.of([p / size for p, _ in runs]).as_dict(),
                              "after": Figure.of([a / size for _, a in runs]).as_dict()}
    return out


def format_loading(result: dict) -> str:
    """The loading rows as a Markdown table."""
    lines = [f"\nloading through roundpipe.hf.from_pretrained (LoRA r=8): a {result['layers']}"
             f"-layer Llama of width {result['hidden']}, {result['bf16_bytes'] / 1e6:.0f} MB "
             "of bf16 safetensors",
             "| base | peak RSS increase / bf16 size | after loading / bf16 size |",
             "|---|---|---|"]
    for kind, row in result["kinds"].items():
        peak, after = Figure.from_dict(row["peak"]), Figure.from_dict(row["after"])
        lines.append(f"| {kind} | {peak.text(2)} | {after.text(2)} |")
    return "\n".join(lines)
