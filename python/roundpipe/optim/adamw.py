"""``roundpipe.optim.AdamW``: torch.optim.AdamW's interface and results."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from .adam import Adam


class AdamW(Adam):
    """AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019): Adam whose
    weight decay multiplies the parameter by ``1 - lr * weight_decay`` instead of entering the
    gradient. A drop-in replacement for ``torch.optim.AdamW``, which is likewise ``Adam`` with
    ``decoupled_weight_decay=True``; same signature, defaults (``weight_decay=1e-2``), state and
    ``state_dict``. See :class:`roundpipe.optim.Adam` for the tensors accepted, the compact
    storage options (``state_dtype``, ``stochastic_rounding``, ``seed``) and the errors.
    """

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1e-3,
        betas: Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        state_dtype: Any = torch.float32,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
            capturable=capturable, differentiable=differentiable, fused=fused,
            decoupled_weight_decay=True, state_dtype=state_dtype,
            stochastic_rounding=stochastic_rounding, seed=seed,
        )

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
