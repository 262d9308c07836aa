"""One rank of the distributed tests (tests/test_distributed.py starts N of these, as torchrun
would: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment).

    python tests/distributed_ranks.py CASE OUTDIR [ARGS...]

Cases: ``train`` (every mode — ``step``, ``async``, ``exact``, ``+clip`` with a loss scaler,
``+one`` with one copy of the weights, ``+data`` replacing every parameter's ``.data`` with
an equal clone after the first step — replicated and sharded, results saved per mode),
``disk`` (each mode, replicated and sharded, with and without ``optimizer_dir``: whether
the results are identical and which files the rank's folder held), ``save`` (train, then a
DCP checkpoint), ``save_int8`` (the same with int8 optimizer state,
sharded), ``adafactor_sharded`` (Adafactor refused with sharded copies), ``resume`` (load a
DCP checkpoint, train on), ``fail`` (rank 1 raises in the second step, in its loss_fn or in
a layer's backward, in every mode, replicated and sharded: each rank records when and what it
raised; the process group's timeout is 15 s), ``die MODE SHARD FAILING HOW`` (a plain script
whose rank FAILING fails in its loss_fn and does not catch it, ``raise`` or ``exit``: every
rank's process ends; timeout 15 s),
``memory`` (peak host bytes per parameter, sharded, exact mode), ``user_collectives`` (the
user's own collectives on the wrapper's group during asynchronous steps and exact mode:
an all-reduced loss for logging and ``roundpipe.global_num_items``), ``settings SETTING``
(rank 1 wraps with another value of SETTING: each rank records the error it gets),
``auto_plan MODE`` (``layers_per_stage="auto"``, ranks whose own plans would differ: the plans
each rank ran and its weights).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import roundpipe
import roundpipe.optim as rpo

BATCH, STEPS, LR = 12, 5, 1e-2


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(),
                         nn.Linear(48, 6))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 6, generator=g)


def loss_fn(out, target):
    """The mean over this microbatch's rows of their summed squared errors, written as for
    plain PyTorch: the default loss_reduction="mean" weights each microbatch by its rows and
    grad_reduction="mean" averages the ranks' equal shares, so the gradient is the whole
    batch's mean loss."""
    return ((out - target) ** 2).sum(-1).mean()


def train(model, opt, mode: str, steps: range, rank: int, world: int, scaler=None, clip=None,
          lf=loss_fn, before_step=lambda step: None):
    """``steps`` steps in ``mode`` on this rank's rows of each batch; ``before_step(step)`` is
    called before each."""
    kw = {} if clip is None else {"max_grad_norm": clip}
    for step in steps:
        before_step(step)
        x, y = batch(step)
        xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
        if mode == "exact":
            model.forward_backward(input_args=(xs,), label=ys, loss_fn=lf, optimizer=opt,
                                   grad_scaler=scaler, **kw)
        else:
            model.forward_backward(input_args=(xs,), label=ys, loss_fn=lf, grad_scaler=scaler)
            model.step(opt, is_async=mode == "async", grad_scaler=scaler, **kw)
    model.synchronize()


def wrap(shard: bool, seed_rank: int, one_copy: bool = False, optimizer_dir=None):
    """The model wrapped for this rank; ``one_copy``: optim_dtype is the model's (float32), so
    the optimizer steps the model copy itself; ``optimizer_dir``: the optimizer state on a
    disk."""
    torch.manual_seed(1000 + seed_rank)  # every rank starts elsewhere: the broadcast fixes it
    net = nn.Sequential(nn.Linear(8, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 6))
    if seed_rank == 0:
        net.load_state_dict(build().state_dict())
    model = roundpipe.RoundPipe(net, torch.float32 if one_copy else None,
                                process_group=dist.group.WORLD, shard_optimizer=shard,
                                num_microbatch=2, optimizer_dir=optimizer_dir)
    return model, rpo.AdamW(model.optim_parameters(), lr=LR, eps=1e-3)


class _Raise(torch.autograd.Function):
    """The identity, whose backward raises when ``armed`` (a layer failing mid-backward)."""

    @staticmethod
    def forward(ctx, x, armed):
        ctx.armed = armed
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.armed:
            FAILED.append(time.time())
            raise RuntimeError("boom on rank 1 (backward)")
        return grad, None


class Boom(nn.Module):
    """A layer without parameters that fails in its backward while ``armed``."""

    armed = False

    def forward(self, x):
        return _Raise.apply(x, self.armed)


