"""Learning-rate schedules with DeepSpeed's parameters and formulas.

Each factory returns ``schedule(step) -> lr`` where ``step`` is the number of optimizer updates
applied so far (an int or an int tensor; a device tensor stays on the device, so no host sync)
and ``lr`` is a 0-dim float64 tensor. Steps skipped for overflow do not advance a schedule.

DeepSpeed's own schedulers lag one update behind these (its first two updates both use the
warmup start); `zfunc.Config.from_deepspeed` reproduces that lag, plain zfunc code does not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from zfunc.errors import ConfigError

__all__ = ["warmup_lr", "warmup_decay_lr", "warmup_cosine_lr"]

Schedule = Callable[[Any], torch.Tensor]


def _warmup_fraction(i: torch.Tensor, n: int, kind: str) -> torch.Tensor:
    """0 at ``i = 0`` rising to 1 at ``i = n``: ``ln(i + 1) / ln(n)`` or ``i / n``."""
    if kind == "log":
        return torch.log(i + 1) / math.log(n)
    return i / n


def _check(n: int, kind: str) -> None:
    if not (isinstance(n, int) and n > 0):
        raise ConfigError(f"warmup_num_steps: expected a positive integer, got {n!r}")
    if kind not in ("log", "linear"):
        raise ConfigError(f'warmup_type: expected "log" or "linear", got {kind!r}')


def warmup_lr(warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
              warmup_type: str = "log") -> Schedule:
    """Rise from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    ``log``: ``min + (max - min) * ln(i + 1) / ln(N)``; ``linear``: ``min + (max - min) * i / N``;
    ``N = max(2, warmup_num_steps)`` as in DeepSpeed's ``WarmupLR``.

    Examples:
        >>> from zfunc.schedules import warmup_lr
        >>> f = warmup_lr(0.0, 1.0, warmup_num_steps=4, warmup_type="linear")
        >>> [round(f(i).item(), 2) for i in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    _check(warmup_num_steps, warmup_type)
    return _WarmupLR(warmup_min_lr, warmup_max_lr, max(2, warmup_num_steps), warmup_type)


def warmup_decay_lr(total_num_steps: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                    warmup_num_steps: int = 1000, warmup_type: str = "log") -> Schedule:
    """`warmup_lr`, then linear decay to ``warmup_min_lr`` at ``total_num_steps``.

    After warmup: ``min + (max - min) * max(0, (T - i) / max(1, T - N))`` (DeepSpeed's
    ``WarmupDecayLR``).

    Examples:
        >>> from zfunc.schedules import warmup_decay_lr
        >>> f = warmup_decay_lr(6, 0.0, 1.0, warmup_num_steps=2, warmup_type="linear")
        >>> [round(f(i).item(), 2) for i in range(7)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    _check(warmup_num_steps, warmup_type)
    if not (isinstance(total_num_steps, int) and total_num_steps > 0):
        raise ConfigError(f"total_num_steps: expected a positive integer, got {total_num_steps!r}")
    warm = warmup_lr(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
    return _WarmupDecayLR(warm, total_num_steps)


def warmup_cosine_lr(total_num_steps: int, lr: float, warmup_min_ratio: float = 0.0,
                     warmup_num_steps: int = 1000, cos_min_ratio: float = 1e-4,
                     warmup_type: str = "log") -> Schedule:
    """Warm up from ``lr * warmup_min_ratio`` to ``lr``, then cosine-decay to ``lr * cos_min_ratio``.

    Warmup ratio ``r0 + (1 - r0) * w(i)``; after it ``p = min(1, (i - N + 1) / max(1, T - N))``
    and ratio ``max(0, c + (1 - c) * (1 + cos(pi p)) / 2)``, ``N = max(2, warmup_num_steps)``
    (DeepSpeed 0.19's ``WarmupCosineLR``).

    Examples:
        >>> from zfunc.schedules import warmup_cosine_lr
        >>> f = warmup_cosine_lr(5, lr=1.0, warmup_num_steps=2, cos_min_ratio=0.0, warmup_type="linear")
        >>> [round(f(i).item(), 2) for i in range(6)]
        [0.0, 0.5, 0.75, 0.25, 0.0, 0.0]
    """
    _check(warmup_num_steps, warmup_type)
    if not (isinstance(total_num_steps, int) and total_num_steps > 0):
        raise ConfigError(f"total_num_steps: expected a positive integer, got {total_num_steps!r}")
    return _WarmupCosineLR(lr, warmup_min_ratio, max(2, warmup_num_steps), cos_min_ratio, total_num_steps, warmup_type)


# The schedules are values (frozen dataclasses): a Config holding one compares equal to its copy
# and pickles with its state.

@dataclasses.dataclass(frozen=True)
class _WarmupLR:
    lo: float
    hi: float
    n: int  # max(2, warmup_num_steps)
    kind: str

    def gamma(self, step: Any) -> torch.Tensor:
        """How far from ``lo`` to ``hi`` at ``step`` (0 to 1)."""
        i = torch.as_tensor(step, dtype=torch.float64)
        frac = torch.clamp(_warmup_fraction(i, self.n, self.kind), max=1.0)
        return torch.where(i < self.n, frac, torch.ones_like(frac))

    def __call__(self, step: Any) -> torch.Tensor:
        return self.lo + (self.hi - self.lo) * self.gamma(step)


@dataclasses.dataclass(frozen=True)
class _WarmupDecayLR:
    warm: _WarmupLR
    total: int

    def gamma(self, step: Any) -> torch.Tensor:
        """How far from ``lo`` to ``hi`` at ``step``: up in the warmup, then down."""
        w = self.warm
        i = torch.as_tensor(step, dtype=torch.float64)
        return torch.where(i < w.n, w.gamma(step), torch.clamp((self.total - i) / max(1, self.total - w.n), min=0.0))

    def __call__(self, step: Any) -> torch.Tensor:
        w = self.warm
        return w.lo + (w.hi - w.lo) * self.gamma(step)


@dataclasses.dataclass(frozen=True)
class _WarmupCosineLR:
    lr: float
    r0: float
    n: int
    c: float
    total: int
    kind: str

    def ratio(self, step: Any) -> torch.Tensor:
        """The share of ``lr`` at ``step``."""
        n, r0, c = self.n, self.r0, self.c
        i = torch.as_tensor(step, dtype=torch.float64)
        warm = r0 + (1 - r0) * _warmup_fraction(i, n, self.kind)
        p = torch.clamp((i - n + 1) / max(1, self.total - n), max=1.0)
        cos = torch.clamp(c + (1 - c) * (1 + torch.cos(math.pi * p)) / 2, min=0.0)
        return torch.where(i < n, warm, cos)

    def __call__(self, step: Any) -> torch.Tensor:
        return self.lr * self.ratio(step)
