"""Data parallel RoundPipe over torch.distributed (gloo, CPU), 2 and 3 processes started as
torchrun would (tests/distributed_ranks.py), each run bounded by a timeout:

- N ranks each given 1/N of every batch end with the weights of plain PyTorch trained on the
  whole batch (a reference written here), over 5 steps, for step(opt), is_async=True (against
  the one-step-stale reference) and exact mode, replicated and sharded, with clipping and a
  loss scaler too, and with one copy of the weights (``optim_dtype`` the model's: the optimizer
  steps the model copy, an asynchronous step is not stale); sharded equals replicated;
- sharded optimizer state: the per-rank element counts sum to the total and are balanced;
- a DCP checkpoint saved at 2 ranks loads in 1 process and at 3 ranks, and training continues
  as the uninterrupted run;
- a failing rank surfaces on every rank within the process group's timeout, in every mode,
  and so does one whose uncaught exception (or ``os._exit``) ends its process.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

import roundpipe
import roundpipe.optim as rpo

import distributed_ranks as dr
import launcher


def launch(case: str, world: int, out, *args: str, **kwargs) -> list:
    """``world`` ranks of tests/distributed_ranks.py ``case`` (``launcher.launch``'s keyword
    arguments); their (returncode, stderr)."""
    return [(r.returncode, r.stderr)
            for r in launcher.launch("distributed_ranks.py", world, case, out, *args, **kwargs)]


def reference(mode: str, steps: int = dr.STEPS, clip: bool = False) -> dict:
    """Plain PyTorch, one process, the whole batch, mean loss; ``async``: the gradient of step
    t at the weights from before step t-1."""
    net = dr.build()
    opt = torch.optim.AdamW(net.parameters(), lr=dr.LR, eps=1e-3)
    compute = copy.deepcopy(net)
    for step in range(steps):
        if mode != "async":
            compute.load_state_dict(net.state_dict())
        x, y = dr.batch(step)
        for xm, ym in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)):
            (((compute(xm) - ym) ** 2).sum() / dr.BATCH).backward()
        if mode == "async":
            compute.load_state_dict(net.state_dict())   # W[t] for the next step's gradient
        for p, c in zip(net.parameters(), compute.parameters()):
            p.grad, c.grad = c.grad, None
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return net.state_dict()


def _close(a: dict, b: dict, tol: float = 2e-6) -> None:
    for k, v in b.items():
        torch.testing.assert_close(a[k], v, rtol=tol, atol=tol, msg=k)


@pytest.mark.parametrize("world,modes", [(2, "step,async,exact,step+clip,exact+clip,async+one,"
                                             "step+one+data"),
                                         (3, "step,async,exact,exact+one")])
def test_ranks_on_slices_train_like_one_process_on_the_batch(tmp_path, world, modes):
    for rc, err in launch("train", world, tmp_path, modes):
        assert rc == 0, err[-3000:]
    total = sum(p.numel() for p in dr.build().parameters()) * 2  # exp_avg, exp_avg_sq
    for mode in modes.split(","):
        base = mode.split("+")[0]
        if "+one" in mode:  # one copy: an asynchronous step is not stale
            base = "step" if base == "async" else base
        ref = reference(base, clip="+clip" in mode)
        replicated = torch.load(tmp_path / f"{mode}-0.pt")
        sharded = torch.load(tmp_path / f"{mode}-1.pt")
        _close(replicated, ref)
        _close(sharded, ref)
        _close(sharded, replicated, 1e-6)
        reports = [[json.loads((tmp_path / f"{mode}-{s}-counts-{r}.json").read_text())
                    for r in range(world)] for s in (0, 1)]
        assert all(r["state_elements"] == total for r in reports[0])   # replicated: all of it
        counts = [r["state_elements"] for r in reports[1]]              # sharded: 1/N each
        assert sum(counts) == total and max(counts) <= 1.05 * total / world, counts
        if "+clip" in mode:  # the same global norm on every rank
            assert len({r["grad_norm"] for rs in reports for r in rs}) == 1


def test_a_dcp_checkpoint_saved_at_2_ranks_continues_at_1_and_3(tmp_path):
    for rc, err in launch("save", 2, tmp_path):
        assert rc == 0, err[-3000:]
    ref = reference("step")
    # one process, no process group
    torch.manual_seed(5)
    model = roundpipe.RoundPipe(dr.build(), num_microbatch=2)
    opt = rpo.AdamW(model.optim_parameters(), lr=dr.LR, eps=1e-3)
    extra = roundpipe.load_checkpoint(str(tmp_path / "ckpt"), model, opt)
    assert extra == {"step": 3}
    assert all(float(s["step"]) == 3 for s in opt.state.values())
    dr.train(model, opt, "step", range(3, dr.STEPS), 0, 1)
    _close(model.state_dict(), ref)
    # three ranks
    for rc, err in launch("resume", 3, tmp_path):
        assert rc == 0, err[-3000:]
    _close(torch.load(tmp_path / "resumed-3.pt"), ref)


def test_host_bytes_per_parameter_per_rank_when_sharded(tmp_path):
    """bf16 model copy (2 B) on every rank; optimizer copy, AdamW state and gradient (16 B)
    split over the 2 ranks; exact mode, 12 layers, 100M parameters: <= 2 + 16 / 2 + 0.5."""
    values = []
    for r in launcher.launch("distributed_ranks.py", 2, "memory", tmp_path, timeout=600,
                             omp_threads=None):
        assert r.returncode == 0, r.stderr[-3000:]
        values.append(float(r.stdout.split()[-1]))
    assert all(8 <= v <= 2 + 16 / 2 + 0.5 for v in values), values


@pytest.mark.parametrize("world", [2, 3])
def test_a_failing_rank_surfaces_on_every_rank_within_the_groups_timeout(tmp_path, world):
    """Rank 1 raises in the second step (in its loss_fn: sync, async and exact mode; in a
    layer's backward: exact mode, mid-backward), replicated and sharded, with the process
    group's timeout at 15 s. Was: rank 0 raised after 80 s (RoundPipe's own gloo group had
    torch's default timeout, not the user's), and with 3 ranks, exact, sharded, the failing rank
    itself hung (its cleanup waited for its optimizer thread, stuck in a collective). Now every
    rank raises within the timeout (measured: well under a second: the failing rank abandons
    the group and the others' waits see it), naming the failed rank, and every process ends."""
    timeout, slack = 15.0, 5.0
    for rc, err in launch("fail", world, tmp_path, timeout=240):
        assert rc == 0, err[-3000:]
    records = [json.loads((tmp_path / f"fail-{r}.json").read_text()) for r in range(world)]
    assert len(records[0]) == 8
    for name, failing in records[1].items():
        assert failing["failed"] is not None and "boom on rank 1" in failing["raised"][1], name
        for r, rec in enumerate(records):
            got = rec[name]
            assert got["timeout"] == timeout  # RoundPipe's group inherits the user's timeout
            assert got["raised"] is not None, (name, r, "went on as if rank 1 had trained")
            late = got["raised"][0] - failing["failed"]
            print(f"{name} rank {r}: raised {late:.2f} s after rank 1 failed")
            assert late < timeout + slack, (name, r, late)
            if r != 1:
                assert "rank 1 failed" in got["raised"][1], (name, r, got["raised"][1])


# (world, mode, sharded, failing rank, how): each mode, replicated and sharded, 2 and 3 ranks,
# rank 0 (which holds the store) and another failing, an exception and os._exit ("exit": the
# process ends without a word), in three launches (each starts the ranks afresh: about 10 s of
# a 2-core machine); the mode x sharding product is the test above's, with the ranks alive
DYING = [(3, "exact", True, 0, "raise"), (3, "async", False, 2, "raise"),
         (2, "step", True, 0, "exit")]


@pytest.mark.parametrize("world,mode,shard,failing,how", DYING)
def test_a_rank_whose_exception_ends_its_process_is_named_on_every_rank(tmp_path, world, mode,
                                                                       shard, failing, how):
    """Plain scripts that do not catch: rank ``failing`` fails in its loss_fn in the second
    step and its process ends. Was: the others failed with gloo's "Connection closed by peer
    ... GLHF!", naming no rank and no cause (the reason was written to the store, but the
    process was gone before a wait read it, and with rank 0 the store went with it). Now every
    other rank raises RoundPipe's error naming the failed rank and its error (the failed
    process stays until each knows), within the group's timeout (15 s); a process that ends
    without a word (``os._exit``) is still named, by its PID."""
    timeout, slack = 15.0, 5.0
    results = launcher.launch("distributed_ranks.py", world, "die", tmp_path, mode,
                              "1" if shard else "0", failing, how, timeout=200)

    def stamp(err: str, key: str) -> float:
        return float(next(line.split()[1] for line in err.splitlines() if line.startswith(key)))

    failed_at = stamp(results[failing].stderr, "FAILED_AT")
    if how == "raise":
        assert results[failing].returncode == 1
        assert f"RuntimeError: boom on rank {failing}" in results[failing].stderr
        want = rf"rank {failing} failed: RuntimeError: boom on rank {failing}"
    else:
        assert results[failing].returncode == 3
        want = rf"rank {failing} \(PID \d+\) left: its process ended without saying why"
    for r, got in enumerate(results):
        if r == failing:
            continue
        err = got.stderr
        assert got.returncode == 1 and "trained on as if" not in err, (r, err[-3000:])
        # the exception's line of the traceback (torch prefixes each line with "[rankN]: ")
        last = [line for line in err.splitlines()
                if re.match(r"(\[rank\d+\]: )?RuntimeError", line)][-1]
        assert re.search(r"RoundPipe: the process group's collectives were abandoned \(" + want,
                         last), (r, err[-3000:])
        late = stamp(err, "RAISED_AT") - failed_at
        print(f"rank {r}: raised {late:.2f} s after rank {failing} failed")
        assert late < timeout + slack, (r, late)


def test_adafactor_is_refused_when_the_optimizer_copies_are_sharded(tmp_path):
    """Its factored second moments are means over whole rows and columns: a rank holding some
    rows would compute another algorithm. Refused (step and exact mode, ours and torch's)
    before anything changes."""
    for rc, err in launch("adafactor_sharded", 2, tmp_path):
        assert rc == 0, err[-3000:]
    for r in range(2):
        got = json.loads((tmp_path / f"adafactor-{r}.json").read_text())
        assert got["unchanged"]
        assert len(got["messages"]) == 4
        assert all("shard_optimizer=False" in m for m in got["messages"]), got["messages"]


def test_the_users_own_collectives_on_the_group_during_optimizer_work(tmp_path):
    """An all-reduce of the loss for logging and roundpipe.global_num_items on the group the
    wrapper was given, while an asynchronous step or exact mode has the optimizer thread in
    its collectives: RoundPipe's run on a group of their own, so neither aborts (gloo's
    "collective mismatch") nor times out; every rank logs the same values and the weights are
    plain PyTorch's."""
    for rc, err in launch("user_collectives", 2, tmp_path, timeout=240):
        assert rc == 0, err[-3000:]
    logs = [json.loads((tmp_path / f"user-logs-{r}.json").read_text()) for r in range(2)]
    assert logs[0] == logs[1]
    for key, log in logs[0].items():
        assert [n for _, n in log] == [16] * dr.STEPS, key  # 2 ranks x 2 rows x 4 targets
    for mode in ("async", "exact"):
        ref = reference(mode)
        for shard in (0, 1):
            _close(torch.load(tmp_path / f"user-{mode}-{shard}.pt"), ref)


@pytest.mark.parametrize("setting", ["shard_optimizer", "layers_per_stage", "grad_reduction",
                                     "optim_dtype"])
def test_ranks_wrapping_with_different_settings_are_refused_naming_the_setting(tmp_path,
                                                                               setting):
    """Was: SIGABRT (shard_optimizer), a timeout (layers_per_stage), or silently different
    weights per rank (grad_reduction, optim_dtype). Now a ValueError on every rank at
    construction, naming the setting."""
    for rc, err in launch("settings", 2, tmp_path, setting, timeout=120):
        assert rc == 0, err[-3000:]
    for r in range(2):
        message = json.loads((tmp_path / f"settings-{r}.json").read_text())["message"]
        assert f"different {setting}" in message, message


def test_a_two_rank_run_issues_no_future_warning(tmp_path):
    """As ``python -W error::FutureWarning``: the collectives RoundPipe calls are not
    deprecated ones (reduce_scatter_tensor / all_gather_into_tensor warned on every call)."""
    for rc, err in launch("train", 2, tmp_path, "step,async,exact",
                          env={"PYTHONWARNINGS": "error::FutureWarning"}):
        assert rc == 0, err[-3000:]


@pytest.mark.parametrize("mode", ["step", "exact"])
def test_automatic_plans_are_the_same_on_every_rank(tmp_path, mode):
    """``layers_per_stage="auto"`` with ranks that would plan differently on their own (their
    devices' memory differs: the whole model fits rank 0's in one stage, not rank 1's): every
    rank plans under the smallest budget and runs rank 0's plan at every call (their
    collectives follow the stages: different plans would hang or mix gradients), the plan is
    revised at least once, and the weights are plain PyTorch's."""
    for rc, err in launch("auto_plan", 2, tmp_path, mode, timeout=120):
        assert rc == 0, err[-3000:]
    runs = [json.loads((tmp_path / f"auto-{mode}-{r}.json").read_text()) for r in range(2)]
    assert runs[0]["plans"] == runs[1]["plans"]
    assert runs[0]["revisions"] >= 1
    assert len(runs[0]["plans"][-1]) > 1  # rank 1's device cannot hold one stage of 5 layers
    _close(torch.load(tmp_path / f"auto-{mode}.pt"), reference(mode))


def test_each_rank_keeps_its_optimizer_state_in_its_own_folder_on_disk(tmp_path):
    """optimizer_dir shared by 2 ranks: each rank's own subfolder (rank0, rank1) holds its
    files (sharded: its rows only), every mode trains bit for bit as without a disk, and the
    folders go with the models."""
    for rc, err in launch("disk", 2, tmp_path):
        assert rc == 0, err[-3000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"disk-{rank}.json").read_text())
        assert report.pop("removed")
        for key, r in report.items():
            assert r["same"], (rank, key)
            assert "LOCK" in r["files"] and any(f.endswith(".bin") for f in r["files"]), r
