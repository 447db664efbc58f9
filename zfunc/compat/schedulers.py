"""DeepSpeed's ``OneCycle`` and ``LRRangeTest`` schedulers for the engine.

They write into the returned optimizer's ``param_groups``, which the engine reads at each step,
as a torch scheduler on that optimizer would; the engine steps them after each applied update.
Update ``u`` (0-based) uses the schedule at ``u`` (DeepSpeed sets the first values at
construction and advances after each update).

``OneCycle``: one cycle rises from ``cycle_min_lr`` to ``cycle_max_lr`` over ``cycle_first_step_size`` updates
and falls back over ``cycle_second_step_size`` (default: the first's), optionally in stairs;
after the cycle the learning rate decays as ``cycle_min_lr / (1 + decay_lr_rate * k /
decay_step_size)``. Momentum (Adam's beta1) moves the opposite way between ``cycle_max_mom`` and
``cycle_min_mom``, and beta2 is set to 0.99, as DeepSpeed does. The functional API has no
counterpart (a `zfunc.Config` schedules the learning rate only): set ``betas`` per step with
`zfunc.set_hyperparams`.

``LRRangeTest``: ``lr_range_test_min_lr * (1 + lr_range_test_step_rate * u /
lr_range_test_step_size)``, the quotient floored with ``lr_range_test_staircase``.
"""

from __future__ import annotations

import math
from typing import Any

from zfunc.errors import ConfigError

__all__ = ["OneCycle", "LRRangeTest", "SCHEDULERS"]

_BETA2 = 0.99  # DeepSpeed's OneCycle pairs each cycled beta1 with this beta2


