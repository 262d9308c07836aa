"""Host-overhead benchmark: what RoundPipe's own Python costs, on models whose compute is
negligible, against plain PyTorch training the same model with the same optimizer
(``roundpipe.optim.AdamW``, so the optimizer kernel is the same on both sides). Three sections:

**Per call** (``--sections call``): the fixed cost of one ``forward_backward`` + ``step`` on a
tiny model (3 layers: Linear, Tanh, Linear; a few thousand parameters) on the CPU device. With
so little compute, the difference is what the wrapper costs per call: thread hand-offs,
splitting and merging, RNG forks, gradient hand-over, the step's bookkeeping. Contenders (each
its own model, warmed up; ``--repeats`` interleaved rounds of ``--calls`` calls each; a round
ends with ``synchronize()``):

- ``torch``: ``loss_fn(net(x), y).backward(); opt.step(); opt.zero_grad()``;
- ``M=1``: ``RoundPipe(device="cpu", num_microbatch=1)``, ``forward_backward`` + ``step(opt)``;
- ``M=2``: the same with two microbatches (the default for one device);
- ``cpu,cpu M=3``: two CPU device workers, three microbatches (their default);
- ``async M=1``: ``step(opt, is_async=True)``;
- ``exact M=1``: ``forward_backward(..., optimizer=opt)``.

**Per stage visit, as a fit** (``--sections fit``): ``nn.Sequential`` of ``L`` x
``nn.Linear(64, 64)``, batch 8, fp32, MSE loss, ``L`` in ``--fit-layers`` (8 32 128), ``M`` in
``--fit-microbatches`` (1 4) microbatches; plain PyTorch runs the same microbatches with
gradient accumulation. Per round, each RoundPipe contender's ms per call minus plain's is fitted
over the ``(L, M)`` points as ``a + b*L + c*L*M`` (least squares): ``c`` is the host's cost per
stage visit of one layer on one microbatch (forward and backward), ``b`` per layer and call (its
uploads, gradient hand-over, the per-layer optimizer step), ``a`` per call. Plain's own ms per
call gets the same fit, beside it. Contenders: ``one layer per stage`` (the CPU device's default
plan, and the worst case: a visit per layer), ``planned`` (``layers_per_stage="auto"``, CUDA's
default: the planner groups layers), ``recompute`` (one layer per stage, every stage but the
last recomputing: the upstream design).

**Issue rate at a real model's geometry** (``--sections geometry``): the host's time per call of
a model with the layer count of the 1.82B Llama of the first GPU run (embedding, 24 decoder
layers, norm and head: 26 pipeline layers) and the plan the planner makes for it on an H200 at
``--tokens`` tokens per step (from the model's sizes, compute at the H200's measured rate and
its memory; see :func:`geometry_plan`), each layer a negligible ``nn.Linear(64, 64)``, with
``--geometry-microbatches`` (4 8 16) microbatches; printed beside what the GPU's compute per
call would take at that geometry (6 x parameters x tokens at 266 TFLOPS, the bf16 rate plain HF
reached on the H200) and as a share of it. On the GPU the layers' own kernel launches come on
top (plain HF issues them too); CUDA's events and stream waits are not measured here.

    python -m roundpipe.bench overhead
    python -m roundpipe.bench overhead --sections fit --repeats 7 --json overhead.json
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

import roundpipe.optim as rpo
from roundpipe import RoundPipe

from . import (write_json, MIN_REPEATS, Figure, interleave, paired_ratio, positive_int,
               repeats_arg, thread_plan, timed, writable_path)

LEGEND = """\
Columns (median over the repeats, with the min-max range):
  ms/call     wall time of one training call (forward_backward + step, or the plain loop's
              forward, backward, step and zero_grad), averaged over --calls calls
  over torch  ms/call minus the torch loop's ms/call in the same round: the wrapper's fixed
              cost per call
  x torch     ms/call over the torch loop's, per round"""

