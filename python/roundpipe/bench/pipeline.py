"""Pipeline benchmark: trains a configurable transformer with RoundPipe in several modes and
with plain PyTorch, and reports for each tokens/s, the share of device time spent waiting for
weights and for the optimizer, the bytes moved over their floor, and what bounds each mode:

- ``off``: overlap disabled (``step(opt)`` after each ``forward_backward``, no prefetch);
- ``sync``: ``step(opt)`` after each ``forward_backward`` with the next stage's weights
  prefetched (what a plain loop over RoundPipe does by default);
- ``async``: ``step(opt, is_async=True)`` (one step of staleness, see ``RoundPipe.step``);
- ``exact``: ``forward_backward(optimizer=opt)`` (per-stage steps during the backward pass);
- ``exact+clip``: the same with ``max_grad_norm=1.0``: the step waits for every gradient's
  norm, so it runs after the backward (in the background, each layer released to the next
  call as soon as it is written): how much of exact mode's overlap clipping keeps;
- ``torch``: the reference, plain PyTorch training of the same model, whole, on the first
  device, in the model dtype, with ``torch.optim.AdamW`` (fused on CUDA); "does not fit" when
  the device runs out of memory. RoundPipe's modes are compared with it per round;
- ``torch+recompute``: the same with RoundPipe's recomputation: every module but the last
  under ``torch.utils.checkpoint`` (non-reentrant, early stop off, so each recomputes its
  whole forward in the backward, as a RoundPipe stage does). RoundPipe's modes are also
  compared with it per round: what the pipeline costs beyond recomputing;
- ``fsdp2-offload`` (only when asked for with ``--modes``): what a user would pick instead on
  one GPU, torch's FSDP2 (``fully_shard`` over each block and the model, one process) with
  ``CPUOffloadPolicy`` (fp32 weights, gradients and ``torch.optim.AdamW`` state on the host,
  its fused CPU step) and ``MixedPrecisionPolicy`` (compute in the model dtype), every block
  under ``torch.utils.checkpoint`` and gradient accumulation over the same microbatches.

Each RoundPipe mode's **bound** is printed beside it, in tokens/s, from figures of the same run:
the GPU compute with recomputation (``torch+recompute``'s time per iteration), the host step
alone (the time of ``step(opt)`` in ``sync``) and the PCIe bytes (each direction's bytes per
iteration over the pinned copy's peak bandwidth): ``off`` and ``sync`` cannot overlap the step,
their bound is ``max(compute, PCIe) + step``; ``async`` and ``exact`` overlap it, theirs is
``max(compute, PCIe, step)``.

RoundPipe's modes recompute as ``--recompute`` says: ``auto`` (the default: the planner keeps
the saved tensors of the stages that fit the memory budget, on the CPU device all of them),
``all`` (every stage but the last recomputes, the upstream design) or ``none``.

``--model llama`` trains a Hugging Face ``LlamaForCausalLM`` built from its config (``--hidden``,
``--intermediate``, ``--heads``, ``--kv-heads``, ``--vocab``) through
``roundpipe.wrap_model_to_roundpipe`` against plain HF (the reference with
``gradient_checkpointing_enable()``), the loss HF's own; ``--model encoder`` (default) an
``nn.Sequential`` of ``nn.TransformerEncoderLayer`` s. ``--one-model`` builds one RoundPipe
wrapper and optimizer for all RoundPipe modes and one model for both torch modes (what fits a
model of billions of parameters on one machine; the final losses are then not comparable).

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
    python -m roundpipe.bench pipeline --model llama --layers 24 --hidden 2560 \
        --intermediate 6912 --heads 20 --kv-heads 4 --vocab 32000 --seq 1024 --batch 8 \
        --microbatches 4 --one-model --modes sync async exact torch+recompute fsdp2-offload
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import time

import torch
import torch.utils.checkpoint
from torch import nn

import roundpipe.optim as rpo
from roundpipe import OptimizerCtx, RoundPipe

from . import (MIN_REPEATS, Figure, available_cpus, compare, interleave, paired_ratio,
               positive_int, repeats_arg, thread_plan, writable_path)

MODES = ("off", "sync", "async", "exact", "exact+clip", "torch", "torch+recompute",
         "fsdp2-offload")
#: --recompute -> RoundPipe(recompute=...)
RECOMPUTE = {"auto": "auto", "all": True, "none": False}
DEFAULT_MODES = MODES[:-1]
ROUNDPIPE_MODES = ("off", "sync", "async", "exact", "exact+clip")


def build_model(layers: int, hidden: int, heads: int, vocab: int, dtype: torch.dtype) -> nn.Sequential:
    """Embedding, ``layers`` pre-norm transformer encoder layers (no dropout), norm, head."""
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0,
                                         batch_first=True, norm_first=True)
              for _ in range(layers)]
    return nn.Sequential(nn.Embedding(vocab, hidden), *blocks, nn.LayerNorm(hidden),
                         nn.Linear(hidden, vocab)).to(dtype)


def build_llama(args, dtype: torch.dtype, device: str) -> nn.Module:
    """A Hugging Face ``LlamaForCausalLM`` from ``--layers/--hidden/--intermediate/--heads/
    --kv-heads/--vocab``, its weights drawn on ``device`` (a GPU initialises billions of
    parameters in seconds, the host in minutes), then moved to the host."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                   intermediate_size=args.intermediate or 4 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads or args.heads,
                                   max_position_embeddings=max(args.seq, 128))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(dtype)
    return model.cpu()


