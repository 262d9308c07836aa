"""Pipeline benchmark: trains a configurable transformer with RoundPipe in four modes and
with plain PyTorch, and reports for each tokens/s, the share of device time spent waiting for
weights and for the optimizer, and the bytes moved over their floor:

- ``off``: overlap disabled (``step(opt)`` after each ``forward_backward``, no prefetch);
- ``async``: ``step(opt, is_async=True)`` (one step of staleness, see ``RoundPipe.step``);
- ``exact``: ``forward_backward(optimizer=opt)`` (per-stage steps during the backward pass);
- ``exact+clip``: the same with ``max_grad_norm=1.0``: the step waits for every gradient's
  norm, so it runs after the backward (in the background, each layer released to the next
  call as soon as it is written): how much of exact mode's overlap clipping keeps;
- ``torch``: the reference, plain PyTorch training of the same model, whole, on the first
  device, in the model dtype, with ``torch.optim.AdamW`` (fused on CUDA); "does not fit" when
  the device runs out of memory;
- ``torch+recompute``: the same with RoundPipe's recomputation: every module but the last
  under ``torch.utils.checkpoint`` (non-reentrant, early stop off, so each recomputes its
  whole forward in the backward, as a RoundPipe stage does). RoundPipe's modes are also
  compared with it per round: what the pipeline costs beyond recomputing.

Each mode trains its own model, built and warmed up once; then ``--repeats`` rounds run every
mode for ``--iters`` iterations in turn (rotating who goes first), and every figure is the
median over the rounds with its min-max range. All modes see the same batches, so their final
losses are comparable (async is one step stale).

Threads: the run uses ``--threads`` CPUs (default: all it may use). With W CPU device workers
each worker's torch ops get ``threads // W`` intra-op threads, and the torch reference, which
runs alone, gets all ``threads``: the same CPUs (two workers with two threads each on two cores
would oversubscribe them). The threads a layer actually ran with are recorded in the layers
and printed.

    python -m roundpipe.bench pipeline                                   # defaults
    python -m roundpipe.bench pipeline --devices cpu,cpu --layers 8 --hidden 256 --repeats 7
    python -m roundpipe.bench pipeline --devices cuda:0 --layers 24 --hidden 2048 --seq 1024
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.utils.checkpoint
from torch import nn

import roundpipe.optim as rpo
from roundpipe import OptimizerCtx, RoundPipe

from . import (MIN_REPEATS, Figure, available_cpus, compare, interleave, paired_ratio,
               positive_int, repeats_arg, thread_plan, writable_path)

MODES = ("off", "async", "exact", "exact+clip", "torch", "torch+recompute")


def build_model(layers: int, hidden: int, heads: int, vocab: int, dtype: torch.dtype) -> nn.Sequential:
    """Embedding, ``layers`` pre-norm transformer encoder layers (no dropout), norm, head."""
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0,
                                         batch_first=True, norm_first=True)
              for _ in range(layers)]
    return nn.Sequential(nn.Embedding(vocab, hidden), *blocks, nn.LayerNorm(hidden),
                         nn.Linear(hidden, vocab)).to(dtype)


class _Contender:
    """One line of the table: a model trained in its own way, built and warmed up once, then
    timed ``--iters`` iterations per repeat (:meth:`run`). Every contender sees the same
    batches in the same order, so their losses can be compared at the end."""

    def __init__(self, mode: str, args, devices: list[str], dtype: torch.dtype,
                 intra_op: int) -> None:
        self.mode, self.args, self.devices, self.dtype = mode, args, devices, dtype
        self.intra_op = intra_op
        self.cuda = devices[0].startswith("cuda")
        self.tokens = args.batch * args.seq
        self.batches_seen = 0
        self.threads_seen: set[int] = set()
        self.note = None
        self.reserved_gib = None
        torch.set_num_threads(intra_op)  # a device worker keeps the count of its first use
        if self.cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_reserved(devices[0])
            torch.cuda.reset_peak_memory_stats(devices[0])
        try:
            self._build()
            self.iteration(self._batch())  # warm-up: threads, allocator, optimizer state
            self._sync()
        except torch.cuda.OutOfMemoryError:
            self.note = "does not fit on the device"
            self.__dict__.pop("net", None)
            self.__dict__.pop("opt", None)
            torch.cuda.empty_cache()
            return
        if self.cuda:  # what this contender added at its peak, over the others' memory
            self.reserved_gib = (torch.cuda.max_memory_reserved(devices[0]) - base) / 2**30

    def _build(self) -> None:
        a = self.args
        self.net = build_model(a.layers, a.hidden, a.heads, a.vocab, self.dtype)
        # Records the intra-op threads every layer runs with. Asking also applies torch's
        # count to a device worker thread on its first layer: without that, a thread that has
        # not yet run a torch parallel_for runs the ops that thread through MKL or OpenMP
        # directly (tanh, exp, ...) on all cores, whatever torch.set_num_threads said.
        for layer in self.net:
            layer.register_forward_pre_hook(
                lambda module, inputs: self.threads_seen.add(torch.get_num_threads()))

    def _batch(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + self.batches_seen)
        self.batches_seen += 1
        return torch.randint(self.args.vocab, (self.args.batch, self.args.seq + 1), generator=g)

    def loss_fn(self, logits, target):
        """The mean over the (micro)batch's tokens, as in plain PyTorch (every row has
        ``--seq`` tokens, so RoundPipe's row shares make it the whole batch's mean)."""
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    def run(self) -> dict:
        """One repeat: ``--iters`` timed iterations; returns its measurements."""
        torch.set_num_threads(self.intra_op)
        batches = [self._batch() for _ in range(self.args.iters)]
        start = time.perf_counter()
        losses = [self.iteration(b) for b in batches]
        self._sync()
        seconds = time.perf_counter() - start
        self.final_loss = float(losses[-1])
        return {"seconds": seconds, "tokens_per_s": self.tokens * len(batches) / seconds}


class RoundPipeRun(_Contender):
    """``off``, ``async``, ``exact`` or ``exact+clip`` (see the module docstring)."""

    def _build(self) -> None:
        super()._build()
        a = self.args
        self.model = RoundPipe(self.net, optim_dtype=torch.float32, device=self.devices,
                               layers_per_stage=a.layers_per_stage,
                               num_microbatch=a.microbatches, prefetch=self.mode != "off")
        with OptimizerCtx():
            self.opt = rpo.AdamW(self.model.parameters(), lr=1e-4)

    def iteration(self, b: torch.Tensor):
        kw = dict(input_args=(b[:, :-1],), label=b[:, 1:], loss_fn=self.loss_fn)
        if self.mode == "exact":
            return self.model.forward_backward(**kw, optimizer=self.opt)
        if self.mode == "exact+clip":
            return self.model.forward_backward(**kw, optimizer=self.opt, max_grad_norm=1.0)
        loss = self.model.forward_backward(**kw)
        self.model.step(self.opt, is_async=self.mode == "async")
        return loss

    def _sync(self) -> None:
        self.model.synchronize()

    def run(self) -> dict:
        self.model.pipeline_stats(reset=True)
        row = super().run()
        stats = self.model.pipeline_stats(reset=True)  # may synchronise CUDA: after the timing
        elapsed, workers = row["seconds"], len(self.devices)
        device_total = elapsed * workers
        idle_between = max(0.0, elapsed - stats["wall_s"]) * workers
        row["wait_weights_pct"] = 100 * stats["weights_wait_s"] / device_total
        row["wait_optimizer_pct"] = 100 * (stats["optimizer_wait_s"] + idle_between) / device_total
        row["bytes"] = {k: v for k, v in stats.items() if k.endswith("_bytes")}
        row["weights_vs_floor"] = _ratio(stats["h2d_weight_bytes"], stats["weight_floor_bytes"])
        row["grads_vs_floor"] = _ratio(stats["d2h_param_grad_bytes"], stats["param_grad_floor_bytes"])
        if stats["upload_s"] > 0:
            row["upload_gb_s"] = (stats["h2d_weight_bytes"] + stats["h2d_buffer_bytes"]) \
                / stats["upload_s"] / 1e9
        return row


class TorchRun(_Contender):
    """``torch``: the same model, batches and loss in plain PyTorch on the first device alone,
    in the model dtype, ``torch.optim.AdamW`` (fused on CUDA) over the model's parameters."""

    def _build(self) -> None:
        super()._build()
        self.net = self.net.to(self.devices[0])
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-4,
                                     **({"fused": True} if self.cuda else {}))

    def iteration(self, b: torch.Tensor):
        b = b.to(self.devices[0])
        loss = self.loss_fn(self.net(b[:, :-1]), b[:, 1:])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.devices[0])


