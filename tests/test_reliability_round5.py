"""Reliability round 5 (issue 45): defects found by attacking the planner, the HF families, the
Trainer's checkpoints, clipping and data parallel. Each test compares with an independent
reference: plain transformers' training loss under the same seed, the planner's own
``check_sizes``, plain PyTorch's clipping, a model that was never given the refused arguments.
Item 2 (a RoundPipeTrainer checkpoint in plain Trainer) is in tests/test_trainer_modes.py, item 6
(a rank whose exception ends its process) in tests/test_distributed.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.planner import LayerCost, Link, check_sizes, plan_stages, predict

LINK = Link(upload_bytes_per_s=50e9, download_bytes_per_s=40e9, visit_s=2e-4, chunk_s=5e-5)
LAYERS = [LayerCost(10**6, 2 * 10**6, 10**6, 1e-3, 2e-3, True) for _ in range(4)]


# --- item 3: predict checks its sizes as plan_stages does --------------------------------------


@pytest.mark.parametrize("sizes", [[1], [5], [0, 4], [2, -1, 3], [2.0, 2], [True, 3], []])
def test_predict_refuses_sizes_that_are_not_a_plan_of_the_layers(sizes):
    """Was: a time for each of these (4 layers). The reference: check_sizes, which plan_stages
    and RoundPipe(layers_per_stage=...) apply, refuses every one of them."""
    with pytest.raises(ValueError):
        check_sizes(sizes, len(LAYERS), "reference")
    with pytest.raises(ValueError, match="predict: sizes"):
        predict(LAYERS, sizes, 2, 1, LINK)
    with pytest.raises(ValueError, match="num_microbatch and num_devices"):
        predict(LAYERS, [2, 2], 0, 1, LINK)
    assert predict(LAYERS, (2, 2), 2, 1, LINK) > 0  # a plan still has its time


# --- item 4: budgets that are no number, NaN or infinite; memory_budget=1 ----------------------


def test_an_infinite_budget_plans_without_a_cap():
    """Was: ``min() arg is an empty sequence``. The reference: the same layers under a budget
    that holds the whole model many times over (no layer or stage comes near its half)."""
    for devices in (1, 2):
        roomy = plan_stages(LAYERS, 2, devices, 10**15, LINK)
        free = plan_stages(LAYERS, 2, devices, math.inf, LINK)
        assert free.sizes == roomy.sizes and free.predicted_s == pytest.approx(roomy.predicted_s)
        assert free.budget_bytes == math.inf


@pytest.mark.parametrize("budget", [math.nan, -math.inf, 0, -5, "1e9", None, True, 1j])
def test_a_budget_that_is_not_a_number_of_bytes_is_refused_naming_it(budget):
    with pytest.raises(ValueError, match=r"budget_bytes must be a number of bytes > 0"):
        plan_stages(LAYERS, 2, 1, budget, LINK)


def test_an_int_memory_budget_below_a_mebibyte_is_refused_saying_fractions_are_floats():
    """``memory_budget=1`` (the int) meant "all of it" and was one byte: every layer was later
    refused as "more than half of the memory budget (0.0 kB of 0.0 kB)". Refused at
    construction now; 1.0 (the float) and a real byte count are accepted."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for budget in (1, 2, 1000, (1 << 20) - 1):
        with pytest.raises(ValueError, match=r"memory_budget=.* is an int, so bytes.*written as "
                                             r"a float \(memory_budget=1\.0"):
            roundpipe.RoundPipe(net, device="cpu", layers_per_stage="auto", memory_budget=budget)
    for budget in (1.0, 1 << 20, 2**30):
        model = roundpipe.RoundPipe(net, device="cpu", layers_per_stage="auto",
                                    memory_budget=budget)
        model.forward_backward(input_args=(torch.randn(3, 4),), loss_fn=lambda o: o.sum())
