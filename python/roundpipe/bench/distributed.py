"""Distributed benchmark: ``--nproc`` ranks (gloo on this machine) train the pipeline
benchmark's transformer with RoundPipe, replicated and sharded, in each mode, and each rank also
trains the same model alone on its share of the batch; reported per mode (medians over the
ranks):

- ``step ms``: one iteration (forward_backward + step) with the process group;
- ``alone ms``: the same iteration without it (what the rank computes);
- ``comm ms``: time the optimizer thread spent in collectives per iteration;
- ``hidden``: the share of that communication the iteration did not wait for,
  ``1 - max(0, step - alone) / comm``;
- ``MB/rank``: bytes each rank sends per step by the textbook ring costs — replicated:
  all-reduce of fp32 gradients, ``2 * 4P(N-1)/N``; sharded: reduce-scatter of fp32 gradients
  plus all-gather of the model copy's rows, ``4P(N-1)/N + itemsize * P(N-1)/N``.

On one machine the ranks share its cores, so "alone" is measured under the same load.

    python -m roundpipe.bench distributed --nproc 2
    python -m roundpipe.bench distributed --nproc 3 --layers 8 --hidden 256 --iters 6
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import roundpipe.optim as rpo
from roundpipe import RoundPipe

from . import positive_int, writable_path
from .pipeline import build_model

MODES = ("step", "async", "exact")


def _iteration(model, opt, mode, batch, tokens):
    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten(),
                                                 reduction="sum") / tokens

    kw = dict(input_args=(batch[:, :-1],), label=batch[:, 1:], loss_fn=loss_fn)
    if mode == "exact":
        model.forward_backward(**kw, optimizer=opt)
    else:
        model.forward_backward(**kw)
        model.step(opt, is_async=mode == "async")


def _time(args, mode, group, shard, rank, world) -> tuple[float, float]:
    """Seconds per iteration and collective seconds per iteration (0 without a group)."""
    net = build_model(args.layers, args.hidden, args.heads, args.vocab, torch.float32)
    model = RoundPipe(net, device="cpu", num_microbatch=args.microbatches,
                      process_group=group, shard_optimizer=shard)
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    per_rank = max(1, args.batch // world)
    batches = [torch.randint(args.vocab, (per_rank, args.seq + 1), generator=g)
               for _ in range(args.iters + 1)]
    _iteration(model, opt, mode, batches[0], args.batch * args.seq)
    model.synchronize()
    model.pipeline_stats(reset=True)
    start = time.perf_counter()
    for b in batches[1:]:
        _iteration(model, opt, mode, b, args.batch * args.seq)
    model.synchronize()
    elapsed = (time.perf_counter() - start) / args.iters
    return elapsed, model.pipeline_stats()["comm_s"] / args.iters


def _rank(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    rows = []
    for shard in (False, True):
        for mode in args.modes:
            step, comm = _time(args, mode, dist.group.WORLD, shard, rank, world)
            alone, _ = _time(args, mode, None, False, rank, world)
            rows.append({"mode": mode, "sharded": shard, "step_s": step, "alone_s": alone,
                         "comm_s": comm})
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench distributed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=positive_int, default=2, help="ranks (default 2)")
    ap.add_argument("--layers", type=positive_int, default=4, help="transformer layers (4)")
    ap.add_argument("--hidden", type=positive_int, default=256, help="hidden size (256)")
    ap.add_argument("--heads", type=positive_int, default=4, help="attention heads (4)")
    ap.add_argument("--vocab", type=positive_int, default=512, help="vocabulary (512)")
    ap.add_argument("--seq", type=positive_int, default=64, help="sequence length (64)")
    ap.add_argument("--batch", type=positive_int, default=8, help="global batch (8)")
    ap.add_argument("--microbatches", type=positive_int, default=2, help="per rank (2)")
    ap.add_argument("--iters", type=positive_int, default=4, help="timed iterations (4)")
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                    help="comma-separated of step,async,exact")
    ap.add_argument("--json", type=writable_path, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if args.hidden % args.heads:
        ap.error("--hidden must be a multiple of --heads")
    if any(m not in MODES for m in args.modes):
        ap.error(f"--modes: choose from {','.join(MODES)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/roundpipe-bench-distributed-{os.getpid()}"
    mp.spawn(_rank, args=(args.nproc, port, args, out), nprocs=args.nproc)
    per_rank = [json.load(open(f"{out}.{r}")) for r in range(args.nproc)]
    for r in range(args.nproc):
        os.remove(f"{out}.{r}")
    P = sum(p.numel() for p in build_model(args.layers, args.hidden, args.heads, args.vocab,
                                           torch.float32).parameters())
    N = args.nproc
    print(f"{N} ranks (gloo, this machine), transformer {args.layers}x{args.hidden}, "
          f"{P / 1e6:.2f}M parameters, global batch {args.batch}x{args.seq}, fp32, CPU devices")
    print(f"{'mode':<7}{'sharded':>8}{'step ms':>10}{'alone ms':>10}{'comm ms':>10}"
          f"{'hidden':>8}{'MB/rank':>9}")
    rows = []
    for k, row in enumerate(per_rank[0]):
        med = {key: statistics.median(pr[k][key] for pr in per_rank)
               for key in ("step_s", "alone_s", "comm_s")}
        exposed = max(0.0, med["step_s"] - med["alone_s"])
        hidden = 1 - exposed / med["comm_s"] if med["comm_s"] > 0 else float("nan")
        itemsize = 4  # the benchmark's model copy is fp32
        sent = (2 * 4 * P if not row["sharded"] else 4 * P + itemsize * P) * (N - 1) / N
        rows.append(dict(row, **med, hidden=hidden, mb_per_rank=sent / 1e6))
        print(f"{row['mode']:<7}{str(row['sharded']):>8}{1e3 * med['step_s']:>10.1f}"
              f"{1e3 * med['alone_s']:>10.1f}{1e3 * med['comm_s']:>10.1f}"
              f"{max(0.0, min(1.0, hidden)) * 100:>7.0f}%{sent / 1e6:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=2)
