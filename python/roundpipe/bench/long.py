"""``python -m roundpipe.bench long``: peak host memory of one training call at long sequences,
RoundPipe on the CPU device against plain transformers, for the batch shapes of issue 46.

Each cell is a fresh process (its peak RSS, ``VmHWM``, is the whole process's: Python, torch
and transformers included) that builds a small Qwen3 (``--layers`` decoder layers, hidden
``--hidden``, 4 query heads on 2 key/value heads of 16, vocabulary 1000), makes one batch of
two rows of ``seq`` tokens and trains on it once:

- ``plain``: no mask, no positions (plain causal);
- ``padded``: an ``attention_mask`` whose second row is right-padded by a quarter;
- ``packed``: two documents per row (``position_ids`` restarting halfway, no mask);

``roundpipe``: ``wrap_model_to_roundpipe(..., device="cpu", num_microbatch=1)`` and one
``forward_backward`` (its attention within segments, :mod:`roundpipe.hf.attention`);
``transformers``: ``model(**batch).loss.backward()`` on ``attn_implementation="sdpa"`` (dense
masks for padded and packed rows). The RoundPipe cells also report ``host_stage_input_bytes``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

SHAPES = ("plain", "padded", "packed")

_SCRIPT = r"""
import sys
import torch
import transformers

shape, seq, which, layers, hidden = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024


torch.manual_seed(0)
model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
    vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16))
ids = torch.randint(0, 1000, (2, seq), generator=torch.Generator().manual_seed(1))
batch = {"input_ids": ids, "labels": ids}
if shape == "padded":
    mask = torch.ones_like(ids)
    mask[1, seq - seq // 4:] = 0
    batch["attention_mask"] = mask
elif shape == "packed":
    batch["position_ids"] = (torch.arange(seq) % (seq // 2)).expand(2, seq)
stage = 0
if which == "roundpipe":
    import roundpipe

    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu", num_microbatch=1)
    w.forward_backward(input_kwargs=batch)
    stage = w.pipeline_stats()["host_stage_input_bytes"]
else:
    model(**batch, use_cache=False).loss.backward()
print(status("VmHWM"), int(stage))
"""


def measure(shape: str, seq: int, which: str, layers: int = 2, hidden: int = 64) -> tuple:
    """``(peak RSS bytes, host stage-input bytes)`` of one fresh process training once (see
    the module docstring); ``which``: ``"roundpipe"`` or ``"transformers"``.

    Raises:
        RuntimeError: the process failed (its error output's end in the message).
    """
    r = subprocess.run([sys.executable, "-c", _SCRIPT, shape, str(seq), which, str(layers),
                        str(hidden)], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{which} {shape} {seq}: {r.stderr[-2000:]}")
    peak, stage = r.stdout.split()[-2:]
    return int(peak), int(stage)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench long", description=__doc__)
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384],
                    help="tokens per row")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--transformers-at", type=int, nargs="*", default=None,
                    help="sequence lengths of the transformers cells (default: the longest)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args(argv)
    hf_at = [max(args.seq)] if args.transformers_at is None else args.transformers_at
    mb = 2 ** 20
    print(f"Qwen3, {args.layers} layers, hidden {args.hidden}, batch 2, one training call; "
          "peak RSS of a fresh process (MiB); RoundPipe: stage inputs held on the host (MiB)")
    print("| sequence | " + " | ".join(args.shapes) + " |")
    print("|---|" + "---:|" * len(args.shapes))
    ours: dict = {}
    for seq in args.seq:
        cells = []
        for shape in args.shapes:
            peak, stage = measure(shape, seq, "roundpipe", args.layers, args.hidden)
            ours[shape, seq] = peak
            cells.append(f"{peak / mb:,.0f} ({stage / mb:,.1f})")
        print(f"| {seq:,} | " + " | ".join(cells) + " |", flush=True)
    for seq in hf_at:
        cells = []
        for shape in args.shapes:
            peak, _ = measure(shape, seq, "transformers", args.layers, args.hidden)
            ratio = f", RoundPipe {ours[shape, seq] / peak:.2f}x" if (shape, seq) in ours else ""
            cells.append(f"{peak / mb:,.0f}{ratio}")
        print(f"| transformers sdpa, {seq:,} | " + " | ".join(cells) + " |", flush=True)
