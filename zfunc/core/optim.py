"""The optimizers' hyperparameters (Adam/AdamW, SGD, Lion, Adagrad, Muon) with torch's names and
defaults, and parameter groups that give some parameters other values or another optimizer."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch

import zfunc_kernels
from zfunc.errors import ConfigError, check, is_finite_number, is_number
from zfunc.core.state import AdagradState, AdamState, LionState, MuonState, SGDState

__all__ = ["AdamConfig", "SGDConfig", "LionConfig", "AdagradConfig", "MuonConfig", "OPTIMIZERS", "adam", "adamw",
           "sgd", "lion", "adagrad", "muon", "ParamGroup", "assign_groups"]


class _Optimizer:
    """What every optimizer record shares: its per-group values and its fused pass.

    A record names ``moments`` (its state per element, stored in `Config.moment_dtype`), ``live`` (the per-group hyperparameters,
    `zfunc.GroupHyper`'s names), ``state_class``, ``hyper`` (the kernel's hyperparameter record)
    and ``kernel`` (the fused pass in `zfunc_kernels`).
    """

    def values(self) -> dict[str, float]:
        """The per-group hyperparameters this optimizer reads, as `zfunc.GroupHyper` names them."""
        return {n: float(self.betas[int(n[-1]) - 1]) if n.startswith("beta") else float(getattr(self, n))
                for n in self.live}

    def fused(self, master: torch.Tensor, grad: torch.Tensor, moments: list[torch.Tensor],
              scalars: zfunc_kernels.StepScalars, row: dict[str, float], compute: torch.Tensor | None) -> None:
        """One fused pass over a run of one parameter group (``row``: its hyperparameters; the
        record's own fields fill in what is not per group, e.g. ``nesterov``, ``decoupled``)."""
        hyper = self.hyper(**{f: row[f] if f in row else getattr(self, f) for f in self.hyper._fields})
        self.kernel(master, grad, *moments, scalars, hyper, compute=compute)


@dataclasses.dataclass(frozen=True)
class AdamConfig(_Optimizer):
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

    name = "adam"
    moments = ("mu", "nu")
    live = ("lr", "weight_decay", "beta1", "beta2", "eps")
    state_class = AdamState
    hyper = zfunc_kernels.AdamHyper
    kernel = staticmethod(zfunc_kernels.fused_adam)
    moment_init = 0.0

    def __post_init__(self) -> None:
        _check_common(self.lr, self.weight_decay)
        _set_betas(self, below_one=True)
        check(is_finite_number(self.eps) and self.eps >= 0, "optimizer.eps", "a finite number >= 0", self.eps)


def _set_betas(opt: Any, below_one: bool) -> None:
    """Check ``opt.betas`` (two numbers in [0, 1), or [0, 1]) and store them as a tuple of floats."""
    b = opt.betas
    check(isinstance(b, (tuple, list)) and len(b) == 2
          and all(is_number(x) and 0 <= x and (x < 1 if below_one else x <= 1) for x in b),
          "optimizer.betas", f"two numbers in [0, 1{')' if below_one else ']'}", b)
    object.__setattr__(opt, "betas", (float(b[0]), float(b[1])))


def _check_common(lr: float, weight_decay: float) -> None:
    check(is_finite_number(lr) and lr >= 0, "optimizer.lr", "a finite number >= 0", lr)
    check(is_finite_number(weight_decay) and weight_decay >= 0, "optimizer.weight_decay", "a finite number >= 0",
          weight_decay)


@dataclasses.dataclass(frozen=True)
class SGDConfig(_Optimizer):
    """``torch.optim.SGD``'s hyperparameters with torch's names and defaults (`zfunc.sgd`).

    Examples:
        >>> import zfunc
        >>> zfunc.SGDConfig(lr=0.1, momentum=0.9, nesterov=True).moments
        ('momentum_buffer',)
    """

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    name = "sgd"
    moments = ("momentum_buffer",)
    live = ("lr", "weight_decay", "momentum", "dampening")
    state_class = SGDState
    hyper = zfunc_kernels.SGDHyper
    kernel = staticmethod(zfunc_kernels.fused_sgd)
    moment_init = 0.0

    def __post_init__(self) -> None:
        _check_common(self.lr, self.weight_decay)
        check(is_finite_number(self.momentum) and self.momentum >= 0, "optimizer.momentum", "a finite number >= 0",
              self.momentum)
        check(is_finite_number(self.dampening), "optimizer.dampening", "a finite number", self.dampening)
        check(isinstance(self.nesterov, bool), "optimizer.nesterov", "True or False", self.nesterov)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError("optimizer.nesterov: needs momentum > 0 and dampening 0 (as torch.optim.SGD)")


@dataclasses.dataclass(frozen=True)
class LionConfig(_Optimizer):
    """Lion's hyperparameters (Chen et al., 2023), decoupled weight decay (`zfunc.lion`).

    Examples:
        >>> import zfunc
        >>> zfunc.LionConfig().betas
        (0.9, 0.99)
    """

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0

    name = "lion"
    moments = ("mu",)
    live = ("lr", "weight_decay", "beta1", "beta2")
    state_class = LionState
    hyper = zfunc_kernels.LionHyper
    kernel = staticmethod(zfunc_kernels.fused_lion)
    moment_init = 0.0

    def __post_init__(self) -> None:
        _check_common(self.lr, self.weight_decay)
        _set_betas(self, below_one=False)


@dataclasses.dataclass(frozen=True)
class AdagradConfig(_Optimizer):
    """``torch.optim.Adagrad``'s hyperparameters with torch's names and defaults (`zfunc.adagrad`).

    Examples:
        >>> import zfunc
        >>> zfunc.AdagradConfig().eps
        1e-10
    """

    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    name = "adagrad"
    moments = ("sum",)
    live = ("lr", "weight_decay", "lr_decay", "eps")
    state_class = AdagradState
    hyper = zfunc_kernels.AdagradHyper
    kernel = staticmethod(zfunc_kernels.fused_adagrad)

    def __post_init__(self) -> None:
        _check_common(self.lr, self.weight_decay)
        for key in ("lr_decay", "eps", "initial_accumulator_value"):
            v = getattr(self, key)
            check(is_finite_number(v) and v >= 0, f"optimizer.{key}", "a finite number >= 0", v)

    @property
    def moment_init(self) -> float:
        return float(self.initial_accumulator_value)


@dataclasses.dataclass(frozen=True)
class MuonConfig(_Optimizer):
    """``torch.optim.Muon``'s hyperparameters with torch's names and defaults (`zfunc.muon`).

    Muon takes 2-D parameters only. Its step is not one element pass: `zfunc.core.muon` runs the
    momentum pass, orthogonalizes each matrix whole, then the update pass. ``ns_dtype`` is
    where Newton-Schulz runs: bfloat16 as torch (the default), or float32 (more exact, and faster
    on CPUs without bfloat16 matrix units).

    Examples:
        >>> import zfunc
        >>> zfunc.MuonConfig().momentum, zfunc.MuonConfig().ns_steps
        (0.95, 5)
    """

    lr: float = 1e-3
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    ns_dtype: torch.dtype = torch.bfloat16

    name = "muon"
    moments = ("momentum_buffer",)
    live = ("lr", "weight_decay", "momentum", "eps")
    state_class = MuonState
    moment_init = 0.0
    matrices_only = True

    def __post_init__(self) -> None:
        _check_common(self.lr, self.weight_decay)
        check(is_finite_number(self.momentum) and self.momentum >= 0, "optimizer.momentum", "a finite number >= 0",
              self.momentum)
        check(isinstance(self.nesterov, bool), "optimizer.nesterov", "True or False", self.nesterov)
        c = self.ns_coefficients
        check(isinstance(c, (tuple, list)) and len(c) == 3 and all(is_finite_number(x) for x in c),
              "optimizer.ns_coefficients", "three finite numbers (a, b, c)", c)
        object.__setattr__(self, "ns_coefficients", tuple(float(x) for x in c))
        check(is_finite_number(self.eps) and self.eps > 0, "optimizer.eps", "a finite number > 0", self.eps)
        check(isinstance(self.ns_steps, int) and not isinstance(self.ns_steps, bool) and 0 <= self.ns_steps < 100,
              "optimizer.ns_steps", "an int in [0, 100)", self.ns_steps)
        check(self.adjust_lr_fn in (None, "original", "match_rms_adamw"), "optimizer.adjust_lr_fn",
              'None, "original" or "match_rms_adamw"', self.adjust_lr_fn)
        check(self.ns_dtype in (torch.bfloat16, torch.float32), "optimizer.ns_dtype", "torch.bfloat16 or torch.float32",
              self.ns_dtype)

    def lr_ratio(self, shape: tuple[int, ...]) -> float:
        """The learning-rate factor of a matrix of ``shape`` (torch's ``adjust_lr_fn``):
        ``sqrt(max(1, rows / cols))`` ("original", the default) or ``0.2 sqrt(max(rows, cols))``.

        Examples:
            >>> import zfunc
            >>> zfunc.muon().lr_ratio((8, 2)), zfunc.muon(adjust_lr_fn="match_rms_adamw").lr_ratio((4, 25))
            (2.0, 1.0)
        """
        rows, cols = shape[:2]
        if self.adjust_lr_fn == "match_rms_adamw":
            return 0.2 * math.sqrt(max(rows, cols))
        return math.sqrt(max(1.0, rows / cols))


OPTIMIZERS = (AdamConfig, SGDConfig, LionConfig, AdagradConfig, MuonConfig)
"""The optimizer records: each names its moments (state per element), its per-group hyperparameters (``live``),
its state record, and its fused pass (``fused``); `zfunc.apply_step`, checkpoints and
`zfunc.memory_plan` read these instead of naming Adam's moments."""


def muon(lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
         ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315), eps: float = 1e-7,
         ns_steps: int = 5, adjust_lr_fn: str | None = None, ns_dtype: torch.dtype = torch.bfloat16) -> MuonConfig:
    """Muon as `torch.optim.Muon` defines it: momentum, orthogonalized per matrix by Newton-Schulz
    (in bfloat16 as torch, or ``ns_dtype=torch.float32``), decoupled weight decay, the lr scaled
    per matrix shape.

    For 2-D parameters only: give it the hidden matrices through a `zfunc.ParamGroup` and keep an
    Adam-type optimizer for the rest (embeddings, norms, biases). Sharded, each matrix is still
    orthogonalized whole (`zfunc.core.muon`).

    Examples:
        >>> import torch, zfunc
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> matrices = zfunc.ParamGroup(lambda name, p: p.ndim == 2, optimizer=zfunc.muon(lr=0.02))
        >>> state = zfunc.init(model, zfunc.Config(optimizer=zfunc.adamw(lr=3e-4), param_groups=[matrices]))
        >>> type(state.opt).__name__, [type(o).__name__ for o in state.group_opts]
        ('AdamState', ['MuonState'])
    """
    return MuonConfig(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                      ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                      ns_dtype=ns_dtype)


