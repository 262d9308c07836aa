"""The optimizer state on a disk (``RoundPipe(..., optimizer_dir=...)``) against the disk and
against host memory, in one run:

- **disk**: sequential bandwidth of the folder's disk with the store's own I/O (direct I/O,
  the request size and depth it chose at first use): reading, writing, and both at once (one
  file read while another is written, the mix a step makes);
- **step** (per algorithm and state format): ``model.step(opt)`` of a model whose optimizer
  copies and state live on the disk (nothing read ahead: the step reads all it steps), its
  bytes read and written (``pipeline_stats``) against the disk's bound for that mix, ``max(read
  / read bandwidth, write / write bandwidth, (read + write) / both-at-once bandwidth)`` with
  each byte read and written once: the share of the disk's bandwidth the step reaches; and the
  same step in memory, the step's time over ``max(in memory, disk bound)`` (compact state is
  compute-bound on few threads, so its step may be the CPU's, not the disk's);
- **exact**: exact-mode calls (``forward_backward(..., optimizer=opt)``) on the CPU device with
  the state on the disk against the same calls in memory (the compute, with its in-memory
  step) and the disk's time for the call's bytes: the call's time over
  ``max(compute, disk)``. The tokens per call are chosen so that compute and disk are
  comparable (``--tokens`` fixes them);
- **memory**: peak RSS of a fresh process training (exact mode, bfloat16 model copy, float32
  AdamW) a model whose optimizer copies and state are at least 4x the window, after a warm-up
  of the fixed costs: the model copy, the window (its peak), and what remains (the fixed
  allowance: a stage in flight, threads, allocator), next to what the same run needs in
  memory.

Each figure: median (min-max) over ``--repeats`` interleaved rounds; ratios per round.

    python -m roundpipe.bench disk --dir /nvme/scratch        # a folder on the disk to measure
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
from torch import nn

from ..disk import store_of
from . import Figure, MIN_REPEATS, interleave, positive_int, repeats_arg, write_json

# (name, optimizer class, kwargs, model dtype, optimizer copies' dtype)
CONFIGS = [
    ("fp32 AdamW", "AdamW", {}, torch.float32, None),
    ("bf16 state", "AdamW", {"state_dtype": torch.bfloat16}, torch.float32, None),
    ("int8 state", "AdamW", {"state_dtype": "int8"}, torch.float32, None),
    ("bf16 master + int8 state", "AdamW", {"state_dtype": "int8", "stochastic_rounding": True},
     torch.bfloat16, torch.bfloat16),
    ("SGD momentum", "SGD", {"momentum": 0.9}, torch.float32, None),
    ("Adafactor", "Adafactor", {}, torch.float32, None),
]


def mlp(hidden: int, layers: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                         nn.Linear(4 * hidden, hidden))
                           for _ in range(layers)]).to(dtype)


# --- the disk ----------------------------------------------------------------------------------

def disk_bandwidth(folder: str, nbytes: int, repeats: int) -> dict:
    """Sequential read, write and both at once (GB/s) of ``nbytes`` files in ``folder``, with
    the request size and depth :func:`roundpipe.disk.io.measure` chooses there (what a store
    uses), interleaved ``repeats`` times."""
    from ..disk import io
    from ..disk.folder import Folder

    box = Folder(folder, 0, io.SYSCALLS)
    try:
        choice = io.measure(box.path, box.direct, io.SYSCALLS)
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if box.direct else 0)
        fds = [os.open(box.file(f"{k}.bin"), flags, 0o600) for k in range(2)]
        bufs = [mmap.mmap(-1, nbytes) for _ in range(2)]
        for fd, buf in zip(fds, bufs):
            buf.write(os.urandom(1 << 20) * (nbytes >> 20))
            os.posix_fallocate(fd, 0, nbytes)
            _pass(io.write_full, fd, buf, choice)
        runs = {
            "read": lambda: _timed_pass([(io.read_full, fds[0], bufs[0])], choice, nbytes),
            "write": lambda: _timed_pass([(io.write_full, fds[1], bufs[1])], choice, nbytes),
            "both": lambda: _timed_pass([(io.read_full, fds[0], bufs[0]),
                                         (io.write_full, fds[1], bufs[1])], choice, nbytes),
        }
        got = interleave(runs, repeats)
        for fd in fds:
            os.close(fd)
    finally:
        box.close()
    return {"choice": {"block": choice.block, "depth": choice.depth, "direct": choice.direct,
                       "reason": choice.reason},
            **{k: Figure.of(v).as_dict() for k, v in got.items()}}


def _pass(op, fd: int, buf, choice) -> None:
    from ..disk import io

    view = memoryview(buf)
    offsets = list(range(0, len(view), choice.block))
    lock = threading.Lock()

    def run():
        while True:
            with lock:
                if not offsets:
                    return
                o = offsets.pop(0)
            op(io.SYSCALLS, fd, view[o:o + choice.block], o, choice.direct)

    threads = [threading.Thread(target=run) for _ in range(choice.depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    view.release()


def _timed_pass(jobs, choice, nbytes: int) -> float:
    """GB/s of the ``jobs`` (op, fd, buffer) run at once, each over its whole file."""
    start = time.perf_counter()
    threads = [threading.Thread(target=_pass, args=(op, fd, buf, choice)) for op, fd, buf in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(jobs) * nbytes / (time.perf_counter() - start) / 1e9


def disk_seconds(read: float, write: float, bw: dict) -> float:
    """The disk's time for ``read`` and ``write`` bytes: the largest of read alone, write
    alone and both at once at the measured medians."""
    gb = 1e9
    return max(read / (bw["read"]["median"] * gb), write / (bw["write"]["median"] * gb),
               (read + write) / (bw["both"]["median"] * gb))


# --- a step per algorithm --------------------------------------------------------------------

def _build(name, cls_name, kw, dtype, optim_dtype, hidden, layers, folder):
    import roundpipe
    import roundpipe.optim as rpo

    model = roundpipe.RoundPipe(mlp(hidden, layers, dtype), optim_dtype=optim_dtype,
                                device="cpu", num_microbatch=1, optimizer_dir=folder)
    return model, getattr(rpo, cls_name)(model.optim_parameters(), lr=1e-4, seed=0, **kw)


def step_rows(folder: str, hidden: int, layers: int, repeats: int, bw: dict,
              names: list) -> dict:
    """Per configuration, the synchronous step (``model.step(opt)`` after a call, the disk's
    reads ahead dropped first so that the step reads all it steps) on the disk and the same
    step in memory, interleaved over ``repeats`` rounds: seconds, bytes read and written, the
    share of the disk's bound reached, and the step's time over max(in memory, disk bound)."""
    x = torch.randn(2, hidden)
    lf = lambda o: o.float().square().mean()  # noqa: E731
    runs, built, params = {}, [], {}
    for name, cls_name, kw, dtype, odt in CONFIGS:
        if name not in names:
            continue
        for where in ("disk", "memory"):
            d = (os.path.join(folder, name.replace(" ", "_").replace("+", ""))
                 if where == "disk" else None)
            model, opt = _build(name, cls_name, kw, dtype, odt, hidden, layers, d)
            built.append((model, opt))
            params[name] = sum(p.numel() for p in model.optim_parameters())
            xin = x.to(dtype)
            for _ in range(2):  # state created, the read-ahead order learned
                model.forward_backward(input_args=(xin,), loss_fn=lf)
                model.step(opt)

            def run(model=model, opt=opt, xin=xin):
                model.forward_backward(input_args=(xin,), loss_fn=lf)
                model.synchronize()
                store = store_of(next(model.optim_parameters()))
                if store is not None:
                    store.settle()
                model.pipeline_stats(reset=True)
                start = time.perf_counter()
                model.step(opt)
                t = time.perf_counter() - start
                s = model.pipeline_stats()
                return t, s["disk_read_bytes"], s["disk_write_bytes"]
            runs[f"{name}/{where}"] = run
    got = interleave(runs, repeats)
    out = {}
    for name in dict.fromkeys(k.split("/")[0] for k in got):
        rows, mem = got[f"{name}/disk"], [t for t, _, _ in got[f"{name}/memory"]]
        bound = [disk_seconds(w, w, bw) for _, _, w in rows]  # each byte read and written once
        out[name] = {"seconds": Figure.of([t for t, _, _ in rows]).as_dict(),
                     "memory_seconds": Figure.of(mem).as_dict(),
                     "read_bytes": Figure.of([r for _, r, _ in rows]).as_dict(),
                     "write_bytes": Figure.of([w for _, _, w in rows]).as_dict(),
                     "bytes_per_param": statistics.fmean(2 * w / params[name]
                                                         for _, _, w in rows),
                     "share_of_disk": Figure.of([b / t for b, (t, _, _) in
                                                 zip(bound, rows)]).as_dict(),
                     "over_bound": Figure.of([t / max(m, b) for (t, _, _), m, b in
                                              zip(rows, mem, bound)]).as_dict()}
    del built
    return out


# --- exact mode --------------------------------------------------------------------------------

def exact_rows(folder: str, hidden: int, layers: int, tokens: int, repeats: int,
               bw: dict) -> dict:
    """Exact-mode calls with the state on the disk and in memory, interleaved; per round the
    disk call's time over max(the memory call's time, the disk's time for its bytes)."""
    import roundpipe
    import roundpipe.optim as rpo

    lf = lambda o: o.float().square().mean()  # noqa: E731
    models = {}
    for key, d in (("memory", None), ("disk", os.path.join(folder, "exact"))):
        model = roundpipe.RoundPipe(mlp(hidden, layers, torch.float32), device="cpu",
                                    num_microbatch=4, optimizer_dir=d)
        models[key] = (model, rpo.AdamW(model.optim_parameters(), lr=1e-4))

    def call(key, n):
        model, opt = models[key]
        x = torch.randn(n, hidden)
        model.pipeline_stats(reset=True)
        start = time.perf_counter()
        model.forward_backward(input_args=(x,), loss_fn=lf, optimizer=opt)
        model.synchronize()
        t = time.perf_counter() - start
        s = model.pipeline_stats()
        return t, s["disk_read_bytes"], s["disk_write_bytes"]

    params = sum(p.numel() for p in models["memory"][0].optim_parameters())
    for key in models:  # state created, read-ahead order learned
        call(key, 16)
        call(key, 16)
    if tokens is None:  # compute about the disk's time for the call's bytes: two refinements
        t_disk = disk_seconds(12 * params, 12 * params, bw)
        tokens = 64
        for _ in range(2):
            t = statistics.median(call("memory", tokens)[0] for _ in range(3))
            tokens = min(8192, max(16, int(tokens * t_disk / max(t, 1e-3))))
    got = interleave({k: (lambda k=k: call(k, tokens)) for k in models}, repeats)
    mem, disk = got["memory"], got["disk"]
    disk_s = [disk_seconds(r, w, bw) for _, r, w in disk]
    ratio = [d[0] / max(m[0], s) for d, m, s in zip(disk, mem, disk_s)]
    out = {"tokens": tokens, "params": params,
           "memory_s": Figure.of([m[0] for m in mem]).as_dict(),
           "disk_call_s": Figure.of([d[0] for d in disk]).as_dict(),
           "disk_bytes_s": Figure.of(disk_s).as_dict(),
           "over_bound": Figure.of(ratio).as_dict()}
    del models
    return out


