"""``roundpipe.optim.Adafactor``: torch.optim.Adafactor's interface and results, stepped by SIMD
kernels."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ._base import CpuOptimizer, check_tensor_lr


class Adafactor(CpuOptimizer):
    """Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory
    Cost", 2018), as torch.optim.Adafactor (torch 2.13) defines it: a drop-in replacement whose
    step runs in the RoundPipe C++ kernels.

    The second moment of a tensor of two or more dimensions is factored into a row factor
    ``row_var`` (shape ``[..., rows, 1]``) and a column factor ``col_var`` (``[..., 1, cols]``)
    over its last two dimensions, so its state costs (rows + cols) floats per matrix instead of
    rows * cols; a vector or 0-dim tensor keeps the whole ``variance``. There is no first moment.
    ``lr`` caps the relative step size ``min(lr, 1 / sqrt(step))`` (scaled by the parameter's
    RMS, at least ``eps[1]``) and scales the decoupled weight decay; ``d`` clips the update's
    RMS; ``eps[0]`` (None: the parameter dtype's machine epsilon) floors the second moment's
    square root. See roundpipe/adafactor.hpp for the formulas, computed as torch computes them
    (a step reads the gradient three times: the update's norm is needed before the update).

    Same signature, defaults, validation errors, ``state`` keys (``step``: 0-dim float32
    tensor; ``row_var``/``col_var`` or ``variance``: float32) and ``state_dict`` format as
    ``torch.optim.Adafactor``, in both directions; results match
    ``torch.optim.Adafactor(foreach=False)`` to float32 rounding. One difference: a parameter
    with no elements is stepped (its ``step`` counts) where torch 2.13 raises
    ``ZeroDivisionError``.

    Parameters must be float32 (bfloat16 with ``stochastic_rounding``), CPU, dense and
    contiguous tensors with dense gradients of the same shape. ``lr`` may be a 1-element tensor.

    Args:
        params: iterable of parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: maximum relative step size and weight-decay scale (default 1e-2).
        beta2_decay: beta2 at step t is ``1 - t**beta2_decay`` (default -0.8).
        eps: ``(eps1, eps2)``: floor of the second moment's square root (None: machine epsilon
            of the parameter's dtype) and of the parameter's RMS (default ``(None, 1e-3)``).
        d: clipping threshold of the update's RMS (default 1.0).
        weight_decay: decoupled weight decay, ``param *= 1 - lr * weight_decay`` (default 0).
        foreach: ignored with a UserWarning (placeholder for torch compatibility).
        maximize: maximize the objective instead of minimizing it (default False).
        state_dtype, stochastic_rounding, seed: compact storage, keyword-only (see
            :class:`roundpipe.optim.CpuOptimizer`); the state stays float32 (the factored state
            is small already), bfloat16 parameters are accepted with ``stochastic_rounding``.

    Raises:
        ValueError: a hyperparameter is out of range (as torch.optim.Adafactor), or
            ``state_dtype`` is not float32.
    """

    _algorithm = "Adafactor"  # kernel, state and option tables: from roundpipe._C
    _option_keys = {"eps1": ("eps", 0), "eps2": ("eps", 1)}
    _group_defaults = {"foreach": None}

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[Optional[float], float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        state_dtype: Any = torch.float32,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None,
    ) -> None:
        check_tensor_lr(lr)
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 >= beta2_decay:
            raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
        if eps[0] is not None and not 0.0 <= eps[0]:
            raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]}")
        if not 0.0 <= eps[1]:
            raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]}")
        if not 1.0 <= d:
            raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")
        if state_dtype is not torch.float32:
            raise ValueError("roundpipe.optim.Adafactor: state_dtype must be torch.float32 (the "
                             f"factored state is small already), got {state_dtype!r}")
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d,
                        weight_decay=weight_decay, foreach=foreach, maximize=maximize)
        super().__init__(params, defaults, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed)

    @staticmethod
    def _state_shape(p, key):
        if key == "row_var":
            return p.shape[:-1] + (1,)
        if key == "col_var":
            return p.shape[:-2] + (1, p.shape[-1])
        return p.shape

    def _required_keys(self, active):
        # torch reads the factors and the variance with .get (a missing one fails later, in
        # the update: ours names it in a ValueError), only "step" as state["step"]
        return self._scalar_keys

    def _state_layout(self, group, p):
        # what _init_state creates: the factors of a matrix, the whole variance of a vector
        if p.dim() > 1:
            return [(tuple(self._state_shape(p, k)), torch.float32) for k in ("row_var", "col_var")]
        return [(tuple(p.shape), torch.float32)]

    @staticmethod
    def _state_value(st, key):
        # a parameter keeps either the factors or the variance; empty state: created first
        return st.get(key) if "step" in st else st[key]

    def _init_state(self, group, p, state):
        # as torch: the factors (keepdim shapes of the row and column means) for a tensor of
        # two or more dimensions, the whole variance otherwise; float32 whatever p's dtype
        state["step"] = torch.zeros((), dtype=torch.float32)
        if p.dim() > 1:
            for key in ("row_var", "col_var"):
                state[key] = torch.zeros(self._state_shape(p, key), dtype=torch.float32)
        else:
            self._new_state(p, state, "variance")

    def _options(self, group):
        eps1, eps2 = group["eps"]
        if eps1 is None:  # as torch: the machine epsilon of the (first) parameter's dtype
            params = group["params"]
            eps1 = torch.finfo(params[0].dtype if params else torch.float32).eps
        return super()._options({**group, "eps": (eps1, eps2)})