def cuda_device(device: str) -> torch.device:
    """``device`` as a ``torch.device``, CUDA initialised: torch's memory statistics
    (``reset_peak_memory_stats`` first of all) fail with "Invalid device argument" until
    something has initialised the caching allocator, and nothing has before the first
    contender builds its model."""
    torch.cuda.init()
    return torch.device(device)


class _Contender:
    """One line of the table: a model trained in its own way, built and warmed up once, then
    timed ``--iters`` iterations per repeat (:meth:`run`). Every contender sees the same
    batches in the same order, so their losses can be compared at the end."""

    def __init__(self, mode: str, args, devices: list[str], dtype: torch.dtype,
                 intra_op: int, share: "_Contender" = None) -> None:
        self.mode, self.args, self.devices, self.dtype = mode, args, devices, dtype
        self.intra_op = intra_op
        self.cuda = devices[0].startswith("cuda")
        self.tokens = args.batch * args.seq
        self.batches_seen = 0
        self.threads_seen: set[int] = set()
        self.note = None
        self.reserved_gib = None
        self.step_s: list[float] = []
        torch.set_num_threads(intra_op)  # a device worker keeps the count of its first use
        if share is not None:  # --one-model: the model, optimizer and notes of another mode
            for key in ("net", "opt", "model", "note", "reserved_gib", "threads_seen"):
                if key in share.__dict__:
                    setattr(self, key, getattr(share, key))
            if self.note is None:
                self.iteration(self._batch())  # this mode's warm-up
                self._sync()
            return
        if self.cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_reserved(cuda_device(devices[0]))
            torch.cuda.reset_peak_memory_stats(cuda_device(devices[0]))
        try:
            self._build()
            self.iteration(self._batch())  # warm-up: threads, allocator, optimizer state
            self._sync()
        except torch.cuda.OutOfMemoryError:
            self.note = "does not fit on the device"
            for key in ("net", "opt", "model"):
                self.__dict__.pop(key, None)
            torch.cuda.empty_cache()
            return
        if self.cuda:  # what this contender added at its peak, over the others' memory
            self.reserved_gib = (torch.cuda.max_memory_reserved(cuda_device(devices[0]))
                                 - base) / 2**30

    def _build(self) -> None:
        a = self.args
        if a.model == "llama":
            self.net = build_llama(a, self.dtype, self.devices[0])
            layers = list(self.net.model.layers)
        else:
            self.net = build_model(a.layers, a.hidden, a.heads, a.vocab, self.dtype)
            layers = list(self.net)
        # Records the intra-op threads every layer runs with. Asking also applies torch's
        # count to a device worker thread on its first layer: without that, a thread that has
        # not yet run a torch parallel_for runs the ops that thread through MKL or OpenMP
        # directly (tanh, exp, ...) on all cores, whatever torch.set_num_threads said.
        for layer in layers:
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

    def microbatches(self) -> int:
        return self.args.microbatches or len(self.devices) + 1

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
    """``off``, ``sync``, ``async``, ``exact`` or ``exact+clip`` (see the module docstring)."""

    def _build(self) -> None:
        super()._build()
        a = self.args
        kwargs = dict(device=self.devices, layers_per_stage=a.layers_per_stage,
                      num_microbatch=a.microbatches, prefetch=self.mode != "off",
                      recompute=RECOMPUTE[a.recompute])
        if a.model == "llama":
            import roundpipe

            self.model = roundpipe.wrap_model_to_roundpipe(self.net, torch.float32, **kwargs)
        else:
            self.model = RoundPipe(self.net, optim_dtype=torch.float32, **kwargs)
        with OptimizerCtx():
            self.opt = rpo.AdamW(self.model.parameters(), lr=1e-4)
        # an automatic plan (stages, recomputation) settles before anything is timed; its
        # training is undone, so that every mode trains the same steps on the same batches
        before = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()),
                  self.batches_seen)
        for _ in range(8):
            if self.model.plan().kept:
                break
            self.iteration(self._batch())
        self._sync()
        self.model.load_state_dict(before[0])
        self.opt.load_state_dict(before[1])
        self.batches_seen = before[2]

    def iteration(self, b: torch.Tensor):
        if self.args.model == "llama":  # HF's own loss (labels shifted inside)
            kw = dict(input_kwargs={"input_ids": b[:, :-1], "labels": b[:, :-1]})
        else:
            kw = dict(input_args=(b[:, :-1],), label=b[:, 1:], loss_fn=self.loss_fn)
        if self.mode == "exact":
            return self.model.forward_backward(**kw, optimizer=self.opt)
        if self.mode == "exact+clip":
            return self.model.forward_backward(**kw, optimizer=self.opt, max_grad_norm=1.0)
        loss = self.model.forward_backward(**kw)
        start = time.perf_counter()
        self.model.step(self.opt, is_async=self.mode == "async")
        if self.mode in ("off", "sync"):  # the host step alone (synchronous)
            self.step_s.append(time.perf_counter() - start)
        return loss

    def _sync(self) -> None:
        self.model.synchronize()

    def run(self) -> dict:
        self.model.pipeline_stats(reset=True)
        self.step_s.clear()
        row = super().run()
        stats = self.model.pipeline_stats(reset=True)  # may synchronise CUDA: after the timing
        elapsed, workers = row["seconds"], len(self.devices)
        device_total = elapsed * workers
        idle_between = max(0.0, elapsed - stats["wall_s"]) * workers
        row["wait_weights_pct"] = 100 * stats["weights_wait_s"] / device_total
        row["wait_optimizer_pct"] = 100 * (stats["optimizer_wait_s"] + idle_between) / device_total
        row["bytes"] = {k: v for k, v in stats.items() if k.endswith("_bytes")}
        row["stages"] = stats["stages"]
        row["plan"] = list(self.model.plan().sizes)
        row["recompute"] = [s for s, r in enumerate(self.model.plan().recompute) if r]
        if self.step_s:
            row["step_s"] = sorted(self.step_s)[len(self.step_s) // 2]
            self.step_s.clear()
        row["weights_vs_floor"] = _ratio(stats["h2d_weight_bytes"], stats["weight_floor_bytes"])
        row["grads_vs_floor"] = _ratio(stats["d2h_param_grad_bytes"], stats["param_grad_floor_bytes"])
        if stats["upload_s"] > 0:
            row["upload_gb_s"] = (stats["h2d_weight_bytes"] + stats["h2d_buffer_bytes"]) \
                / stats["upload_s"] / 1e9
        return row


class TorchRun(_Contender):
    """``torch``: the same model, batches and loss in plain PyTorch on the first device alone,
    in the model dtype, ``torch.optim.AdamW`` (fused on CUDA) over the model's parameters, the
    batch in ``--microbatches`` slices with gradient accumulation (the same tokens per step)."""

    def _build(self) -> None:
        super()._build()
        self.net = self.net.to(self.devices[0])
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-4,
                                     **({"fused": True} if self.cuda else {}))

    def _loss(self, b: torch.Tensor) -> torch.Tensor:
        if self.args.model == "llama":
            return self.net(input_ids=b[:, :-1], labels=b[:, :-1]).loss
        return self.loss_fn(self.net(b[:, :-1]), b[:, 1:])

    def iteration(self, b: torch.Tensor):
        b = b.to(self.devices[0])
        parts = torch.tensor_split(b, self.microbatches())
        total = 0.0
        for part in parts:
            loss = self._loss(part) * (len(part) / len(b))
            loss.backward()
            total = total + loss.detach()
        self.opt.step()
        self.opt.zero_grad()
        return total

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.devices[0])


