"""Peers in the optimizer benchmark: the CPU optimizers a user would otherwise run next to a
GPU, on the same tensors and threads as ``roundpipe.optim``, in the same interleaved rounds.

Per configuration (:data:`CONFIGS`) and layout, one set of rounds times the floor, ours and
every peer whose package imports:

- ``Adam``, ``AdamW`` (float32): DeepSpeed's ``DeepSpeedCPUAdam`` (``adamw_mode`` False/True:
  ZeRO-Offload's CPU optimizer);
- ``Adagrad`` (float32): DeepSpeed's ``DeepSpeedCPUAdagrad`` where the installed DeepSpeed has it;
- ``AdamW int8 state``: ``state_dtype="int8"`` against torchao's ``AdamW8bit`` and bitsandbytes'
  ``AdamW8bit`` (its CPU backend), the same scheme (blocks of 256, dynamic map);
- ``AdamW bf16 master + int8 state``: bfloat16 parameters with ``stochastic_rounding=True`` and
  int8 state against ``AdamW8bit(bf16_stochastic_round=True)`` (torchao);
- ``AdamW bf16 master + bf16 state``: against torchao's ``_AdamW(bf16_stochastic_round=True)``
  (state in the parameter's dtype) and ``DeepSpeedCPUAdam(fp32_optimizer_states=False)``
  (bfloat16 parameters and state, rounded to nearest);
- ``AdamW bf16 state``: float32 parameters, bfloat16 state: no peer keeps this form, the row
  shows ours against its floor only.

None of these packages is a dependency of RoundPipe: a peer whose package is missing is skipped
with a printed note. DeepSpeed compiles its CPU ops (``cpu_adam``, ``cpu_adagrad``) with ninja
the first time they are loaded (``pip install deepspeed ninja py-cpuinfo``; minutes on 2
cores, then cached in torch's extension folder); the benchmark says so and builds them before
any timing. torchao compiles each step function with ``torch.compile`` per tensor shape on its
first step, also before the timing (the untimed steps).

Every contender, ours included, first takes two steps at lr 0.1 (two different gradients) from
the same values as ``torch.optim.X(foreach=True)`` on float32 copies, and its parameters are
compared with that reference within the configuration's tolerance (:func:`check`): a
wrongly wired peer, or one that does nothing, is reported as WRONG and the benchmark exits
non-zero after printing. Then the lr is set to 1e-3 and the timed rounds run.

A layout's tensors are cut to whole blocks of 256 elements (50M: 49,999,872; torchao keeps
float32 state for any other size). The floor of a configuration is the streaming kernel over
float32 tensors of the same layout with the float32 algorithm's state count (Adam: 28 bytes
per element), scaled per round to the configuration's bytes per element (as
``python -m roundpipe.bench memory`` does).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import roundpipe.optim as rpo

from . import Figure, paired_ratio
from .floors import floor_step

#: lr of the two checked steps (updates far above a bfloat16 step, so one that does nothing
#: cannot pass) and of the timed ones
CHECK_LR, TIMED_LR = 0.1, 1e-3
WEIGHT_DECAY = 0.01  # also for Adam and Adagrad (L2), so the check tells Adam from AdamW
BLOCK = 256  # elements per int8 block, in ours (roundpipe.optim.compact), torchao's and bnb's

#: package -> what to install for it
PACKAGES = {
    "deepspeed": "pip install deepspeed ninja py-cpuinfo (its C++ ops build on first use)",
    "torchao": "bash scripts/setup.sh --peers, then PYTHONPATH=.venv/peers; or pip install torchao",
    "bitsandbytes": "bash scripts/setup.sh --peers, then PYTHONPATH=.venv/peers; or pip install "
                    "bitsandbytes",
}

Factory = Callable[[list, float], torch.optim.Optimizer]


@dataclass(frozen=True)
class Peer:
    """A contender from another package: ``make(params, lr)`` builds it on ``params``."""

    label: str
    package: str
    make: Factory
    deepspeed_op: str | None = None  # the DeepSpeed op builder it loads, built before timing


@dataclass(frozen=True)
class Config:
    """One way of keeping a parameter's optimizer side, as ours and its peers run it."""

    name: str
    algorithm: str                  # the --algorithms name selecting it
    param_dtype: torch.dtype        # parameters and gradients
    bytes_per_element: float        # what one step must read and write per element
    floor_states: int               # float32 state arrays of the float32 algorithm (the floor)
    tolerance: str                  # "float32" | "int8" | "bfloat16" (see check())
    ours: Factory
    reference: Factory              # torch.optim on float32 copies
    peers: tuple[Peer, ...] = field(default=())
    compact: bool = False           # int8/bf16 state: needs tensors of >= 4096 elements