FIT_LEGEND = """\
Fit of ms per call, per round, over every (L, M): a + b*L + c*L*M (median over the rounds, with
the min-max range). For RoundPipe rows the fitted quantity is its ms per call minus plain's in
the same round, so c is RoundPipe's host cost per stage visit of a layer on a microbatch (its
forward and its backward), b per layer and call, a per call; plain's row fits its own ms per
call. cpu ms: the process's CPU time per call (all threads), fitted the same way: what the
wrapper costs without the time the OS gave other processes."""

# name -> (devices, microbatches, how the step is taken)
CONTENDERS = {
    "M=1": (["cpu"], 1, "sync"),
    "M=2": (["cpu"], 2, "sync"),
    "cpu,cpu M=3": (["cpu", "cpu"], 3, "sync"),
    "async M=1": (["cpu"], 1, "async"),
    "exact M=1": (["cpu"], 1, "exact"),
}

# name -> RoundPipe keyword arguments of the fit's contenders
FIT_CONTENDERS = {
    "one layer per stage": {"layers_per_stage": 1},
    "planned": {"layers_per_stage": "auto"},
    "recompute": {"layers_per_stage": 1, "recompute": True},
}

#: the 1.82B Llama of the first GPU run (docs/benchmarks.md), bf16 weights, fp32 AdamW
LLAMA_1_8B = {"layers": 24, "hidden": 2560, "intermediate": 6912, "heads": 20, "kv_heads": 4,
              "vocab": 32000}
#: the H200 of that run: memory (bytes), pinned host-to-device copy peak (bytes/s), and the
#: model-FLOPs rate plain HF reached there in bf16 (6 x parameters x tokens/s)
H200 = {"memory": 141e9, "upload": 55e9, "flops": 266e12}


def tiny_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def linear_stack(layers: int, width: int = 64) -> nn.Sequential:
    """``layers`` x ``nn.Linear(width, width)`` (torch's initialisation, seed 0)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _loss_fn(batch: int):
    """The batch's mean squared error, as in plain PyTorch (RoundPipe weights each
    microbatch's mean by its rows)."""
    return lambda out, y: ((out - y) ** 2).mean()


def torch_loop(args):
    """A zero-argument callable running ``args.calls`` plain PyTorch training steps."""
    net = tiny_model(args.width)
    opt = rpo.AdamW(net.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 1)
    loss_fn = _loss_fn(args.batch)

    def calls():
        for _ in range(args.calls):
            loss_fn(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    return calls


def roundpipe_loop(args, devices: list[str], microbatches: int, how: str):
    """A zero-argument callable running ``args.calls`` RoundPipe training calls."""
    model = RoundPipe(tiny_model(args.width), optim_dtype=torch.float32, device=devices,
                      num_microbatch=microbatches)
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 1)
    loss_fn = _loss_fn(args.batch)

    def calls():
        for _ in range(args.calls):
            if how == "exact":
                model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=opt)
            else:
                model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
                model.step(opt, is_async=how == "async")
        model.synchronize()
    return calls


