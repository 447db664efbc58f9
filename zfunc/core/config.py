"""What a training run is: ZeRO stage, precision, optimizer, accumulation, clipping.

`Config` is a frozen value that is checked once, when it is made: every invalid field raises
`ConfigError` naming the field and what it accepts, so nothing downstream sees a half-valid run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from zfunc.core.deepspeed_config import read_config, translate
from zfunc.errors import ConfigError, check, is_finite_number, is_positive_int
from zfunc.core.optim import OPTIMIZERS, AdamConfig, ParamGroup, adam, adamw
from zfunc.core.scaler import FLOAT32_MAX, DynamicLossScale

__all__ = ["Config", "ConfigError", "AdamConfig", "ParamGroup", "adam", "adamw", "DynamicLossScale"]

_PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_MASTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)



@dataclasses.dataclass(frozen=True)
class Config:
    """A training run: ZeRO stage, precision, optimizer, accumulation and clipping.

    Args:
        stage: ZeRO stage 0..3 (0: replicate everything; 1: shard optimizer state;
            2: also gradients; 3: also parameters).
        precision: compute dtype of the model: ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        optimizer: `zfunc.adamw(...)` (the default, lr 1e-3), `zfunc.adam`, `zfunc.sgd`,
            `zfunc.lion`, `zfunc.adagrad` or `zfunc.muon` (for 2-D parameters only).
        grad_accum: micro-batches per optimizer step.
        clip: global-norm clipping threshold; ``None`` or ``0`` disables.
        loss_scale: `DynamicLossScale`, a float (static) or ``None`` (no scaling).
        master_dtype: dtype of the master parameters.
        moment_dtype: dtype of the optimizers' moments.
        grad_accum_dtype: dtype of the gradient accumulator.
        comm_dtype: dtype gradients are reduced in (default: ``grad_accum_dtype``).
        autocast: a dtype to run forward under `torch.autocast`, or ``None``.
        lr_schedule: callable ``step -> lr`` (see `zfunc.schedules`), or ``None`` for a constant.
        units: stage 3: module names or classes gathered as one unit each (default: the
            elements of the model's ``nn.ModuleList``s, e.g. its transformer blocks). Stages
            1-2: given, the next forward gathers the step's updated parameters unit by unit, each
            unit waited for when its module starts (`zfunc.autograd.forward_gather`); a unit's
            parameters must then be used inside its module's forward only, as at stage 3.
            ``None`` at stages 1-2: gathered before `zfunc.apply_step` returns.
        param_groups: `zfunc.ParamGroup`s giving some parameters their own learning rate, weight
            decay, betas or eps, or their own optimizer (group ``i + 1``; parameters in none are
            group 0, the optimizer's own).
        freeze: names of parameters to keep fixed besides those with ``requires_grad=False``
            (what a DeepSpeed ``model_parameters`` list leaves out); the module is not changed.
        persist_threshold: stage 3: parameters of at most this many elements stay in the root
            unit, gathered once per forward (DeepSpeed's ``stage3_param_persistence_threshold``).
        align: elements each rank's shard is padded to a multiple of (keeps shards 16-byte aligned).
        shard_size: hybrid sharding (stages 1-3): shard the state over groups of this many
            consecutive ranks and replicate it across the groups (FSDP2's HSDP, DeepSpeed's
            ``mics_shard_size``); e.g. the ranks per node, so only one all-reduce per step crosses
            nodes. ``None`` shards over the whole world; it must divide the world size.
        offload_optimizer: ``"cpu"``: ZeRO-Offload. The master weights and optimizer state of
            this rank's shard live in host memory and the CPU kernel updates them; the compute
            device keeps only the compute copy and the gradients. ``None``: all on the device.
        bucket_mb: stages 0-2: MiB of gradient (in ``reduce_dtype``) per bucket, reduced during
            backward (at stages 0-1, the backward of the step's last micro-batch) as soon as it
            is complete (DDP's ``bucket_cap_mb``): smaller buckets start sooner and overlap
            more, at the cost of more, smaller collectives. A model that runs
            its own collectives during backward (SyncBatchNorm) on the same process group while
            leaving some parameters unused on some ranks should use one bucket (a large value):
            the buckets' reduces must not interleave with its collectives differently per rank.
        prefetch: stage 3: how many units ahead of the running one are all-gathered, in forward
            and in backward, so the gathers overlap the computation (FSDP2's and DeepSpeed's
            prefetch); each costs one unit of memory. 0 gathers a unit when its module starts.
        offload_pin_memory: page-lock the host arena when the compute device is CUDA (faster,
            asynchronous copies; DeepSpeed's ``offload_optimizer.pin_memory``).
        buffer_dtype: the dtype of the model's floating buffers (BatchNorm statistics, rotary
            tables): ``"compute"`` (the default) casts them to the compute dtype, as
            ``model.bfloat16()`` does; ``None`` keeps each buffer's own dtype (DeepSpeed 0.19's
            default, FSDP2's); a dtype casts them to it (DeepSpeed's ``data_types.buffer_dtype``).
        grad_reduce: ``"mean"``: the gradient is averaged over the data-parallel ranks (DDP's,
            FSDP2's and DeepSpeed's default); ``"sum"``: summed over them (DeepSpeed's
            ``gradient_allreduce_op: "sum"``). Micro-batches are averaged either way.

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
    optimizer: Any = dataclasses.field(default_factory=adamw)
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
    param_groups: Sequence[ParamGroup] = ()
    freeze: Sequence[str] = ()
    persist_threshold: int = 100_000
    align: int = 4
    shard_size: int | None = None
    offload_optimizer: str | None = None
    offload_pin_memory: bool = True
    bucket_mb: float = 25.0
    prefetch: int = 1
    grad_reduce: str = "mean"
    buffer_dtype: torch.dtype | str | None = "compute"

    def __deepcopy__(self, memo: dict[int, Any]) -> Config:
        return self  # a frozen value: a state's copy shares it (and so compares equal in structure)

    def __post_init__(self) -> None:
        check(type(self.stage) is int and self.stage in (0, 1, 2, 3), "stage", "one of 0, 1, 2, 3", self.stage)
        check(self.precision in _PRECISIONS, "precision", '"fp32", "fp16" or "bf16"', self.precision)
        check(isinstance(self.optimizer, OPTIMIZERS), "optimizer",
              "zfunc.adam, adamw, sgd, lion, adagrad or muon (...)", self.optimizer)
        check(is_positive_int(self.grad_accum), "grad_accum", "a positive integer", self.grad_accum)
        check(self.clip is None or (is_finite_number(self.clip) and self.clip >= 0),
               "clip", "None or a finite number >= 0", self.clip)
        ls = self.loss_scale
        check(ls is None or isinstance(ls, DynamicLossScale) or (is_finite_number(ls) and 0 < ls <= FLOAT32_MAX),
              "loss_scale", "None, a number in (0, 3.4e38], or zfunc.DynamicLossScale(...)", ls)
        check(self.master_dtype in _MASTER_DTYPES, "master_dtype",
               "torch.float32, torch.bfloat16 or torch.float16", self.master_dtype)
        check(self.moment_dtype in _MOMENT_DTYPES, "moment_dtype",
               "torch.float32 or torch.bfloat16", self.moment_dtype)
        check(self.grad_accum_dtype in _MASTER_DTYPES, "grad_accum_dtype",
               "torch.float32, torch.bfloat16 or torch.float16", self.grad_accum_dtype)
        check(self.comm_dtype is None or self.comm_dtype in _MASTER_DTYPES, "comm_dtype",
               "None, torch.float32, torch.bfloat16 or torch.float16", self.comm_dtype)
        check(self.autocast is None or self.autocast in _MASTER_DTYPES, "autocast",
               "None, torch.float32, torch.bfloat16 or torch.float16", self.autocast)
        check(self.lr_schedule is None or callable(self.lr_schedule), "lr_schedule",
               "None or a callable step -> lr", self.lr_schedule)
        check(is_positive_int(self.align), "align", "a positive integer", self.align)
        check(is_finite_number(self.bucket_mb) and self.bucket_mb > 0, "bucket_mb", "a number > 0 (MiB)",
              self.bucket_mb)
        check(isinstance(self.prefetch, int) and not isinstance(self.prefetch, bool) and self.prefetch >= 0,
              "prefetch", "an integer >= 0 (units gathered ahead)", self.prefetch)
        check(self.grad_reduce in ("mean", "sum"), "grad_reduce", '"mean" or "sum"', self.grad_reduce)
        check(self.offload_optimizer in (None, "cpu"), "offload_optimizer",
              'None or "cpu" (host memory; NVMe is not supported)', self.offload_optimizer)
        check(isinstance(self.offload_pin_memory, bool), "offload_pin_memory", "True or False", self.offload_pin_memory)
        check(self.shard_size is None or is_positive_int(self.shard_size), "shard_size",
              "None or a positive integer (a divisor of the world size)", self.shard_size)
        check(isinstance(self.persist_threshold, int) and not isinstance(self.persist_threshold, bool)
              and self.persist_threshold >= 0, "persist_threshold", "an integer >= 0", self.persist_threshold)
        check(self.units is None or (isinstance(self.units, (list, tuple))
                                      and all(isinstance(u, (str, type)) for u in self.units)),
               "units", "None or a list of module names or module classes", self.units)
        if self.units is not None:
            object.__setattr__(self, "units", tuple(self.units))
        check(isinstance(self.param_groups, (list, tuple)) and all(isinstance(g, ParamGroup) for g in self.param_groups),
              "param_groups", "a list of zfunc.ParamGroup", self.param_groups)
        object.__setattr__(self, "param_groups", tuple(self.param_groups))
        check(isinstance(self.freeze, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in self.freeze),
              "freeze", "a list of parameter names", self.freeze)
        object.__setattr__(self, "freeze", tuple(self.freeze))
        check(self.buffer_dtype in ("compute", None, torch.float32, torch.bfloat16, torch.float16), "buffer_dtype",
              '"compute", None (keep each buffer\'s dtype) or torch.float32, bfloat16 or float16', self.buffer_dtype)
        if self.units is not None and self.stage == 0:
            raise ConfigError("units: stage 0 gathers nothing (every rank holds all parameters); leave units "
                              "unset, or use stage 1, 2 or 3")
        if self.offload_optimizer is not None and self.stage == 0:
            raise ConfigError("offload_optimizer: needs stage 1, 2 or 3 (stage 0 keeps the whole optimizer state "
                              "on every rank; shard it first, then offload the shard)")
        # (fp16 weights have fp16 gradients, whatever autocast computes in: they need one)
        if (self.precision == "bf16" or self.autocast == torch.bfloat16 and self.precision != "fp16") \
                and self.loss_scale is not None:
            raise ConfigError("loss_scale: bf16 needs no loss scaling (its range is fp32's); set loss_scale=None, "
                              "or use precision='fp16' (fp16 weights, whose gradients need one)")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in (from ``precision``)."""
        return _PRECISIONS[self.precision]

    def buffer_dtype_of(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a buffer of ``dtype`` is kept in (`buffer_dtype`; non-float buffers keep theirs).

        Examples:
            >>> import torch, zfunc
            >>> cfg = zfunc.Config(precision="bf16")
            >>> cfg.buffer_dtype_of(torch.float32), cfg.replace(buffer_dtype=None).buffer_dtype_of(torch.float32)
            (torch.bfloat16, torch.float32)
        """
        if dtype not in (torch.float32, torch.bfloat16, torch.float16) or self.buffer_dtype is None:
            return dtype
        return self.compute_dtype if self.buffer_dtype == "compute" else self.buffer_dtype

    @property
    def shards_grads(self) -> bool:
        """Whether gradients are reduce-scattered to their owners during backward, into a
        shard-sized accumulator: stages 2-3, and stage 1 with one micro-batch per step (there is
        nothing to accumulate locally, so waiting for the step would only lose the overlap).

        Examples:
            >>> import zfunc
            >>> [zfunc.Config(stage=s, grad_accum=a).shards_grads for s, a in ((1, 1), (1, 4), (2, 4))]
            [True, False, True]
        """
        return self.stage >= 2 or (self.stage == 1 and self.grad_accum == 1)

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients travel in across ranks."""
        return self.comm_dtype or self.grad_accum_dtype

    @property
    def clip_value(self) -> float:
        """The clipping threshold, 0.0 when clipping is off."""
        return float(self.clip or 0.0)

    @classmethod
    def from_deepspeed(cls, ds: Mapping[str, Any] | str, world_size: int = 1) -> Config:
        """A `Config` from a DeepSpeed config dict or JSON path (`zfunc.core.deepspeed_config.translate`).

        Examples:
            >>> import zfunc
            >>> cfg = zfunc.Config.from_deepspeed({
            ...     "train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
            ...     "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
            ...     "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, world_size=2)
            >>> cfg.stage, cfg.grad_accum, cfg.precision, cfg.clip, cfg.optimizer.decoupled
            (2, 2, 'bf16', 1.0, True)
        """
        ds = read_config(ds)
        fields, _ = translate(ds, world_size)
        if ds.get("managed_gradient_accumulation") is False:
            raise ConfigError("managed_gradient_accumulation: false is an engine setting (zfunc.initialize); with "
                              "the functional API the caller owns the boundary already: call apply_step when the "
                              "accumulation ends (it averages the micro-batches run)")
        return cls(**fields)

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (and checked)."""
        return dataclasses.replace(self, **changes)