# --- the optimizers ------------------------------------------------------------------------

def _ours(cls, **extra) -> Factory:
    def make(params, lr):
        return cls(params, lr=lr, weight_decay=WEIGHT_DECAY, seed=0, **extra)
    return make


def _torch(cls) -> Factory:
    def make(params, lr):
        return cls(params, lr=lr, weight_decay=WEIGHT_DECAY, foreach=True)
    return make


def _deepspeed_adam(adamw: bool) -> Factory:
    def make(params, lr):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(params, lr=lr, weight_decay=WEIGHT_DECAY, adamw_mode=adamw,
                                fp32_optimizer_states=params[0].dtype == torch.float32)
    return make


def _deepspeed_adagrad(params, lr):
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    return DeepSpeedCPUAdagrad(params, lr=lr, eps=1e-10, weight_decay=WEIGHT_DECAY)


def _torchao(name: str, **extra) -> Factory:
    def make(params, lr):
        import torchao.optim
        return getattr(torchao.optim, name)(params, lr=lr, weight_decay=WEIGHT_DECAY, **extra)
    return make


def _bitsandbytes_adamw8bit(params, lr):
    import bitsandbytes
    return bitsandbytes.optim.AdamW8bit(params, lr=lr, weight_decay=WEIGHT_DECAY)


F32, BF16 = torch.float32, torch.bfloat16
_INT8_STATE = 2 * (1 + 4 / BLOCK)  # a code per value and a float32 absmax per 256, read + write
CONFIGS = [
    Config("Adam", "Adam", F32, 28, 2, "float32", _ours(rpo.Adam), _torch(torch.optim.Adam),
           (Peer("DeepSpeedCPUAdam", "deepspeed", _deepspeed_adam(False), "CPUAdamBuilder"),)),
    Config("AdamW", "AdamW", F32, 28, 2, "float32", _ours(rpo.AdamW), _torch(torch.optim.AdamW),
           (Peer("DeepSpeedCPUAdam adamw", "deepspeed", _deepspeed_adam(True),
                 "CPUAdamBuilder"),)),
    Config("Adagrad", "Adagrad", F32, 20, 1, "float32", _ours(rpo.Adagrad),
           _torch(torch.optim.Adagrad),
           (Peer("DeepSpeedCPUAdagrad", "deepspeed", _deepspeed_adagrad, "CPUAdagradBuilder"),)),
    Config("AdamW bf16 state", "AdamW", F32, 12 + 2 * 4, 2, "bfloat16",
           _ours(rpo.AdamW, state_dtype=BF16), _torch(torch.optim.AdamW), compact=True),
    Config("AdamW int8 state", "AdamW", F32, 12 + 2 * _INT8_STATE, 2, "int8",
           _ours(rpo.AdamW, state_dtype="int8"), _torch(torch.optim.AdamW),
           (Peer("torchao AdamW8bit", "torchao", _torchao("AdamW8bit")),
            Peer("bitsandbytes AdamW8bit", "bitsandbytes", _bitsandbytes_adamw8bit)),
           compact=True),
    Config("AdamW bf16 master+int8", "AdamW", BF16, 6 + 2 * _INT8_STATE, 2, "int8",
           _ours(rpo.AdamW, state_dtype="int8", stochastic_rounding=True),
           _torch(torch.optim.AdamW),
           (Peer("torchao AdamW8bit bf16 SR", "torchao",
                 _torchao("AdamW8bit", bf16_stochastic_round=True)),), compact=True),
    Config("AdamW bf16 master+state", "AdamW", BF16, 6 + 2 * 4, 2, "bfloat16",
           _ours(rpo.AdamW, state_dtype=BF16, stochastic_rounding=True),
           _torch(torch.optim.AdamW),
           (Peer("torchao _AdamW bf16 SR", "torchao",
                 _torchao("_AdamW", bf16_stochastic_round=True)),
            Peer("DeepSpeedCPUAdam bf16 (RN)", "deepspeed", _deepspeed_adam(True),
                 "CPUAdamBuilder")), compact=True),
]


