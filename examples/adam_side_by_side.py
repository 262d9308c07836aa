"""Train the same small byte-level language model twice, with roundpipe.optim.Adam and with
torch.optim.Adam, on the source text of Python's standard library, and show that both loss
curves agree while the RoundPipe optimizer step is faster.

    python examples/adam_side_by_side.py --steps 300
"""

from __future__ import annotations

import argparse
import pathlib
import sysconfig
import time

import torch
from tqdm import tqdm

import roundpipe.optim


def load_text(root: pathlib.Path, limit: int) -> torch.Tensor:
    """Bytes of the .py files under root, up to `limit` bytes, as a uint8 tensor."""
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class ByteMLP(torch.nn.Module):
    """Predicts the next byte from the previous `context` bytes."""

    def __init__(self, context: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(context * dim, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.embed(x).flatten(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=pathlib.Path, default=pathlib.Path(sysconfig.get_paths()["stdlib"]),
                    help="folder of .py files to train on (default: Python's standard library)")
    ap.add_argument("--bytes", type=int, default=4_000_000, help="how much text to read")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    text = load_text(args.data, args.bytes)
    torch.manual_seed(args.seed)
    models = {"roundpipe": ByteMLP(args.context, args.dim, args.hidden)}
    models["torch"] = ByteMLP(args.context, args.dim, args.hidden)
    models["torch"].load_state_dict(models["roundpipe"].state_dict())
    optims = {
        "roundpipe": roundpipe.optim.Adam(models["roundpipe"].parameters(), lr=args.lr),
        "torch": torch.optim.Adam(models["torch"].parameters(), lr=args.lr),
    }
    n_params = sum(p.numel() for p in models["torch"].parameters())
    print(f"{len(text) / 1e6:.1f} MB of text from {args.data}; model {n_params / 1e6:.2f}M "
          f"parameters; RoundPipe ISA {roundpipe.optim.active_isa()}, "
          f"{roundpipe.optim.num_threads()} threads")

    gen = torch.Generator().manual_seed(args.seed)
    step_time = {k: 0.0 for k in models}
    losses = {k: [] for k in models}
    bar = tqdm(range(1, args.steps + 1), unit="step")
    for step in bar:
        idx = torch.randint(0, len(text) - args.context - 1, (args.batch,), generator=gen)
        x = torch.stack([text[i : i + args.context] for i in idx.tolist()])
        y = text[idx + args.context]
        for name, model in models.items():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optims[name].zero_grad()
            loss.backward()
            t0 = time.perf_counter()
            optims[name].step()
            step_time[name] += time.perf_counter() - t0
            losses[name].append(loss.item())
        bar.set_postfix(roundpipe=f"{losses['roundpipe'][-1]:.3f}", torch=f"{losses['torch'][-1]:.3f}")
        if step % max(1, args.steps // 10) == 0 or step == 1:
            tqdm.write(f"step {step:5d}  loss roundpipe {losses['roundpipe'][-1]:.4f}  "
                       f"torch {losses['torch'][-1]:.4f}")

    window = max(1, args.steps // 10)
    mean = {k: sum(v[-window:]) / window for k, v in losses.items()}
    print(f"\nfirst loss {losses['torch'][0]:.4f}; mean of the last {window} steps: "
          f"roundpipe {mean['roundpipe']:.4f}, torch {mean['torch']:.4f}")
    for name in models:
        print(f"optimizer step time {name:9s}: {1e3 * step_time[name] / args.steps:7.3f} ms/step")
    print(f"speed-up of the optimizer step: {step_time['torch'] / step_time['roundpipe']:.2f}x")


if __name__ == "__main__":
    main()
