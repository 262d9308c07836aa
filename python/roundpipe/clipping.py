"""Clipping by the global gradient norm, with ``torch.nn.utils.clip_grad_norm_``'s arithmetic.

The wrapper gathers each parameter's squared gradient norm where the gradient is read anyway
(on the device, right after the microbatches are summed, before the download) and applies
the coefficient inside the fused optimizer step, so clipping costs no pass over host memory.
From the squared norms this module computes what torch computes from the gradients: the
total norm as a float32, ``clip_coef = max_norm / (total_norm + 1e-6)`` in float32 and
clamped at 1. The total norm is summed in float64 (torch sums float32 per-tensor norms), so
it can differ from torch's in its last bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Clip:
    """``step(..., max_grad_norm=, norm_type=, error_if_nonfinite=)``, checked.

    Raises:
        ValueError: ``max_grad_norm`` is not a finite number >= 0, or ``norm_type`` is not 2.
        TypeError: ``error_if_nonfinite`` is not a bool.
    """

    max_norm: float
    error_if_nonfinite: bool = False

    @staticmethod
    def make(max_grad_norm: Any, norm_type: Any, error_if_nonfinite: Any, where: str):
        if max_grad_norm is None:
            return None
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
                or not (0.0 <= max_grad_norm < math.inf):
            raise ValueError(f"{where}: max_grad_norm must be a finite number >= 0, got "
                             f"{max_grad_norm!r}")
        if isinstance(norm_type, bool) or norm_type not in (2, 2.0):
            raise ValueError(f"{where}: norm_type {norm_type!r} is not supported (only the L2 "
                             "norm, 2.0, is gathered during the pass)")
        if not isinstance(error_if_nonfinite, bool):
            raise TypeError(f"{where}: error_if_nonfinite must be a bool, got "
                            f"{type(error_if_nonfinite).__name__}")
        return Clip(float(max_grad_norm), error_if_nonfinite)

    def coefficient(self, total_norm: float) -> float:
        """The factor the gradients are multiplied by (float32 value as a float), computed as
        torch does from the float32 total norm.

        Raises:
            RuntimeError: the norm is not finite and ``error_if_nonfinite`` (torch's message).
        """
        norm = torch.tensor(total_norm, dtype=torch.float32)
        if self.error_if_nonfinite and not math.isfinite(float(norm)):
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is non-finite, so "
                "it cannot be clipped. To disable this error and scale the gradients by the "
                "non-finite norm anyway, set `error_if_nonfinite=False`")
        coef = self.max_norm / (norm + 1e-6)
        return float(torch.clamp(coef, max=1.0))


def total_norm(norms_sq: list[float]) -> float:
    """The L2 norm from per-tensor squared norms (float64 sum)."""
    return math.sqrt(math.fsum(norms_sq))
