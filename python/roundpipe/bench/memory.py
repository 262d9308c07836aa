"""The host-memory ladder: what each way of keeping the optimizer's side of a parameter costs, in
one run. For each configuration (``CONFIGS``):

- **bytes/param**: host bytes per trainable parameter: the peak RSS of a fresh process training
  a 12-layer model built directly in bfloat16 (no float32 model ever exists) on the RoundPipe CPU
  device in exact overlapped mode (``forward_backward(..., optimizer=opt)``), minus the RSS after
  a warm-up of the fixed costs (threads, allocator arenas, oneDNN), over the parameter count;
  next to it the persistent floor (model copy + optimizer copy + state) it must stay above;
- **step ns/param**, **B/param**, **%floor**: the optimizer step as exact mode runs it
  (``fused_step``: float32 gradient in, bfloat16 model copy out; for bfloat16 master weights a
  bfloat16 gradient and no copy) on one 16M-element tensor (Adafactor: a 4000 x 4000 matrix),
  1 thread, against its byte floor: the bytes it must move over the bandwidth of the streaming
  kernel (``stream_step``, 28 bytes per element) measured in the same round: medians and
  min-max ranges over ``--repeats`` interleaved rounds;
- **loading** (:mod:`roundpipe.bench.loading`): peak RSS while loading a bf16 checkpoint
  through ``roundpipe.hf.from_pretrained`` with LoRA on an NF4, int8 and bf16 base, over the
  checkpoint's bf16 size;
- **LoRA on a quantized base** (:mod:`.qlora`): host bytes per frozen parameter, upload bytes
  and tokens/s of LoRA training on a bf16, int8 and NF4 frozen base, and the dequantization
  kernel's speed against torch ops;
- **convergence**: the demo's model (``examples/train_qwen3.py``, a small Qwen3 configuration)
  trained for the same steps with each configuration: final training loss (mean of the last 10%
  of steps) and validation loss, their difference from float32 AdamW; all loss curves in one
  plot (``--out``/memory_ladder.png).

"bf16 master + int8 state" keeps the bfloat16 model copy as the only copy of the weights
(``RoundPipe(model_bf16, optim_dtype=torch.bfloat16)``: the optimizer steps the model copy
itself, with stochastic rounding).

    python -m roundpipe.bench memory                       # everything (a few minutes, 2 cores)
    python -m roundpipe.bench memory --skip-convergence --hidden 512
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import torch

from . import qlora
from . import write_json, Figure, MIN_REPEATS, interleave, positive_int, repeats_arg, timed, writable_path


@dataclass(frozen=True)
class Config:
    name: str
    optimizer: str          # "adamw" | "adafactor"
    state_dtype: str        # "float32" | "bfloat16" | "int8"
    master_dtype: str       # "float32" | "bfloat16"
    floor: float            # persistent bytes per parameter: model copy + master + state
    step_bytes: float       # bytes per element the fused step moves


# AdamW's two moments; int8 adds one float32 absmax per 256 values of each; the fused step reads
# param, gradient and state, writes param, state and the bfloat16 model copy.
CONFIGS = [
    Config("fp32 AdamW", "adamw", "float32", "float32", 2 + 4 + 8, 8 + 4 + 16 + 2),
    Config("bf16 state", "adamw", "bfloat16", "float32", 2 + 4 + 4, 8 + 4 + 8 + 2),
    Config("int8 state", "adamw", "int8", "float32", 2 + 4 + 2 + 8 / 256, 8 + 4 + 4 + 16 / 256 + 2),
    Config("bf16 master + int8 state", "adamw", "int8", "bfloat16", 2 + 2 + 8 / 256,
           4 + 2 + 4 + 16 / 256),
    # Adafactor's factored state is (rows + cols) per matrix: ~0 bytes per parameter; its step
    # reads the gradient three times (roundpipe/adafactor.hpp)
    Config("Adafactor", "adafactor", "float32", "float32", 2 + 4, 8 + 12 + 4 + 2),
]

_MEMORY_SCRIPT = r"""
import sys
import torch
from torch import nn
import roundpipe, roundpipe.optim as rpo

optimizer, state_dtype, master, hidden, mode = sys.argv[1:6]
master, hidden = getattr(torch, master), int(hidden)

def make_opt(params):
    kw = dict(stochastic_rounding=master == torch.bfloat16, seed=0)
    if optimizer == "adafactor":
        return rpo.Adafactor(params, **kw)
    sd = "int8" if state_dtype == "int8" else getattr(torch, state_dtype)
    return rpo.AdamW(params, lr=1e-4, state_dtype=sd, **kw)

