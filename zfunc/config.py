"""What a training run is: ZeRO stage, precision, optimizer, accumulation, clipping.

`Config` is a frozen value that is checked once, when it is made: every invalid field raises
`ConfigError` naming the field and what it accepts, so nothing downstream sees a half-valid run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Config", "ConfigError", "AdamConfig", "adam", "adamw", "DynamicLossScale"]

_PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_MASTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the accepted form.

    Examples:
        >>> import zfunc
        >>> try:
        ...     zfunc.Config(stage=5)
        ... except zfunc.ConfigError as e:
        ...     print(e)
        stage: expected one of 0, 1, 2, 3, got 5
    """


def _check(ok: bool, name: str, expected: str, got: Any) -> None:
    if not ok:
        raise ConfigError(f"{name}: expected {expected}, got {got!r}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


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
        _check(_is_number(self.lr) and self.lr > 0 and math.isfinite(self.lr),
               "optimizer.lr", "a positive finite number", self.lr)
        b = self.betas
        _check(isinstance(b, (tuple, list)) and len(b) == 2 and all(_is_number(x) and 0 <= x < 1 for x in b),
               "optimizer.betas", "two numbers in [0, 1)", b)
        object.__setattr__(self, "betas", (float(b[0]), float(b[1])))
        _check(_is_number(self.eps) and self.eps >= 0, "optimizer.eps", "a number >= 0", self.eps)
        _check(_is_number(self.weight_decay) and self.weight_decay >= 0,
               "optimizer.weight_decay", "a number >= 0", self.weight_decay)


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


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """DeepSpeed's dynamic loss scale for fp16 (growth factor 2, hysteresis, minimum).

    The scale starts at ``init``; after ``window`` clean steps it doubles; an overflow first
    consumes hysteresis and then halves it, never below ``min_scale``.

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

    def __post_init__(self) -> None:
        _check(_is_number(self.init) and math.isfinite(self.init) and self.init > 0,
               "loss_scale.init", "a finite number > 0", self.init)
        _check(_positive_int(self.window), "loss_scale.window", "a positive integer", self.window)
        _check(_positive_int(self.hysteresis), "loss_scale.hysteresis", "a positive integer", self.hysteresis)
        _check(_is_number(self.min_scale) and math.isfinite(self.min_scale) and self.min_scale > 0,
               "loss_scale.min_scale", "a finite number > 0", self.min_scale)
        object.__setattr__(self, "init", float(self.init))
        object.__setattr__(self, "min_scale", float(self.min_scale))


@dataclasses.dataclass(frozen=True)
class Config:
    """A training run: ZeRO stage, precision, optimizer, accumulation and clipping.

    Args:
        stage: ZeRO stage 0..3 (0: replicate everything; 1: shard optimizer state;
            2: also gradients; 3: also parameters).
        precision: compute dtype of the model: ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        optimizer: `zfunc.adam(...)` or `zfunc.adamw(...)` (default AdamW, lr 1e-3).
        grad_accum: micro-batches per optimizer step.
        clip: global-norm clipping threshold; ``None`` or ``0`` disables.
        loss_scale: `DynamicLossScale`, a float (static) or ``None`` (no scaling).
        master_dtype: dtype of the master parameters.
        moment_dtype: dtype of the Adam moments.
        grad_accum_dtype: dtype of the gradient accumulator.
        comm_dtype: dtype gradients are reduced in (default: ``grad_accum_dtype``).
        autocast: a dtype to run forward under `torch.autocast`, or ``None``.
        lr_schedule: callable ``step -> lr`` (see `zfunc.schedules`), or ``None`` for a constant.
        units: stage 3: module names or classes gathered as one unit each (default: the
            elements of the model's ``nn.ModuleList``s, e.g. its transformer blocks).
        persist_threshold: stage 3: parameters of at most this many elements stay in the root
            unit, gathered once per forward (DeepSpeed's ``stage3_param_persistence_threshold``).
        align: elements each rank's shard is padded to a multiple of (keeps shards 16-byte aligned).

    Examples:
        >>> import zfunc
        >>> cfg = zfunc.Config(stage=2, grad_accum=4, clip=1.0)
        >>> cfg.stage, cfg.grad_accum, cfg.optimizer.lr
        (2, 4, 0.001)
        >>> cfg.replace(stage=1).stage
        1
    """

    stage: int = 2
    precision: str = "fp32"
    optimizer: AdamConfig = dataclasses.field(default_factory=adamw)
    grad_accum: int = 1
    clip: float | None = None
    loss_scale: DynamicLossScale | float | None = None
    master_dtype: torch.dtype = torch.float32
    moment_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype | None = None
    autocast: torch.dtype | None = None
    lr_schedule: Callable[[Any], Any] | None = None
    units: Sequence[str | type] | None = None
    persist_threshold: int = 100_000
    align: int = 4

    def __post_init__(self) -> None:
        _check(self.stage in (0, 1, 2, 3) and not isinstance(self.stage, bool),
               "stage", "one of 0, 1, 2, 3", self.stage)
        _check(self.precision in _PRECISIONS, "precision", '"fp32", "fp16" or "bf16"', self.precision)
        _check(isinstance(self.optimizer, AdamConfig), "optimizer",
               "zfunc.adam(...) or zfunc.adamw(...)", self.optimizer)
        _check(_positive_int(self.grad_accum), "grad_accum", "a positive integer", self.grad_accum)
        _check(self.clip is None or (_is_number(self.clip) and self.clip >= 0 and math.isfinite(self.clip)),
               "clip", "None or a finite number >= 0", self.clip)
        ls = self.loss_scale
        _check(ls is None or isinstance(ls, DynamicLossScale)
               or (_is_number(ls) and math.isfinite(ls) and ls > 0),
               "loss_scale", "None, a finite number > 0, or zfunc.DynamicLossScale(...)", ls)
        _check(self.master_dtype in _MASTER_DTYPES, "master_dtype",
               "torch.float32, torch.bfloat16 or torch.float16", self.master_dtype)
        _check(self.moment_dtype in _MOMENT_DTYPES, "moment_dtype",
               "torch.float32 or torch.bfloat16", self.moment_dtype)
        _check(self.grad_accum_dtype in _MASTER_DTYPES, "grad_accum_dtype",
               "torch.float32, torch.bfloat16 or torch.float16", self.grad_accum_dtype)
        _check(self.comm_dtype is None or self.comm_dtype in _MASTER_DTYPES, "comm_dtype",
               "None, torch.float32, torch.bfloat16 or torch.float16", self.comm_dtype)
        _check(self.autocast is None or self.autocast in _MASTER_DTYPES, "autocast",
               "None, torch.float32, torch.bfloat16 or torch.float16", self.autocast)
        _check(self.lr_schedule is None or callable(self.lr_schedule), "lr_schedule",
               "None or a callable step -> lr", self.lr_schedule)
        _check(_positive_int(self.align), "align", "a positive integer", self.align)
        _check(isinstance(self.persist_threshold, int) and self.persist_threshold >= 0, "persist_threshold",
               "an integer >= 0", self.persist_threshold)
        _check(self.units is None or (isinstance(self.units, (list, tuple))
                                      and all(isinstance(u, (str, type)) for u in self.units)),
               "units", "None or a list of module names or module classes", self.units)
        if self.units is not None:
            object.__setattr__(self, "units", tuple(self.units))
        if (self.precision == "bf16" or self.autocast == torch.bfloat16) and self.loss_scale is not None:
            raise ConfigError("loss_scale: bf16 needs no loss scaling (its range is fp32's); "
                              "set loss_scale=None, or use precision='fp16'")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in (from ``precision``)."""
        return _PRECISIONS[self.precision]

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients travel in across ranks."""
        return self.comm_dtype or self.grad_accum_dtype

    @property
    def clip_value(self) -> float:
        """The clipping threshold, 0.0 when clipping is off."""
        return float(self.clip or 0.0)

    @classmethod
    def from_deepspeed(cls, ds: Any, world_size: int = 1) -> Config:
        """A `Config` from a DeepSpeed config dict or JSON path (see `zfunc.deepspeed_config`).

        Examples:
            >>> import zfunc
            >>> zfunc.Config.from_deepspeed({"train_batch_size": 8, "zero_optimization": {"stage": 1}}).stage
            1
        """
        from zfunc.deepspeed_config import from_deepspeed

        return from_deepspeed(ds, world_size)

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (and checked)."""
        return dataclasses.replace(self, **changes)