# --- peak RSS ----------------------------------------------------------------------------------

_RSS_SCRIPT = r"""
import json, sys, tempfile, torch
from torch import nn
import roundpipe, roundpipe.optim as rpo
from roundpipe.disk import store_of
hidden, layers, folder, disk = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"

def status(key):
    with open("/proc/self/status") as f:
        return next(int(v.split()[1]) * 1024 for v in f if v.startswith(key + ":"))

def train(model, opt, x, steps):
    for _ in range(steps):
        model.forward_backward(input_args=(x,), loss_fn=lambda o: o.float().square().mean(),
                               optimizer=opt)
    model.synchronize()

small = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
warm = roundpipe.RoundPipe(small, optim_dtype=torch.float32, device="cpu", num_microbatch=2,
                           optimizer_dir=tempfile.mkdtemp(dir=folder) if disk else None)
train(warm, rpo.AdamW(warm.optim_parameters(), lr=1e-4), torch.randn(4, 64).bfloat16(), 2)
del warm
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
torch.set_default_dtype(torch.bfloat16)
net = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                    nn.Linear(4 * hidden, hidden)) for _ in range(layers)])
torch.set_default_dtype(torch.float32)
n = sum(p.numel() for p in net.parameters())
model = roundpipe.RoundPipe(net, optim_dtype=torch.float32, device="cpu", num_microbatch=2,
                            optimizer_dir=folder if disk else None)
opt = rpo.AdamW(model.optim_parameters(), lr=1e-4)
train(model, opt, torch.randn(4, hidden).bfloat16(), 3)
stats = model.pipeline_stats()
print(json.dumps({"params": n, "peak": status("VmHWM") - base,
                  "window": stats["disk_window_bytes"],
                  "window_limit": store_of(next(model.optim_parameters())).limit if disk else 0}))
"""


