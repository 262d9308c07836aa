"""Execute: running a stage's layers on one microbatch with the stage's device tensors.

Every layer runs under a seed fixed by (call seed, layer, microbatch) — see :func:`layer_seed` —
in a forked RNG, so its randomness (dropout) is the same in the forward pass and in the
recomputation of the backward pass, and does not depend on how layers are grouped into stages,
on the order stages run in, or on how many devices there are.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Optional

import torch
from torch import nn

from .. import recompute

_SEED_MOD = 2**63

# torch's CPU generator (and each CUDA device's) is process-wide: workers fork, seed and
# restore it one layer at a time, so each layer draws from its own seed and the caller's
# generator is left as it was. Re-entrant: a layer may run another RoundPipe (a teacher),
# whose pass then runs on the same thread (see :func:`in_layer`).
RNG_LOCK = threading.RLock()
_local = threading.local()


def layer_seed(call_seed: int, layer: int, microbatch: int) -> int:
    """The seed layer ``layer`` runs under for microbatch ``microbatch`` in a ``forward`` or
    ``forward_backward`` call whose seed is ``call_seed`` (one ``torch.randint(2**62, ())``
    drawn from the global generator at the start of the call): ``call_seed + layer * 2**20 +
    microbatch``, modulo 2**63."""
    return (call_seed + (layer << 20) + microbatch) % _SEED_MOD


def draw_call_seed() -> int:
    """One draw from torch's global generator: the seed of a forward/forward_backward call."""
    return int(torch.randint(2**62, ()).item())


def in_layer() -> bool:
    """Whether the calling thread is running a layer of some RoundPipe right now."""
    return getattr(_local, "depth", 0) > 0


def run_layers(layers: list[nn.Module], first_layer: int,
               tensors: list[list[tuple[tuple, torch.Tensor]]], stage_input: Any,
               microbatch: int, call_seed: int, device: torch.device, store: dict,
               recomputing: bool, locks: Optional[list] = None,
               meter: Optional[Callable[[int], Any]] = None) -> Any:
    """Runs ``layers`` (global indices from ``first_layer``) on ``stage_input`` with the
    device tensors ``tensors[i]`` of layer ``i`` (``(sites, tensor)`` pairs:
    :attr:`roundpipe.transfer.TensorRef.sites`). Layer 0 receives the user's inputs as
    ``(args, kwargs)``; every other layer receives the previous layer's output as its single
    argument, as ``nn.Sequential``. ``locks[i]`` (optional) is held while layer ``i`` runs:
    a module that appears in stages on different devices must not run on two threads at
    once (its tensors are swapped while it runs). ``meter(index)`` (optional) is a context
    around layer ``index``'s run that measures it (:mod:`roundpipe.pipeline.meter`)."""
    x = stage_input
    cuda = (device.index or 0) if device.type == "cuda" else None
    for offset, (layer, placed) in enumerate(zip(layers, tensors)):
        index = first_layer + offset
        lock = locks[offset] if locks is not None else None
        if index == 0:
            args, kwargs = x
        else:
            args, kwargs = (x,), {}
        with lock if lock is not None else _NO_LOCK, RNG_LOCK, \
                recompute.running(store, (index, microbatch), recomputing), \
                meter(index) if meter is not None else _NO_LOCK:
            x = _run_layer(layer, placed, args, kwargs, layer_seed(call_seed, index, microbatch),
                           cuda)
    return x


def _run_layer(layer: nn.Module, placed: list[tuple[tuple, torch.Tensor]], args: tuple,
               kwargs: dict, seed: int, cuda: Optional[int]) -> Any:
    """``layer(*args, **kwargs)`` with its tensors swapped for ``placed`` (as
    ``torch.func.functional_call`` would: the modules' ``_parameters`` / ``_buffers`` entries,
    a tied tensor at each of its places; restored after) and torch's CPU generator (and CUDA
    device ``cuda``'s) seeded with ``seed``, their states restored after (as
    ``torch.random.fork_rng``). The caller holds :data:`RNG_LOCK`."""
    cpu_rng = torch.default_generator.get_state()
    cuda_rng = torch.cuda.get_rng_state(cuda) if cuda is not None else None
    swapped = []
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        torch.default_generator.manual_seed(seed)
        if cuda is not None:
            with torch.cuda.device(cuda):
                torch.cuda.manual_seed(seed)
        for sites, t in placed:
            for held, key in sites:
                swapped.append((held, key, held[key]))
                held[key] = t
        return layer(*args, **kwargs)
    finally:
        for held, key, original in reversed(swapped):
            held[key] = original
        _local.depth -= 1
        torch.default_generator.set_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, cuda)


_NO_LOCK = contextlib.nullcontext()
