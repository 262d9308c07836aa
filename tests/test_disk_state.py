"""Optimizer state on a disk (``RoundPipe(..., optimizer_dir=...)``, issue 44).

- every ``roundpipe.optim`` algorithm, float32, bfloat16 and int8 state and bfloat16 master
  weights, in each step mode, trains bit for bit as the same optimizer in host memory; between
  steps every optimizer copy and state tensor views its file, and the run really read and wrote
  the disk;
- the window is bounded: with a state four times the window or more, the window's buffers
  (counted where they are allocated) never exceed its limit, three sets of tensors;
- ``state_dict`` / ``load_state_dict`` (both ways between disk and memory) and checkpoints
  resume exactly;
- faults, each a clear ``StateDiskError`` naming the folder and the cause: the disk full at the
  reservation (nothing stepped) and in the middle of a step (every parameter's tensors at one
  step; the failed writes held in memory, written once the disk takes them), a short write
  (finished), a write that stops, a read error, a file size limit (EFBIG, a real one), a file
  system without O_DIRECT (buffered) and tmpfs (warned), a folder in use (by this process and
  by another), a killed process's files (removed, warned), foreign files (refused, kept); the
  files go at a normal exit;
- what cannot stream is refused: a step function, a torch optimizer, pickling.
"""

from __future__ import annotations

import copy
import errno
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import weakref

import pytest
import torch
from torch import nn

import roundpipe
import roundpipe.disk.io as dio
import roundpipe.optim as rpo
from roundpipe.disk import StateDiskError
from roundpipe.disk.store import _slot_of

from launcher import child_env

HIDDEN = 64  # 64 x 64 weights: 4096 elements, the smallest int8 state


def net(layers: int = 3, hidden: int = HIDDEN, dtype=torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.Tanh()]
    return nn.Sequential(*mods).to(dtype)


def batch(step: int, hidden: int = HIDDEN):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, hidden, generator=g), torch.randn(6, hidden, generator=g)


def loss_fn(out, y):
    return (out.float() - y).square().mean()


def wrap(folder, layers=3, hidden=HIDDEN, optim_dtype=torch.float32, dtype=torch.bfloat16):
    return roundpipe.RoundPipe(net(layers, hidden, dtype), optim_dtype=optim_dtype,
                               optimizer_dir=folder, num_microbatch=2)


def train(model, opt, mode: str, steps) -> None:
    for step in steps:
        x, y = batch(step, model.module[0].in_features)
        if mode == "exact":
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=opt)
        else:
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            model.step(opt, is_async=mode == "async")
    model.synchronize()


def snapshot(model, opt) -> dict:
    """Everything training changes, as copies: the full-precision weights, the model copies,
    the optimizer's state dict."""
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()},
            "model": {k: v.detach().clone() for k, v in model.module.named_parameters()},
            "opt": copy.deepcopy(opt.state_dict())}


def assert_identical(a, b, where="") -> None:
    """Equal bit for bit (tensors: dtype, shape and values; NaNs compared as bits)."""
    if isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            assert_identical(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}/{k}")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                           b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)), where
    else:
        assert a == b, (where, a, b)


def assert_on_disk(model, opt) -> None:
    """Between steps every optimizer copy and state tensor views its file (none holds host
    memory of its own), and the run read and wrote the disk."""
    store = model._copies.store
    held = [o for o in model.optim_parameters() if _slot_of(o) is not None]
    held += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    assert held
    for t in held:
        slot = _slot_of(t)
        assert slot is not None and t.data_ptr() == slot.home.data_ptr()
    assert store.stats["read_bytes"] > 0 and store.stats["write_bytes"] > 0


ALGORITHMS = [
    (rpo.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)), (rpo.Adam, dict(lr=1e-2, amsgrad=True)),
    (rpo.AdamW, dict(lr=1e-2)), (rpo.NAdam, dict(lr=1e-2)), (rpo.RAdam, dict(lr=1e-2)),
    (rpo.Adamax, dict(lr=1e-2)), (rpo.Adagrad, dict(lr=1e-2, initial_accumulator_value=0.1)),
    (rpo.Adadelta, dict(lr=1.0)), (rpo.RMSprop, dict(lr=1e-3, momentum=0.9, centered=True)),
    (rpo.Rprop, dict(lr=1e-3)), (rpo.ASGD, dict(lr=1e-2, t0=1.0)),
    (rpo.Adafactor, dict(lr=1e-2)),
]