def check(kind: str, params, reference, lr: float) -> dict:
    """Whether ``params`` match the float32 ``reference`` after the two checked steps at ``lr``:
    ``float32``: every element within rounding (1e-6 absolute plus 1e-6 relative);
    ``bfloat16``: every element within two bfloat16 steps of its value (one rounding per step)
    plus 2% of ``lr`` (state rounded to bfloat16); ``int8``: the mean error at most 1% of ``lr``
    (8-bit state makes single elements whose moments nearly cancel err by a large part of an
    update, in bitsandbytes' and torchao's as in ours; measured means are ~0.35%, while an
    optimizer that does nothing errs by about 2 lr). Returns {max_abs_error, mean_abs_error,
    worst_over_tolerance (float32, bfloat16) or mean_over_tolerance (int8), ok}."""
    diffs = [(p.detach().float() - r.detach()).abs().flatten() for p, r in zip(params, reference)]
    d = torch.cat(diffs)
    out = {"max_abs_error": float(d.max()), "mean_abs_error": float(d.double().mean())}
    if kind == "int8":
        out["mean_over_tolerance"] = out["mean_abs_error"] / (0.01 * lr)
        out["ok"] = out["mean_over_tolerance"] <= 1.0
        return out
    mag = torch.cat([r.detach().abs().flatten() for r in reference])
    if kind == "float32":
        tol = 1e-6 + 1e-6 * mag
    elif kind == "bfloat16":
        tol = 2 ** -6 * mag + 0.02 * lr
    else:
        raise ValueError(f"unknown check kind {kind!r}")
    out["worst_over_tolerance"] = float((d / tol).max())
    out["ok"] = out["worst_over_tolerance"] <= 1.0
    return out


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Sets every group's lr (in place where it is a tensor, as torchao keeps it)."""
    for group in opt.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


# --- what is installed, DeepSpeed's ops, OpenMP threads ----------------------------------------

def find_peers(log=print, packages=None) -> dict[str, str | None]:
    """package -> None when it imports, else why not (printed as a note with what to
    install); ``packages``: only these (default: all of :data:`PACKAGES`), the others are
    left out with a note."""
    found: dict[str, str | None] = {}
    for package, install in PACKAGES.items():
        if packages is not None and package not in packages:
            found[package] = "left out by --peer-packages"
            log(f"note: {package}'s peers left out (--peer-packages)")
            continue
        try:
            importlib.import_module(package)
            found[package] = None
        except Exception as e:  # ImportError, or a package that fails on this torch
            found[package] = f"{type(e).__name__}: {e}".splitlines()[0]
            log(f"note: {package} not usable ({found[package]}): its peers are skipped "
                f"({install})")
    return found


def deepspeed_op_built(builder_name: str) -> bool:
    """Whether DeepSpeed's op loads without compiling: installed prebuilt, or already built in
    torch's extension folder (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``).
    False where DeepSpeed or that builder is missing."""
    try:
        from deepspeed.ops import op_builder
        builder = getattr(op_builder, builder_name)()
    except Exception:
        return False
    try:
        importlib.import_module(builder.absolute_name())
        return True
    except Exception:
        pass
    from torch.utils.cpp_extension import _get_build_directory
    folder = _get_build_directory(builder.name, verbose=False)
    return os.path.isfile(os.path.join(folder, builder.name + ".so"))


def build_deepspeed_op(builder_name: str, log=print) -> str | None:
    """Loads DeepSpeed's op, building it first if needed (said before: minutes); None when it
    loads, else why not."""
    try:
        from deepspeed.ops import op_builder
        builder = getattr(op_builder, builder_name)()
    except Exception as e:
        return f"{builder_name} not found in this DeepSpeed ({type(e).__name__}: {e})"
    built = deepspeed_op_built(builder_name)
    if not built:
        log(f"DeepSpeed's {builder.name} op is not built yet: building it now with ninja "
            "(once: minutes on 2 cores, then cached in torch's extension folder), before any "
            "timing ...")
    start = time.perf_counter()
    try:
        builder.load(verbose=False)
    except Exception as e:
        return f"its {builder.name} op failed to build or load ({type(e).__name__}: {e})"
    if not built:
        log(f"... built in {time.perf_counter() - start:.0f} s")
    return None


def openmp_runtimes() -> list[str]:
    """The OpenMP runtimes loaded in this process (libgomp, libiomp, libomp), by path: torch's,
    and any other that a peer's extension brought (Linux; elsewhere an empty list)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if re.match(r"lib(g|i)?omp[\w.-]*\.so", os.path.basename(p)))


def set_openmp_threads(threads: int) -> dict[str, int]:
    """``omp_set_num_threads(threads)`` in every loaded OpenMP runtime (DeepSpeed's ops run
    OpenMP loops), for the calling thread; returns each runtime's ``omp_get_max_threads()``."""
    out = {}
    for path in openmp_runtimes():
        try:
            lib = ctypes.CDLL(path)
            lib.omp_set_num_threads(ctypes.c_int(threads))
            out[path] = int(lib.omp_get_max_threads())
        except (OSError, AttributeError):
            continue
    return out