def sgd(lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
        nesterov: bool = False) -> SGDConfig:
    """SGD as `torch.optim.SGD` defines it (momentum, dampening, nesterov, L2 weight decay).

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(1, 1, bias=False), zfunc.Config(stage=0, optimizer=zfunc.sgd(lr=0.5)))
        >>> state = zfunc.accumulate(state, {"weight": torch.ones(1, 1)})
        >>> w = zfunc.full_params(state)["weight"].item()
        >>> round(zfunc.full_params(zfunc.apply_step(state))["weight"].item() - w, 4)
        -0.5
    """
    return SGDConfig(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)


def lion(lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> LionConfig:
    """Lion (Chen et al., 2023): the sign of an interpolated momentum, decoupled weight decay.

    Examples:
        >>> import zfunc
        >>> zfunc.lion(lr=3e-4, weight_decay=0.1).weight_decay
        0.1
    """
    return LionConfig(lr=lr, betas=betas, weight_decay=weight_decay)


def adagrad(lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0, eps: float = 1e-10,
            initial_accumulator_value: float = 0.0) -> AdagradConfig:
    """Adagrad as `torch.optim.Adagrad` defines it.

    Examples:
        >>> import zfunc
        >>> zfunc.adagrad(lr=0.1).lr
        0.1
    """
    return AdagradConfig(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
                         initial_accumulator_value=initial_accumulator_value)


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
        weight_decay: as the optimizer's (``None``: the optimizer's value). So are the rest; a
            value the optimizer does not read is an error at `zfunc.init`.
        betas: Adam's and Lion's.
        eps: Adam's and Adagrad's.
        momentum: SGD's.
        dampening: SGD's.
        lr_decay: Adagrad's.
        optimizer: this group's own optimizer (``None``: `Config.optimizer`), e.g. `zfunc.muon`
            for the hidden matrices while the rest train with AdamW. The group's values default
            to this optimizer's; its state is its own record (`TrainState.group_opts`) and its
            own fused pass.

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
    momentum: float | None = None
    dampening: float | None = None
    lr_decay: float | None = None
    optimizer: Any = None

    def __post_init__(self) -> None:
        check(self.optimizer is None or isinstance(self.optimizer, OPTIMIZERS), "param_groups.optimizer",
              "None or zfunc.adam, adamw, sgd, lion, adagrad or muon (...)", self.optimizer)
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
        for key in ("momentum", "dampening", "lr_decay"):
            v = getattr(self, key)
            check(v is None or (is_finite_number(v) and v >= 0), f"param_groups.{key}", "a finite number >= 0", v)

    def values(self) -> dict[str, float]:
        """The hyperparameters this group sets, as `zfunc.GroupHyper` names them."""
        out = {k: float(getattr(self, k)) for k in ("lr", "weight_decay", "eps", "momentum", "dampening", "lr_decay")
               if getattr(self, k) is not None}
        if self.betas is not None:
            out.update(beta1=self.betas[0], beta2=self.betas[1])
        return out

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
        chosen = [i for i, g in enumerate(groups) if _selects(g, i, name, p)]
        if len(chosen) > 1:
            raise ConfigError(f"param_groups: {name!r} is in groups {chosen}; put each parameter in one group")
        out[name] = chosen[0] + 1 if chosen else 0
    return out


def _selects(group: ParamGroup, i: int, name: str, p: torch.Tensor) -> bool:
    """`ParamGroup.selects` (a predicate's answer taken as true or false: ``re.search`` works),
    a predicate's failure named as group ``i``'s."""
    try:
        return group.selects(name, p)
    except Exception as e:  # noqa: BLE001 - whatever the user's predicate raises
        raise ConfigError(f"param_groups[{i}]: its predicate failed on {name!r} ({type(e).__name__}: {e}); it is "
                          "called as predicate(name, parameter) and returns whether the group takes it") from e
