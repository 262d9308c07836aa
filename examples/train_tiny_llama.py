"""The main job: train a small decoder-only transformer (Llama-style blocks: RMSNorm, rotary
attention, SwiGLU) with RoundPipe on real text, byte-level (no tokenizer, no download).

The model copy is bf16 and lives on the host; the optimizer copies are fp32 and are stepped by
roundpipe.optim.AdamW on the CPU; each stage is streamed to the compute device (the GPU when there
is one, else the CPU) for forward and backward, in microbatches, with recomputation.

    python examples/train_tiny_llama.py                  # Python's standard library source
    python examples/train_tiny_llama.py --data notes.txt --steps 500 --dim 384 --layers 6

Writes <out>/loss.png and <out>/metrics.json and prints a sample of generated text.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import roundpipe
import roundpipe.optim
from roundpipe import OptimizerCtx, RoundPipe


# --- data --------------------------------------------------------------------------------------

def load_bytes(path: pathlib.Path, limit: int) -> torch.Tensor:
    """A text file, or every .py/.txt/.md/.rst file under a folder (sorted), as byte ids."""
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.suffix in {".py", ".txt", ".md", ".rst"} and p.is_file())
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    blob = b"\n".join(chunks)[:limit]
    if len(blob) < 1024:
        raise SystemExit(f"--data {path}: only {len(blob)} bytes of text found")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


# --- model ---------------------------------------------------------------------------------------

def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dimension of (batch, heads, seq, head_dim)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = torch.arange(seq, device=x.device, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention with rotary embeddings, SwiGLU MLP."""

    def __init__(self, dim: int, heads: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.dropout(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.dropout(self.down(F.silu(gate) * up))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def tiny_llama(dim: int, layers: int, heads: int, dropout: float, vocab: int = 256) -> nn.Sequential:
    hidden = int(8 * dim / 3) // 64 * 64 or 64
    return nn.Sequential(nn.Embedding(vocab, dim),
                         *[Block(dim, heads, hidden, dropout) for _ in range(layers)],
                         Head(dim, vocab))


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """This microbatch's share of the mean cross-entropy over the whole batch (RoundPipe sums
    the microbatch losses)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / total_tokens


@torch.no_grad()
def generate(model: RoundPipe, prompt: bytes, length: int, context: int, temperature: float,
             gen: torch.Generator) -> bytes:
    ids = list(prompt)
    for _ in range(length):
        x = torch.tensor([ids[-context:]])
        logits = model(x)[0, -1].float() / temperature
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
    return bytes(ids)


def main() -> None:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--data", type=pathlib.Path, default=pathlib.Path(sysconfig.get_paths()["stdlib"]),
                    help="a text file, or a folder whose .py/.txt/.md/.rst files are read "
                         "(default: Python's standard library)")
    ap.add_argument("--max-bytes", type=int, default=20_000_000, help="read at most this much text")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    ap.add_argument("--microbatches", type=int, default=2, help="microbatches per step")
    ap.add_argument("--dim", type=int, default=256, help="model width")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--heads", type=int, default=8, help="attention heads")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay)")
    ap.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                    help="dtype of the model copy (the optimizer copies are float32)")
    ap.add_argument("--device", default=None, help="compute device (default: cuda if available, else cpu)")
    ap.add_argument("--sample-bytes", type=int, default=300, help="length of the generated sample")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/tiny_llama"),
                    help="folder for loss.png and metrics.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name in ("steps", "batch", "seq", "microbatches", "dim", "layers", "heads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")

    torch.manual_seed(args.seed)
    text = load_bytes(args.data, args.max_bytes)
    val_size = max(len(text) // 50, 4 * (args.seq + 1))   # 2%, and enough for a few sequences
    if len(text) - val_size < 4 * (args.seq + 1):
        raise SystemExit(f"--data {args.data}: {len(text)} bytes of text is too little for "
                         f"--seq {args.seq}; need at least {val_size + 4 * (args.seq + 1)}")
    train, val = text[:-val_size], text[-val_size:]
    net = tiny_llama(args.dim, args.layers, args.heads, args.dropout).to(getattr(torch, args.dtype))
    model = RoundPipe(net, optim_dtype=torch.float32, device=args.device, num_microbatch=args.microbatches)
    decay = [p for n, p in model.optim_named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.optim_named_parameters() if p.dim() < 2]
    opt = roundpipe.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=args.lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    n_params = sum(p.numel() for p in model.optim_parameters())
    print(f"{len(text):,} bytes of text from {args.data}; model {n_params / 1e6:.2f}M "
          f"parameters ({args.dtype} model copy, float32 optimizer copy), {args.layers} blocks "
          f"({len(net)} layers with the embedding and the head); "
          f"compute device {model.device}; optimizer ISA {roundpipe.optim.active_isa()} with "
          f"{roundpipe.optim.num_threads()} threads")

    gen = torch.Generator().manual_seed(args.seed)

    def batch(source: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(source) - args.seq - 1, (size,), generator=gen)
        rows = torch.stack([source[i : i + args.seq + 1] for i in idx.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def val_loss() -> float:
        model.eval()
        x, y = batch(val, 32)
        logits = model(x)
        model.train()
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item()

    tokens = args.batch * args.seq
    history = {"step": [], "loss": [], "tokens_per_s": [], "optimizer_ms": []}
    first_val = val_loss()
    bar = tqdm(range(1, args.steps + 1), unit="step", dynamic_ncols=True)
    start = time.perf_counter()
    for step in bar:
        t0 = time.perf_counter()
        x, y = batch(train, args.batch)
        loss = model.forward_backward(input_args=(x,), label=y,
                                      loss_fn=lambda out, tgt: next_byte_loss(out, tgt, tokens))
        t1 = time.perf_counter()
        model.step(lambda: (torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
                            opt.step(), opt.zero_grad()))
        schedule.step()
        t2 = time.perf_counter()
        history["step"].append(step)
        history["loss"].append(loss.item())
        history["tokens_per_s"].append(tokens / (t2 - t0))
        history["optimizer_ms"].append(1e3 * (t2 - t1))
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / (t2 - t0):,.0f}",
                        opt_ms=f"{1e3 * (t2 - t1):.1f}")
    elapsed = time.perf_counter() - start
    last_val = val_loss()

    model.eval()  # no dropout while sampling
    sample = generate(model, b"def ", args.sample_bytes, args.seq, 0.8, gen)
    window = max(1, args.steps // 10)
    metrics = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "parameters": n_params,
        "first_loss": history["loss"][0],
        "final_loss_mean_last_10pct": sum(history["loss"][-window:]) / window,
        "val_loss_before": first_val,
        "val_loss_after": last_val,
        "tokens_per_s": args.steps * tokens / elapsed,
        "optimizer_ms_median": sorted(history["optimizer_ms"])[len(history["optimizer_ms"]) // 2],
        "seconds": elapsed,
        "sample": sample.decode("utf-8", "replace"),
        "history": history,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["step"], history["loss"], lw=1)
    ax.set(xlabel="step", ylabel="training loss (nats/byte)",
           title=f"RoundPipe tiny Llama, {n_params / 1e6:.1f}M params, {args.dtype} + fp32 AdamW")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / "loss.png", dpi=120)

    print(f"\nloss {metrics['first_loss']:.3f} -> {metrics['final_loss_mean_last_10pct']:.3f} "
          f"(mean of the last {window} steps); validation {first_val:.3f} -> {last_val:.3f}")
    print(f"{metrics['tokens_per_s']:,.0f} tokens/s over {elapsed:.0f} s; optimizer step "
          f"{metrics['optimizer_ms_median']:.1f} ms (median)")
    print(f"wrote {args.out / 'loss.png'} and {args.out / 'metrics.json'}")
    print("sample:\n" + "-" * 60 + "\n" + metrics["sample"] + "\n" + "-" * 60)


if __name__ == "__main__":
    main()
