"""Per-call overhead benchmark: the fixed cost of one ``forward_backward`` + ``step`` of a
RoundPipe on a tiny model (3 layers: Linear, Tanh, Linear; a few thousand parameters) on the
CPU, against plain PyTorch training the same model with the same optimizer
(``roundpipe.optim.AdamW``, so the optimizer kernel is the same on both sides). With so
little compute, the difference is what the wrapper costs per call: thread hand-offs, splitting
and merging, functional calls, RNG forks, gradient hand-over, the step's bookkeeping.

Contenders (each its own model, warmed up; ``--repeats`` interleaved rounds of ``--calls``
calls each; a round ends with ``synchronize()``):

- ``torch``: ``loss_fn(net(x), y).backward(); opt.step(); opt.zero_grad()``;
- ``M=1``: ``RoundPipe(device="cpu", num_microbatch=1)``, ``forward_backward`` + ``step(opt)``;
- ``M=2``: the same with two microbatches (the default for one device);
- ``cpu,cpu M=3``: two CPU device workers, three microbatches (their default);
- ``async M=1``: ``step(opt, is_async=True)``;
- ``exact M=1``: ``forward_backward(..., optimizer=opt)``.

    python -m roundpipe.bench overhead
    python -m roundpipe.bench overhead --calls 200 --repeats 9 --json overhead.json
"""

from __future__ import annotations

import argparse

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

# name -> (devices, microbatches, how the step is taken)
CONTENDERS = {
    "M=1": (["cpu"], 1, "sync"),
    "M=2": (["cpu"], 2, "sync"),
    "cpu,cpu M=3": (["cpu", "cpu"], 3, "sync"),
    "async M=1": (["cpu"], 1, "async"),
    "exact M=1": (["cpu"], 1, "exact"),
}


def tiny_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m roundpipe.bench overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=LEGEND)
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
    ap.add_argument("--json", type=writable_path, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    result = run(args)
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
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
