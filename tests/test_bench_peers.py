"""The peers table of ``python -m roundpipe.bench`` (:mod:`roundpipe.bench.peers`) cannot rot:
each peer whose package is installed steps as torch.optim does (checked here, independently of
the benchmark's own check), and the benchmark prints and saves its rows with finite figures.

What is skipped, and why:

- a peer whose package is not installed (none is a dependency of RoundPipe; torchao and
  bitsandbytes are in requirements-peers.txt);
- DeepSpeed's peers unless its ``cpu_adam``/``cpu_adagrad`` ops are already built (prebuilt, or
  in torch's extension folder after one ``python -m roundpipe.bench`` run): building them takes
  minutes on 2 cores, which the suite must not pay on every fresh machine; where they are built
  its tests take seconds;
- torchao's ``torch.compile``: its step functions run eagerly here (compiling them costs about a
  minute on a cold cache on 2 cores; the compiled function is torchao's own and computes the
  same). What is tested is ours: the wiring of each peer (its class, arguments, lr, state
  form), the rows, the checks.

No speed is asserted (the benchmark reports ratios measured in one run).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from roundpipe.bench import available_cpus, peers


def _unusable(peer: peers.Peer) -> str | None:
    """Why ``peer`` cannot be tested here, or None."""
    try:
        importlib.import_module(peer.package)
    except Exception as e:
        return f"{peer.package} not usable: {type(e).__name__}"
    if peer.deepspeed_op and not peers.deepspeed_op_built(peer.deepspeed_op):
        return (f"DeepSpeed's {peer.deepspeed_op} op is not built (minutes; python -m "
                "roundpipe.bench --peers only builds it once)")
    return None


CASES = [(c, p) for c in peers.CONFIGS for p in c.peers]
TORCH = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "Adagrad": torch.optim.Adagrad}


@pytest.mark.parametrize("config,peer", CASES, ids=[f"{c.name}: {p.label}" for c, p in CASES])
def test_peer_steps_as_torch_optim(config, peer, monkeypatch):
    reason = _unusable(peer)
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # torchao eagerly (see above)
    gen = torch.Generator().manual_seed(3)
    values = [(torch.rand(8192, generator=gen) - 0.5).to(config.param_dtype) for _ in range(2)]
    grads = [[(torch.rand(8192, generator=gen) - 0.5).to(config.param_dtype) for _ in range(2)]
             for _ in range(2)]
    params = [torch.nn.Parameter(v.clone()) for v in values]
    ref_params = [torch.nn.Parameter(v.float().clone()) for v in values]  # .float(): no copy
    opt = peer.make(params, 0.1)
    ref = TORCH[config.algorithm](ref_params, lr=0.1, weight_decay=0.01)
    for g in grads:
        for p, q, x in zip(params, ref_params, g):
            p.grad, q.grad = x.clone(), x.float().clone()
        opt.step()
        ref.step()
    if config.tolerance == "int8":
        assert all(s.dtype != torch.float32 or s.dim() == 0 or s.numel() < 8192
                   for s in _state_tensors(opt, params[0])), "int8 state kept as float32"
    for p, v, r in zip(params, values, ref_params):
        assert p.dtype == config.param_dtype
        p, v = p.detach().float(), v.float()
        assert (p - v).abs().mean() > 0.05                 # two steps of ~0.1: it moved
        d = (p - r.detach()).abs()
        if config.tolerance == "float32":
            torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)
        elif config.tolerance == "bfloat16":
            assert bool((d <= 2 ** -6 * r.detach().abs() + 2e-3).all()), float(d.max())
        else:  # 8-bit state: single elements err by much of an update, the mean by ~0.35%
            assert float(d.mean()) <= 1e-3, float(d.mean())


def _state_tensors(opt, p) -> list[torch.Tensor]:
    """The tensors of ``opt``'s state of ``p`` (torchao's subclasses by their codes)."""
    out = []
    for v in opt.state[p].values():
        if torch.is_tensor(v):
            out.append(getattr(v, "codes", v))
    return out


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_the_benchmarks_check_refuses_a_step_that_did_nothing(kind):
    gen = torch.Generator().manual_seed(0)
    before = [torch.rand(4096, generator=gen) - 0.5]
    after = [b - 0.1 * torch.sign(torch.rand(4096, generator=gen) - 0.5) for b in before]
    assert not peers.check(kind, before, after, 0.1)["ok"]
    assert peers.check(kind, after, after, 0.1)["ok"]


def test_a_missing_package_is_a_note_not_an_error(monkeypatch):
    monkeypatch.setitem(peers.PACKAGES, "no_such_package_for_roundpipe", "pip install nothing")
    lines = []
    found = peers.find_peers(lines.append, packages=["no_such_package_for_roundpipe"])
    assert found["no_such_package_for_roundpipe"].startswith("ModuleNotFoundError")
    assert any("no_such_package_for_roundpipe not usable" in s and "pip install nothing" in s
               for s in lines)
    assert all(found[p] == "left out by --peer-packages" for p in peers.PACKAGES
               if p != "no_such_package_for_roundpipe")
    assert not peers.deepspeed_op_built("NoSuchBuilder")


def test_the_peers_table_has_every_installed_peers_rows(tmp_path):
    usable = sorted({p.package for _, p in CASES if _unusable(p) is None})
    if not usable:
        pytest.skip("no peer package usable here")
    out = tmp_path / "peers.json"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")  # torchao eagerly (see above)
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "--peers", "only",
                        "--peer-packages", *usable, "--algorithms", "Adam", "AdamW", "Adagrad",
                        "--layouts", "50M", "--scale", "0.0002", "--repeats", "5",
                        "--threads", "all", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "(both --threads all; the peers' OpenMP loops too)" in r.stdout
    result = json.loads(out.read_text())
    assert result["threads"]["roundpipe_pool"] == result["threads"]["torch_intra_op"] \
        == available_cpus()
    assert result["rows"] == [] and result["peers"]["wrong"] == []
    rows = {row["config"]: row for row in result["peers"]["rows"]}
    assert set(rows) == {c.name for c in peers.CONFIGS}          # with or without a peer
    for config in peers.CONFIGS:
        row = rows[config.name]
        # 10k elements cut to whole blocks of 256
        assert row["elements"] == 9984 and row["bytes_per_element"] == config.bytes_per_element
        expected = {p.label for p in config.peers if _unusable(p) is None}
        assert set(row["peers"]) == expected, config.name
        assert set(row["ns_per_param_samples"]) == {"floor", "roundpipe"} | expected
        for samples in row["ns_per_param_samples"].values():
            assert len(samples) == 5 and all(math.isfinite(v) and v > 0 for v in samples)
        for name, peer in row["peers"].items():
            assert all(math.isfinite(v) and v > 0 for v in peer["speedup"].values())
            assert name in r.stdout
        assert set(row["checks"]) == {"roundpipe"} | expected
        assert all(c["ok"] for c in row["checks"].values()), row["checks"]
        assert 0 < row["floor_fraction"]["median"] < 10
