"""The loss scale as plain state: a pytree of device tensors and a pure update.

DeepSpeed's ZeRO rule (``deepspeed/runtime/fp16/loss_scaler.py``), with ``S`` the scale, ``t`` the
update count, ``L`` the count at the last overflow, ``h`` the hysteresis left (``H`` when full)
and ``W`` the window:

* overflow: if ``H == 1`` or ``h == 1`` then ``S = max(S / 2, min_scale)``, else ``h -= 1``;
  ``L = t``.
* clean step: with ``consecutive_hysteresis``, ``h = H``. If ``k = t - L - 1 > 0`` and
  ``k % W == 0`` then ``S *= 2`` (and, without ``consecutive_hysteresis``, ``h = H``).
* ``t += 1``.

One knowing difference: DeepSpeed raises when an overflow arrives with the scale already at the
minimum. Raising needs the host to read ``found_inf`` every step; zfunc instead stays at the
minimum and keeps skipping, and ``metrics.skipped`` / ``ScalerState.skipped`` say so.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from zfunc._tree import dataclass
from zfunc.errors import ConfigError, check, is_finite_number, is_positive_int

if TYPE_CHECKING:
    from zfunc.core.config import Config

__all__ = ["DynamicLossScale", "ScalerState", "scaler_init", "scaler_update"]

FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: a loss scale must stay below it."""
FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32: the floor of `DynamicLossScale.grad_scaler`'s scale (GradScaler has none)."""


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """A dynamic loss scale for fp16 (growth factor 2, hysteresis, minimum).

    The scale starts at ``init``; an overflow first consumes hysteresis and then halves it,
    never below ``min_scale``; clean steps double it. When, is ``rule``'s:

    - ``"deepspeed"`` (DeepSpeed's ZeRO rule, the module docstring): at the ``window + 1``-th
      clean step after an overflow, and every ``window`` clean steps from then on;
    - ``"grad_scaler"`` (``torch.amp.GradScaler``'s, which DeepSpeed uses under fp16
      ``torch_autocast``): at every ``window``-th clean step in a row (its ``growth_interval``),
      counted from the start or the last overflow; every overflow halves the scale
      (``hysteresis=1``). `grad_scaler` makes one with ``GradScaler()``'s defaults.

    Examples:
        >>> import zfunc
        >>> zfunc.DynamicLossScale(init=2.0**8, window=2).window
        2
    """

    init: float = 2.0**16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False
    rule: str = "deepspeed"

    @classmethod
    def grad_scaler(cls, init_scale: float = 2.0**16, growth_interval: int = 2000) -> DynamicLossScale:
        """``torch.amp.GradScaler(init_scale=..., growth_interval=...)``'s schedule (growth factor 2,
        backoff 0.5, no floor but float32's smallest normal number).

        Examples:
            >>> import zfunc
            >>> zfunc.DynamicLossScale.grad_scaler().window, zfunc.DynamicLossScale.grad_scaler().rule
            (2000, 'grad_scaler')
        """
        return cls(init=init_scale, window=growth_interval, hysteresis=1, min_scale=FLOAT32_TINY, rule="grad_scaler")

    def __post_init__(self) -> None:
        check(self.rule in ("deepspeed", "grad_scaler"), "loss_scale.rule", '"deepspeed" or "grad_scaler"', self.rule)
        if self.rule == "grad_scaler" and (self.hysteresis != 1 or self.consecutive_hysteresis):
            raise ConfigError("loss_scale.hysteresis: torch.amp.GradScaler's rule (rule='grad_scaler') halves the "
                              "scale at every overflow; set hysteresis=1 and consecutive_hysteresis=False (or use "
                              "DynamicLossScale.grad_scaler()), or rule='deepspeed'")
        check(is_finite_number(self.init) and 0 < self.init <= FLOAT32_MAX,
              "loss_scale.init", "a number in (0, 3.4e38]", self.init)
        check(is_positive_int(self.window), "loss_scale.window", "a positive integer", self.window)
        check(is_positive_int(self.hysteresis), "loss_scale.hysteresis", "a positive integer", self.hysteresis)
        check(is_finite_number(self.min_scale) and 0 < self.min_scale <= FLOAT32_MAX,
              "loss_scale.min_scale", "a number in (0, 3.4e38]", self.min_scale)
        object.__setattr__(self, "init", float(self.init))
        object.__setattr__(self, "min_scale", float(self.min_scale))


