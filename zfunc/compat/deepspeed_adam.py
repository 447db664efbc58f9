"""DeepSpeed's Adam classes (``deepspeed.ops.adam``) as the switch serves them: torch optimizers
that `zfunc.initialize` reads as it reads ``torch.optim.Adam``/``AdamW`` (zfunc's own fused Adam
runs the step). Accelerate builds ``DeepSpeedCPUAdam`` from the client's optimizer when the
DeepSpeed config offloads the optimizer and names none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zfunc.errors import ConfigError

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class _DeepSpeedAdam(torch.optim.Adam):
    """Adam, or AdamW with ``adamw_mode`` (DeepSpeed's default), over ``params``; stepped by
    the engine, never on its own."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, **kwargs: Any):
        name = type(self).__name__
        if not bias_correction or amsgrad:
            raise ConfigError(f"{name}(bias_correction={bias_correction}, amsgrad={amsgrad}): zfunc's Adam has bias "
                              "correction and no amsgrad; leave both at their defaults")
        unknown = sorted(set(kwargs) - {"fp32_optimizer_states", "set_grad_none", "adam_w_mode"})
        if unknown:
            raise ConfigError(f"{name}: zfunc does not implement {unknown}; remove them")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.adam_w_mode = bool(kwargs.get("adam_w_mode", adamw_mode))  # (FusedAdam's spelling)

    def step(self, closure: Any = None) -> Any:
        raise RuntimeError(f"{type(self).__name__}.step(): give the optimizer to zfunc.initialize (deepspeed.initialize) "
                           "and call engine.step(); zfunc's fused Adam runs the update")


class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """``deepspeed.ops.adam.DeepSpeedCPUAdam``: AdamW by default (``adamw_mode=True``).

    Examples:
        >>> import torch, zfunc
        >>> model = torch.nn.Linear(2, 1)
        >>> engine, *_ = zfunc.initialize(model=model, optimizer=DeepSpeedCPUAdam(model.parameters(), lr=0.1),
        ...                               config={"train_batch_size": 1})
        >>> engine.cfg.optimizer.decoupled, DeepSpeedCPUAdam(model.parameters(), adamw_mode=False).adam_w_mode
        (True, False)
    """


class FusedAdam(_DeepSpeedAdam):
    """``deepspeed.ops.adam.FusedAdam``: AdamW by default (``adam_w_mode=True``)."""