def status(key):  # bytes of a /proc/self/status line (VmRSS, VmHWM)
    with open("/proc/self/status") as f:
        return next(int(v.split()[1]) * 1024 for v in f if v.startswith(key + ":"))

def train(model, opt, mode, x, steps):
    lf = lambda o: o.float().square().mean()
    for _ in range(steps):
        if mode == "exact":
            model.forward_backward(input_args=(x,), loss_fn=lf, optimizer=opt)
        else:
            model.forward_backward(input_args=(x,), loss_fn=lf)
            model.step(opt, is_async=mode == "async")
    model.synchronize()

# what does not grow with the model first (threads, OpenMP, oneDNN, allocator arenas)
small = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
warm = roundpipe.RoundPipe(small, optim_dtype=master, device="cpu", num_microbatch=4)
for m in ("exact", "step", "async"):
    train(warm, make_opt(warm.optim_parameters()), m, torch.randn(4, 64).bfloat16(), 2)
del warm
# the peak is VmHWM reset here, not ru_maxrss: a child started by vfork + exec (subprocess)
# keeps its parent's peak RSS in ru_maxrss, so under a large parent (a pytest session) it
# reported the parent's size
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
base = status("VmRSS")
torch.set_default_dtype(torch.bfloat16)   # built in bf16: no fp32 model ever exists
net = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                    nn.Linear(4 * hidden, hidden)) for _ in range(12)])
torch.set_default_dtype(torch.float32)
n = sum(p.numel() for p in net.parameters())
model = roundpipe.RoundPipe(net, optim_dtype=master, device="cpu", num_microbatch=4)
train(model, make_opt(model.optim_parameters()), mode, torch.randn(4, hidden).bfloat16(), 3)
peak = status("VmHWM")
print((peak - base) / n)
"""


def measure_memory(config: Config, hidden: int, mode: str = "exact") -> float:
    """Host bytes per parameter of ``config`` training a 12-layer model of width ``hidden``
    (``12 * 8 * hidden**2`` parameters) on the CPU device for 3 steps in ``mode``: ``exact``
    (``forward_backward(..., optimizer=opt)``), ``step`` (``step(opt)``) or ``async``
    (``step(opt, is_async=True)``). A fresh process: its peak RSS after a warm-up of the fixed
    costs (every mode on a tiny model), over the parameter count."""
    r = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, config.optimizer,
                        config.state_dtype, config.master_dtype, str(hidden), mode],
                       capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise RuntimeError(f"memory run of {config.name!r} failed:\n{r.stderr[-2000:]}")
    return float(r.stdout.split()[-1])


def _step_runner(config: Config, n: int):
    """One fused step of ``config`` as exact mode runs it, on ``n`` elements."""
    import roundpipe.optim as rpo

    gen = torch.Generator().manual_seed(0)
    bf16_master = config.master_dtype == "bfloat16"
    shape = (4000, n // 4000) if config.optimizer == "adafactor" else (n,)
    p = torch.nn.Parameter((torch.rand(shape, generator=gen) - 0.5)
                           .to(torch.bfloat16 if bf16_master else torch.float32))
    g = (torch.rand(shape, generator=gen) - 0.5).to(p.dtype)
    copy = None if bf16_master else torch.empty(shape, dtype=torch.bfloat16)
    kw = dict(stochastic_rounding=bf16_master, seed=0)
    if config.optimizer == "adafactor":
        opt = rpo.Adafactor([p], **kw)
    else:
        sd = "int8" if config.state_dtype == "int8" else getattr(torch, config.state_dtype)
        opt = rpo.AdamW([p], lr=1e-4, state_dtype=sd, **kw)

    def step():
        opt.fused_step([p], [g], None if copy is None else [copy])
    step()
    return step


def measure_speed(configs: list[Config], n: int, repeats: int) -> dict[str, dict]:
    """Per configuration: ns per parameter of its step and its percentage of the byte floor
    (floor time over step time per round), medians with min-max ranges over interleaved
    rounds; and the streaming kernel's bandwidth."""
    import roundpipe.optim as rpo
    from roundpipe import _C

    rpo.set_num_threads(1)
    torch.set_num_threads(1)
    floor_t = [torch.rand(n) for _ in range(4)]
    floor_opts = _C.StreamOptions()
    floor_opts.states = 2

    def floor():
        _C.stream_step(floor_opts, [floor_t[0]], [floor_t[1]], [[floor_t[2]], [floor_t[3]]], [])

    runners = {"floor": floor, **{c.name: _step_runner(c, n) for c in configs}}
    ns = {k: [1e9 * t / n for t in v]
          for k, v in interleave({k: timed(f) for k, f in runners.items()}, repeats).items()}
    # the byte floor of a config: its bytes at the bandwidth the 28-byte stream reached
    out: dict = {}
    for c in configs:
        floor_ns = [f * c.step_bytes / 28 for f in ns["floor"]]
        out[c.name] = dict(bytes=c.step_bytes, ns=Figure.of(ns[c.name]).as_dict(),
                           floor_ns=Figure.of(floor_ns).as_dict(),
                           pct_floor=Figure.of([100 * f / x for f, x in
                                                zip(floor_ns, ns[c.name])]).as_dict())
    out["stream GB/s"] = Figure.of([28 / f for f in ns["floor"]]).as_dict()
    return out