# --- one configuration on one layout --------------------------------------------------------

def _fresh(values: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(v.clone()) for v in values]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    return ps


def prepare(config: Config, peers: list[Peer], count: int, size: int, seed: int = 0):
    """The contenders of ``config`` on ``count`` tensors of ``size`` elements, each on its own
    copy of the same values and gradients, checked against torch.optim: returns (steps: name
    -> a callable doing one step at lr 1e-3, checks: name -> :func:`check`'s result). The
    floor (float32 twins, the float32 algorithm's bytes) is under "floor"."""
    gen = torch.Generator().manual_seed(seed)
    values = [(torch.rand(size, generator=gen) - 0.5).to(config.param_dtype)
              for _ in range(count)]
    grads = [[(torch.rand(size, generator=gen) - 0.5).to(config.param_dtype)
              for _ in range(count)] for _ in range(2)]
    contenders = {"roundpipe": config.ours, **{p.label: p.make for p in peers}}
    params = {k: _fresh(values, grads[0]) for k in contenders}
    opts = {k: make(params[k], CHECK_LR) for k, make in contenders.items()}
    ref_params = _fresh([v.float() for v in values], [g.float() for g in grads[0]])
    ref = config.reference(ref_params, CHECK_LR)
    for step in range(2):
        for k, opt in opts.items():
            if step:
                for p, g in zip(params[k], grads[1]):
                    p.grad.copy_(g)
            opt.step()
        if step:
            for p, g in zip(ref_params, grads[1]):
                p.grad.copy_(g)
        ref.step()
    checks = {}
    for k in opts:
        checks[k] = check(config.tolerance, params[k], ref_params, CHECK_LR)
        set_lr(opts[k], TIMED_LR)
    del ref, ref_params
    twins = _fresh([v.float() for v in values], [g.float() for g in grads[1]])
    floor, _ = floor_step(twins, config.floor_states)
    steps = {"floor": floor, **{k: opt.step for k, opt in opts.items()}}
    return steps, checks


def row(config: Config, layout: str, label: str, count: int, size: int,
        ns: dict[str, list[float]], checks: dict) -> dict:
    """A peers-table row: ns per element of every contender (median, range, samples; the
    floor's scaled to the configuration's bytes), our share of the floor and, per peer, the
    per-round ratio peer time / our time."""
    floor_bytes = 4 * (2 * config.floor_states + 3)
    ns = dict(ns, floor=[f * config.bytes_per_element / floor_bytes for f in ns["floor"]])
    peers = [k for k in ns if k not in ("floor", "roundpipe")]
    return {
        "config": config.name, "algorithm": config.algorithm, "layout": layout, "label": label,
        "tensors": count, "elements": count * size,
        "param_dtype": str(config.param_dtype).replace("torch.", ""),
        "bytes_per_element": config.bytes_per_element,
        "ns_per_param": {k: Figure.of(v).median for k, v in ns.items()},
        "ns_per_param_range": {k: [min(v), max(v)] for k, v in ns.items()},
        "ns_per_param_samples": ns,
        "floor_fraction": paired_ratio(ns["floor"], ns["roundpipe"]).as_dict(),
        "peers": {k: {"speedup": paired_ratio(ns[k], ns["roundpipe"]).as_dict()} for k in peers},
        "checks": checks,
    }


HEADER = (f"{'configuration':24s} {'layout':>8s} {'B/el':>5s} {'floor ns':>8s} {'ours ns':>8s} "
          f"{'spr':>4s} {'%floor':>6s}  {'peer':26s} {'ns':>8s} {'spr':>4s} "
          f"{'ours faster (range)':>20s}")

LEGEND = """\
Peers table (same tensors, same threads, same interleaved rounds; ns per element, medians):
  configuration  parameters and state as kept: AdamW bf16 state = float32 parameters with
              bfloat16 state; bf16 master = bfloat16 parameters (and gradients) stepped in place
              with stochastic rounding (SR); int8 = 8-bit blockwise state (blocks of 256)
  B/el        bytes one step must read and write per element (int8 state: a code per value and
              a float32 absmax per 256 values)
  floor ns    the streaming kernel over float32 tensors of the same layout, scaled per round to
              B/el (its bandwidth times the configuration's bytes)
  %floor      floor time / our time, median of the per-round ratios
  peer        DeepSpeedCPUAdam / DeepSpeedCPUAdagrad (DeepSpeed's C++ CPU ops, as ZeRO-Offload
              runs them; bf16 (RN): bfloat16 parameters and state, rounded to nearest), torchao's
              AdamW8bit and _AdamW (torch.compile'd per tensor), bitsandbytes' AdamW8bit (its
              CPU backend)
  ours faster peer time / our time: median of the per-round ratios (min-max)
  WRONG       the contender's parameters after two steps at lr 0.1 differ from
              torch.optim's (float32 copies, same values and gradients) beyond the tolerance"""