class RecomputeRun(TorchRun):
    """``torch+recompute``: :class:`TorchRun` with every module but the last under
    ``torch.utils.checkpoint`` (``use_reentrant=False``, early stop off: each module's whole
    forward runs again in the backward, as RoundPipe recomputes every stage but the last); for
    ``--model llama``, HF's ``gradient_checkpointing_enable()`` (every decoder layer)."""

    def _loss(self, b: torch.Tensor) -> torch.Tensor:
        if self.args.model == "llama":
            self.net.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            self.net.train()
            try:
                return super()._loss(b)
            finally:
                self.net.gradient_checkpointing_disable()
        x = b[:, :-1]
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            for module in self.net[:-1]:
                x = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)
        return self.loss_fn(self.net[-1](x), b[:, 1:])


class FsdpOffloadRun(TorchRun):
    """``fsdp2-offload``: FSDP2 with CPU offload on one process (see the module docstring)."""

    def _build(self) -> None:
        import os
        import socket

        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        _Contender._build(self)
        if not dist.is_initialized():
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(port))
            dist.init_process_group("nccl" if self.cuda else "gloo", rank=0, world_size=1)
            if self.cuda:
                torch.cuda.set_device(cuda_device(self.devices[0]))
        net = self.net.float()  # fp32 master weights on the host, compute in the model dtype
        mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy() if self.cuda else None
        kw = {"mp_policy": mp, **({"offload_policy": offload} if offload else {})}
        blocks = list(net.model.layers) if self.args.model == "llama" else list(net)[1:-2]
        for block in blocks:
            fully_shard(block, **kw)
        fully_shard(net, **kw)
        self.net = net
        if self.args.model == "llama":
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)

    def _loss(self, b: torch.Tensor) -> torch.Tensor:
        if self.args.model == "llama":
            return self.net(input_ids=b[:, :-1], labels=b[:, :-1]).loss
        x = self.net[0](b[:, :-1])
        for module in list(self.net)[1:-2]:
            x = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)
        return self.loss_fn(self.net[-1](self.net[-2](x)), b[:, 1:])