class RecomputeRun(TorchRun):
    """``torch+recompute``: :class:`TorchRun` with every module but the last under
    ``torch.utils.checkpoint`` (``use_reentrant=False``, early stop off: each module's whole
    forward runs again in the backward, as RoundPipe recomputes every stage but the last)."""

    def iteration(self, b: torch.Tensor):
        b = b.to(self.devices[0])
        x = b[:, :-1]
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            for module in self.net[:-1]:
                x = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)
            loss = self.loss_fn(self.net[-1](x), b[:, 1:])
            loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


def _ratio(moved: float, floor: float):
    return moved / floor if floor else None


def measure(args, devices: list[str], dtype: torch.dtype, threads: dict) -> list[dict]:
    """Builds every contender of ``args.modes``, runs ``args.repeats`` interleaved rounds and
    returns one row per mode: medians, min-max ranges and every repeat's values."""
    contenders = {}
    for mode in args.modes:
        cls = {"torch": TorchRun, "torch+recompute": RecomputeRun}.get(mode, RoundPipeRun)
        contenders[mode] = cls(mode, args, devices, dtype,
                               threads["torch_reference"] if mode.startswith("torch")
                               else threads["torch_per_worker"])
    runnable = {m: c.run for m, c in contenders.items() if c.note is None}
    results = interleave(runnable, args.repeats)
    rows = []
    for mode, c in contenders.items():
        row = {"mode": mode, "tokens_per_s": None, "wait_weights_pct": None,
               "wait_optimizer_pct": None, "reserved_gib": c.reserved_gib,
               "torch_threads_seen_in_layers": sorted(c.threads_seen)}
        if c.note:
            row["note"] = c.note
            rows.append(row)
            continue
        reps = results[mode]
        row["repeats"] = reps
        row["final_loss"] = c.final_loss
        for key in ("tokens_per_s", "wait_weights_pct", "wait_optimizer_pct", "upload_gb_s"):
            values = [r[key] for r in reps if key in r]
            if values:
                f = Figure.of(values)
                row[key], row[key + "_range"] = f.median, [f.low, f.high]
        for key in ("weights_vs_floor", "grads_vs_floor", "bytes"):  # counts: the same each time
            if key in reps[0]:
                row[key] = reps[-1][key]
        rows.append(row)
    return rows

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