def run(args) -> dict:
    """Builds and warms up every contender, then times ``args.repeats`` interleaved rounds."""
    threads = thread_plan(args.threads, 1, cuda=False)
    rpo.set_num_threads(threads["roundpipe_pool"])
    contenders = {}
    for name, (devices, microbatches, how) in CONTENDERS.items():
        # each device worker keeps the thread count of its first use (here, the warm-up)
        torch.set_num_threads(max(1, args.threads // len(devices)))
        contenders[name] = roundpipe_loop(args, devices, microbatches, how)
        contenders[name]()
    torch.set_num_threads(args.threads)
    contenders["torch"] = torch_loop(args)
    contenders["torch"]()
    seconds = interleave({k: timed(fn) for k, fn in contenders.items()}, args.repeats)
    ms = {k: [1e3 * s / args.calls for s in v] for k, v in seconds.items()}
    rows = []
    for name in ["torch", *CONTENDERS]:
        row = {"contender": name, "ms_per_call": Figure.of(ms[name]).as_dict(),
               "samples_ms": ms[name]}
        if name != "torch":
            row["over_torch_ms"] = Figure.of([a - b for a, b in zip(ms[name], ms["torch"])]).as_dict()
            row["x_torch"] = paired_ratio(ms[name], ms["torch"]).as_dict()
        rows.append(row)
    parameters = sum(p.numel() for p in tiny_model(args.width).parameters())
    return {"config": vars(args), "parameters": parameters, "threads": threads, "rows": rows}


# --- per stage visit, as a fit ----------------------------------------------------------------

def _clocked(fn):
    """``fn`` as a contender returning ``(wall s, process CPU s)``."""
    def run():
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu
    return run


def plain_stack_loop(layers: int, microbatches: int, batch: int, calls: int):
    """``calls`` plain PyTorch steps of :func:`linear_stack`: ``microbatches`` slices of the
    batch with gradient accumulation (each slice's mean weighted by its rows), AdamW."""
    net = linear_stack(layers)
    opt = rpo.AdamW(net.parameters(), lr=1e-3)
    x, y = torch.randn(batch, 64), torch.randn(batch, 64)
    parts = list(zip(x.tensor_split(microbatches), y.tensor_split(microbatches)))

    def loop():
        for _ in range(calls):
            for xs, ys in parts:
                (nn.functional.mse_loss(net(xs), ys) * (len(xs) / batch)).backward()
            opt.step()
            opt.zero_grad()
    return loop


def roundpipe_stack_loop(layers: int, microbatches: int, batch: int, calls: int, **kwargs):
    """``calls`` RoundPipe training calls (``forward_backward`` + ``step``) of
    :func:`linear_stack` on the CPU device, with ``kwargs`` for ``RoundPipe``; the plan settles
    in the warm-up."""
    model = RoundPipe(linear_stack(layers), optim_dtype=torch.float32, device="cpu",
                      num_microbatch=microbatches, **kwargs)
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-3)
    x, y = torch.randn(batch, 64), torch.randn(batch, 64)

    def loop():
        for _ in range(calls):
            model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
            model.step(opt)
        model.synchronize()
    for _ in range(6):  # measured calls, then the plan is kept
        loop()
        if model.plan().kept:
            break
    loop.model = model
    return loop


def fit_abc(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least-squares ``(a, b, c)`` of ``y = a + b*L + c*L*M`` over ``(L, M, y)`` points."""
    A = torch.tensor([[1.0, L, L * M] for L, M, _ in points], dtype=torch.float64)
    y = torch.tensor([[v] for _, _, v in points], dtype=torch.float64)
    a, b, c = torch.linalg.lstsq(A, y).solution.flatten().tolist()
    return a, b, c


def run_fit(args) -> dict:
    """Every (L, M) of the fit, plain and each of :data:`FIT_CONTENDERS`, built, warmed up and
    timed in ``args.repeats`` interleaved rounds; per round, the fits (see the module
    docstring)."""
    configs = [(L, M) for L in args.fit_layers for M in args.fit_microbatches]
    loops = {}
    plans = {}
    for L, M in configs:
        loops[("plain", L, M)] = plain_stack_loop(L, M, args.fit_batch, args.fit_calls)
        loops[("plain", L, M)]()
        for name, kwargs in FIT_CONTENDERS.items():
            loop = roundpipe_stack_loop(L, M, args.fit_batch, args.fit_calls, **kwargs)
            plans[f"{name} L={L} M={M}"] = {"sizes": list(loop.model.plan().sizes),
                                            "recompute": list(loop.model.plan().recompute)}
            loops[(name, L, M)] = loop
    results = interleave({k: _clocked(v) for k, v in loops.items()}, args.repeats)
    per_call = {k: [(w * 1e3 / args.fit_calls, c * 1e3 / args.fit_calls) for w, c in v]
                for k, v in results.items()}
    rows = []
    for name in ["plain", *FIT_CONTENDERS]:
        fits = {"wall": [], "cpu": []}
        for r in range(args.repeats):
            for clock, i in (("wall", 0), ("cpu", 1)):
                points = []
                for L, M in configs:
                    value = per_call[(name, L, M)][r][i]
                    if name != "plain":
                        value -= per_call[("plain", L, M)][r][i]
                    points.append((L, M, value))
                fits[clock].append(fit_abc(points))
        row = {"contender": name}
        for clock, values in fits.items():
            for k, key in enumerate(("a_ms", "b_us", "c_us")):
                scale = 1.0 if k == 0 else 1e3
                row[f"{clock}_{key}"] = Figure.of([v[k] * scale for v in values]).as_dict()
        row["ms_per_call"] = {f"L={L} M={M}": Figure.of([w for w, _ in per_call[(name, L, M)]]).as_dict()
                              for L, M in configs}
        rows.append(row)
    return {"configs": configs, "rows": rows, "plans": plans, "batch": args.fit_batch,
            "calls": args.fit_calls}


# --- issue rate at a real model's geometry ----------------------------------------------------

def geometry_costs(tokens: int, microbatches: int, g: dict = LLAMA_1_8B, gpu: dict = H200):
    """The planner's :class:`~roundpipe.planner.LayerCost` of each pipeline layer of a Llama of
    geometry ``g`` (embedding, decoder layers, norm and head) trained in bf16 with fp32
    gradient sums, at ``tokens`` tokens per step in ``microbatches`` microbatches, on ``gpu``:
    weights and gradients from the parameter counts; a decoder layer's saved tensors 34 bytes
    x hidden per token (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", eq. 1 without the attention scores, which fused attention does not
    keep); times from 2 (forward) and 6 (recomputation and backward) FLOPs per parameter and
    token at ``gpu["flops"]``. Returns ``(costs, parameters)``."""
    from ..planner import LayerCost

    h, i, v = g["hidden"], g["intermediate"], g["vocab"]
    kv = h // g["heads"] * g["kv_heads"]
    per_token = tokens / microbatches
    grad_item = 4 if microbatches > 1 else 2

    def layer(params: int, flop_params: int, act_per_token: float) -> LayerCost:
        seconds = flop_params * per_token / gpu["flops"]
        return LayerCost(2 * params, grad_item * params, int(act_per_token * per_token),
                         2 * seconds, 6 * seconds, True, None, 2 * seconds)

    decoder = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    costs = ([layer(v * h, 0, 2 * h)] + [layer(decoder, decoder, 34 * h)] * g["layers"]
             + [layer(v * h + h, v * h, 4 * h)])
    return costs, v * h + g["layers"] * decoder + v * h + h


def geometry_plan(tokens: int, microbatches: int, g: dict = LLAMA_1_8B, gpu: dict = H200):
    """The plan :func:`roundpipe.planner.plan_stages` makes for :func:`geometry_costs` on one
    ``gpu`` (budget 0.6 of its memory, RoundPipe's default; uploads at its pinned peak; the
    host's costs per visit and microbatch the planner assumes), and the model's parameters."""
    from ..planner import Link, plan_stages
    from ..staging import CHUNK_S, VISIT_S

    costs, parameters = geometry_costs(tokens, microbatches, g, gpu)
    link = Link(gpu["upload"], gpu["upload"], VISIT_S, CHUNK_S)
    return plan_stages(costs, microbatches, 1, int(0.6 * gpu["memory"]), link,
                       recompute="auto"), parameters


def run_geometry(args) -> dict:
    """Per ``M`` of ``args.geometry_microbatches``: the planned and the one-layer-per-stage
    tiny model of the geometry's layer count, and plain PyTorch on it, timed in
    ``args.repeats`` interleaved rounds (``forward_backward`` + ``step`` per call)."""
    rows, loops = [], {}
    for M in args.geometry_microbatches:
        plan, parameters = geometry_plan(args.tokens, M)
        L, batch = sum(plan.sizes), 2 * M
        loops[("plain", M)] = plain_stack_loop(L, M, batch, args.geometry_calls)
        loops[("plain", M)]()
        loops[("planned", M)] = roundpipe_stack_loop(
            L, M, batch, args.geometry_calls, layers_per_stage=list(plan.sizes),
            recompute=list(plan.recompute))
        loops[("one layer per stage", M)] = roundpipe_stack_loop(L, M, batch, args.geometry_calls,
                                                                 layers_per_stage=1)
        gpu_ms = 6 * parameters * args.tokens / H200["flops"] * 1e3
        rows.append({"microbatches": M, "layers": L, "plan": list(plan.sizes),
                     "recompute": list(plan.recompute), "parameters": parameters,
                     "gpu_compute_ms": gpu_ms})
    results = interleave({k: timed(v) for k, v in loops.items()}, args.repeats)
    for row in rows:
        M = row["microbatches"]
        plain = [s * 1e3 / args.geometry_calls for s in results[("plain", M)]]
        row["plain_ms"] = Figure.of(plain).as_dict()
        for name in ("planned", "one layer per stage"):
            ms = [s * 1e3 / args.geometry_calls for s in results[(name, M)]]
            row[name] = {"ms": Figure.of(ms).as_dict(),
                         "over_plain_ms": Figure.of([a - b for a, b in zip(ms, plain)]).as_dict(),
                         "pct_of_gpu": Figure.of([100 * a / row["gpu_compute_ms"]
                                                  for a in ms]).as_dict()}
    return {"tokens": args.tokens, "geometry": LLAMA_1_8B, "gpu": H200, "rows": rows}


# --- output -----------------------------------------------------------------------------------

def _print_calls(args, result: dict) -> None:
    t = result["threads"]
    print(f"per-call overhead: Linear({args.width}, {args.width}), Tanh, Linear({args.width}, 1) "
          f"({result['parameters']} parameters), batch {args.batch}, fp32, CPU; "
          f"{args.repeats} interleaved repeats of {args.calls} calls")
    print(f"threads: torch intra-op {args.threads} (split between the workers of cpu,cpu); "
          f"roundpipe.optim pool {t['roundpipe_pool']}; {t['cpus_available']} CPUs available")
    print(LEGEND)
    print(f"{'contender':<13}{'ms/call (min-max)':>26}{'over torch ms (min-max)':>28}"
          f"{'x torch':>22}")
    for r in result["rows"]:
        over = Figure.from_dict(r["over_torch_ms"]).text(3) if "over_torch_ms" in r else "-"
        ratio = Figure.from_dict(r["x_torch"]).text(2, "x") if "x_torch" in r else "-"
        print(f"{r['contender']:<13}{Figure.from_dict(r['ms_per_call']).text(3):>26}{over:>28}"
              f"{ratio:>22}")


def _print_fit(args, fit: dict) -> None:
    print(f"\nper stage visit: nn.Sequential of L x nn.Linear(64, 64), batch {fit['batch']}, fp32, "
          f"MSE, roundpipe.optim.AdamW on both sides, CPU device, L in {list(args.fit_layers)}, "
          f"M in {list(args.fit_microbatches)}; {args.repeats} interleaved rounds of "
          f"{fit['calls']} calls; load average {_load()}")
    print(FIT_LEGEND)
    print(f"{'contender':<22}{'a ms (min-max)':>24}{'b us (min-max)':>24}{'c us (min-max)':>24}"
          f"{'c us, cpu clock':>24}")
    for r in fit["rows"]:
        f = lambda key, d=1: Figure.from_dict(r[key]).text(d)  # noqa: E731
        print(f"{r['contender']:<22}{f('wall_a_ms', 3):>24}{f('wall_b_us'):>24}{f('wall_c_us'):>24}"
              f"{f('cpu_c_us'):>24}")
    for name, plan in fit["plans"].items():
        if name.startswith("planned") and "M=4" in name:
            print(f"{name}: stages {plan['sizes']}, recompute {plan['recompute']}")


def _print_geometry(args, geo: dict) -> None:
    g = geo["geometry"]
    print(f"\nissue rate: {g['layers'] + 2} pipeline layers (the 1.82B Llama: hidden {g['hidden']}, "
          f"{g['layers']} decoder layers, vocab {g['vocab']}) as nn.Linear(64, 64) each, "
          f"{geo['tokens']} tokens per step; the plan planned for an H200 (0.6 of "
          f"{H200['memory'] / 1e9:.0f} GB, uploads at {H200['upload'] / 1e9:.0f} GB/s); GPU compute "
          f"= 6 x parameters x tokens at {H200['flops'] / 1e12:.0f} TFLOPS; load average {_load()}")
    print(f"{'M':>3}  {'plan (stages; recomputing)':<34}{'GPU ms':>8}{'plain ms':>20}"
          f"{'planned ms':>20}{'% of GPU':>18}{'1 layer/stage ms':>22}{'% of GPU':>18}")
    for r in geo["rows"]:
        rec = [s for s, x in enumerate(r["recompute"]) if x]
        plan = f"{len(r['plan'])}: {r['plan'][:6]}{'...' if len(r['plan']) > 6 else ''}; {rec or 'none'}"
        f = lambda d, digits=2: Figure.from_dict(d).text(digits)  # noqa: E731
        print(f"{r['microbatches']:>3}  {plan:<34}{r['gpu_compute_ms']:>8.0f}{f(r['plain_ms']):>20}"
              f"{f(r['planned']['ms']):>20}{f(r['planned']['pct_of_gpu'], 1):>18}"
              f"{f(r['one layer per stage']['ms']):>22}"
              f"{f(r['one layer per stage']['pct_of_gpu'], 1):>18}")


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


SECTIONS = ("call", "fit", "geometry")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=LEGEND + "\n" + FIT_LEGEND)
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="what to run (default: all)")
    ap.add_argument("--width", type=positive_int, default=32, help="hidden width (default 32)")
    ap.add_argument("--batch", type=positive_int, default=8, help="batch size (default 8)")
    ap.add_argument("--calls", type=positive_int, default=50,
                    help="training calls per repeat (default 50)")
    ap.add_argument("--repeats", type=repeats_arg, default=7,
                    help=f"interleaved rounds, at least {MIN_REPEATS} (default 7)")
    ap.add_argument("--threads", type=positive_int, default=1,
                    help="torch's intra-op threads (split between the device workers of "
                         "cpu,cpu, at least one each) and the roundpipe.optim pool (default 1: "
                         "a tiny model gains nothing from more, and on a busy machine extra "
                         "threads measure OpenMP wake-ups instead of the wrapper)")
    ap.add_argument("--fit-layers", type=positive_int, nargs="+", default=[8, 32, 128],
                    help="layer counts L of the fit (default 8 32 128)")
    ap.add_argument("--fit-microbatches", type=positive_int, nargs="+", default=[1, 4],
                    help="microbatch counts M of the fit (default 1 4)")
    ap.add_argument("--fit-batch", type=positive_int, default=8, help="the fit's batch (default 8)")
    ap.add_argument("--fit-calls", type=positive_int, default=10,
                    help="training calls per contender and round in the fit (default 10)")
    ap.add_argument("--tokens", type=positive_int, default=8192,
                    help="tokens per step of the geometry's GPU compute and plan (default 8192)")
    ap.add_argument("--geometry-microbatches", type=positive_int, nargs="+", default=[4, 8, 16],
                    help="microbatches of the geometry section (default 4 8 16)")
    ap.add_argument("--geometry-calls", type=positive_int, default=10,
                    help="training calls per contender and round there (default 10)")
    ap.add_argument("--json", type=writable_path, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    if len(args.fit_layers) * len(args.fit_microbatches) < 3 or len(set(args.fit_layers)) < 2:
        ap.error("the fit needs at least two layer counts and three (L, M) points")
    if max(args.fit_microbatches) > args.fit_batch:
        ap.error("--fit-microbatches must not exceed --fit-batch")
    threads = thread_plan(args.threads, 1, cuda=False)
    rpo.set_num_threads(threads["roundpipe_pool"])
    torch.set_num_threads(args.threads)
    result: dict = {"config": vars(args), "load_average": _load()}
    if "call" in args.sections:
        result.update(run(args))
        _print_calls(args, result)
    if "fit" in args.sections:
        torch.set_num_threads(args.threads)
        result["fit"] = run_fit(args)
        _print_fit(args, result["fit"])
    if "geometry" in args.sections:
        torch.set_num_threads(args.threads)
        result["geometry"] = run_geometry(args)
        _print_geometry(args, result["geometry"])
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