def demo_script() -> pathlib.Path:
    """examples/train_qwen3.py of the repository this package was installed from, or of the
    working directory."""
    for root in (pathlib.Path(__file__).resolve().parents[3], pathlib.Path.cwd()):
        path = root / "examples" / "train_qwen3.py"
        if path.is_file():
            return path
    raise FileNotFoundError("the convergence runs need the repository's examples/train_qwen3.py "
                            "(run from the repository, or pass --skip-convergence)")


def run_convergence(config: Config, args, out: pathlib.Path) -> dict:
    """The demo trained with ``config``; its metrics.json."""
    run_dir = out / config.name.replace(" ", "_").replace("+", "and")
    cmd = [sys.executable, str(demo_script()), "--out", str(run_dir),
           "--hidden", str(args.conv_hidden), "--layers", str(args.conv_layers), "--heads", "4",
           "--kv-heads", "2", "--steps", str(args.conv_steps), "--batch", "8", "--seq", "64",
           "--max-chars", str(args.conv_chars), "--sample-tokens", "4", "--seed", "0",
           "--optimizer", config.optimizer, "--state-dtype", config.state_dtype,
           "--master-dtype", config.master_dtype, "--dtype", "float32"]
    if config.optimizer == "adafactor":
        cmd += ["--lr", str(args.adafactor_lr)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                       env=dict(os.environ, TQDM_DISABLE="1"))
    if r.returncode != 0:
        raise RuntimeError(f"convergence run of {config.name!r} failed:\n{r.stderr[-3000:]}")
    return json.loads((run_dir / "metrics.json").read_text())