@dataclass(frozen=True)
class ScalerState:
    """Loss-scale state: every field a device scalar.

    Attributes:
        scale: the current loss scale (float32; exactly 1 when scaling is off).
        last_overflow: the optimizer step (``TrainState.step``, the ``t`` above) of the last
            overflow (``-1`` before any).
        hysteresis: overflows still absorbed before the scale halves (``h``).
        skipped: steps skipped because of an overflow, in total.

    Examples:
        >>> import torch, zfunc
        >>> s = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config()).scaler
        >>> s.scale.item(), s.skipped.item()
        (1.0, 0)
    """

    scale: torch.Tensor
    last_overflow: torch.Tensor
    hysteresis: torch.Tensor
    skipped: torch.Tensor


def scaler_init(cfg: Config, device: torch.device | str = "cpu") -> ScalerState:
    """The scaler state a run starts with.

    Examples:
        >>> import zfunc
        >>> from zfunc.core.scaler import scaler_init
        >>> s = scaler_init(zfunc.Config(precision="fp16", loss_scale=zfunc.DynamicLossScale(init=256.0)))
        >>> s.scale.item(), s.hysteresis.item()
        (256.0, 2)
    """
    ls = cfg.loss_scale
    init = ls.init if isinstance(ls, DynamicLossScale) else float(ls or 1.0)
    hyst = ls.hysteresis if isinstance(ls, DynamicLossScale) else 1

    def i64(v: int) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int64, device=device)

    return ScalerState(scale=torch.tensor(init, dtype=torch.float32, device=device),
                       last_overflow=i64(-1), hysteresis=i64(hyst), skipped=i64(0))


def scaler_update(s: ScalerState, found_inf: torch.Tensor, cfg: Config, step: torch.Tensor) -> ScalerState:
    """The scaler after optimizer step ``step`` (``t``: steps taken before it, skipped ones
    included, i.e. ``TrainState.step``), whose gradients overflowed iff ``found_inf > 0``.

    Pure and branch-free on the device: no host sync.

    Examples:
        >>> import torch, zfunc
        >>> from zfunc.core.scaler import scaler_init, scaler_update
        >>> cfg = zfunc.Config(precision="fp16", loss_scale=zfunc.DynamicLossScale(init=16.0, hysteresis=1))
        >>> s = scaler_init(cfg)
        >>> for t, overflow in enumerate([1, 1, 0]):
        ...     s = scaler_update(s, torch.tensor(float(overflow)), cfg, torch.tensor(t))
        ...     print(s.scale.item(), s.skipped.item())
        8.0 1
        4.0 2
        4.0 2
    """
    overflow = found_inf > 0
    skipped = s.skipped + overflow.to(torch.int64)
    ls = cfg.loss_scale
    if not isinstance(ls, DynamicLossScale):
        return ScalerState(scale=s.scale, last_overflow=torch.where(overflow, step, s.last_overflow),
                           hysteresis=s.hysteresis, skipped=skipped)
    full = torch.full_like(s.hysteresis, ls.hysteresis)
    # Overflow branch.
    halve = overflow & ((ls.hysteresis == 1) | (s.hysteresis == 1))
    halved = torch.clamp(s.scale / 2, min=ls.min_scale)
    h_after_overflow = torch.where(halve, s.hysteresis, s.hysteresis - 1)
    # Clean branch.
    if ls.rule == "grad_scaler":  # the window-th clean step in a row (GradScaler's growth tracker)
        grow = (~overflow) & ((step - s.last_overflow) % ls.window == 0)
    else:
        k = step - s.last_overflow - 1
        grow = (~overflow) & (k > 0) & (k % ls.window == 0)
    if ls.consecutive_hysteresis:
        h_clean = full
    else:
        h_clean = torch.where(grow, full, s.hysteresis)
    scale = torch.where(halve, halved, torch.where(grow, s.scale * 2, s.scale))
    hysteresis = torch.where(overflow, h_after_overflow, h_clean)
    last = torch.where(overflow, step, s.last_overflow)
    return ScalerState(scale=scale, last_overflow=last,
                       hysteresis=hysteresis, skipped=skipped)