LEGEND = """\
Columns (median over the repeats, each repeat --iters iterations, with the min-max range):
  tokens/s        tokens trained per second of wall time (batch x seq per iteration)
  wait weights    % of device time (wall time x devices) the compute waited for weights: on
                  the CPU the copies themselves, on CUDA measured on the device with events
  wait optimizer  % of device time the devices sat idle between passes (synchronous step,
                  final synchronisation) or a pass waited for a layer's update
  weights/floor   weight bytes moved host to device over their floor (each stage's weights
                  once per forward and once per backward visit); 1.00x: nothing crossed twice
  grads/floor     parameter-gradient bytes moved device to host over their floor (each
                  stage's gradients once per call); byte counts are the same in every repeat
  upload GB/s     (CUDA) weight and buffer bytes uploaded per second of upload time, and its
  % of peak       share of a pinned host-to-device copy's bandwidth measured in this run
  reserved GiB    (CUDA) device memory the contender added at its peak, over what was reserved
                  before it was built (measured in its warm-up iteration)
Ratios ("1.50x the tokens/s of off") are medians of per-repeat ratios (both measured in the
same round) with their range; "within noise" when the range includes 1."""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench pipeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=LEGEND)
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch (default 8)")
    ap.add_argument("--iters", type=int, default=3,
                    help="timed iterations per repeat (default 3); a repeat ends with "
                         "synchronize(), so its last asynchronous or exact-mode update is "
                         "counted in it: more iterations show the steady state")
    ap.add_argument("--repeats", type=repeats_arg, default=MIN_REPEATS,
                    help=f"interleaved rounds, at least {MIN_REPEATS} (default {MIN_REPEATS}): "
                         "every mode runs --iters iterations per round")
    ap.add_argument("--threads", type=positive_int, default=available_cpus(),
                    help="CPUs to use (default: all this process may use, here "
                         f"{available_cpus()}): on CPU devices each of the W device workers "
                         "gets threads // W torch intra-op threads and the torch reference "
                         "all of them; the roundpipe.optim pool gets them all")
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
                    help="also write the results (with every repeat's values) as JSON to this file")
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
    threads = thread_plan(args.threads, len(devices), cuda)
    rpo.set_num_threads(threads["roundpipe_pool"])

    print(f"transformer: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch "
          f"{args.batch}, {dtype}, devices {','.join(devices)}; {args.repeats} interleaved "
          f"repeats of {args.iters} iterations per mode")
    rows = measure(args, devices, dtype, threads)
    print(describe_threads(threads, rows))
    print(LEGEND)
    peak = pinned_copy_peak_gb_s(devices[0]) if cuda else None
    print_table(rows, cuda, peak)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "devices": devices, "dtype": str(dtype),
                       "threads": threads, "pinned_peak_gb_s": peak, "rows": rows}, f, indent=2)


