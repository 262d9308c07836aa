"""The numbers the README states are checked against their source: the test count against what
pytest collects, the host-memory table against docs/host_memory.md's ladder, the optimizer
ratios against docs/benchmarks.md, the demo's timings against docs/demo.md's table, the demo
model's size against the model the demo builds. A number changed in one place and not the
other fails here. And the README and docs build the optimizer one way."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _table(text: str, header: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table whose header line starts with
    ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_the_test_count_is_what_pytest_collects():
    """The README's count is a machine's with AVX-512 (the ``isa`` fixture runs a test once per
    ISA the CPU has): on one without, each test run for AVX2 would also run for AVX-512 there,
    so those are counted twice (a CI machine may have either)."""
    import roundpipe.optim as rpo

    stated = int(re.search(r"about ([\d ,]+) tests", README).group(1).replace(" ", "")
                 .replace(",", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", str(ROOT / "tests")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    collected = int(re.search(r"(\d+) tests? collected", proc.stdout).group(1))
    if "avx512" not in rpo.supported_isas():
        ids = [re.search(r"\[(.*)\]$", line) for line in proc.stdout.splitlines()]
        collected += sum(1 for m in ids if m and "avx2" in m.group(1).split("-"))
    assert abs(collected - stated) <= 0.1 * collected, (
        f"README says about {stated} tests; pytest collects {collected} (on AVX-512)")


def test_the_host_memory_table_is_the_ladders():
    readme = _table(README, "| configuration | floor B/param |")
    ladder = {r[0]: r for r in _table((ROOT / "docs" / "host_memory.md").read_text(),
                                      "| configuration | floor B/param |")}
    assert len(readme) == len(ladder) == 5
    for name, floor, measured, losses in readme:
        row = ladder[name]   # configuration, floor, measured, ..., vs fp32 AdamW (last column)
        assert (floor, measured, losses) == (row[1], row[2], row[-1]), name


def test_the_optimizer_ratios_are_the_benchmark_pages():
    paragraph = README[README.index("Optimizer steps, from"):README.index("## Documentation")]
    benchmarks = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    ranges = re.findall(r"\d+(?:\.\d+)?-\d+(?:\.\d+)?x|\d+% or more|\d+\.\d+ ms", paragraph)
    assert len(ranges) >= 6
    for r in ranges:
        assert r in benchmarks or r.replace(" or more", "") in benchmarks, r


def test_the_demo_timings_are_the_demo_pages():
    """Every time the README's quick start gives for the demo is in docs/demo.md's table."""
    quick = README[README.index("The demo trains"):README.index("The tests take")]
    table = (ROOT / "docs" / "demo.md").read_text()
    times = re.findall(r"\d+ min(?: \d+ s)?", quick)
    assert times
    for t in times:
        assert t in table, t


def test_the_demo_model_size_is_the_models(tmp_path):
    """The README's "3.8M-parameter Qwen3": the model the demo builds with its defaults."""
    pytest.importorskip("transformers")
    import torch

    spec = importlib.util.spec_from_file_location("train_qwen3", ROOT / "examples" / "train_qwen3.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    demo.torch = torch
    args = demo.parse_args(["--out", str(tmp_path)])
    tokenizer = types.SimpleNamespace(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        model = demo.build_model(args, args.vocab, tokenizer)
    stated = float(re.search(r"trains a ([\d.]+)M-parameter Qwen3", README).group(1))
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == stated


def test_the_readme_and_docs_build_the_optimizer_one_way():
    """``opt = ...(model.optim_parameters(), ...)`` and ``model.step(opt)`` in every example;
    ``OptimizerCtx`` and step functions are described where they matter, not used as a second
    idiom for the same loop."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [(p.name, b) for p in pages
              for b in re.findall(r"```python\n(.*?)```", p.read_text(), re.S)]
    assert len(blocks) > 10
    for name, block in blocks:
        assert "with OptimizerCtx()" not in block, name
        assert "step(lambda: (opt.step(), opt.zero_grad()))" not in block, name
