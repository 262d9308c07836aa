"""Host bytes per trainable parameter of each compact-storage option, measured as the memory
benchmark measures them (roundpipe.bench.memory: peak RSS of a fresh process over the parameter
count, after a warm-up of the fixed costs; a 12-layer, 100M-parameter model built in bfloat16,
trained in exact overlapped mode on the CPU device), held between the persistent floor (model
copy + optimizer copy + state) and the issue's bounds: about one stage in flight above it."""

from __future__ import annotations

import pytest

from roundpipe.bench.memory import CONFIGS, measure_memory

BOUNDS = {"fp32 AdamW": 15.5, "bf16 state": 11.5, "int8 state": 9.5, "Adafactor": 7.5,
          "bf16 master + int8 state": 5.5}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_host_bytes_per_parameter_between_floor_and_bound(config):
    per_param = measure_memory(config, 1024)
    assert config.floor <= per_param <= BOUNDS[config.name], per_param