def _run(folder, cls, kwargs, mode, steps=3, **wrap_kw):
    model = wrap(folder, **wrap_kw)
    opt = cls(model.optim_parameters(), **kwargs)
    train(model, opt, mode, range(steps))
    return model, opt


@pytest.mark.parametrize("cls,kwargs", ALGORITHMS, ids=[c.__name__ for c, _ in ALGORITHMS])
def test_every_algorithm_trains_bit_for_bit_as_in_memory(tmp_path, cls, kwargs):
    """float32 state in exact mode (stage by stage in the backward), and the algorithm's compact
    state (int8 where it has it, else bfloat16; Adafactor: bfloat16 master weights) in the
    synchronous step."""
    compact = ({"state_dtype": "int8"} if cls._int8_signed else
               {} if cls is rpo.Adafactor else {"state_dtype": torch.bfloat16})
    runs = [(dict(kwargs), "exact", {})]
    if cls is rpo.Adafactor:
        runs.append((dict(kwargs, stochastic_rounding=True, seed=3), "step",
                     {"optim_dtype": torch.bfloat16}))
    else:  # (centered RMSprop needs float32 state)
        runs.append((dict(kwargs, seed=3, **compact, **({"centered": False}
                                                        if cls is rpo.RMSprop else {})),
                     "step", {}))
    for kw, mode, wrap_kw in runs:
        ram = snapshot(*_run(None, cls, kw, mode, **wrap_kw))
        model, opt = _run(tmp_path / f"{mode}", cls, kw, mode, **wrap_kw)
        assert_on_disk(model, opt)
        assert_identical(snapshot(model, opt), ram, f"{cls.__name__} {kw} {mode}")


@pytest.mark.parametrize("mode", ["step", "async", "exact"])
def test_each_step_mode_with_bf16_and_int8_state_and_bf16_master_weights(tmp_path, mode):
    for kw, wrap_kw in [({"state_dtype": torch.bfloat16}, {}),
                        ({"state_dtype": "int8", "stochastic_rounding": True},
                         {"optim_dtype": torch.bfloat16})]:
        ram = snapshot(*_run(None, rpo.AdamW, dict(lr=1e-2, seed=1, **kw), mode, **wrap_kw))
        model, opt = _run(tmp_path / mode, rpo.AdamW, dict(lr=1e-2, seed=1, **kw), mode,
                          **wrap_kw)
        assert_on_disk(model, opt)
        assert_identical(snapshot(model, opt), ram, f"{kw} {mode}")
        del model, opt


@pytest.mark.parametrize("mode", ["step", "exact"])
def test_clipping_and_a_loss_scaler_step_the_same_on_disk(tmp_path, mode):
    """The verdict's paths (exact mode's step after the backward, the layer-by-layer step with
    a scale and a clip factor): float16 model copy, a GradScaler, max_grad_norm."""
    def run(folder):
        model = wrap(folder, dtype=torch.float16)
        opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)
        scaler = roundpipe.GradScaler(init_scale=2.0 ** 10)
        for step in range(3):
            x, y = batch(step)
            kw = dict(grad_scaler=scaler, max_grad_norm=0.05)
            if mode == "exact":
                model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=opt,
                                       **kw)
            else:
                model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn,
                                       grad_scaler=scaler)
                model.step(opt, **kw)
        model.synchronize()
        return model, opt

    ram = snapshot(*run(None))
    model, opt = run(tmp_path / "d")
    assert model.last_step_stats().grad_norm > 0.05  # clipped
    assert_on_disk(model, opt)
    assert_identical(snapshot(model, opt), ram)


def test_the_optimizers_own_step_streams_too(tmp_path):
    """``opt.step()`` over optimizer copies on a disk (what a step function would call; the
    wrapper refuses step functions with ``optimizer_dir``, so it is reached here inside the
    wrapper's own step context): each param group through the window, as in memory."""
    from roundpipe import guards

    got = []
    for folder in (None, tmp_path / "d"):
        model = wrap(folder)
        named = list(model.optim_named_parameters())
        opt = rpo.Adam([{"params": [o for n, o in named if n.endswith("weight")]},
                        {"params": [o for n, o in named if n.endswith("bias")], "lr": 0.1}],
                       lr=1e-2, amsgrad=True)
        g = torch.Generator().manual_seed(0)
        for step in range(2):
            for _, o in named:
                o.grad = torch.randn(o.shape, generator=g)
            with guards.inside_step(model._steps):
                opt.step()
        got.append(({n: o.detach().clone() for n, o in named}, copy.deepcopy(opt.state_dict())))
        if folder is not None:
            assert_on_disk(model, opt)
        del model, opt
    assert_identical(got[1], got[0])