def rss_runs(folder: str, hidden: int, layers: int, repeats: int,
             kinds: tuple = ("disk", "memory")) -> dict:
    """Per kind (``"disk"``, ``"memory"``), what ``repeats`` fresh processes measured (run in
    alternation): parameters, peak RSS over the fixed costs, the window's peak and limit."""
    got: dict = {k: [] for k in kinds}
    for r in range(repeats):
        for key in (kinds if r % 2 == 0 else kinds[::-1]):
            d = tempfile.mkdtemp(dir=folder)
            out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(hidden), str(layers),
                                  d, "1" if key == "disk" else "0"],
                                 capture_output=True, text=True, timeout=1800)
            shutil.rmtree(d, ignore_errors=True)
            if out.returncode != 0:
                raise RuntimeError(f"the {key} run failed:\n{out.stderr[-2000:]}")
            got[key].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return got


def rss_rows(folder: str, hidden: int, layers: int, repeats: int) -> dict:
    """Peak RSS over a fresh process's fixed costs, on the disk and in memory
    (:func:`rss_runs`), split into the model copy, the window and the rest."""
    got = rss_runs(folder, hidden, layers, repeats)
    n = got["disk"][0]["params"]
    model_copy = 2 * n
    disk_peak = [g["peak"] for g in got["disk"]]
    window = [g["window"] for g in got["disk"]]
    return {"params": n, "model_copy_bytes": model_copy,
            "optimizer_bytes": 12 * n,
            "window_limit": got["disk"][0]["window_limit"],
            "peak_disk": Figure.of(disk_peak).as_dict(),
            "window_peak": Figure.of(window).as_dict(),
            "allowance": Figure.of([p - model_copy - w for p, w in
                                    zip(disk_peak, window)]).as_dict(),
            "peak_memory": Figure.of([g["peak"] for g in got["memory"]]).as_dict()}


