"""Optimizer-step benchmark: for each algorithm and parameter layout, in one run,

- the floor: ``roundpipe._C.stream_step``, which moves exactly the algorithm's bytes per element
  (reads param, grad and each state array; writes param and each state array) with one add per
  element, on the same threads and ISA as our optimizers, over the same tensors through the same
  per-tensor checks (:mod:`roundpipe.bench.floors`);
- ``roundpipe.optim.X``;
- ``torch.optim.X`` with ``foreach=False``, ``foreach=True`` and, where torch has one, ``fused=True``.

A second table covers the fused mixed-precision pass (``CpuOptimizer.fused_step``: bfloat16
gradient in, bfloat16 model copy out, in one pass) against the same work done separately
(convert the gradient to float32, step, copy the parameter to bfloat16), with its own floor
(``stream_step`` through the same fused pass, moving the same bytes).

A third table (:mod:`roundpipe.bench.peers`) puts the optimizers users would otherwise pick next
to ours, where their packages are installed (never a dependency of RoundPipe; a missing one is
skipped with a printed note): DeepSpeed's ``DeepSpeedCPUAdam``/``DeepSpeedCPUAdagrad`` against
our float32 steps, torchao's ``AdamW8bit``/``_AdamW(bf16_stochastic_round=True)`` and
bitsandbytes' ``AdamW8bit`` against our int8 state and bfloat16 master weights, same tensors,
threads and interleaved rounds (``--peers only`` for just that table, ``none`` to skip it).

Each contender steps its own copy of the parameters and state; contenders are timed in turn,
``--repeats`` rounds (rotating who goes first, so machine drift hits all alike), and every
figure is the median over the rounds with its min-max range; ratios are taken per round.
Our pool, torch's intra-op threads and the peers' OpenMP loops all get ``--threads`` (a number
or ``all``). Also reported:
a torch matrix multiply timed alone and right after one of our steps (the pool's workers must be
asleep, not spinning, when the step returns).

    python -m roundpipe.bench                        # all algorithms, three layouts, 1 thread
    python -m roundpipe.bench --algorithms Adam SGD --layouts 200x250k --threads 2
    python -m roundpipe.bench --scale 0.001 --repeats 5 --json out.json   # a quick run
    python -m roundpipe.bench --mixed-layout none     # skip the mixed-precision table
    python -m roundpipe.bench --peers only --algorithms Adam AdamW --layouts 50M --threads all
    python -m roundpipe.bench --clock thread        # CPU time: on a machine shared with others
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import roundpipe.optim as rpo
from roundpipe import _C

from . import (write_json, MIN_REPEATS, Figure, available_cpus, compare, human, interleave, paired_ratio,
               positive_float, positive_int, repeats_arg, writable_path)
from . import peers as peer_table
from .cpu import cpu_model, cpu_vendor, describe_prefetch
from .floors import floor_step, matrix_shape

# name -> (roundpipe class, torch class, whether torch has fused=True for CPU)
ALGORITHMS = {
    "Adadelta": (rpo.Adadelta, torch.optim.Adadelta, False),
    "Adafactor": (rpo.Adafactor, torch.optim.Adafactor, False),
    "Adagrad": (rpo.Adagrad, torch.optim.Adagrad, True),
    "Adam": (rpo.Adam, torch.optim.Adam, True),
    "AdamW": (rpo.AdamW, torch.optim.AdamW, True),
    "Adamax": (rpo.Adamax, torch.optim.Adamax, False),
    "ASGD": (rpo.ASGD, torch.optim.ASGD, False),
    "NAdam": (rpo.NAdam, torch.optim.NAdam, False),
    "RAdam": (rpo.RAdam, torch.optim.RAdam, False),
    "RMSprop": (rpo.RMSprop, torch.optim.RMSprop, False),
    "Rprop": (rpo.Rprop, torch.optim.Rprop, False),
    "SGD": (rpo.SGD, torch.optim.SGD, True),
}
# SGD with torch's default momentum 0 keeps no state; the benchmark uses momentum 0.9.
KWARGS = {"SGD": dict(momentum=0.9)}
# Adafactor factors the second moment of matrices: its tensors are matrices of the layout's
# sizes, and its floor two streaming passes (roundpipe.bench.floors)
MATRICES = {"Adafactor"}
LAYOUTS = {"50M": (1, 50_000_000), "200x250k": (200, 250_000), "20000x1k": (20_000, 1_000)}


def _params(count: int, size: int, gen: torch.Generator,
            matrix: bool = False) -> list[torch.nn.Parameter]:
    shape = matrix_shape(size) if matrix else (size,)
    ps = [torch.nn.Parameter(torch.rand(shape, generator=gen) - 0.5) for _ in range(count)]
    for p in ps:
        p.grad = torch.rand(shape, generator=gen) - 0.5
    return ps


def _clone(ps: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    out = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for o, p in zip(out, ps):
        o.grad = p.grad.clone()
    return out


def _contenders(name: str, count: int, size: int, gen: torch.Generator) -> dict:
    """name -> a zero-argument callable doing one step, each on its own tensors."""
    ours_cls, torch_cls, has_fused = ALGORITHMS[name]
    kwargs = dict(lr=1e-3, **KWARGS.get(name, {}))
    base = _params(count, size, gen, matrix=name in MATRICES)
    ours = ours_cls(base, **kwargs)
    ours.step()  # creates the state
    states = [k for k, v in ours.state[base[0]].items() if torch.is_tensor(v) and v.dim() > 0]
    floor, bytes_per_element = (floor_step(_clone(base), 0, passes=2) if name in MATRICES
                                else floor_step(_clone(base), len(states)))
    steps = {"floor": floor, "roundpipe": ours.step}
    variants = {"torch foreach=False": dict(foreach=False), "torch foreach=True": dict(foreach=True)}
    if has_fused:
        variants["torch fused=True"] = dict(fused=True)
    for label, extra in variants.items():
        opt = torch_cls(_clone(base), **kwargs, **extra)
        opt.step()
        steps[label] = opt.step
    return steps, bytes_per_element


def _mixed_contenders(name: str, count: int, size: int, gen: torch.Generator):
    """name -> one step of: the fused pass's floor, fused_step (bf16 grad in, bf16 copy out),
    and the same done separately; plus the bytes per element of the fused and separate ways."""
    ours_cls = ALGORITHMS[name][0]
    kwargs = dict(lr=1e-3, **KWARGS.get(name, {}))
    fused_params = _params(count, size, gen)
    grads16 = [p.grad.to(torch.bfloat16) for p in fused_params]
    for p in fused_params:
        p.grad = None
    copies = [torch.empty_like(g) for g in grads16]
    fused = ours_cls(fused_params, **kwargs)
    fused.fused_step(fused_params, grads16, copies)  # creates the state
    states = [k for k, v in fused.state[fused_params[0]].items() if torch.is_tensor(v) and v.dim() > 0]
    sep_params = [torch.nn.Parameter(p.detach().clone()) for p in fused_params]
    sep_copies = [c.clone() for c in copies]
    separate = ours_cls(sep_params, **kwargs)

    def separate_step():
        for p, g in zip(sep_params, grads16):
            p.grad = g.float()                      # convert: read 2, write 4 bytes
        separate.step()                             # step on float32 gradients
        torch._foreach_copy_(sep_copies, sep_params)  # copy: read 4, write 2 bytes

    floor_params = [p.detach().clone() for p in fused_params]
    floor_states = [[fused.state[p][k].clone() for p in fused_params] for k in states]
    floor_copies = [c.clone() for c in copies]
    floor_opts = _C.StreamOptions()
    floor_opts.states = len(states)
    steps = {
        "floor": lambda: _C.stream_step(floor_opts, floor_params, grads16, floor_states, [],
                                        floor_copies),
        "fused": lambda: fused.fused_step(fused_params, grads16, copies),
        "separate": separate_step,
    }
    fused_bytes = 2 + 4 * (2 * len(states) + 2) + 2
    # separate: the float32 step moves as many bytes as the fused pass (a 4-byte gradient instead
    # of a 2-byte gradient and a 2-byte copy), plus the conversion (2 + 4) and the copy (4 + 2)
    return steps, fused_bytes, fused_bytes + 6 + 6


def layout_shape(layout: str, scale: float) -> tuple[int, int]:
    """``(tensors, elements per tensor)`` of ``layout`` under ``--scale``: a multi-tensor layout
    gets fewer tensors of the same size, the single tensor fewer elements."""
    count, size = LAYOUTS[layout]
    if count > 1:
        return max(1, round(count * scale)), size
    return 1, max(1, round(size * scale))


def layout_label(count: int, size: int) -> str:
    """The real sizes, named as the layouts are: ``50M``, ``200x250k``, ``10x250k``."""
    return human(size) if count == 1 else f"{count}x{human(size)}"


# untimed rounds at most, to let the prefetch calibration finish before the timing
CALIBRATION_ROUNDS = 5


# --clock: what a step's time is. "thread": the calling thread's CPU time, which leaves out the
# time the OS gives other processes (on a machine shared with other work); with one thread every
# contender (our pool, torch's intra-op threads, the peers' OpenMP loops) runs on the caller.
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def _timed(fn, clock):
    def run() -> float:
        start = clock()
        fn()
        return clock() - start
    return run


def _measure(steps: dict, repeats: int, elements: int,
             clock=time.perf_counter) -> dict[str, list[float]]:
    """ns per element of every step (timed by ``clock``), per repeat, interleaved, after one
    untimed step each (the first step creates the state and, for ours, the param group's step
    plan), and more untimed rounds (up to :data:`CALIBRATION_ROUNDS`) while the kernels are
    calibrating their prefetch distance on steps of this size (roundpipe/tuning.hpp), so that
    every timed step runs with the distance chosen."""
    for _ in range(CALIBRATION_ROUNDS):
        for fn in steps.values():
            fn()
        if (rpo.prefetch_choice()["source"] != "default (calibrating)"
                or elements < _C.PREFETCH_CALIBRATION_ELEMENTS):
            break
    times = interleave({k: _timed(fn, clock) for k, fn in steps.items()}, repeats)
    return {k: [1e9 * t / elements for t in v] for k, v in times.items()}


def _row(algorithm: str, layout: str, count: int, size: int, bytes_per_element: int,
         ns: dict[str, list[float]], ours: str) -> dict:
    """A table row: every contender's ns per element (median, range, samples), and per-round
    ratios: the floor over ``ours`` and the best torch variant (or ``separate``) over ``ours``."""
    others = [k for k in ns if k not in ("floor", ours)]
    best = min(others, key=lambda k: statistics.median(ns[k]))
    return {
        "algorithm": algorithm, "layout": layout, "label": layout_label(count, size),
        "tensors": count, "elements": count * size, "bytes_per_element": bytes_per_element,
        "ns_per_param": {k: statistics.median(v) for k, v in ns.items()},
        "ns_per_param_range": {k: [min(v), max(v)] for k, v in ns.items()},
        "ns_per_param_samples": ns, "ours": ours, "best_other": best,
        "floor_fraction": paired_ratio(ns["floor"], ns[ours]).as_dict(),
        "speedup": paired_ratio(ns[best], ns[ours]).as_dict(),
    }


def _fig(row: dict, key: str) -> Figure:
    return Figure.of(row["ns_per_param_samples"][key])


def format_row(r: dict) -> str:
    """One line of either table (see :data:`LEGEND`)."""
    floor, ours, best = _fig(r, "floor"), _fig(r, r["ours"]), _fig(r, r["best_other"])
    frac, speed = Figure.from_dict(r["floor_fraction"]), Figure.from_dict(r["speedup"])
    name = r["best_other"].replace("torch ", "") if r["ours"] == "roundpipe" else ""
    line = (f"{r['algorithm']:9s} {r['label']:>10s} {r['bytes_per_element']:4d} "
            f"{floor.median:8.3f} {100 * floor.spread:3.0f}% {ours.median:8.3f} "
            f"{100 * ours.spread:3.0f}% {r['bytes_per_element'] / ours.median:6.1f} "
            f"{100 * frac.median:5.0f}% {name:>17s} {best.median:8.3f} {100 * best.spread:3.0f}% "
            f"{speed.median:6.2f}x ({speed.low:.2f}-{speed.high:.2f})")
    return line + ("  within noise" if speed.contains(1.0) else "")


HEADER = (f"{'algorithm':9s} {'layout':>10s} {'B/el':>4s} {'floor ns':>8s} {'spr':>4s} "
          f"{'ours ns':>8s} {'spr':>4s} {'GB/s':>6s} {'%floor':>6s} {'torch best':>17s} "
          f"{'ns':>8s} {'spr':>4s} {'speed-up (range)':>18s}")
MIXED_HEADER = HEADER.replace("ours ns", "fused ns").replace("torch best", "separate")

LEGEND = """\
Columns (ns = nanoseconds per parameter element per step, the median over the repeats):
  layout      the tensors stepped, as they are after --scale: 50M = one tensor of 50M
              elements, 200x250k = 200 tensors of 250k elements
  B/el        bytes the step must move per element: reads of the parameter, the gradient and
              each state array and writes of the parameter and each state array, 4 bytes each
              in float32 (Adam: read p, g, m, v and write p, m, v: 7 x 4 = 28; Adafactor, on
              matrices, reads the gradient three times: 24)
  floor ns    a streaming kernel (roundpipe._C.stream_step) moving exactly B/el bytes per
              element with one add, on the same threads and ISA, over the same tensors through
              the same per-tensor checks as our step: the memory-bandwidth floor (on many small
              tensors, plus what any step over them pays per tensor)
  ours ns     roundpipe.optim.<algorithm>.step()
  spr         (max - min) / median of the column before it, over the repeats
  GB/s        B/el / ours ns: the memory bandwidth our step reaches
  %floor      floor time / our time (100% = at the floor), median of the per-round ratios
  torch best  the fastest (by median) of torch.optim.<algorithm> with foreach=False,
              foreach=True and fused=True where torch has it
  speed-up    torch best time / our time: median of the per-round ratios (min-max); "within
              noise" when that range includes 1