def describe_threads(t: dict, rows: list[dict]) -> str:
    seen = {r["mode"]: r["torch_threads_seen_in_layers"] for r in rows}
    ours = sorted({n for m, s in seen.items() if not m.startswith("torch") for n in s})
    return (f"threads: {t['device_workers']} RoundPipe device worker(s) with "
            f"{t['torch_per_worker']} torch intra-op thread(s) each (seen in the layers: "
            f"{ours or '-'}); the torch reference {t['torch_reference']} (seen: "
            f"{seen.get('torch') or '-'}); roundpipe.optim pool {t['roundpipe_pool']}; "
            f"--threads {t['threads_arg']} of {t['cpus_available']} CPUs available")


def print_table(rows: list[dict], cuda: bool, peak) -> None:
    def fig(r, key, unit="", digits=1):
        if r.get(key) is None:
            return "-"
        return Figure(r[key], *r[key + "_range"]).text(digits, unit)

    def ratio(x):
        return "-" if x is None else f"{x:.2f}x"

    header = (f"{'mode':<16}{'tokens/s (min-max)':>26}{'wait weights':>22}{'wait optimizer':>22}"
              f"{'weights/floor':>15}{'grads/floor':>13}")
    if cuda:
        header += f"{'upload GB/s':>26}{'% of peak':>11}{'reserved GiB':>14}"
    print(header)
    for r in rows:
        line = (f"{r['mode']:<16}{fig(r, 'tokens_per_s'):>26}{fig(r, 'wait_weights_pct', '%'):>22}"
                f"{fig(r, 'wait_optimizer_pct', '%'):>22}{ratio(r.get('weights_vs_floor')):>15}"
                f"{ratio(r.get('grads_vs_floor')):>13}")
        if cuda:
            line += f"{fig(r, 'upload_gb_s', '', 2):>26}"
            line += (f"{100 * r['upload_gb_s'] / peak:>10.1f}%" if r.get("upload_gb_s")
                     else f"{'-':>11}")
            line += (f"{r['reserved_gib']:>14.2f}" if r.get("reserved_gib") is not None
                     else f"{'-':>14}")
        if "note" in r:
            line += f"  ({r['note']})"
        print(line)
    for ref, what in (("off", "the tokens/s of overlap off"),
                      ("torch+recompute", "the tokens/s of torch with the same recomputation")):
        base = next((r for r in rows if r["mode"] == ref and r["tokens_per_s"]), None)
        for r in rows:
            if base and r is not base and r["tokens_per_s"] is not None \
                    and not (ref != "off" and r["mode"].startswith("torch")):
                tps = [x["tokens_per_s"] for x in r["repeats"]]
                print(f"{r['mode']}: " + compare(paired_ratio(tps, [x["tokens_per_s"] for x in
                                                                    base["repeats"]]), what))
    for r in rows:
        if r["tokens_per_s"] is not None:
            lo, hi = r["tokens_per_s_range"]
            if hi > 1.5 * lo:
                print(f"note: {r['mode']}'s tokens/s varied {hi / lo:.1f}x between repeats: "
                      "the machine is busy (or its threads oversubscribed); compare ranges, "
                      "not medians, or run again with more --repeats")
    if cuda:
        print(f"pinned host-to-device copy peak: {peak:.2f} GB/s")
