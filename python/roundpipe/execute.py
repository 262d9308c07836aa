"""Execute: running one stage on one microbatch.

Every layer runs under a seed fixed by (call seed, layer, microbatch) — see :func:`layer_seed` —
in a forked RNG, so its randomness (dropout) is the same in the forward pass and in the
recomputation of the backward pass, and does not depend on how layers are grouped into stages,
on the order stages run in, or on how many devices there are.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from . import recompute
from .transfer import LayerWeights

_SEED_MOD = 2**63

# torch's CPU generator is global: workers on different devices fork, seed and restore it one
# at a time, so each layer draws from its own seed and the caller's generator is left as it was.
RNG_LOCK = threading.Lock()


def layer_seed(call_seed: int, layer: int, microbatch: int) -> int:
    """The seed layer ``layer`` runs under for microbatch ``microbatch`` in a ``forward`` or
    ``forward_backward`` call whose seed is ``call_seed`` (one ``torch.randint(2**62, ())``
    drawn from the global generator at the start of the call): ``call_seed + layer * 2**20 +
    microbatch``, modulo 2**63."""
    return (call_seed + (layer << 20) + microbatch) % _SEED_MOD


def draw_call_seed() -> int:
    """One draw from torch's global generator: the seed of a forward/forward_backward call."""
    return int(torch.randint(2**62, ()).item())


def run_stage(layers: list[nn.Module], first_layer: int, weights: list[LayerWeights],
              stage_input: Any, microbatch: int, call_seed: int, device: torch.device,
              store: dict, recomputing: bool) -> Any:
    """Runs ``layers`` (global indices from ``first_layer``) on ``stage_input`` with the device
    tensors ``weights``. Layer 0 receives the user's inputs as ``(args, kwargs)``; every other
    layer receives the previous layer's output as its single argument, as ``nn.Sequential``."""
    x = stage_input
    cuda = [device.index or 0] if device.type == "cuda" else []
    for offset, (layer, w) in enumerate(zip(layers, weights)):
        index = first_layer + offset
        seed = layer_seed(call_seed, index, microbatch)
        with RNG_LOCK, torch.random.fork_rng(devices=cuda), \
                recompute.running(store, (index, microbatch), recomputing):
            torch.default_generator.manual_seed(seed)
            if cuda:
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(seed)
            if index == 0:
                args, kwargs = x
                x = functional_call(layer, w.tensors, tuple(args), dict(kwargs))
            else:
                x = functional_call(layer, w.tensors, (x,))
    return x