def test_the_window_stays_bounded_when_the_state_is_many_times_larger(tmp_path, monkeypatch):
    """16 layers of 256 x 256 (fp32 AdamW: 12 bytes per weight on disk): the state is >= 4x the
    window. Every window buffer is counted where it is allocated (the store's only host memory
    for state): at no time do the live ones exceed the window's limit."""
    live, peak = [0], [0]
    real = dio.aligned_buffer

    def counted(size):
        buf = real(size)
        live[0] += len(buf)
        peak[0] = max(peak[0], live[0])
        weakref.finalize(buf, lambda n=len(buf): live.__setitem__(0, live[0] - n))
        return buf

    monkeypatch.setattr(dio, "aligned_buffer", counted)
    for mode in ("exact", "step"):
        live[0] = peak[0] = 0
        model = wrap(tmp_path / mode, layers=16, hidden=256)
        opt = rpo.AdamW(model.optim_parameters(), lr=1e-3)
        train(model, opt, mode, range(2))
        first = model.pipeline_stats(reset=True)
        train(model, opt, mode, range(2, 3))
        stats = model.pipeline_stats()
        store = model._copies.store
        slots = [_slot_of(t) for t in list(model.optim_parameters()) + [
            v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]]
        assert stats["disk_write_bytes"] == sum(s.size for s in slots)  # each once per step
        assert first["disk_read_bytes"] >= first["disk_write_bytes"] > 0  # each read once at least
        assert stats["disk_window_bytes"] == store.stats["window_peak_bytes"]
        on_disk = sum(o.numel() * 4 * 3 for o in model.optim_parameters())
        assert store.limit * 4 <= on_disk, (store.limit, on_disk)
        assert 0 < peak[0] <= store.limit, (peak[0], store.limit)
        assert store.stats["window_peak_bytes"] <= store.limit
        assert store.stats["read_ahead_hits"] > 0  # the next set was read while one stepped
        assert_on_disk(model, opt)
        del model, opt


def test_state_dict_round_trips_between_disk_and_memory(tmp_path):
    """A disk optimizer's state dict loads into one in memory and back; both train on as the
    uninterrupted run in memory."""
    kw = dict(lr=1e-2, state_dtype="int8", seed=5)
    ref_model, ref_opt = _run(None, rpo.AdamW, kw, "step", steps=4)
    ref = snapshot(ref_model, ref_opt)
    disk_model, disk_opt = _run(tmp_path / "a", rpo.AdamW, kw, "step", steps=2)
    mem_model = wrap(None)
    mem_opt = rpo.AdamW(mem_model.optim_parameters(), **kw)
    # (copies: as in torch, a loaded state dict's tensors are taken as they are, the 0-dim
    # step counts included, and each optimizer below trains on)
    mem_model.load_state_dict(copy.deepcopy(disk_model.state_dict()))
    mem_opt.load_state_dict(copy.deepcopy(disk_opt.state_dict()))
    back_model = wrap(tmp_path / "b")
    back_opt = rpo.AdamW(back_model.optim_parameters(), **kw)
    back_model.load_state_dict(copy.deepcopy(mem_model.state_dict()))
    back_opt.load_state_dict(copy.deepcopy(mem_opt.state_dict()))
    assert_on_disk(disk_model, disk_opt)
    for model, opt in ((disk_model, disk_opt), (mem_model, mem_opt), (back_model, back_opt)):
        train(model, opt, "step", range(2, 4))
        assert_identical(snapshot(model, opt), ref)


@pytest.mark.parametrize("kw", [dict(lr=1e-2), dict(lr=1e-2, state_dtype="int8", seed=2)],
                         ids=["fp32", "int8"])