def format_row(r: dict) -> list[str]:
    """The lines of one row: the configuration, ours and its first peer, then one line per
    further peer."""
    samples = r["ns_per_param_samples"]
    ours, frac = Figure.of(samples["roundpipe"]), Figure.from_dict(r["floor_fraction"])
    head = (f"{r['config']:24s} {r['label']:>8s} {r['bytes_per_element']:5.1f} "
            f"{r['ns_per_param']['floor']:8.3f} {ours.median:8.3f} {100 * ours.spread:3.0f}% "
            f"{100 * frac.median:5.0f}%")
    if not r["checks"]["roundpipe"]["ok"]:
        head += "  WRONG (ours)"
    lines = []
    for i, (name, peer) in enumerate(r["peers"].items() or [("", None)]):
        left = head if i == 0 else " " * len(head)
        if peer is None:
            lines.append(f"{left}  {'(no peer installed or none keeps this form)'}")
            continue
        fig, speed = Figure.of(samples[name]), Figure.from_dict(peer["speedup"])
        line = (f"{left}  {name:26s} {fig.median:8.3f} {100 * fig.spread:3.0f}% "
                f"{speed.median:6.2f}x ({speed.low:.2f}-{speed.high:.2f})")
        if speed.contains(1.0):
            line += "  within noise"
        if not r["checks"][name]["ok"]:
            line += f"  WRONG (max error {r['checks'][name]['max_abs_error']:.2g})"
        lines.append(line)
    return lines


def selected(algorithms, found: dict[str, str | None]) -> list[tuple[Config, list[Peer]]]:
    """The configurations of ``algorithms`` with their peers whose package imports."""
    return [(c, [p for p in c.peers if found.get(p.package) is None])
            for c in CONFIGS if c.algorithm in algorithms]


def run(algorithms, layouts: list[tuple[str, int, int, str]], threads: int, repeats: int,
        measure, log=print, packages=None) -> dict:
    """The peers table: for each layout ``(name, tensors, elements each, label)`` and each
    configuration of ``algorithms``, ours and the installed peers (of ``packages``, default
    all) timed by ``measure(steps, repeats, elements)`` (the optimizer benchmark's interleaved
    rounds). DeepSpeed's ops are built first. Returns {"rows", "skipped", "openmp_threads",
    "wrong", "packages", "deepspeed_ops_failed"}."""
    found = find_peers(log, packages)
    configs = selected(algorithms, found)
    failed_ops: dict[str, str] = {}
    for op in sorted({p.deepspeed_op for _, ps in configs for p in ps if p.deepspeed_op}):
        why = build_deepspeed_op(op, log)
        if why:
            failed_ops[op] = why
            log(f"note: DeepSpeed: {why}: its peers are skipped")
    configs = [(c, [p for p in ps if p.deepspeed_op not in failed_ops]) for c, ps in configs]
    openmp = set_openmp_threads(threads)
    log("OpenMP runtimes (torch's, and DeepSpeed's ops'): " + (
        ", ".join(f"{path} ({n} thread{'s' * (n != 1)})" for path, n in openmp.items())
        or "none found"))
    log(HEADER)
    rows, skipped, wrong = [], [], []
    for layout, count, size, label in layouts:
        # torchao keeps float32 state for a tensor whose size is not a multiple of its block
        # (50M is not): every row of the layout steps the same, whole blocks
        if size >= BLOCK:
            size -= size % BLOCK
        for config, peers in configs:
            if config.compact and size < rpo.compact.INT8_MIN_NUMEL:
                skipped.append(f"{config.name} on {label}: tensors under "
                               f"{rpo.compact.INT8_MIN_NUMEL} elements keep float32 state")
                continue
            steps, checks = prepare(config, peers, count, size)
            r = row(config, layout, label, count, size, measure(steps, repeats, count * size),
                    checks)
            del steps
            rows.append(r)
            wrong += [f"{config.name} {label}: {k}" for k, c in checks.items() if not c["ok"]]
            for line in format_row(r):
                log(line)
    for s in skipped:
        log(f"skipped: {s}")
    return {"rows": rows, "skipped": skipped, "openmp_threads": openmp, "wrong": wrong,
            "packages": found, "deepspeed_ops_failed": failed_ops}
