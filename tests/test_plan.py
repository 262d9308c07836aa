"""roundpipe.plan's pure functions on their own: stages and their devices, the layers check, and
the maps of modules shared between stages (locks, buffer dependencies, per-stage sizes), each
against what is worked out by hand here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roundpipe.plan import check_layers, device_index, make_stages, shared_modules, uniform_sizes


def test_stages_go_to_the_devices_round_robin():
    devices = [torch.device("cpu", 0), torch.device("cpu", 1)]
    stages = make_stages(uniform_sizes(5, 2), devices)
    assert [(s.start, s.stop) for s in stages] == [(0, 2), (2, 4), (4, 5)]
    assert [s.device for s in stages] == [devices[0], devices[1], devices[0]]
    assert [device_index(s, 3) for s in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="layers_per_stage must be >= 1"):
        uniform_sizes(5, 0)


def test_layers_must_be_modules_of_the_model():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert check_layers(model, iter(model)) == list(model)
    with pytest.raises(ValueError, match="layers must not be empty"):
        check_layers(model, [])
    with pytest.raises(TypeError, match=r"layers\[1\] must be an nn.Module"):
        check_layers(model, [model[0], "x"])
    with pytest.raises(ValueError, match=r"'weight' of layers\[0\] is not a parameter"):
        check_layers(model, [nn.Linear(2, 2)])


def test_shared_modules_maps():
    torch.manual_seed(0)
    tied = nn.Linear(3, 3)                        # used by layers 0 and 3 (stages 0 and 2)
    norm = nn.BatchNorm1d(3)                      # buffers, used by layers 1 and 2 (stages 0, 1)
    head = nn.Linear(3, 4, bias=False)
    head.weight.requires_grad_(False)             # frozen: no gradient
    layers = [nn.Sequential(tied), nn.Sequential(norm), nn.Sequential(norm, head),
              nn.Sequential(tied)]
    stages = make_stages(uniform_sizes(len(layers), 2), [torch.device("cpu")])  # [0, 1], [2, 3]
    trainable = {id(p) for layer in layers for p in layer.parameters() if p.requires_grad}
    maps = shared_modules(layers, stages, trainable)
    # layers 0 and 3 share `tied` across stages, 1 and 2 share `norm` across stages: one lock
    # per group, the groups' locks distinct
    assert maps.locks[0] is maps.locks[3] and maps.locks[1] is maps.locks[2]
    assert maps.locks[0] is not None and maps.locks[1] is not None
    assert maps.locks[0] is not maps.locks[1]
    # stage 1 shares `norm` (which holds buffers) with stage 0
    assert maps.buffer_deps == [[], [0]]
    f32 = 4
    norm_bytes = (3 + 3) * f32 + (3 + 3) * f32 + 8  # weight, bias; running mean, var; count
    assert maps.stage_bytes == [(9 + 3) * f32 + norm_bytes, norm_bytes + 12 * f32 + (9 + 3) * f32]
    assert maps.grad_numels == [[9, 3, 3, 3], [3, 3, 9, 3]]


def test_no_lock_without_a_module_shared_across_stages():
    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    maps = shared_modules(layers, make_stages((1, 1), [torch.device("cpu")]), set())
    assert maps.locks == [None, None] and maps.buffer_deps == [[], []]
    assert maps.grad_numels == [[], []]