def _per_group(value: Any, groups: int, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ConfigError(f"scheduler.params.{name}: {len(value)} values for {groups} parameter groups")
        return [float(v) for v in value]
    return [float(value)] * groups


class OneCycle:
    """DeepSpeed's 1Cycle policy over ``optimizer.param_groups`` (``lr``, and ``betas`` for Adam).

    Examples:
        >>> import torch, zfunc
        >>> engine, optimizer, _, sched = zfunc.initialize(model=torch.nn.Linear(2, 1), config={
        ...     "train_batch_size": 1, "scheduler": {"type": "OneCycle", "params": {
        ...         "cycle_min_lr": 0.0, "cycle_max_lr": 1.0, "cycle_first_step_size": 2,
        ...         "cycle_min_mom": 0.8, "cycle_max_mom": 0.9}}})
        >>> lrs = []
        >>> for _ in range(5):
        ...     lrs.append(optimizer.param_groups[0]["lr"])
        ...     _ = engine.backward(engine(torch.ones(1, 2)).sum())
        ...     engine.step()
        >>> lrs, [round(b, 2) for b in optimizer.param_groups[0]["betas"]]
        ([0.0, 0.5, 1.0, 0.5, 0.0], [0.9, 0.99])
    """

    def __init__(self, optimizer: Any, cycle_min_lr: Any, cycle_max_lr: Any, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: Any = 0.8,
                 cycle_max_mom: Any = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        groups = len(optimizer.param_groups)
        self.first = float(cycle_first_step_size)
        self.second = self.first if cycle_second_step_size is None else float(cycle_second_step_size)
        if self.first <= 0 or self.second < 0:
            raise ConfigError("scheduler.params.cycle_first_step_size: must be positive (and "
                              f"cycle_second_step_size non-negative), got {cycle_first_step_size}, "
                              f"{cycle_second_step_size}")
        self.total = self.first + self.second
        self.stairs = (int(cycle_first_stair_count), int(cycle_first_stair_count if cycle_second_stair_count is None
                                                         else cycle_second_stair_count))
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(cycle_min_lr, groups, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, groups, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        # As DeepSpeed: momentum cycles only for optimizers with betas (Adam's beta1).
        self.cycle_momentum = bool(cycle_momentum) and all("betas" in g for g in optimizer.param_groups)
        self.min_moms = _per_group(cycle_min_mom, groups, "cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, groups, "cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._write(self.min_lrs, self.min_moms)

    def _scale(self, i: int) -> float:
        """0 at the cycle's start, 1 at its peak, 0 at its end; in stairs when asked."""
        x = i / self.total - math.floor(i / self.total)
        ratio = self.first / self.total
        rising = x <= ratio
        stairs = self.stairs[0] if rising else self.stairs[1]
        if stairs > 0:  # from the integer position, so a stair is never lost to rounding
            at = i % self.total
            pos = at * stairs / self.first if at <= self.first else (self.total - at) * stairs / self.second
            return math.floor(pos) / stairs
        return x / ratio if rising else (x - 1) / (ratio - 1)

    def _values(self, it: int) -> tuple[list[float], list[float]]:
        """The learning rates and beta1s after update ``it`` (DeepSpeed's ``last_batch_iteration``)."""
        if it < self.total:
            s = self._scale(it + 1)
            return ([lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)],
                    [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)])
        k = it - self.total + 1
        decays = self.decay_step_size != 0
        lrs = ([lo / (1 + self.decay_lr_rate * k / self.decay_step_size) for lo in self.min_lrs]
               if decays and self.decay_lr_rate != 0 else list(self.min_lrs))
        moms = ([hi * (1 + self.decay_mom_rate * k / self.decay_step_size) for hi in self.max_moms]
                if decays and self.decay_mom_rate != 0 else list(self.max_moms))
        return lrs, moms

    def _write(self, lrs: list[float], moms: list[float]) -> None:
        if self.cycle_momentum and any(m >= 1 for m in moms):
            raise ConfigError(
                f"scheduler.params.decay_mom_rate: OneCycle's momentum (Adam's beta1) reached {max(moms):.4g} after "
                f"update {self.last_batch_iteration + 1} (cycle_max_mom * (1 + decay_mom_rate * k / decay_step_size) "
                "grows past the cycle), and beta1 must stay below 1 (DeepSpeed trains on with it and diverges). "
                "Use a smaller decay_mom_rate, 0, or cycle_momentum false; the updates so far are applied")
        for g, lr, mom in zip(self.optimizer.param_groups, lrs, moms):
            g["lr"] = lr
            if self.cycle_momentum:
                g["betas"] = (mom, _BETA2)
        self._last_lr = list(lrs)

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance after an applied update (the engine calls it)."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if batch_iteration is None else batch_iteration
        self._write(*self._values(self.last_batch_iteration))

    def get_lr(self) -> list[float]:
        """The learning rates the next update uses."""
        return self._values(self.last_batch_iteration)[0] if self.last_batch_iteration >= 0 else list(self.min_lrs)

    def get_last_lr(self) -> list[float]:
        """The learning rates last written."""
        return list(self._last_lr)

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The ``betas`` the next update uses (None when momentum does not cycle)."""
        if not self.cycle_momentum:
            return None
        moms = self._values(self.last_batch_iteration)[1] if self.last_batch_iteration >= 0 else self.min_moms
        return [(m, _BETA2) for m in moms]

    def state_dict(self) -> dict[str, int]:
        """``{"last_batch_iteration": ...}``, as DeepSpeed's."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Resume at ``sd["last_batch_iteration"]`` (the values are written at the next step)."""
        self.last_batch_iteration = int(sd["last_batch_iteration"])


class LRRangeTest:
    """DeepSpeed's learning-rate range test over ``optimizer.param_groups``.

    Examples:
        >>> import torch, zfunc
        >>> engine, optimizer, _, sched = zfunc.initialize(model=torch.nn.Linear(2, 1), config={
        ...     "train_batch_size": 1, "scheduler": {"type": "LRRangeTest", "params": {
        ...         "lr_range_test_min_lr": 0.1, "lr_range_test_step_size": 2}}})
        >>> lrs = []
        >>> for _ in range(4):
        ...     lrs.append(optimizer.param_groups[0]["lr"])
        ...     _ = engine.backward(engine(torch.ones(1, 2)).sum())
        ...     engine.step()
        >>> [round(lr, 3) for lr in lrs]
        [0.1, 0.15, 0.2, 0.25]
    """

    def __init__(self, optimizer: Any, lr_range_test_min_lr: Any = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        if not (isinstance(lr_range_test_step_size, int) and lr_range_test_step_size > 0):
            raise ConfigError("scheduler.params.lr_range_test_step_size: expected a positive integer, got "
                              f"{lr_range_test_step_size!r}")
        self.optimizer = optimizer
        self.min_lrs = _per_group(lr_range_test_min_lr, len(optimizer.param_groups), "lr_range_test_min_lr")
        self.step_size, self.step_rate = lr_range_test_step_size, float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._write()

    def get_lr(self) -> list[float]:
        """The learning rates the next update uses."""
        q = (self.last_batch_iteration + 1) / self.step_size
        return [lo * (1 + self.step_rate * (math.floor(q) if self.staircase else q)) for lo in self.min_lrs]

    def _write(self) -> None:
        self._last_lr = self.get_lr()
        for g, lr in zip(self.optimizer.param_groups, self._last_lr):
            g["lr"] = lr

    def step(self, batch_iteration: int | None = None) -> None:
        """Advance after an applied update (the engine calls it)."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if batch_iteration is None else batch_iteration
        self._write()

    def get_last_lr(self) -> list[float]:
        """The learning rates last written."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, int]:
        """``{"last_batch_iteration": ...}``, as DeepSpeed's."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Resume at ``sd["last_batch_iteration"]``."""
        self.last_batch_iteration = int(sd["last_batch_iteration"])


SCHEDULERS = {"OneCycle": OneCycle, "LRRangeTest": LRRangeTest}
