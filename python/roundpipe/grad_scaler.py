"""``roundpipe.GradScaler``: dynamic loss scaling for fp16 training, handed to the wrapper.

The arithmetic is ``torch.amp.GradScaler``'s (a float32 scale; the loss multiplied by it, the
gradients by ``float32(1 / scale)``, the scale multiplied by ``backoff_factor`` after an overflow and by
``growth_factor`` after ``growth_interval`` steps without one), with two changes that keep it
exact when the update of one step runs while the next step's passes already run (the
asynchronous step):

- the scale is fixed per step: every ``forward_backward`` call of a step uses the scale in
  force when the step's first call started, and the step unscales by that same scale;
- an overflow backs off from the scale that overflowed, not from a scale another step already
  reduced: ``new = min(current, overflowed * backoff_factor)`` (so one overflow episode seen by
  two steps in flight halves the scale once);

and two options from DeepSpeed: ``hysteresis=h`` backs off at the h-th consecutive overflow
(every overflowing step is skipped), ``min_scale`` is a floor. The defaults reproduce torch.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import Any


class GradScaler:
    """Dynamic loss scale for ``RoundPipe.forward_backward(..., grad_scaler=)`` and
    ``RoundPipe.step(..., grad_scaler=)`` (see the module docstring).

    Args:
        init_scale: initial scale (default 2**16).
        growth_factor: factor the scale grows by after ``growth_interval`` steps without
            overflow (> 1, default 2.0).
        backoff_factor: factor the scale shrinks by on overflow (in (0, 1), default 0.5).
        growth_interval: consecutive non-skipped steps before growing (int >= 1, default 2000).
        enabled: False makes every method a no-op and the scale 1.0 (as torch's).
        hysteresis: consecutive overflowing steps before backing off (int >= 1, default 1:
            at every overflow, as torch). Every overflowing step is skipped.
        min_scale: the scale never goes below this (> 0, default 1.0).

    Raises:
        ValueError: an argument out of range (named in the message).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True, hysteresis: int = 1, min_scale: float = 1.0) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"GradScaler: enabled must be a bool, got {type(enabled).__name__}")
        _check_positive(init_scale, "init_scale")
        _check_positive(min_scale, "min_scale")
        _check_int(hysteresis, "hysteresis")
        self._lock = threading.Lock()
        self._enabled = enabled
        self._scale = _f32(init_scale)
        self.set_growth_factor(growth_factor)
        self.set_backoff_factor(backoff_factor)
        self.set_growth_interval(growth_interval)
        self._hysteresis = int(hysteresis)
        self._min_scale = float(min_scale)
        self._growth_tracker = 0
        self._overflows = 0  # consecutive overflowing steps

    # --- torch.amp.GradScaler's interface --------------------------------------------------------

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """The scale the next step's calls will use (1.0 when disabled)."""
        with self._lock:
            return self._scale if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        if not (isinstance(new_factor, (int, float)) and new_factor > 1.0 and math.isfinite(new_factor)):
            raise ValueError(f"GradScaler: growth_factor must be a finite number > 1, got {new_factor!r}")
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        if not (isinstance(new_factor, (int, float)) and 0.0 < new_factor < 1.0):
            raise ValueError(f"GradScaler: backoff_factor must be in (0, 1), got {new_factor!r}")
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        _check_int(new_interval, "growth_interval")
        self._growth_interval = int(new_interval)

    def get_hysteresis(self) -> int:
        return self._hysteresis

    def get_min_scale(self) -> float:
        return self._min_scale

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (torch's keys, plus ``hysteresis``, ``min_scale``
        and the count of consecutive overflows); empty when disabled, as torch's."""
        if not self._enabled:
            return {}
        with self._lock:
            return {"scale": self._scale, "growth_factor": self._growth_factor,
                    "backoff_factor": self._backoff_factor,
                    "growth_interval": self._growth_interval,
                    "_growth_tracker": self._growth_tracker, "hysteresis": self._hysteresis,
                    "min_scale": self._min_scale, "_overflows": self._overflows}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` (also torch.amp.GradScaler's, whose missing keys keep
        their values).

        Raises:
            RuntimeError: the state dict is empty while this scaler is enabled (as torch).
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        with self._lock:
            self._scale = _f32(state_dict["scale"])
            self._growth_factor = float(state_dict["growth_factor"])
            self._backoff_factor = float(state_dict["backoff_factor"])
            self._growth_interval = int(state_dict["growth_interval"])
            self._growth_tracker = int(state_dict["_growth_tracker"])
            self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
            self._min_scale = float(state_dict.get("min_scale", self._min_scale))
            self._overflows = int(state_dict.get("_overflows", 0))

    # --- torch.amp.GradScaler's training calls: the wrapper makes them ----------------------------

    def scale(self, outputs: Any) -> Any:
        """Not used with RoundPipe: raises ``RuntimeError`` naming what does it (the loss
        is scaled inside ``forward_backward(..., grad_scaler=scaler)``)."""
        raise RuntimeError(_HABIT.format(call="scale(loss).backward()"))

    def unscale_(self, optimizer: Any) -> None:
        """Not used with RoundPipe: raises ``RuntimeError`` (the step unscales, inside
        ``model.step(opt, grad_scaler=scaler)``; clip there with ``max_grad_norm=``)."""
        raise RuntimeError(_HABIT.format(call="unscale_(opt)"))

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Not used with RoundPipe: raises ``RuntimeError`` (``model.step(opt,
        grad_scaler=scaler)`` skips an overflowing step)."""
        raise RuntimeError(_HABIT.format(call="step(opt)"))

    def update(self, new_scale: Any = None) -> None:
        """Not used with RoundPipe: raises ``RuntimeError`` (``model.step(opt,
        grad_scaler=scaler)`` updates the scale)."""
        raise RuntimeError(_HABIT.format(call="update()"))

    # --- what the wrapper calls ----------------------------------------------------------------------

    def apply_verdict(self, found_inf: bool, used_scale: float) -> bool:
        """Records the verdict of a step whose gradients were scaled by ``used_scale`` (what
        ``RoundPipe.step`` calls once it knows whether the gradients overflowed): an overflow
        (``found_inf``) counts toward ``hysteresis`` and then backs the scale off from
        ``used_scale`` (not below ``min_scale``); a finite step counts toward growth (every
        ``growth_interval`` finite steps in a row multiply the scale by ``growth_factor``, in
        float32, as torch's). Returns whether the step is skipped (False when disabled)."""
        if not self._enabled:
            return False
        with self._lock:
            if found_inf:
                self._overflows += 1
                self._growth_tracker = 0
                if self._overflows >= self._hysteresis:
                    self._overflows = 0
                    backed_off = max(_f32(used_scale * self._backoff_factor), self._min_scale)
                    self._scale = min(self._scale, backed_off)
                return True
            self._overflows = 0
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._growth_tracker = 0
                grown = _f32(self._scale * self._growth_factor)
                if math.isfinite(grown):
                    self._scale = grown
            return False

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"GradScaler(scale={self.get_scale()}, growth_factor={self._growth_factor}, "
                f"backoff_factor={self._backoff_factor}, growth_interval={self._growth_interval}, "
                f"enabled={self._enabled}, hysteresis={self._hysteresis}, "
                f"min_scale={self._min_scale})")


_HABIT = (
    "roundpipe.GradScaler.{call}: RoundPipe scales, unscales, skips and updates inside its own "
    "calls; pass the scaler to both: loss = model.forward_backward(..., grad_scaler=scaler) "
    "then model.step(opt, grad_scaler=scaler) (clip with max_grad_norm= there)")


def _f32(x: float) -> float:
    """``x`` rounded to float32, as torch keeps its scale (a float32 tensor)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # beyond float32's range: inf, as a float32 tensor overflows
        return math.copysign(math.inf, x)


def _check_positive(x: Any, name: str) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0.0 < x < math.inf):
        raise ValueError(f"GradScaler: {name} must be a finite number > 0, got {x!r}")


def _check_int(x: Any, name: str) -> None:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"GradScaler: {name} must be an int >= 1, got {x!r}")
