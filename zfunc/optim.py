"""The optimizer's hyperparameters: Adam and AdamW with torch's names and defaults."""

from __future__ import annotations

import dataclasses

from zfunc.errors import check, is_finite_number, is_number

__all__ = ["AdamConfig", "adam", "adamw"]


@dataclasses.dataclass(frozen=True)
class AdamConfig:
    """Hyperparameters of Adam/AdamW with torch's names and defaults.

    ``decoupled=True`` is AdamW (``p -= lr * wd * p``); ``False`` is Adam with L2 regularisation
    folded into the gradient (``g += wd * p``), as `torch.optim.Adam` does.

    Examples:
        >>> import zfunc
        >>> zfunc.AdamConfig(lr=0.1, betas=[0.8, 0.9]).betas
        (0.8, 0.9)
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True

    def __post_init__(self) -> None:
        check(is_finite_number(self.lr) and self.lr > 0, "optimizer.lr", "a positive finite number", self.lr)
        b = self.betas
        check(isinstance(b, (tuple, list)) and len(b) == 2 and all(is_number(x) and 0 <= x < 1 for x in b),
              "optimizer.betas", "two numbers in [0, 1)", b)
        object.__setattr__(self, "betas", (float(b[0]), float(b[1])))
        check(is_finite_number(self.eps) and self.eps >= 0, "optimizer.eps", "a finite number >= 0", self.eps)
        check(is_finite_number(self.weight_decay) and self.weight_decay >= 0,
              "optimizer.weight_decay", "a finite number >= 0", self.weight_decay)


def adam(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
         weight_decay: float = 0.0) -> AdamConfig:
    """Adam as `torch.optim.Adam` defines it (weight decay added to the gradient).

    Examples:
        >>> import zfunc
        >>> zfunc.adam(lr=1e-2).decoupled
        False
    """
    return AdamConfig(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=False)


def adamw(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
          weight_decay: float = 0.01) -> AdamConfig:
    """AdamW as `torch.optim.AdamW` defines it (decoupled weight decay, default 0.01).

    Examples:
        >>> import zfunc
        >>> opt = zfunc.adamw(lr=3e-4)
        >>> opt.lr, opt.weight_decay, opt.decoupled
        (0.0003, 0.01, True)
    """
    return AdamConfig(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=True)
