"""Optimizer-step benchmark: for each algorithm and parameter layout, in one run,

- the floor: ``roundpipe._C.stream_step``, which moves exactly the algorithm's bytes per element
  (reads param, grad and each state array; writes param and each state array) with one add per
  element, on the same threads and ISA as our optimizers;
- ``roundpipe.optim.X``;
- ``torch.optim.X`` with ``foreach=False``, ``foreach=True`` and, where torch has one, ``fused=True``.

Each contender steps its own copy of the parameters and state; contenders are timed in turn,
``--repeats`` rounds, and the median is reported, so machine drift hits all alike. Also reported:
a torch matrix multiply timed alone and right after one of our steps (the pool's workers must be
asleep, not spinning, when the step returns).

    python -m roundpipe.bench                        # all algorithms, three layouts, 1 thread
    python -m roundpipe.bench --algorithms Adam SGD --layouts 200x250k --threads 2
    python -m roundpipe.bench --scale 0.001 --repeats 2 --json out.json   # a quick run
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


def run(algorithms, layouts, threads: int, repeats: int, scale: float, log=print) -> dict:
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
    return {"threads": threads, "isa": rpo.active_isa(), "repeats": repeats, "scale": scale,
            "rows": [dict(asdict(r), ours=r.ours, torch_best=r.torch_best) for r in rows],
            "matmul": matmul_interference(repeats)}


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
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--threads", type=int, default=1, help="threads for ours and torch (default 1)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds per contender (median)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply every layout's element count by this factor (e.g. 0.01 for a "
                         "quick run)")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    args = ap.parse_args(argv)
    print(f"RoundPipe optimizer benchmark: ISA {rpo.active_isa()}, {args.threads} thread(s), "
          f"median of {args.repeats}; ns per parameter; %floor = floor time / our time")
    print(HEADER)
    result = run(args.algorithms, args.layouts, args.threads, args.repeats, args.scale)
    m = result["matmul"]
    print(f"512x512 matmul: {m['alone_ms']:.3f} ms alone, {m['after_step_ms']:.3f} ms right "
          f"after a RoundPipe step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
