"""Optimizer-step benchmark: for each algorithm and parameter layout, in one run,

- the floor: ``roundpipe._C.stream_step``, which moves exactly the algorithm's bytes per element
  (reads param, grad and each state array; writes param and each state array) with one add per
  element, on the same threads and ISA as our optimizers;
- ``roundpipe.optim.X``;
- ``torch.optim.X`` with ``foreach=False``, ``foreach=True`` and, where torch has one, ``fused=True``.

A second table covers the fused mixed-precision pass (``CpuOptimizer.fused_step``: bfloat16
gradient in, bfloat16 model copy out, in one pass) against the same work done separately
(convert the gradient to float32, step, copy the parameter to bfloat16), with its own floor
(``stream_step`` through the same fused pass, moving the same bytes).

Each contender steps its own copy of the parameters and state; contenders are timed in turn,
``--repeats`` rounds, and the median is reported, so machine drift hits all alike. Also reported:
a torch matrix multiply timed alone and right after one of our steps (the pool's workers must be
asleep, not spinning, when the step returns).

    python -m roundpipe.bench                        # all algorithms, three layouts, 1 thread
    python -m roundpipe.bench --algorithms Adam SGD --layouts 200x250k --threads 2
    python -m roundpipe.bench --scale 0.001 --repeats 2 --json out.json   # a quick run
    python -m roundpipe.bench --mixed-layout none     # skip the mixed-precision table
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

import roundpipe.optim as rpo
from roundpipe import _C

from . import positive_float, positive_int, writable_path

# name -> (roundpipe class, torch class, whether torch has fused=True for CPU)
ALGORITHMS = {
    "Adadelta": (rpo.Adadelta, torch.optim.Adadelta, False),
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
LAYOUTS = {"50M": (1, 50_000_000), "200x250k": (200, 250_000), "20000x1k": (20_000, 1_000)}


@dataclass
class Row:
    algorithm: str
    layout: str
    elements: int
    bytes_per_element: int
    ns_per_param: dict[str, float] = field(default_factory=dict)

    @property
    def ours(self) -> float:
        return self.ns_per_param["roundpipe"]

    @property
    def torch_best(self) -> tuple[str, float]:
        name = min((k for k in self.ns_per_param if k.startswith("torch")),
                   key=self.ns_per_param.__getitem__)
        return name, self.ns_per_param[name]


def _params(count: int, size: int, gen: torch.Generator) -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(torch.rand(size, generator=gen) - 0.5) for _ in range(count)]
    for p in ps:
        p.grad = torch.rand(size, generator=gen) - 0.5
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
    base = _params(count, size, gen)
    ours = ours_cls(base, **kwargs)
    ours.step()  # creates the state
    states = [k for k, v in ours.state[base[0]].items() if torch.is_tensor(v) and v.dim() > 0]
    floor_states = [[ours.state[p][k].clone() for p in base] for k in states]
    floor_params = _clone(base)
    floor_opts = _C.StreamOptions()
    floor_opts.states = len(states)
    steps = {
        "floor": lambda: _C.stream_step(floor_opts, floor_params, [p.grad for p in floor_params],
                                        floor_states, []),
        "roundpipe": ours.step,
    }
    variants = {"torch foreach=False": dict(foreach=False), "torch foreach=True": dict(foreach=True)}
    if has_fused:
        variants["torch fused=True"] = dict(fused=True)
    for label, extra in variants.items():
        opt = torch_cls(_clone(base), **kwargs, **extra)
        opt.step()
        steps[label] = opt.step
    return steps, len(states)


def _median_times(steps: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(repeats):
        order = list(steps)
        order = order[r % len(order):] + order[: r % len(order)]  # rotate who goes first
        for k in order:
            t0 = time.perf_counter()
            steps[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_interference(repeats: int) -> dict[str, float]:
    """Median time of a 512x512 matmul alone and right after a RoundPipe step."""
    a, b = torch.rand(512, 512), torch.rand(512, 512)
    ps = _params(16, 65536, torch.Generator().manual_seed(1))
    opt = rpo.Adam(ps)
    alone, after = [], []
    for _ in range(repeats * 5):
        t0 = time.perf_counter()
        a @ b
        alone.append(time.perf_counter() - t0)
        opt.step()
        t0 = time.perf_counter()
        a @ b
        after.append(time.perf_counter() - t0)
    return {"alone_ms": 1e3 * statistics.median(alone), "after_step_ms": 1e3 * statistics.median(after)}


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


def run_mixed(algorithms, layout: str, repeats: int, scale: float, log=print) -> list[dict]:
    count, size = LAYOUTS[layout]
    count = max(1, round(count * scale)) if count > 1 else 1
    size = max(1, round(size * scale)) if count == 1 else size
    gen = torch.Generator().manual_seed(1)
    rows = []
    for name in algorithms:
        steps, fused_bytes, separate_bytes = _mixed_contenders(name, count, size, gen)
        med = _median_times(steps, repeats)
        ns = {k: 1e9 * v / (count * size) for k, v in med.items()}
        row = dict(algorithm=name, layout=layout, elements=count * size,
                   fused_bytes_per_element=fused_bytes, separate_bytes_per_element=separate_bytes,
                   ns_per_param=ns)
        rows.append(row)
        log(format_mixed_row(row))
        del steps
    return rows


MIXED_HEADER = (f"{'algorithm':9s} {'layout':9s} {'B/el':>4s} {'floor ns':>9s} {'fused ns':>8s} "
                f"{'GB/s':>6s} {'%floor':>6s} {'sep B/el':>8s} {'sep ns':>7s} {'speed-up':>8s}")


def format_mixed_row(r: dict) -> str:
    ns = r["ns_per_param"]
    b = r["fused_bytes_per_element"]
    return (f"{r['algorithm']:9s} {r['layout']:9s} {b:4d} {ns['floor']:9.3f} {ns['fused']:8.3f} "
            f"{b / ns['fused']:6.1f} {100 * ns['floor'] / ns['fused']:5.0f}% "
            f"{r['separate_bytes_per_element']:8d} {ns['separate']:7.3f} "
            f"{ns['separate'] / ns['fused']:7.2f}x")


def run(algorithms, layouts, threads: int, repeats: int, scale: float, log=print,
        mixed_layout: str | None = None) -> dict:
    rpo.set_num_threads(threads)
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for layout in layouts:
        count, size = LAYOUTS[layout]
        count = max(1, round(count * scale)) if count > 1 else 1
        size = max(1, round(size * scale)) if count == 1 else size
        for name in algorithms:
            steps, n_states = _contenders(name, count, size, gen)
            med = _median_times(steps, repeats)
            elements = count * size
            row = Row(name, layout, elements, 4 * (2 * n_states + 3),
                      {k: 1e9 * v / elements for k, v in med.items()})
            rows.append(row)
            log(format_row(row))
            del steps
    mixed = []
    if mixed_layout is not None:
        log("mixed precision (bf16 gradient in, bf16 model copy out) vs convert + step + copy:")
        log(MIXED_HEADER)
        mixed = run_mixed(algorithms, mixed_layout, repeats, scale, log)
    return {"threads": threads, "isa": rpo.active_isa(), "repeats": repeats, "scale": scale,
            "rows": [dict(asdict(r), ours=r.ours, torch_best=r.torch_best) for r in rows],
            "mixed": mixed, "matmul": matmul_interference(repeats)}


HEADER = (f"{'algorithm':9s} {'layout':9s} {'B/el':>4s} {'floor ns':>9s} {'ours ns':>8s} "
          f"{'GB/s':>6s} {'%floor':>6s} {'torch best':>20s} {'ns':>7s} {'speed-up':>8s}")


def format_row(r: Row) -> str:
    floor = r.ns_per_param["floor"]
    best, best_ns = r.torch_best
    return (f"{r.algorithm:9s} {r.layout:9s} {r.bytes_per_element:4d} {floor:9.3f} {r.ours:8.3f} "
            f"{r.bytes_per_element / r.ours:6.1f} {100 * floor / r.ours:5.0f}% "
            f"{best[6:]:>20s} {best_ns:7.3f} {best_ns / r.ours:7.2f}x")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The pipeline benchmark (RoundPipe training with and "
                                        "without overlap): python -m roundpipe.bench pipeline "
                                        "--help")
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--threads", type=positive_int, default=1, help="threads for ours and torch (default 1)")
    ap.add_argument("--repeats", type=positive_int, default=7, help="timed rounds per contender (median)")
    ap.add_argument("--scale", type=positive_float, default=1.0,
                    help="multiply every layout's element count by this factor (e.g. 0.01 for a "
                         "quick run)")
    ap.add_argument("--mixed-layout", default="200x250k", choices=list(LAYOUTS) + ["none"],
                    help="layout of the mixed-precision table (default 200x250k; none: skip it)")
    ap.add_argument("--json", type=writable_path,
                    help="also write the results as JSON to this file")
    args = ap.parse_args(argv)
    print(f"RoundPipe optimizer benchmark: ISA {rpo.active_isa()}, {args.threads} thread(s), "
          f"median of {args.repeats}; ns per parameter; %floor = floor time / our time")
    print(HEADER)
    result = run(args.algorithms, args.layouts, args.threads, args.repeats, args.scale,
                 mixed_layout=None if args.mixed_layout == "none" else args.mixed_layout)
    m = result["matmul"]
    print(f"512x512 matmul: {m['alone_ms']:.3f} ms alone, {m['after_step_ms']:.3f} ms right "
          f"after a RoundPipe step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