# --- report ------------------------------------------------------------------------------------

def _gb(d: dict) -> str:
    return Figure.from_dict(d).text(2)


def _mib(d: dict) -> str:
    f = Figure.from_dict(d)
    return Figure(f.median / 2**20, f.low / 2**20, f.high / 2**20).text(1)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m roundpipe.bench disk", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="a folder on the disk to measure (default: a "
                   "new folder in the working directory, removed after)")
    p.add_argument("--disk-mib", type=positive_int, default=512,
                   help="MiB per file of the bandwidth measurement (default 512)")
    p.add_argument("--hidden", type=positive_int, default=512)
    p.add_argument("--layers", type=positive_int, default=8,
                   help="MLP blocks (hidden -> 4 hidden -> hidden) of the step and exact rows")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="rows per exact-mode call (default: compute about the disk's time)")
    p.add_argument("--exact-hidden", type=positive_int, default=1024,
                   help="width of the exact-mode rows' model (--layers blocks): wide, so that "
                        "its bytes take the disk about as long as a few rows take to compute")
    p.add_argument("--configs", nargs="+", default=[c[0] for c in CONFIGS],
                   choices=[c[0] for c in CONFIGS], metavar="NAME")
    p.add_argument("--rss-hidden", type=positive_int, default=512)
    p.add_argument("--rss-layers", type=positive_int, default=16)
    p.add_argument("--repeats", type=repeats_arg, default=MIN_REPEATS)
    p.add_argument("--skip-step", action="store_true")
    p.add_argument("--skip-exact", action="store_true")
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    made = args.dir is None
    folder = tempfile.mkdtemp(prefix="roundpipe-bench-disk-", dir=".") if made else args.dir
    os.makedirs(folder, exist_ok=True)
    result: dict = {"load_average": os.getloadavg(), "cpus": os.cpu_count()}
    try:
        bw = disk_bandwidth(os.path.join(folder, "bandwidth"), args.disk_mib << 20, args.repeats)
        result["disk"] = bw
        c = bw["choice"]
        print(f"disk ({os.path.abspath(folder)}; {'direct' if c['direct'] else 'buffered'} "
              f"I/O, {c['block'] >> 20} MiB requests, depth {c['depth']}): read "
              f"{_gb(bw['read'])} GB/s, write {_gb(bw['write'])} GB/s, both at once "
              f"{_gb(bw['both'])} GB/s")
        if not args.skip_step:
            rows = step_rows(folder, args.hidden, args.layers, args.repeats, bw, args.configs)
            result["step"] = rows
            print("\n| configuration | step s on disk | in memory | read MB | written MB | "
                  "B/param | share of the disk's bound | / max(memory, disk bound) |\n"
                  "|---|---|---|---|---|---|---|---|")
            for name, r in rows.items():
                print(f"| {name} | {Figure.from_dict(r['seconds']).text(3)} | "
                      f"{Figure.from_dict(r['memory_seconds']).text(3)} | "
                      f"{r['read_bytes']['median'] / 1e6:.1f} | "
                      f"{r['write_bytes']['median'] / 1e6:.1f} | {r['bytes_per_param']:.1f} | "
                      f"{Figure.from_dict(r['share_of_disk']).text(2)} | "
                      f"{Figure.from_dict(r['over_bound']).text(2)} |")
        if not args.skip_exact:
            e = exact_rows(folder, args.exact_hidden, args.layers, args.tokens, args.repeats,
                           bw)
            result["exact"] = e
            print(f"\nexact mode, {e['params'] / 1e6:.1f}M parameters, {e['tokens']} rows per "
                  f"call: in memory {Figure.from_dict(e['memory_s']).text(2)} s, the disk's "
                  f"time for the call's bytes {Figure.from_dict(e['disk_bytes_s']).text(2)} s, "
                  f"on the disk {Figure.from_dict(e['disk_call_s']).text(2)} s: "
                  f"{Figure.from_dict(e['over_bound']).text(2)}x max(compute, disk)")
        if not args.skip_rss:
            m = rss_rows(folder, args.rss_hidden, args.rss_layers, args.repeats)
            result["rss"] = m
            print(f"\npeak RSS, {m['params'] / 1e6:.1f}M parameters (bf16 model copy, fp32 "
                  f"AdamW: {m['optimizer_bytes'] / 2**20:.0f} MiB of optimizer copies and "
                  f"state, {m['optimizer_bytes'] / max(m['window_limit'], 1):.1f}x the window's "
                  f"limit of {m['window_limit'] / 2**20:.1f} MiB), exact mode: on the disk "
                  f"{_mib(m['peak_disk'])} MiB = model copy {m['model_copy_bytes'] / 2**20:.1f}"
                  f" + window {_mib(m['window_peak'])} + allowance {_mib(m['allowance'])}; in "
                  f"memory {_mib(m['peak_memory'])} MiB")
        result["load_average_end"] = os.getloadavg()
        la, lb = result["load_average"], result["load_average_end"]
        print(f"\nload average (1, 5, 15 min) at the start {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}, "
              f"at the end {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}, on {result['cpus']} CPUs")
    finally:
        if made:
            shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
