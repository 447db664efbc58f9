"""DeepSpeed's read-only engine accessors: what the run is configured as (`Engine` inherits
them). Each answers from `Engine.cfg` (the `zfunc.Config`) and the batch sizes the DeepSpeed
config gave; see ``docs/deepspeed.md`` for the accessors zfunc does not have."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from zfunc.core.opt_state import optimizers
from zfunc.core.scaler import DynamicLossScale

if TYPE_CHECKING:
    from zfunc.core.deepspeed_config import BatchSizes
    from zfunc.core.config import Config
    from zfunc.core.state import TrainState

__all__ = ["ConfigAccessors"]


class ConfigAccessors:
    """DeepSpeed's configuration getters, by DeepSpeed's names.

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={
        ...     "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
        ...     "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
        >>> engine.zero_optimization_stage(), engine.gradient_clipping(), engine.optimizer_name()
        (2, 0.5, 'adamw')
        >>> engine.get_batch_info(), engine.zero_optimization_partition_gradients(), engine.get_mom()
        ((4, 4, 1), True, [(0.9, 0.999)])
    """

    cfg: Config
    _batch: BatchSizes | None
    _state: TrainState
    managed: bool
    optimizer: Any

    def train_batch_size(self) -> int | None:
        return self._batch.train_batch_size if self._batch else None

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self._batch.micro_batch_size if self._batch else None

    def gradient_accumulation_steps(self) -> int:
        return self.cfg.grad_accum

    def get_batch_info(self) -> tuple[int | None, int | None, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def zero_optimization(self) -> bool:
        return self.cfg.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.cfg.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.cfg.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.cfg.stage == 3

    def zero_param_persistence_threshold(self) -> int:
        return self.cfg.persist_threshold

    def zero_offload_optimizer(self) -> bool:
        return self.cfg.offload_optimizer is not None

    zero_cpu_offload = zero_offload_optimizer

    def fp16_enabled(self) -> bool:
        return self.cfg.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.cfg.precision == "bf16"

    def fp16_master_weights_and_gradients(self) -> bool:
        return self.cfg.precision == "fp16" and self.cfg.master_dtype == torch.float16

    def bf16_master_weights_and_gradients(self) -> bool:
        return self.cfg.precision == "bf16" and self.cfg.master_dtype == torch.bfloat16

    def bf16_optimizer_states(self) -> bool:
        return self.cfg.moment_dtype == torch.bfloat16

    def torch_autocast_enabled(self) -> bool:
        return self.cfg.autocast is not None

    def torch_autocast_dtype(self) -> torch.dtype | None:
        return self.cfg.autocast

    def dynamic_loss_scale(self) -> bool:
        return isinstance(self.cfg.loss_scale, DynamicLossScale)

    @property
    def communication_data_type(self) -> torch.dtype:
        return self.cfg.reduce_dtype

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """``(model dtype, gradient accumulation dtype)``, as DeepSpeed's."""
        return self.cfg.compute_dtype, self.cfg.grad_accum_dtype

    def gradient_clipping(self) -> float:
        return self.cfg.clip_value

    def managed_gradient_accumulation(self) -> bool:
        return self.managed

    def optimizer_name(self) -> str:
        """The optimizers' names, ``+``-joined when parameter groups bring their own."""
        names = [o.name + ("w" if getattr(o, "decoupled", False) else "") for o in optimizers(self.cfg)]
        return "+".join(names)

    def get_mom(self) -> list[Any]:
        """Each group's ``betas`` (Adam, Lion) or ``momentum`` (SGD, Muon), as DeepSpeed's."""
        return [tuple(d["betas"]) if "betas" in d else d.get("momentum") for d in self.optimizer.param_groups]

    def get_data_parallel_rank(self) -> int:
        return self._state.group.rank

    @property
    def device(self) -> torch.device:
        return self._state.device

    @property
    def global_rank(self) -> int:
        return self._state.group.rank

    @property
    def world_size(self) -> int:
        return self._state.group.size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self._state.group.rank))