def test_a_checkpoint_resumes_exactly(tmp_path, kw):
    """save_checkpoint after 2 steps on disk; a new RoundPipe on another folder loads it (its
    state written into the files through their mappings) and trains on as the uninterrupted
    run in memory."""
    ref = snapshot(*_run(None, rpo.AdamW, kw, "exact", steps=4))
    model, opt = _run(tmp_path / "a", rpo.AdamW, kw, "exact", steps=2)
    roundpipe.save_checkpoint(str(tmp_path / "ckpt"), model, opt, extra={"step": 2})
    del model, opt
    resumed = wrap(tmp_path / "b")
    ropt = rpo.AdamW(resumed.optim_parameters(), **kw)
    extra = roundpipe.load_checkpoint(str(tmp_path / "ckpt"), resumed, ropt)
    assert_on_disk_between_steps = [_slot_of(v) is not None for st in ropt.state.values()
                                    for v in st.values() if torch.is_tensor(v) and v.dim()]
    assert assert_on_disk_between_steps and all(assert_on_disk_between_steps)
    train(resumed, ropt, "exact", range(extra["step"], 4))
    assert_identical(snapshot(resumed, ropt), ref)


# --- faults --------------------------------------------------------------------------------------

class Faulty(dio.Syscalls):
    """System calls that fail once ``armed``: writes from the ``write_at``-th one (each one
    while ``persist``, else that one only), reads likewise, the allocation of a file; or cut
    each write short (``short``: half, ``stop``: nothing written)."""

    def __init__(self, write_at=None, read_at=None, allocate=False, short=None,
                 error=errno.ENOSPC, persist=True):
        self.write_at, self.read_at, self.allocate_fails = write_at, read_at, allocate
        self.short, self.error, self.persist = short, error, persist
        self.armed, self.writes, self.reads = False, 0, 0

    def _fail(self, count, at):
        return self.armed and at is not None and (count >= at if self.persist else count == at)

    def pwrite(self, fd, buf, offset):
        if self.armed:
            self.writes += 1
        if self._fail(self.writes, self.write_at):
            raise OSError(self.error, os.strerror(self.error))
        if self.armed and self.short == "half" and len(buf) > dio.ALIGN:
            return super().pwrite(fd, buf[:max(dio.ALIGN, len(buf) // 2)], offset)
        if self.armed and self.short == "stop":
            return 0
        return super().pwrite(fd, buf, offset)

    def pread(self, fd, buf, offset):
        if self.armed:
            self.reads += 1
        if self._fail(self.reads, self.read_at):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().pread(fd, buf, offset)

    def allocate(self, fd, offset, length):
        if self.armed and self.allocate_fails:
            raise OSError(self.error, os.strerror(self.error))
        return super().allocate(fd, offset, length)


def _per_param(model, opt) -> list[tuple]:
    """Per parameter: its optimizer copy, model copy and state tensors, as copies."""
    out = []
    for name, o in model.optim_named_parameters():
        st = opt.state.get(o, {})
        out.append((name, o.detach().clone(), model.module.get_parameter(name).detach().clone(),
                    {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}))
    return out


def _same(a, b) -> bool:
    return (torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) and a[3].keys() == b[3].keys()
            and all(torch.equal(a[3][k], b[3][k]) for k in a[3]))


def _faulty_run(tmp_path, monkeypatch, fake, layers=4):
    """A disk run and its twin in memory, one step done; the fake armed."""
    monkeypatch.setattr(dio, "SYSCALLS", fake)
    ram = wrap(None, layers=layers)
    ram_opt = rpo.AdamW(ram.optim_parameters(), lr=1e-2)
    model = wrap(tmp_path / "d", layers=layers)
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)
    for m, o in ((ram, ram_opt), (model, opt)):
        train(m, o, "step", range(1))
    before = _per_param(ram, ram_opt)
    train(ram, ram_opt, "step", range(1, 2))
    fake.armed = True
    return model, opt, before, _per_param(ram, ram_opt)


def test_a_full_disk_in_the_middle_of_a_step_leaves_every_parameter_whole(tmp_path, monkeypatch):
    """Writes fail with ENOSPC from the second one of step 2 on: the step raises, naming the
    folder and the cause; every parameter's tensors (optimizer copy, model copy, state) are all
    at step 1 or all at step 2 (the first layer written, the failed ones held in memory); once
    the disk takes writes again, the held tensors are written (no error) and training goes on
    as in memory."""
    fake = Faulty(write_at=2)
    model, opt, before, after = _faulty_run(tmp_path, monkeypatch, fake)
    x, y = batch(1)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    with pytest.raises(StateDiskError) as info:
        model.step(opt)
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert str(tmp_path / "d" / "rank0") in message and "No space left on device" in message
    assert "held in memory" in message
    state = _per_param(model, opt)
    stepped = [_same(s, a) for s, a in zip(state, after)]
    for s, a, b, new in zip(state, after, before, stepped):
        assert new or _same(s, b), s[0]   # whole: at step 2, or at step 1
    # layer 0 written, layer 1 held; a later one may have stepped before the failure was seen
    assert stepped[0] and stepped[1], stepped
    fake.armed = False  # space freed
    model.synchronize()
    model._copies.store.flush()  # the held writes go through now
    assert all(_same(s, t) for s, t in zip(_per_param(model, opt), state))


def test_a_full_disk_at_the_reservation_steps_nothing(tmp_path, monkeypatch):
    fake = Faulty(allocate=True)
    monkeypatch.setattr(dio, "SYSCALLS", fake)
    model = wrap(tmp_path / "d")
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)
    before = _per_param(model, opt)
    fake.armed = True
    x, y = batch(0)
    with pytest.raises(StateDiskError) as info:
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, optimizer=opt)
        model.synchronize()
    assert "allocating" in str(info.value) and "the optimizer state of roundpipe.optim.AdamW" \
        in str(info.value) and "No space left on device" in str(info.value)
    assert not any(opt.state.values())
    assert all(_same(a, b) for a, b in zip(_per_param(model, opt), before))


