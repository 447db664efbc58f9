"""The optimizer's hyperparameters: Adam and AdamW with torch's names and defaults, and
parameter groups that give some parameters other values."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Union

import torch

from zfunc.errors import ConfigError, check, is_finite_number, is_number

__all__ = ["AdamConfig", "adam", "adamw", "ParamGroup", "assign_groups"]


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
        check(is_finite_number(self.lr) and self.lr >= 0, "optimizer.lr", "a finite number >= 0", self.lr)
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


Selector = Union[str, Sequence[str], Callable[[str, torch.Tensor], bool]]


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """Hyperparameters for some of the parameters, as a torch optimizer's parameter group.

    Args:
        params: which trainable parameters: a name, a list of names (as
            ``model.named_parameters()``), or a predicate ``(name, param) -> bool`` (optax's
            ``mask``: weight decay on matrices only is ``lambda n, p: p.ndim < 2``).
        lr: this group's learning rate (``None``: the optimizer's). With an ``lr_schedule`` the
            group follows the schedule scaled by ``lr / optimizer.lr``, as torch's schedulers
            scale each group's initial lr.
        weight_decay, betas, eps: as the optimizer's (``None``: the optimizer's value).

    A parameter chosen by no group keeps the optimizer's hyperparameters (group 0); one chosen by
    two groups is an error.

    Examples:
        >>> import zfunc
        >>> no_decay = zfunc.ParamGroup(lambda name, p: p.ndim < 2, weight_decay=0.0)
        >>> cfg = zfunc.Config(optimizer=zfunc.adamw(lr=1e-3, weight_decay=0.1), param_groups=[no_decay])
        >>> cfg.param_groups[0].weight_decay
        0.0
    """

    params: Selector
    lr: float | None = None
    weight_decay: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None

    def __post_init__(self) -> None:
        p = self.params
        ok = callable(p) or isinstance(p, str) or (isinstance(p, (list, tuple)) and all(isinstance(n, str) for n in p))
        check(ok, "param_groups.params", "a name, a list of names or a predicate (name, param) -> bool", p)
        if isinstance(p, list):
            object.__setattr__(self, "params", tuple(p))
        try:  # the values follow AdamConfig's rules
            merged = AdamConfig(lr=1.0 if self.lr is None else self.lr,
                                betas=(0.9, 0.999) if self.betas is None else self.betas,
                                eps=1.0 if self.eps is None else self.eps,
                                weight_decay=0.0 if self.weight_decay is None else self.weight_decay)
        except ConfigError as e:
            raise ConfigError(str(e).replace("optimizer.", "param_groups.", 1)) from None
        if self.betas is not None:
            object.__setattr__(self, "betas", merged.betas)

    def selects(self, name: str, param: torch.Tensor) -> bool:
        """Whether this group chooses the parameter ``name``."""
        p = self.params
        if callable(p):
            return bool(p(name, param))
        return name == p if isinstance(p, str) else name in p

    def names(self) -> tuple[str, ...]:
        """The names this group lists (empty for a predicate)."""
        p = self.params
        return () if callable(p) else ((p,) if isinstance(p, str) else tuple(p))


def assign_groups(groups: Sequence[ParamGroup], trainable: dict[str, torch.Tensor],
                  frozen: Sequence[str] = ()) -> dict[str, int]:
    """Each trainable parameter's group: ``i + 1`` for ``groups[i]``, 0 for none.

    Raises:
        ConfigError: a group lists a parameter the model lacks (or a frozen one), or a parameter
            is in two groups.

    Examples:
        >>> import torch
        >>> w = {"a.weight": torch.zeros(2, 2), "a.bias": torch.zeros(2)}
        >>> assign_groups([ParamGroup(lambda n, p: p.ndim < 2, weight_decay=0.0)], w)
        {'a.weight': 0, 'a.bias': 1}
    """
    out = {}
    for i, g in enumerate(groups):
        for name in g.names():
            if name not in trainable:
                why = "is frozen (requires_grad=False)" if name in frozen else "is not a parameter of the model"
                raise ConfigError(f"param_groups[{i}]: {name!r} {why}; list names from model.named_parameters()")
    for name, p in trainable.items():
        chosen = [i for i, g in enumerate(groups) if g.selects(name, p)]
        if len(chosen) > 1:
            raise ConfigError(f"param_groups: {name!r} is in groups {chosen}; put each parameter in one group")
        out[name] = chosen[0] + 1 if chosen else 0
    return out