Mixed-precision table (bf16 gradient in, bf16 model copy out, one pass):
  B/el        of the fused pass: the float32 step's bytes with a 2-byte gradient read and a
              2-byte model copy written instead of a 4-byte gradient
  floor ns    stream_step through the same fused pass; fused ns: CpuOptimizer.fused_step
  separate    convert the gradient to float32 (2 + 4 bytes), step, copy the parameter to bf16
              (4 + 2 bytes): B/el + 12 bytes; speed-up: separate time / fused time"""


def matmul_interference(repeats: int) -> dict:
    """A 512x512 matmul timed alone and right after a RoundPipe step (the pool's workers must
    be asleep, not spinning, when a step returns): per-repeat medians of five of each."""
    a, b = torch.rand(512, 512), torch.rand(512, 512)
    opt = rpo.Adam(_params(16, 65536, torch.Generator().manual_seed(1)))

    def pair() -> tuple[float, float]:
        alone, after = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            alone.append(time.perf_counter() - t0)
            opt.step()
            t0 = time.perf_counter()
            a @ b
            after.append(time.perf_counter() - t0)
        return statistics.median(alone), statistics.median(after)

    pairs = [pair() for _ in range(repeats)]
    return {"alone_ms": Figure.of([1e3 * p[0] for p in pairs]).as_dict(),
            "after_step_ms": Figure.of([1e3 * p[1] for p in pairs]).as_dict(),
            "after_over_alone": paired_ratio([p[1] for p in pairs], [p[0] for p in pairs]).as_dict()}


def run_mixed(algorithms, layout: str, repeats: int, scale: float, log=print,
              measure=_measure) -> list[dict]:
    count, size = layout_shape(layout, scale)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for name in algorithms:
        if name in MATRICES:  # three passes: not the one-pass comparison this table makes
            continue
        steps, fused_bytes, separate_bytes = _mixed_contenders(name, count, size, gen)
        row = _row(name, layout, count, size, fused_bytes,
                   measure(steps, repeats, count * size), "fused")
        row.update(fused_bytes_per_element=fused_bytes, separate_bytes_per_element=separate_bytes)
        rows.append(row)
        log(format_row(row))
        del steps
    return rows


def threads_arg(text: str) -> int:
    """argparse type: a thread count >= 1, or ``all``: the CPUs this process may run on."""
    if text == "all":
        return available_cpus()
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 1 or 'all', got {text!r}") from None


def _threads_text(text: str) -> str:
    threads_arg(text)  # checked, kept as written (the header says "--threads all")
    return text


def thread_setup(threads: int) -> dict:
    """The threads this benchmark runs with, as they are set (not as asked)."""
    return {"torch_intra_op": torch.get_num_threads(), "roundpipe_pool": rpo.num_threads(),
            "device_workers": 0, "cpus_available": available_cpus(), "isa": rpo.active_isa(),
            "cpu": cpu_model(), "cpu_vendor": cpu_vendor(), "threads_arg": threads}


# the single-tensor layout and the multi-tensor layout of the same bytes, compared by layout_gaps
SAME_BYTES = ("50M", "200x250k")


def layout_gaps(rows: list[dict]) -> list[dict]:
    """Per algorithm measured on both layouts of :data:`SAME_BYTES` with as many elements: our
    time per element on the one tensor over that on the many (measured in different rounds, so
    also normalised by each layout's floor, measured in the same rounds as its step)."""
    by = {(r["algorithm"], r["layout"]): r for r in rows}
    gaps = []
    for (name, layout), one in by.items():
        many = by.get((name, SAME_BYTES[1]))
        if layout != SAME_BYTES[0] or many is None or many["elements"] != one["elements"]:
            continue
        ratio = one["ns_per_param"]["roundpipe"] / many["ns_per_param"]["roundpipe"]
        fractions = (Figure.from_dict(one["floor_fraction"]).median,
                     Figure.from_dict(many["floor_fraction"]).median)
        gaps.append({"algorithm": name, "one": one["label"], "many": many["label"],
                     "time_ratio": ratio, "floor_fraction": fractions,
                     "floor_normalised_ratio": fractions[1] / fractions[0]})
    return gaps


def format_gap(g: dict) -> str:
    """One line of :func:`layout_gaps`' output: the time ratio, the floor-normalised one and
    both layouts' fractions of their floor."""
    return (f"{g['algorithm']:9s} one tensor ({g['one']}) / {g['many']}: "
            f"{g['time_ratio']:.3f}x the time per element; floor-normalised "
            f"{g['floor_normalised_ratio']:.3f}x ({100 * g['floor_fraction'][0]:.0f}% vs "
            f"{100 * g['floor_fraction'][1]:.0f}% of the floor)")


def run(algorithms, layouts, threads: int, repeats: int, scale: float, log=print,
        mixed_layout: str | None = None, peers: str = "none", peer_packages=None,
        clock: str = "wall") -> dict:
    """The benchmark: the main table (unless ``peers == "only"``), the mixed-precision table
    on ``mixed_layout`` (None: skipped), and the peers table (``peers``: ``auto``, ``only`` or
    ``none``; ``peer_packages``: whose peers, default all installed), every step timed by
    ``clock`` (:data:`CLOCKS`; ``thread`` only with one thread); returns everything as a dict
    (the ``--json`` file)."""
    if clock == "thread" and threads != 1:
        raise ValueError(f"clock 'thread' needs threads=1 (the caller runs every step), got "
                         f"{threads}")
    measure = functools.partial(_measure, clock=CLOCKS[clock])
    rpo.set_num_threads(threads)
    torch.set_num_threads(threads)
    setup = thread_setup(threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    if peers != "only":
        log(HEADER)
        for layout in layouts:
            count, size = layout_shape(layout, scale)
            for name in algorithms:
                steps, bytes_per_element = _contenders(name, count, size, gen)
                row = _row(name, layout, count, size, bytes_per_element,
                           measure(steps, repeats, count * size), "roundpipe")
                rows.append(row)
                log(format_row(row))
                del steps
    gaps = layout_gaps(rows)
    if gaps:
        log("one tensor against the same elements split into many (ours; measured in different "
            "rounds):")
        for g in gaps:
            log(format_gap(g))
    mixed = []
    if mixed_layout is not None and peers != "only":
        log("mixed precision (bf16 gradient in, bf16 model copy out) vs convert + step + copy:")
        log(MIXED_HEADER)
        mixed = run_mixed(algorithms, mixed_layout, repeats, scale, log, measure)
    peer_result = None
    if peers != "none":
        log("peers: the CPU optimizers users would otherwise pick, on the same tensors, threads "
            "and rounds:")
        shapes = [(layout, *layout_shape(layout, scale)) for layout in layouts]
        peer_result = peer_table.run(algorithms,
                                     [(n, c, s, layout_label(c, s)) for n, c, s in shapes],
                                     threads, repeats, measure, log, peer_packages)
    return {"threads": setup, "isa": rpo.active_isa(), "repeats": repeats, "scale": scale,
            "clock": clock,
            "rows": rows, "gaps": gaps, "mixed": mixed, "peers": peer_result,
            "matmul": matmul_interference(repeats), "prefetch": rpo.prefetch_choice()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=LEGEND + "\n" + peer_table.LEGEND +
                                        "\n\nThe other benchmarks: python -m "
                                        "roundpipe.bench pipeline --help (RoundPipe training "
                                        "with and without overlap), python -m roundpipe.bench "
                                        "overhead --help (the fixed cost of a call)")
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS),
                    help="parameter layouts by their full-size names (default: all three)")
    ap.add_argument("--threads", type=_threads_text, default="1",
                    help="threads of our pool, torch's intra-op threads and the OpenMP loops of "
                         "DeepSpeed's ops alike: a number or 'all' (the CPUs this process may "
                         "use); default 1")
    ap.add_argument("--repeats", type=repeats_arg, default=7,
                    help=f"interleaved rounds, at least {MIN_REPEATS} (default 7): every figure "
                         "is the median over them, with the min-max range")
    ap.add_argument("--scale", type=positive_float, default=1.0,
                    help="multiply every layout's element count by this factor (e.g. 0.01 for a "
                         "quick run); the table shows the real sizes")
    ap.add_argument("--mixed-layout", default="200x250k", choices=list(LAYOUTS) + ["none"],
                    help="layout of the mixed-precision table (default 200x250k; none: skip it)")
    ap.add_argument("--peers", default="auto", choices=["auto", "only", "none"],
                    help="the peers table (DeepSpeed, torchao, bitsandbytes where installed; "
                         "for Adam, AdamW and Adagrad among --algorithms): auto (default: after "
                         "the other tables), only (just it), none")
    ap.add_argument("--peer-packages", nargs="+", choices=list(peer_table.PACKAGES),
                    help="only the peers of these packages (default: every one installed)")
    ap.add_argument("--clock", default="wall", choices=list(CLOCKS),
                    help="what a step's time is: wall (default), or thread: the calling "
                         "thread's CPU time, which leaves out the time the OS gives other "
                         "processes on a shared machine (only with --threads 1, where every "
                         "contender runs on the calling thread)")
    ap.add_argument("--json", type=writable_path,
                    help="also write the results (with every repeat's values) as JSON to this file")
    args = ap.parse_args(argv)
    threads = threads_arg(args.threads)
    if args.clock == "thread" and threads != 1:
        ap.error(f"--clock thread needs --threads 1, got --threads {args.threads}")
    rpo.set_num_threads(threads)
    torch.set_num_threads(threads)
    t = thread_setup(threads)
    print(f"RoundPipe optimizer benchmark on {t['cpu_vendor']} {t['cpu']}: ISA {t['isa']}, "
          f"prefetch {describe_prefetch(rpo.prefetch_choice())}; threads: "
          f"roundpipe.optim pool "
          f"{t['roundpipe_pool']}, torch intra-op {t['torch_intra_op']} (both --threads"
          f"{' all' if args.threads == 'all' else ''}; the peers' OpenMP loops too), no "
          f"RoundPipe device workers; {t['cpus_available']} CPUs available; median of "
          f"{args.repeats} interleaved repeats, "
          f"{'wall time' if args.clock == 'wall' else 'the calling thread CPU time'}")
    print(LEGEND)
    if args.peers != "none":
        print(peer_table.LEGEND)
    result = run(args.algorithms, args.layouts, threads, args.repeats, args.scale,
                 mixed_layout=None if args.mixed_layout == "none" else args.mixed_layout,
                 peers=args.peers, peer_packages=args.peer_packages, clock=args.clock)
    m = result["matmul"]
    alone, after, ratio = (Figure.from_dict(m[k]) for k in ("alone_ms", "after_step_ms",
                                                            "after_over_alone"))
    print(f"512x512 matmul: {alone.text(3)} ms alone, {after.text(3)} ms right after a RoundPipe "
          "step: " + compare(ratio, "the time alone"))
    print(f"kernels' choices on {t['cpu_vendor']} {t['cpu']}: ISA {result['isa']}, prefetch "
          f"{describe_prefetch(result['prefetch'])}")
    if args.json:
        write_json(args.json, result)
    wrong = (result["peers"] or {}).get("wrong")
    if wrong:
        raise SystemExit("WRONG results (parameters differ from torch.optim's beyond the "
                         "tolerance after two steps): " + "; ".join(wrong))