def test_short_writes_are_finished_and_a_write_that_stops_is_an_error(tmp_path, monkeypatch):
    fake = Faulty(short="half")
    model, opt, _, after = _faulty_run(tmp_path, monkeypatch, fake)
    train(model, opt, "step", range(1, 2))
    assert fake.writes > 0
    assert all(_same(s, a) for s, a in zip(_per_param(model, opt), after))
    fake.short = "stop"
    x, y = batch(2)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    with pytest.raises(StateDiskError, match="short write"):
        model.step(opt)


def test_a_read_error_raises_before_the_unread_parameters_are_stepped(tmp_path, monkeypatch):
    fake = Faulty(read_at=1)
    model, opt, before, after = _faulty_run(tmp_path, monkeypatch, fake)
    x, y = batch(1)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    with pytest.raises(StateDiskError) as info:
        model.step(opt)
    assert info.value.errno == errno.EIO and str(tmp_path / "d") in str(info.value)
    assert "reading the optimizer state of" in str(info.value)
    state = _per_param(model, opt)
    stepped = [_same(s, a) for s, a in zip(state, after)]
    assert all(new or _same(s, b) for s, b, new in zip(state, before, stepped))
    assert not all(stepped)
    fake.armed = False
    train(model, opt, "step", range(2, 3))  # the disk reads again: training goes on


