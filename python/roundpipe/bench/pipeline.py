"""Pipeline benchmark: trains a configurable transformer with RoundPipe for a few iterations in
three modes and reports, for each, tokens/s and the share of device time spent waiting for
weights and for the optimizer:

- ``off``: overlap disabled (``step(opt)`` after each ``forward_backward``, no prefetch);
- ``async``: ``step(opt, is_async=True)`` (one step of staleness, see ``RoundPipe.step``);
- ``exact``: ``forward_backward(optimizer=opt)`` (per-stage steps during the backward pass);
- ``torch``: the reference, plain PyTorch training of the same model, whole, on the first
  device, in the model dtype, with ``torch.optim.AdamW`` (fused on CUDA); "does not fit" when
  the device runs out of memory.

Device time is the run's wall time times the number of devices. "Waited for weights": weight
uploads the compute waited for (on the CPU the copies themselves; on CUDA measured on the
device with events). "Waited for optimizer": time the devices sat idle between passes (the
synchronous step, the final synchronisation) plus the time passes waited for a layer's update.
"weights/floor" and "grads/floor": weight bytes moved host to device and parameter-gradient
bytes moved device to host, over their floors (each stage's weights once per forward and once
per backward visit; each stage's gradients once per call, see ``roundpipe.stats``): 1.00x
means nothing crossed twice. On CUDA it also reports the achieved upload bandwidth against a
pinned host-to-device copy measured in the same run.

    python -m roundpipe.bench pipeline                                   # defaults
    python -m roundpipe.bench pipeline --devices cpu,cpu --layers 8 --hidden 256 --iters 5
    python -m roundpipe.bench pipeline --devices cuda:0 --layers 24 --hidden 2048 --seq 1024
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from torch import nn

import roundpipe.optim as rpo
from roundpipe import OptimizerCtx, RoundPipe

from . import positive_int, writable_path

MODES = ("off", "async", "exact", "torch")


def build_model(layers: int, hidden: int, heads: int, vocab: int, dtype: torch.dtype) -> nn.Sequential:
    """Embedding, ``layers`` pre-norm transformer encoder layers (no dropout), norm, head."""
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0,
                                         batch_first=True, norm_first=True)
              for _ in range(layers)]
    return nn.Sequential(nn.Embedding(vocab, hidden), *blocks, nn.LayerNorm(hidden),
                         nn.Linear(hidden, vocab)).to(dtype)


def run_mode(mode: str, args, devices: list[str], dtype: torch.dtype) -> dict:
    """Trains ``args.iters`` timed iterations (after one warm-up) in ``mode``; returns a row."""
    net = build_model(args.layers, args.hidden, args.heads, args.vocab, dtype)
    model = RoundPipe(net, optim_dtype=torch.float32, device=devices,
                      layers_per_stage=args.layers_per_stage, num_microbatch=args.microbatches,
                      prefetch=mode != "off")
    with OptimizerCtx():
        opt = rpo.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g)
               for _ in range(args.iters + 1)]
    tokens = args.batch * args.seq

    def loss_fn(logits, target):
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten(),
                                           reduction="sum") / tokens

    def iteration(b):
        kw = dict(input_args=(b[:, :-1],), label=b[:, 1:], loss_fn=loss_fn)
        if mode == "exact":
            return model.forward_backward(**kw, optimizer=opt)
        loss = model.forward_backward(**kw)
        model.step(opt, is_async=mode == "async")
        return loss

    iteration(batches[0])  # warm-up: threads, allocator, optimizer state
    model.synchronize()
    model.pipeline_stats(reset=True)
    start = time.perf_counter()
    losses = [iteration(b) for b in batches[1:]]
    model.synchronize()
    elapsed = time.perf_counter() - start
    stats = model.pipeline_stats()
    device_total = elapsed * len(devices)
    idle_between = max(0.0, elapsed - stats["wall_s"]) * len(devices)
    row = {
        "mode": mode,
        "tokens_per_s": tokens * args.iters / elapsed,
        "seconds": elapsed,
        "wait_weights_pct": 100 * stats["weights_wait_s"] / device_total,
        "wait_optimizer_pct": 100 * (stats["optimizer_wait_s"] + idle_between) / device_total,
        "final_loss": float(losses[-1]),
    }
    row["bytes"] = {k: v for k, v in stats.items() if k.endswith("_bytes")}
    row["weights_vs_floor"] = _ratio(stats["h2d_weight_bytes"], stats["weight_floor_bytes"])
    row["grads_vs_floor"] = _ratio(stats["d2h_param_grad_bytes"], stats["param_grad_floor_bytes"])
    if stats["upload_s"] > 0:
        row["upload_gb_s"] = (stats["h2d_weight_bytes"] + stats["h2d_buffer_bytes"]) \
            / stats["upload_s"] / 1e9
    return row


def _ratio(moved: float, floor: float):
    return moved / floor if floor else None


def run_torch(args, device: str, dtype: torch.dtype) -> dict:
    """Plain PyTorch: the same model, batches and loss on ``device`` alone, ``torch.optim.AdamW``
    (fused on CUDA) over the model's own parameters in ``dtype``."""
    row = {"mode": "torch", "wait_weights_pct": None, "wait_optimizer_pct": None}
    try:
        net = build_model(args.layers, args.hidden, args.heads, args.vocab, dtype).to(device)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4,
                                **({"fused": True} if device.startswith("cuda") else {}))
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g)
                   for _ in range(args.iters + 1)]
        tokens = args.batch * args.seq

        def iteration(b):
            b = b.to(device)
            logits = net(b[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten(),
                                               reduction="sum") / tokens
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        def sync():
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)

        iteration(batches[0])
        sync()
        start = time.perf_counter()
        losses = [iteration(b) for b in batches[1:]]
        sync()
        elapsed = time.perf_counter() - start
        row.update(tokens_per_s=tokens * args.iters / elapsed, seconds=elapsed,
                   final_loss=float(losses[-1]))
    except torch.cuda.OutOfMemoryError:
        row.update(tokens_per_s=None, note="does not fit on the device")
        torch.cuda.empty_cache()
    return row


