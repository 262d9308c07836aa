"""The int8 state's dynamic maps (signed and unsigned) and blockwise quantisation written from
their definition (Dettmers et al., 8-bit optimizers; roundpipe/compact.hpp documents ours), in
float64: the reference tests/test_compact_state.py and tests/test_checkpoint_compact.py hold
our kernels to."""

from __future__ import annotations

import torch

DECADE_TOP = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]


def reference_map(is_signed: bool) -> torch.Tensor:
    values = [0.0, 1.0]
    for i, top in enumerate(DECADE_TOP):
        n = 2**i if is_signed else 2 ** (i + 1)
        for j in range(n):
            v = top * (0.1 + 0.9 * (j + 0.5) / n)
            values += [v, -v] if is_signed else [v]
    return torch.tensor(sorted(values), dtype=torch.float64).float()


def reference_bounds(m: torch.Tensor) -> torch.Tensor:
    """The 255 float32-rounded midpoints between neighbouring map values."""
    return ((m[:-1].double() + m[1:].double()) / 2).float()


MAPS = {s: reference_map(s) for s in (True, False)}
BOUNDS = {s: reference_bounds(MAPS[s]) for s in (True, False)}


def reference_quantize(x: torch.Tensor, is_signed: bool):
    """Codes (nearest map value of x / absmax; at a midpoint the lower) and block absmax."""
    flat = x.detach().double().flatten()
    blocks = flat.split(256)
    absmax = torch.stack([b.abs().max() for b in blocks])
    scale = absmax.repeat_interleave(256)[: flat.numel()]
    y = torch.where(scale > 0, flat / scale, torch.zeros_like(flat))
    if not is_signed:
        y = y.clamp(min=0)
    codes = torch.searchsorted(BOUNDS[is_signed].double(), y, right=False)
    return codes.view(x.shape), absmax.float(), y


def reference_dequantize(codes: torch.Tensor, absmax: torch.Tensor, is_signed: bool):
    scale = absmax.repeat_interleave(256)[: codes.numel()].view(codes.shape)
    return MAPS[is_signed][codes.long()] * scale