def test_a_file_size_limit_is_a_clear_error_at_wrapping(tmp_path):
    """A real EFBIG: RLIMIT_FSIZE of 64 KiB in a child process; the optimizer copies' file is
    allocated when the model is wrapped."""
    code = textwrap.dedent(f"""
        import resource, roundpipe, torch
        from test_disk_state import wrap
        from roundpipe.disk import StateDiskError
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            wrap({str(tmp_path / 'd')!r})
        except StateDiskError as e:
            print("ERR", e.errno, e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=child_env())
    assert out.returncode == 0, out.stderr
    assert f"ERR {errno.EFBIG}" in out.stdout and "File too large" in out.stdout, out.stdout
    assert "optimizer copies" in out.stdout and str(tmp_path / "d") in out.stdout


def test_a_file_system_without_direct_io_goes_buffered_and_tmpfs_is_named(tmp_path,
                                                                         monkeypatch):
    class NoDirect(dio.Syscalls):
        def open(self, path, flags, mode=0o600):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return super().open(path, flags, mode)

    ram = snapshot(*_run(None, rpo.AdamW, dict(lr=1e-2), "exact"))
    monkeypatch.setattr(dio, "SYSCALLS", NoDirect())
    with pytest.warns(UserWarning, match="refuses direct I/O"):
        model, opt = _run(tmp_path / "d", rpo.AdamW, dict(lr=1e-2), "exact")
    assert not model._copies.store.folder.direct
    assert_identical(snapshot(model, opt), ram)
    del model, opt
    monkeypatch.undo()
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    folder = f"/dev/shm/roundpipe-test-{os.getpid()}"
    with pytest.warns(UserWarning, match="which is memory"):
        model, opt = _run(folder, rpo.AdamW, dict(lr=1e-2), "exact")
    assert_identical(snapshot(model, opt), ram)
    del model, opt
    assert not os.path.exists(folder)


def test_a_folder_in_use_is_refused(tmp_path):
    model = wrap(tmp_path / "d")
    with pytest.raises(StateDiskError, match="in use by another RoundPipe of this process") as e:
        wrap(tmp_path / "d")
    assert e.value.errno == errno.EBUSY
    del model


_HOLDER = """
import sys, time, roundpipe, roundpipe.optim as rpo
from test_disk_state import wrap, train
model = wrap(sys.argv[1])
opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)
train(model, opt, "step", range(1))
print("ready", flush=True)
time.sleep(300)
"""


def test_another_process_s_folder_is_refused_and_its_leftovers_are_removed(tmp_path):
    """A child holds the folder: refused, naming its pid. The child is killed (SIGKILL: no
    cleanup): the next RoundPipe removes its files with a warning naming that process, and
    trains."""
    folder = tmp_path / "d"
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], env=child_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        with pytest.raises(StateDiskError, match=f"in use by process {child.pid}"):
            wrap(folder)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    left = [n for n in os.listdir(folder / "rank0") if n.endswith(".bin")]
    assert left  # what the killed process left
    with pytest.warns(UserWarning, match=f"process {child.pid} left"):
        model = wrap(folder)
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)
    train(model, opt, "step", range(1))


def test_foreign_files_are_refused_and_kept(tmp_path):
    (tmp_path / "d" / "rank0").mkdir(parents=True)
    (tmp_path / "d" / "rank0" / "notes.txt").write_text("mine")
    with pytest.raises(StateDiskError, match="notes.txt") as e:
        wrap(tmp_path / "d")
    assert e.value.errno == errno.EEXIST
    assert (tmp_path / "d" / "rank0" / "notes.txt").read_text() == "mine"


def test_the_files_go_at_a_normal_exit_and_with_the_model(tmp_path):
    code = ("import sys, roundpipe.optim as rpo\n"
            "from test_disk_state import wrap, train\n"
            "model = wrap(sys.argv[1])\n"
            "opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)\n"
            "train(model, opt, 'exact', range(2))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d")], env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "d").exists()
    model = wrap(tmp_path / "e")
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)
    train(model, opt, "step", range(1))
    assert len(os.listdir(tmp_path / "e" / "rank0")) >= 2
    del model, opt
    deadline = time.monotonic() + 10
    while (tmp_path / "e").exists() and time.monotonic() < deadline:
        import gc
        gc.collect()
        time.sleep(0.05)
    assert not (tmp_path / "e").exists()


def test_a_forked_child_leaves_the_parents_files(tmp_path):
    """A fork()-ed child (a data loader's worker, say) that closes its copy of the store, as
    its exit would, removes nothing: the parent trains on."""
    model = wrap(tmp_path / "d")
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)
    train(model, opt, "step", range(1))
    files = sorted(os.listdir(tmp_path / "d" / "rank0"))
    pid = os.fork()
    if pid == 0:  # the child: close its copy, exit without pytest's machinery
        code = 0
        try:
            model._copies.store.close()
        except BaseException:  # noqa: BLE001 - reported through the exit code
            code = 1
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert sorted(os.listdir(tmp_path / "d" / "rank0")) == files
    train(model, opt, "step", range(1, 2))


def test_what_cannot_stream_is_refused_before_anything_changes(tmp_path):
    model = wrap(tmp_path / "d")
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-2)
    x, y = batch(0)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    with pytest.raises(TypeError, match="not a function"):
        model.step(lambda: opt.step())
    with pytest.raises(ValueError, match="optimizer_dir"):
        model.step(torch.optim.AdamW(model.optim_parameters(), lr=1e-2))
    model.step(opt)  # the gradients were kept for it
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(model)
    with pytest.raises(TypeError, match="optimizer_dir must be"):
        roundpipe.RoundPipe(net(), optimizer_dir=3)