def pinned_copy_peak_gb_s(device: str, megabytes: int = 256, repeats: int = 5) -> float:
    """Host-to-device bandwidth of a pinned copy of ``megabytes`` MB (best of ``repeats``)."""
    host = torch.empty(megabytes << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    best = 0.0
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, host.numel() / (start.elapsed_time(end) / 1e3) / 1e9)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench pipeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch (default 8)")
    ap.add_argument("--iters", type=int, default=4, help="timed iterations (default 4)")
    ap.add_argument("--microbatches", type=positive_int, default=None,
                    help="microbatches per batch (default: devices + 1)")
    ap.add_argument("--layers-per-stage", type=int, default=1, help="default 1")
    ap.add_argument("--devices", default=None,
                    help="comma-separated compute devices, e.g. cpu,cpu or cuda:0,cuda:1 "
                         "(default: cuda:0 if available, else cpu,cpu)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="model dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--json", type=writable_path,
                    help="also write the results as JSON to this file")
    args = ap.parse_args(argv)
    for name in ("layers", "hidden", "heads", "vocab", "seq", "batch", "iters", "layers_per_stage"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.heads:
        ap.error("--hidden must be a multiple of --heads")
    devices = (args.devices.split(",") if args.devices
               else ["cuda:0"] if torch.cuda.is_available() else ["cpu", "cpu"])
    for d in devices:
        try:
            device = torch.device(d)
        except (RuntimeError, ValueError):
            ap.error(f"--devices: {d!r} is not a device")
        if device.type not in ("cpu", "cuda"):
            ap.error(f"--devices: {d!r}: only cpu and cuda devices are supported")
        if device.type == "cuda" and not (torch.cuda.is_available()
                                          and (device.index or 0) < torch.cuda.device_count()):
            ap.error(f"--devices: {d!r} is not available on this machine")
    if len({torch.device(d).type for d in devices}) > 1:
        ap.error("--devices: CPU and CUDA devices cannot be mixed")
    cuda = devices[0].startswith("cuda")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)

    print(f"transformer: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch "
          f"{args.batch}, {args.iters} iterations, {dtype}, devices {','.join(devices)}")
    rows = [run_torch(args, devices[0], dtype) if mode == "torch"
            else run_mode(mode, args, devices, dtype) for mode in args.modes]
    peak = pinned_copy_peak_gb_s(devices[0]) if cuda else None
    header = (f"{'mode':<7}{'tokens/s':>12}{'wait weights':>14}{'wait optimizer':>16}"
              f"{'weights/floor':>15}{'grads/floor':>13}")
    if cuda:
        header += f"{'upload GB/s':>13}{'% of peak':>11}"
    print(header)
    def pct(x, width: int) -> str:
        return f"{'-':>{width + 1}}" if x is None else f"{x:>{width}.1f}%"

    def ratio(x, width: int) -> str:
        return f"{'-':>{width}}" if x is None else f"{x:>{width - 1}.2f}x"

    for r in rows:
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"
        line = (f"{r['mode']:<7}{tps:>12}{pct(r['wait_weights_pct'], 13)}"
                f"{pct(r['wait_optimizer_pct'], 15)}{ratio(r.get('weights_vs_floor'), 15)}"
                f"{ratio(r.get('grads_vs_floor'), 13)}")
        if "note" in r:
            line += f"  ({r['note']})"
        if cuda and "upload_gb_s" in r:
            line += f"{r['upload_gb_s']:>13.2f}{100 * r['upload_gb_s'] / peak:>10.1f}%"
        print(line)
    off = next((r for r in rows if r["mode"] == "off"), None)
    if off:
        for r in rows:
            if r is not off and r["tokens_per_s"] is not None:
                print(f"{r['mode']}: {r['tokens_per_s'] / off['tokens_per_s']:.2f}x the tokens/s "
                      "of overlap off")
    if cuda:
        print(f"pinned host-to-device copy peak: {peak:.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "devices": devices, "dtype": str(dtype),
                       "pinned_peak_gb_s": peak, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