def plot(curves: dict[str, dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, m in curves.items():
        h = m["history"]
        ax.plot(h["step"], h["loss"], lw=1, label=f"{name} (val {m['val_loss_after']:.3f})")
    ax.set(xlabel="step", ylabel="training loss (nats/token)",
           title="RoundPipe memory ladder: the demo's Qwen3 model, same data and steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=positive_int, default=768,
                    help="width of the 12-layer model of the memory runs (default 768: 57M "
                         "parameters)")
    ap.add_argument("--elements", type=positive_int, default=16_000_000,
                    help="elements of the timed step (default 16M)")
    ap.add_argument("--repeats", type=repeats_arg, default=7,
                    help=f"interleaved timed rounds, at least {MIN_REPEATS} (median)")
    ap.add_argument("--conv-steps", type=positive_int, default=120,
                    help="training steps of each convergence run (default 120)")
    ap.add_argument("--conv-hidden", type=positive_int, default=256)
    ap.add_argument("--conv-layers", type=positive_int, default=2)
    ap.add_argument("--conv-chars", type=positive_int, default=1_000_000,
                    help="characters of training text read by the convergence runs")
    ap.add_argument("--configs", nargs="+", default=[c.name for c in CONFIGS],
                    choices=[c.name for c in CONFIGS], metavar="NAME",
                    help="configurations to run (default: all): " +
                         ", ".join(repr(c.name) for c in CONFIGS))
    ap.add_argument("--adafactor-lr", type=float, default=1e-2,
                    help="Adafactor's lr (its cap on the relative step size; default torch's)")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-convergence", action="store_true")
    ap.add_argument("--skip-loading", action="store_true",
                    help="leave out the rows of roundpipe.hf.from_pretrained's peak RSS")
    ap.add_argument("--load-layers", type=positive_int, default=18,
                    help="decoder layers of the loaded Llama (default 18: 230 MB in bf16)")
    ap.add_argument("--load-hidden", type=positive_int, default=768)
    ap.add_argument("--load-repeats", type=positive_int, default=1,
                    help="fresh processes per loading row (min-max over them)")
    ap.add_argument("--load-kinds", nargs="+", default=["nf4", "int8", "bf16"],
                    choices=["nf4", "int8", "bf16"], help="bases of the loading rows")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/memory_ladder"),
                    help="folder for the convergence runs and the plot")
    ap.add_argument("--json", type=writable_path, help="also write the results as JSON")
    qlora.add_arguments(ap)
    args = ap.parse_args(argv)

    import roundpipe.optim as rpo
    from .cpu import cpu_model

    print(f"RoundPipe memory ladder: {cpu_model()}, optimizer ISA {rpo.active_isa()}")
    configs = [c for c in CONFIGS if c.name in args.configs]
    result: dict = {"configs": [c.__dict__ for c in configs]}
    if not args.skip_memory:
        print(f"measuring host bytes per parameter (12 x {args.hidden} model, exact mode, CPU "
              "device)...", flush=True)
        result["memory"] = {c.name: measure_memory(c, args.hidden) for c in configs}
    if not args.skip_speed:
        print(f"timing the steps ({args.elements:,} elements, 1 thread)...", flush=True)
        result["speed"] = measure_speed(configs, args.elements, args.repeats)
    if not args.skip_convergence:
        args.out.mkdir(parents=True, exist_ok=True)
        result["convergence"] = {}
        for c in configs:
            print(f"training the demo's model with {c.name}...", flush=True)
            result["convergence"][c.name] = run_convergence(c, args, args.out)
        plot(result["convergence"], args.out / "memory_ladder.png")
    if not args.skip_lora:
        print("training LoRA on a bf16, int8 and NF4 frozen base...", flush=True)
        result["lora"] = qlora.measure(args)
    print(format_table(result, configs))
    if not args.skip_loading:
        print("measuring peak RSS while loading through roundpipe.hf.from_pretrained...",
              flush=True)
        result["loading"] = loading_rows(args)
    if "lora" in result:
        print(qlora.format_table(result["lora"]))
    if not args.skip_convergence:
        print(f"loss curves: {args.out / 'memory_ladder.png'}")
    if args.json:
        conv = result.get("convergence", {})
        for m in conv.values():
            m.pop("sample", None)
        write_json(args.json, result)


def loading_rows(args) -> dict:
    """The rows of :mod:`roundpipe.bench.loading` (peak RSS while loading through
    ``roundpipe.hf.from_pretrained``, NF4 / int8 / bf16 base, against the bf16 size), printed."""
    import tempfile

    from .loading import format_loading, measure_loading

    with tempfile.TemporaryDirectory() as tmp:
        rows = measure_loading(pathlib.Path(tmp), args.load_layers, args.load_hidden,
                               args.load_repeats, args.load_kinds)
    print(format_loading(rows))
    return rows


def format_table(result: dict, configs: list[Config]) -> str:
    """The ladder as a Markdown table (what docs/host_memory.md shows)."""
    mem, speed = result.get("memory", {}), result.get("speed", {})
    conv = result.get("convergence", {})
    ref = conv.get(CONFIGS[0].name)
    lines = ["| configuration | floor B/param | measured B/param | step ns/param | step B/param "
             "| % of byte floor | train loss | val loss | vs fp32 AdamW (train / val) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in configs:
        cells = [c.name, f"{c.floor:.2f}"]
        cells.append(f"{mem[c.name]:.2f}" if c.name in mem else "-")
        s = speed.get(c.name)
        if s:
            ns, pct = Figure.from_dict(s["ns"]), Figure.from_dict(s["pct_floor"])
            cells += [ns.text(3), f"{s['bytes']:.1f}", pct.text(0, "%")]
        else:
            cells += ["-", "-", "-"]
        k = conv.get(c.name)
        if k:
            train, val = k["final_loss_mean_last_10pct"], k["val_loss_after"]
            cells += [f"{train:.3f}", f"{val:.3f}",
                      f"{100 * (train / ref['final_loss_mean_last_10pct'] - 1):+.2f}% / "
                      f"{100 * (val / ref['val_loss_after'] - 1):+.2f}%" if ref else "-"]
        else:
            cells += ["-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    if "stream GB/s" in speed:
        lines.append(f"\nstreaming kernel (the byte floor's bandwidth): "
                     f"{Figure.from_dict(speed['stream GB/s']).text(1)} GB/s, 1 thread; step "
                     "figures: median (min-max) over interleaved rounds")
    return "\n".join(lines)