def _ratio(moved: float, floor: float):
    return moved / floor if floor else None


def measure(args, devices: list[str], dtype: torch.dtype, threads: dict) -> list[dict]:
    """Builds every contender of ``args.modes``, runs ``args.repeats`` interleaved rounds and
    returns one row per mode: medians, min-max ranges and every repeat's values."""
    contenders = {}
    shared: dict[type, _Contender] = {}
    for mode in args.modes:
        cls = {"torch": TorchRun, "torch+recompute": RecomputeRun,
               "fsdp2-offload": FsdpOffloadRun}.get(mode, RoundPipeRun)
        family = TorchRun if cls is RecomputeRun else cls
        c = cls(mode, args, devices, dtype,
                threads["torch_reference"] if mode.startswith(("torch", "fsdp"))
                else threads["torch_per_worker"], shared.get(family) if args.one_model else None)
        shared.setdefault(family, c)
        contenders[mode] = c
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
        for key in ("weights_vs_floor", "grads_vs_floor", "bytes", "stages", "plan", "recompute"):
            if key in reps[0]:  # counts: the same each time
                row[key] = reps[-1][key]
        steps = [r["step_s"] for r in reps if "step_s" in r]
        if steps:
            row["step_s"] = sorted(steps)[len(steps) // 2]
        rows.append(row)
    return rows


def bounds(rows: list[dict], args, peak_gb_s) -> dict:
    """Each RoundPipe mode's bound in tokens/s (see the module docstring), with its parts in
    seconds per iteration: ``compute`` (torch+recompute's iteration), ``step`` (the host step
    of ``sync`` or ``off``), ``pcie`` (the busier direction's bytes over the pinned peak)."""
    by = {r["mode"]: r for r in rows}
    tokens = args.batch * args.seq
    compute = (tokens / by["torch+recompute"]["tokens_per_s"]
               if by.get("torch+recompute", {}).get("tokens_per_s") else None)
    step = next((by[m]["step_s"] for m in ("sync", "off") if by.get(m, {}).get("step_s")), None)
    out = {}
    for mode in ROUNDPIPE_MODES:
        r = by.get(mode)
        if r is None or r.get("tokens_per_s") is None or compute is None or step is None:
            continue
        pcie = 0.0
        if peak_gb_s and r.get("bytes"):  # the bytes of one repeat: --iters iterations
            b = r["bytes"]
            up = sum(v for k, v in b.items() if k.startswith("h2d_"))
            down = sum(v for k, v in b.items() if k.startswith("d2h_"))
            pcie = max(up, down) / args.iters / (peak_gb_s * 1e9)
        seconds = (max(compute, pcie) + step if mode in ("off", "sync")
                   else max(compute, pcie, step))
        out[mode] = {"tokens_per_s": tokens / seconds, "compute_s": compute, "step_s": step,
                     "pcie_s": pcie, "ratio": r["tokens_per_s"] / (tokens / seconds)}
    return out


def pinned_copy_peak_gb_s(device: str, megabytes: int = 256, repeats: int = 5) -> float:
    """Host-to-device bandwidth of a pinned copy of ``megabytes`` MB (best of ``repeats``)."""
    host = torch.empty(megabytes << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=cuda_device(device))
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
  bound           a RoundPipe mode's bound in tokens/s and its tokens/s over it (see above):
                  compute (torch+recompute), the host step (sync's step), PCIe bytes
Ratios ("1.50x the tokens/s of off") are medians of per-repeat ratios (both measured in the
same round) with their range; "within noise" when the range includes 1."""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench pipeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=LEGEND)
    ap.add_argument("--model", choices=("encoder", "llama"), default="encoder",
                    help="an nn.Sequential of TransformerEncoderLayers (default) or a Hugging "
                         "Face LlamaForCausalLM (needs transformers)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    ap.add_argument("--intermediate", type=int, default=None,
                    help="--model llama: MLP size (default 4 x hidden)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="--model llama: key/value heads (default: --heads)")
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
    ap.add_argument("--layers-per-stage", type=_stage_arg, default=None,
                    help="'auto' or an int (default: auto on CUDA, 1 on the CPU)")
    ap.add_argument("--recompute", choices=tuple(RECOMPUTE), default="auto",
                    help="RoundPipe's recomputation: auto (default: planned, stages that fit "
                         "keep their saved tensors), all (every stage but the last "
                         "recomputes) or none")
    ap.add_argument("--one-model", action="store_true",
                    help="one RoundPipe wrapper for every RoundPipe mode and one model for both "
                         "torch modes (for models too large to build once per mode)")
    ap.add_argument("--devices", default=None,
                    help="comma-separated compute devices, e.g. cpu,cpu or cuda:0,cuda:1 "
                         "(default: cuda:0 if available, else cpu,cpu)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="model dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
                    help="default: every mode but fsdp2-offload")
    ap.add_argument("--json", type=writable_path,
                    help="also write the results (with every repeat's values) as JSON to this file")
    args = ap.parse_args(argv)
    for name in ("layers", "hidden", "heads", "vocab", "seq", "batch", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.model == "llama" and importlib.util.find_spec("transformers") is None:
        ap.error("--model llama needs transformers")
    if args.one_model and "off" in args.modes:
        ap.error("--one-model shares one wrapper, which prefetches: leave out the mode off")
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

    print(f"{args.model}: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch "
          f"{args.batch} ({args.batch * args.seq} tokens per step), {dtype}, devices "
          f"{','.join(devices)}; {args.repeats} interleaved repeats of {args.iters} iterations "
          "per mode")
    rows = measure(args, devices, dtype, threads)
    print(describe_threads(threads, rows))
    print(LEGEND)
    peak = pinned_copy_peak_gb_s(devices[0]) if cuda else None
    limits = bounds(rows, args, peak)
    print_table(rows, cuda, peak, limits)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "devices": devices, "dtype": str(dtype),
                       "threads": threads, "pinned_peak_gb_s": peak, "rows": rows,
                       "bounds": limits}, f, indent=2)


def _stage_arg(text: str):
    """argparse type of --layers-per-stage: 'auto' or an int >= 1."""
    return text if text == "auto" else positive_int(text)


def describe_threads(t: dict, rows: list[dict]) -> str:
    seen = {r["mode"]: r["torch_threads_seen_in_layers"] for r in rows}
    ours = sorted({n for m, s in seen.items() if not m.startswith("torch") for n in s})
    return (f"threads: {t['device_workers']} RoundPipe device worker(s) with "
            f"{t['torch_per_worker']} torch intra-op thread(s) each (seen in the layers: "
            f"{ours or '-'}); the torch reference {t['torch_reference']} (seen: "
            f"{seen.get('torch') or '-'}); roundpipe.optim pool {t['roundpipe_pool']}; "
            f"--threads {t['threads_arg']} of {t['cpus_available']} CPUs available")


def print_table(rows: list[dict], cuda: bool, peak, limits: dict) -> None:
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
                      ("torch", "the tokens/s of plain torch (no recomputation)"),
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
    for mode, b in limits.items():
        print(f"{mode}: bound {b['tokens_per_s']:.0f} tokens/s (compute {b['compute_s'] * 1e3:.1f} "
              f"ms, host step {b['step_s'] * 1e3:.1f} ms, PCIe {b['pcie_s'] * 1e3:.1f} ms per "
              f"iteration); {b['ratio']:.2f}x of it")
    for r in rows:
        if r.get("plan"):
            print(f"{r['mode']}: stages {r['plan']}, recomputing {r['recompute'] or 'none'}")
    if cuda:
        print(f"pinned host-to-device copy peak: {peak:.2f} GB/s")