FAILED: list = []  # when this rank failed (wall clock, comparable across local ranks)


def fail(out: str, rank: int, world: int) -> None:
    """Rank 1 fails in the second step of each scenario (mode x replicated/sharded x in its
    loss_fn or in a layer's backward); every rank catches what it raises and records when."""
    from roundpipe.torch_private import group_timeout

    scenarios = [(mode, shard, "loss") for shard in (False, True)
                 for mode in ("step", "async", "exact")]
    scenarios += [("exact", shard, "backward") for shard in (False, True)]
    only = sys.argv[3:]  # a subset, named as recorded
    record = {}
    for mode, shard, where in scenarios:
        if only and f"{mode}-{int(shard)}-{where}" not in only:
            continue
        torch.manual_seed(0)
        boom = Boom()
        net = nn.Sequential(nn.Linear(8, 48), boom, nn.Tanh(), nn.Linear(48, 48), nn.Tanh(),
                            nn.Linear(48, 6))
        model = roundpipe.RoundPipe(net, process_group=dist.group.WORLD, shard_optimizer=shard,
                                    num_microbatch=2)
        opt = rpo.AdamW(model.optim_parameters(), lr=LR, eps=1e-3)
        FAILED.clear()
        now = {"step": 0}

        def arm(step):
            now["step"] = step
            boom.armed = rank == 1 and step == 1 and where == "backward"

        def loss(out_, target):
            if rank == 1 and now["step"] == 1 and where == "loss":
                FAILED.append(time.time())
                raise RuntimeError("boom on rank 1 (loss_fn)")
            return loss_fn(out_, target)

        raised = None
        try:
            train(model, opt, mode, range(2), rank, world, lf=loss, before_step=arm)
        except Exception as e:  # noqa: BLE001 - what this rank raised is the record
            raised = [time.time(), f"{type(e).__name__}: {e}"]
        record[f"{mode}-{int(shard)}-{where}"] = {
            "failed": FAILED[0] if FAILED else None, "raised": raised,
            "timeout": group_timeout(model.host_process_group).total_seconds()}
        del model, opt
        gc.collect()
        dist.barrier()  # the user's group is unaffected: the next scenario starts together
    with open(f"{out}/fail-{rank}.json", "w") as f:
        json.dump(record, f)


