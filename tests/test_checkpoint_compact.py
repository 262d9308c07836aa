"""DCP checkpoints (``roundpipe.save_checkpoint`` / ``load_checkpoint``) of optimizers with
compact state (``state_dtype=torch.bfloat16`` or ``"int8"``) and of one-copy weights:

- in one process, the state comes back exactly as it was kept, and training continues as the
  uninterrupted run;
- a checkpoint loads into an optimizer of another ``state_dtype``: the values it reads back as
  (int8: the dynamic map as tests/dynamic_map_reference.py writes it from its definition, times
  each block's maximum) converted to that format;
- int8 state sharded over 2 ranks (each rank's blocks over its own rows) loads in one process:
  float32 state takes the values each rank's rows read back as, int8 state requantizes them;
- bfloat16 state loads into torch.optim cast to the parameters' dtype (as torch's own loading);
- what cannot load (int8 state into torch.optim, another optimizer class, other param groups,
  a checkpoint without optimizer) is refused before anything changes.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

import roundpipe
import roundpipe.optim as rpo

import launcher
from dynamic_map_reference import reference_map


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64)).to(dtype)


def _wrapped(state_dtype, one_copy):
    dtype = torch.bfloat16 if one_copy else torch.float32
    model = roundpipe.RoundPipe(_net(dtype), optim_dtype=dtype if one_copy else None,
                                num_microbatch=2)
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-2, state_dtype=state_dtype,
                    stochastic_rounding=one_copy, seed=3)
    return model, opt


def _train(model, opt, steps):
    for step in steps:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        model.forward_backward(input_args=(x,), loss_fn=lambda o: o.float().square().mean())
        model.step(opt)


@pytest.mark.parametrize("state_dtype,one_copy", [("int8", False), (torch.bfloat16, False),
                                                  ("int8", True)])
def test_compact_state_round_trips_and_training_continues(tmp_path, state_dtype, one_copy):
    model, opt = _wrapped(state_dtype, one_copy)
    _train(model, opt, range(2))
    roundpipe.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    saved = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt.state_dict()["state"].items()}
    _train(model, opt, range(2, 4))
    again, again_opt = _wrapped(state_dtype, one_copy)
    roundpipe.load_checkpoint(str(tmp_path / "ckpt"), again, again_opt)
    for k, st in again_opt.state_dict()["state"].items():
        assert st.keys() == saved[k].keys()
        for key, v in st.items():
            assert v.dtype == saved[k][key].dtype and torch.equal(v, saved[k][key]), (k, key)
    _train(again, again_opt, range(2, 4))
    for p, q in zip(model.optim_parameters(), again.optim_parameters()):
        assert torch.equal(p, q)


def test_a_checkpoint_loads_into_another_state_dtype(tmp_path):
    model, opt = _wrapped("int8", False)
    _train(model, opt, range(2))
    roundpipe.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    st = opt.state[next(model.optim_parameters())]
    codes, absmax = st["exp_avg"], st["exp_avg_absmax"]
    expected = (reference_map(True)[codes.long().flatten()].view(-1, 256)
                * absmax[:, None]).view(codes.shape)
    fp32, fp32_opt = _wrapped(torch.float32, False)
    roundpipe.load_checkpoint(str(tmp_path / "ckpt"), fp32, fp32_opt)
    torch.testing.assert_close(fp32_opt.state[next(fp32.optim_parameters())]["exp_avg"], expected,
                               rtol=1e-6, atol=0)
    bf16, bf16_opt = _wrapped(torch.bfloat16, False)
    roundpipe.load_checkpoint(str(tmp_path / "ckpt"), bf16, bf16_opt)
    got = bf16_opt.state[next(bf16.optim_parameters())]["exp_avg"]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=0)


def test_int8_state_sharded_over_two_ranks_loads_in_one_process(tmp_path):
    for r in launcher.launch("distributed_ranks.py", 2, "save_int8", tmp_path):
        assert r.returncode == 0, r.stderr[-3000:]
    parts = [torch.load(tmp_path / f"rows-{r}.pt") for r in range(2)]
    model = roundpipe.RoundPipe(_net(), num_microbatch=2)
    fp32 = rpo.AdamW(model.optim_parameters(), lr=1e-2)
    roundpipe.load_checkpoint(str(tmp_path / "ckpt"), model, fp32)
    int8_model = roundpipe.RoundPipe(_net(), num_microbatch=2)
    int8 = rpo.AdamW(int8_model.optim_parameters(), lr=1e-2, state_dtype="int8")
    roundpipe.load_checkpoint(str(tmp_path / "ckpt"), int8_model, int8)
    int8_state = int8.state_dict(state_dtype=torch.float32)["state"]
    for i, p in enumerate(model.optim_parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            whole = torch.cat([part["state"][i][key] for part in parts])  # rank 0's rows first
            assert torch.equal(fp32.state[p][key], whole), (i, key)
            if p.numel() >= rpo.compact.INT8_MIN_NUMEL:  # requantized: within half a map step
                scale = whole.abs().max()
                torch.testing.assert_close(int8_state[i][key], whole, rtol=0.07,
                                           atol=1e-3 * float(scale))


def _weights(model):
    return [p.detach().clone() for p in model.module.parameters()]


def test_bfloat16_state_loaded_into_torch_optim_is_cast_to_the_parameters(tmp_path):
    model, opt = _wrapped(torch.bfloat16, False)
    _train(model, opt, range(2))
    roundpipe.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    saved = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
    fresh = roundpipe.RoundPipe(_net(), num_microbatch=2)
    torch_opt = torch.optim.AdamW(fresh.optim_parameters(), lr=1e-2)
    roundpipe.load_checkpoint(str(tmp_path / "ckpt"), fresh, torch_opt)
    for i, p in enumerate(fresh.optim_parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            got = torch_opt.state[p][key]
            assert got.dtype == torch.float32 and torch.equal(got, saved[i][key].float())
    _train(fresh, torch_opt, range(2, 3))                     # torch steps from it


def test_checkpoints_refused_before_anything_changes(tmp_path):
    model, opt = _wrapped("int8", False)
    _train(model, opt, range(2))
    roundpipe.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    roundpipe.save_checkpoint(str(tmp_path / "bare"), model)
    cases = [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2), TypeError, "int8"),
        (lambda ps: rpo.Adafactor(ps), ValueError, "another optimizer class"),
        (lambda ps: rpo.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.5}]),
         ValueError, "1 param groups, this one 2"),
    ]
    for make, error, match in cases:
        fresh = roundpipe.RoundPipe(_net(), num_microbatch=2)
        before = _weights(fresh)
        fresh_opt = make(list(fresh.optim_parameters()))
        with pytest.raises(error, match=match):
            roundpipe.load_checkpoint(str(tmp_path / "ckpt"), fresh, fresh_opt)
        assert all(torch.equal(a, b) for a, b in zip(_weights(fresh), before))
        assert not fresh_opt.state
    fresh = roundpipe.RoundPipe(_net(), num_microbatch=2)
    with pytest.raises(ValueError, match="no optimizer state"):
        roundpipe.load_checkpoint(str(tmp_path / "bare"), fresh, rpo.AdamW(fresh.optim_parameters()))


def test_single_process_save_and_load_print_no_warning(tmp_path):
    """DCP's "torch.distributed is disabled ... assuming the intent is to save in a single
    process" and its overwrite notice read as if something were wrong: a save (twice into the
    same folder, as a run's last checkpoint is) and a load warn nothing, and the second save
    replaced the first."""
    import warnings

    model, opt = _wrapped(torch.float32, False)
    path = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        roundpipe.save_checkpoint(path, model, opt, extra={"step": 1})
        _train(model, opt, range(1))
        roundpipe.save_checkpoint(path, model, opt, extra={"step": 2})
        again, again_opt = _wrapped(torch.float32, False)
        assert roundpipe.load_checkpoint(path, again, again_opt) == {"step": 2}
    for p, q in zip(model.optim_parameters(), again.optim_parameters()):
        assert torch.equal(p, q)