def die(mode: str, shard: bool, failing: int, how: str, rank: int, world: int) -> None:
    """A plain training script, as most are: rank ``failing`` fails in its loss_fn in the
    second step and nothing catches it — ``how`` is ``raise`` (an exception ends the process)
    or ``exit`` (``os._exit(3)``: the process ends without a word). It prints ``FAILED_AT
    <time>`` first; every other rank prints ``RAISED_AT <time>`` when its script raises, and
    lets the exception end its process too."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 6))
    model = roundpipe.RoundPipe(net, process_group=dist.group.WORLD, shard_optimizer=shard,
                                num_microbatch=2)
    opt = rpo.AdamW(model.optim_parameters(), lr=LR, eps=1e-3)
    now = {"step": 0}

    def loss(out_, target):
        if rank == failing and now["step"] == 1:
            print(f"FAILED_AT {time.time()}", file=sys.stderr, flush=True)
            if how == "exit":
                os._exit(3)
            raise RuntimeError(f"boom on rank {rank}")
        return loss_fn(out_, target)

    def steps():
        train(model, opt, mode, range(4), rank, world, lf=loss,
              before_step=lambda step: now.update(step=step))

    if rank == failing:
        steps()
        return
    try:
        steps()
    except BaseException:
        print(f"RAISED_AT {time.time()}", file=sys.stderr, flush=True)
        raise
    print("trained on as if nothing had happened", file=sys.stderr)


def memory_per_parameter(layers: int = 12, hidden: int = 1024) -> float:
    """Peak RSS over the parameter count of a bf16 model, fp32 AdamW, sharded, exact mode,
    CPU device, after a warm-up of what does not grow with the model."""
    def status(key):  # bytes of a /proc/self/status line (VmRSS, VmHWM)
        with open("/proc/self/status") as f:
            return next(int(v.split()[1]) * 1024 for v in f if v.startswith(key + ":"))

    def run(net, steps):
        model = roundpipe.RoundPipe(net, optim_dtype=torch.float32, device="cpu",
                                    num_microbatch=4, process_group=dist.group.WORLD,
                                    shard_optimizer=True)
        opt = rpo.AdamW(model.optim_parameters(), lr=1e-4)
        x = torch.randn(4, net[0][0].in_features if isinstance(net[0], nn.Sequential)
                        else net[0].in_features).bfloat16()
        for _ in range(steps):
            model.forward_backward(input_args=(x,), loss_fn=lambda o: o.float().square().mean(),
                                   optimizer=opt)
        model.synchronize()

    torch.set_num_threads(1)
    run(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16), 2)
    # VmHWM reset here, not ru_maxrss: a process started by vfork + exec keeps its parent's
    # peak RSS in ru_maxrss (the pytest session's size)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = status("VmRSS")
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 model ever exists
    net = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                        nn.Linear(4 * hidden, hidden)) for _ in range(layers)])
    torch.set_default_dtype(torch.float32)
    n = sum(p.numel() for p in net.parameters())
    run(net, 3)
    return (status("VmHWM") - base) / n


def main() -> None:
    case, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(
        seconds=15 if case in ("fail", "die") else 20))
    if case == "train":
        for shard in (False, True):
            for mode in sys.argv[3].split(","):
                model, opt = wrap(shard, rank, "+one" in mode)
                clip = 0.5 if "+clip" in mode else None
                scaler = roundpipe.GradScaler(init_scale=2.0**8) if clip else None
                if "+data" in mode:
                    train(model, opt, mode.split("+")[0], range(1), rank, world, scaler, clip)
                    with torch.no_grad():
                        for p in model.module.parameters():
                            p.data = p.data.clone()
                    steps = range(1, STEPS)
                else:
                    steps = range(STEPS)
                train(model, opt, mode.split("+")[0], steps, rank, world, scaler, clip)
                sd = model.state_dict()  # collective: consolidated on every rank
                counts = sum(s.numel() for st in opt.state.values() for s in st.values()
                             if s.dim() > 0)
                if rank == 0:
                    torch.save(sd, f"{out}/{mode}-{int(shard)}.pt")
                with open(f"{out}/{mode}-{int(shard)}-counts-{rank}.json", "w") as f:
                    json.dump({"state_elements": counts,
                               "grad_norm": model.last_step_stats().grad_norm}, f)
    elif case == "disk":  # the optimizer state on a disk, each rank in its own folder
        report = {}
        for shard in (False, True):
            for mode in ("step", "exact"):
                got = []
                for folder in (None, f"{out}/disk"):
                    model, opt = wrap(shard, rank, optimizer_dir=folder)
                    train(model, opt, mode, range(STEPS), rank, world)
                    files = sorted(os.listdir(f"{out}/disk/rank{rank}")) if folder else []
                    got.append((model.state_dict(), opt.state_dict(), files))
                    del model, opt
                    gc.collect()
                (sd, osd, _), (dsd, dosd, files) = got
                same = all(torch.equal(sd[k], dsd[k]) for k in sd) and all(
                    torch.equal(v, dosd["state"][i][k]) for i, st in osd["state"].items()
                    for k, v in st.items())
                report[f"{mode}-{int(shard)}"] = {"same": same, "files": files}
        report["removed"] = not os.path.exists(f"{out}/disk/rank{rank}")
        with open(f"{out}/disk-{rank}.json", "w") as f:
            json.dump(report, f)
    elif case == "save":
        model, opt = wrap(True, rank)
        train(model, opt, "step", range(3), rank, world)
        roundpipe.save_checkpoint(f"{out}/ckpt", model, opt, extra={"step": 3})
    elif case == "resume":
        model, opt = wrap(True, rank)
        extra = roundpipe.load_checkpoint(f"{out}/ckpt", model, opt)
        train(model, opt, "step", range(extra["step"], STEPS), rank, world)
        sd = model.state_dict()
        if rank == 0:
            torch.save(sd, f"{out}/resumed-{world}.pt")
    elif case == "save_int8":  # sharded int8 AdamW state; each rank's rows as float32 too
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
        model = roundpipe.RoundPipe(net, process_group=dist.group.WORLD, shard_optimizer=True,
                                    num_microbatch=2)
        opt = rpo.AdamW(model.optim_parameters(), lr=LR, state_dtype="int8")
        for step in range(2):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step + 10 * rank))
            model.forward_backward(input_args=(x,), loss_fn=lambda o: o.square().mean())
            model.step(opt)
        roundpipe.save_checkpoint(f"{out}/ckpt", model, opt)
        torch.save({"rows": list(model.optim_shard_rows().values()),
                    "state": opt.state_dict(state_dtype=torch.float32)["state"]},
                   f"{out}/rows-{rank}.pt")
    elif case == "adafactor_sharded":  # refused before anything changes, both classes
        model, _ = wrap(True, rank)
        x, y = batch(0)
        before = [p.detach().clone() for p in model.module.parameters()]
        messages = []
        for cls in (rpo.Adafactor, torch.optim.Adafactor):
            opt = cls(model.optim_parameters(), lr=LR)
            for exact in (False, True):
                try:
                    if exact:
                        model.forward_backward(input_args=(x,), label=y, optimizer=opt,
                                               loss_fn=loss_fn)
                    else:
                        model.forward_backward(input_args=(x,), label=y,
                                               loss_fn=loss_fn)
                        model.step(opt)
                    messages.append("stepped")
                except ValueError as e:
                    messages.append(str(e))
                    model.zero_grad()
        unchanged = all(torch.equal(p, b) for p, b in zip(model.module.parameters(), before))
        with open(f"{out}/adafactor-{rank}.json", "w") as f:
            json.dump({"messages": messages, "unchanged": unchanged}, f)
    elif case == "user_collectives":
        logs = {}
        for shard in (False, True):
            for mode in ("async", "exact"):
                model, opt = wrap(shard, rank)
                log = []
                for step in range(STEPS):
                    x, y = batch(step)
                    xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
                    kw = {"optimizer": opt} if mode == "exact" else {}
                    loss = model.forward_backward(input_args=(xs,), label=ys, loss_fn=loss_fn,
                                                  **kw)
                    if mode == "async":
                        model.step(opt, is_async=True)
                    # the user's collectives, on the group given to the wrapper, while the
                    # optimizer thread may be in its own
                    total = loss.detach().clone()
                    dist.all_reduce(total, group=dist.group.WORLD)
                    tokens = roundpipe.global_num_items(torch.ones(2, 5, dtype=torch.long))
                    log.append([float(total), tokens])
                model.synchronize()
                logs[f"{mode}-{int(shard)}"] = log
                sd = model.state_dict()
                if rank == 0:
                    torch.save(sd, f"{out}/user-{mode}-{int(shard)}.pt")
        with open(f"{out}/user-logs-{rank}.json", "w") as f:
            json.dump(logs, f)
    elif case == "settings":
        setting = sys.argv[3]
        kwargs = {"shard_optimizer": (False, True), "layers_per_stage": (1, 2),
                  "grad_reduction": ("sum", "mean"), "optim_dtype": (None, torch.float32)}
        kw = {setting: kwargs[setting][min(rank, 1)]}
        kw.setdefault("grad_reduction", "sum")
        try:
            roundpipe.RoundPipe(build(), process_group=dist.group.WORLD, **kw)
            message = "constructed"
        except ValueError as e:
            message = str(e)
        with open(f"{out}/settings-{rank}.json", "w") as f:
            json.dump({"message": message}, f)
    elif case == "auto_plan":  # layers_per_stage="auto": every rank takes rank 0's plans
        # ranks that would plan differently on their own: rank 0's device holds the whole
        # model in one stage, rank 1's needs two (as GPUs of different sizes would)
        memory = 200_000 if rank == 0 else 80_000
        roundpipe.staging.device_memory = lambda devices: memory
        torch.manual_seed(1000 + rank)
        net = nn.Sequential(nn.Linear(8, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(),
                            nn.Linear(48, 6))
        if rank == 0:
            net.load_state_dict(build().state_dict())
        model = roundpipe.RoundPipe(net, process_group=dist.group.WORLD, num_microbatch=2,
                                    layers_per_stage="auto", memory_budget=0.6)
        opt = rpo.AdamW(model.optim_parameters(), lr=LR, eps=1e-3)
        mode = sys.argv[3]
        plans = []
        for step in range(STEPS):
            train(model, opt, mode, range(step, step + 1), rank, world)
            plans.append(list(model.plan().sizes))
        sd = model.state_dict()
        if rank == 0:
            torch.save(sd, f"{out}/auto-{mode}.pt")
        with open(f"{out}/auto-{mode}-{rank}.json", "w") as f:
            json.dump({"plans": plans,
                       "revisions": model.pipeline_stats()["plan_revisions"]}, f)
    elif case == "memory":
        print(memory_per_parameter(), flush=True)
    elif case == "fail":
        fail(out, rank, world)
    elif case == "die":
        die(sys.argv[3], sys.argv[4] == "1", int(sys.argv[5]), sys.argv[6], rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
