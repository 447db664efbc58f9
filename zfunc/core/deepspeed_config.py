"""DeepSpeed's JSON config turned into the fields of a `zfunc.Config` and the batch sizes.

`translate` reads a config once and returns both; ``Config.from_deepspeed`` and
`zfunc.initialize` call it (this module imports no ``zfunc.core.config``: the dependency runs one way).

The batch keys follow DeepSpeed's fill-in rules and its consistency check; ``optimizer``,
``scheduler``, ``fp16``, ``bf16``, ``torch_autocast``, ``data_types`` and ``zero_optimization``
map to zfunc's fields. Keys zfunc does not implement produce one warning listing them; malformed
values raise `ConfigError` naming the key path.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from zfunc.core import schedules
from zfunc.errors import ConfigError, is_finite_number
from zfunc.core.optim import AdagradConfig, AdamConfig, LionConfig, MuonConfig, ParamGroup, SGDConfig
from zfunc.core.scaler import FLOAT32_MAX, DynamicLossScale

__all__ = ["translate", "read_config", "BatchSizes", "batch_sizes"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "torch.float32": torch.float32,
           "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16}
# Keys that change nothing in zfunc's results: logging and monitoring, DeepSpeed's own tuning.
_HARMLESS = {"steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "dump_state", "seed",
             "memory_breakdown", "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger",
             "timers", "checkpoint", "zero_force_ds_cpu_optimizer", "activation_checkpointing",
             "aio"}  # aio: NVMe offload settings (zfunc refuses NVMe offload itself)
# Keys that change the numbers: accepted at the value that matches zfunc, refused otherwise.
_NUMERIC = {"sparse_gradients": (False,)}
# Where DeepSpeed divides by the world size around the reduce: zfunc divides before it, in the
# graph (what prescaling does), and every setting gives the same average; accepted and warned.
_DIVIDE = {"prescale_gradients", "gradient_predivide_factor"}
_ZERO_HANDLED = {"stage", "stage3_param_persistence_threshold", "mics_shard_size", "zero_hpz_partition_size"}
# What zfunc reads (or knowingly treats as always on) in each precision section.
_SECTION_KEYS = {
    "fp16": {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_gradients",
             "fp16_master_weights_and_grads", "auto_cast"},  # auto_cast: zfunc casts floating inputs to fp16 anyway
    "bf16": {"enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states", "check_grad_overflow",
             "immediate_grad_update"},
    "torch_autocast": {"enabled", "dtype"},
    "data_types": {"grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"},
}
_ZERO_HARMLESS = {"contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_bucket_size",
                  "overlap_comm", "allgather_partitions", "round_robin_gradients", "sub_group_size",
                  "ignore_unused_parameters", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                  "stage3_max_reuse_distance",
                  "stage3_model_persistence_threshold", "load_from_fp32_weights", "elastic_checkpoint",
                  "use_multi_rank_bucket_allreduce", "memory_efficient_linear",
                  "mics_hierarchical_params_gather"}
# Read by the engine (``engine.zero_gather_16bit_weights_on_model_save()``); the fp16 name is the
# older spelling DeepSpeed still reads as the 16-bit one.
_ZERO_ENGINE = ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")


def gather_16bit_on_save(ds: Mapping[str, Any]) -> bool:
    """DeepSpeed's ``stage3_gather_16bit_weights_on_model_save`` (or its older fp16 name), default false.

    Examples:
        >>> gather_16bit_on_save({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
        True
    """
    zero = ds.get("zero_optimization") or {}
    for key in _ZERO_ENGINE:
        if key in zero and not isinstance(zero[key], bool):
            raise _err(f"zero_optimization.{key}", "true or false", zero[key])
    return any(zero.get(key, False) for key in _ZERO_ENGINE)


@dataclasses.dataclass(frozen=True)
class BatchSizes:
    """DeepSpeed's three batch numbers, consistent: ``train = micro * grad_accum * world``."""

    train_batch_size: int
    micro_batch_size: int
    grad_accum: int


def _err(path: str, expected: str, got: Any) -> ConfigError:
    return ConfigError(f"{path}: expected {expected}, got {got!r}")


def _pos_int(ds: Mapping[str, Any], key: str) -> int | None:
    v = ds.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise _err(key, "a positive integer", v)
    return v


def batch_sizes(ds: Mapping[str, Any], world_size: int) -> BatchSizes:
    """Fill in and check DeepSpeed's batch keys for ``world_size`` data-parallel ranks.

    Examples:
        >>> from zfunc.core.deepspeed_config import batch_sizes
        >>> batch_sizes({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, world_size=2)
        BatchSizes(train_batch_size=32, micro_batch_size=8, grad_accum=2)
    """
    tbs = _pos_int(ds, "train_batch_size")
    mbs = _pos_int(ds, "train_micro_batch_size_per_gpu")
    gas = _pos_int(ds, "gradient_accumulation_steps")
    if tbs is None and mbs is None:
        raise ConfigError("train_batch_size / train_micro_batch_size_per_gpu: set at least one of them")
    if tbs is not None and mbs is not None and gas is None:
        gas = max(tbs // mbs // world_size, 1)
    elif tbs is not None and gas is not None and mbs is None:
        mbs = max(tbs // world_size // gas, 1)
    elif tbs is None:
        gas = gas or 1
        tbs = mbs * gas * world_size
    elif mbs is None:
        gas = 1
        mbs = max(tbs // world_size, 1)
    if tbs != mbs * gas * world_size:
        raise ConfigError(
            f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {mbs} * gradient_accumulation_steps "
            f"{gas} * world size {world_size}; make the three batch keys consistent (or set only two of them)")
    return BatchSizes(train_batch_size=tbs, micro_batch_size=mbs, grad_accum=gas)


def _section(ds: Mapping[str, Any], key: str) -> dict[str, Any]:
    v = ds.get(key) or {}
    if not isinstance(v, Mapping):
        raise _err(key, "a dict", v)
    return dict(v)


def _number(sec: Mapping[str, Any], path: str, key: str, default: float) -> float:
    """A finite number >= 0 (numeric strings such as "3" are accepted, as DeepSpeed does)."""
    v = sec.get(key, default)
    name = f"{path}.{key}" if path else key
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise _err(name, "a finite number >= 0", v) from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise _err(name, "a finite number >= 0", v)
    return float(v)


_OFFLOAD_KEYS = {"device", "pin_memory", "nvme_path", "buffer_count", "fast_init", "pipeline_read",
                 "pipeline_write", "ratio", "buffer_size", "max_in_cpu"}


def _offload(zero: Mapping[str, Any]) -> tuple[str | None, bool]:
    """``offload_optimizer`` (and the legacy ``cpu_offload``) as ``(offload_optimizer,
    offload_pin_memory)`` of `zfunc.Config`; ``offload_param`` on a device is refused."""
    sections = {}
    for key in ("offload_optimizer", "offload_param"):
        sec = zero.get(key) or {}
        if not isinstance(sec, Mapping):
            raise _err(f"zero_optimization.{key}", '{"device": "cpu"} or {"device": "none"}', sec)
        for sub in sec:
            if sub not in _OFFLOAD_KEYS:
                raise ConfigError(f"zero_optimization.{key}.{sub}: zfunc does not implement this key (or it is "
                                  "misspelt); remove it")
        sections[key] = sec
    param = sections["offload_param"].get("device", "none")
    if param not in ("none", None):
        raise _err("zero_optimization.offload_param.device", '"none": parameter offload is not built (zfunc '
                   'offloads the optimizer: set offload_optimizer.device "cpu", and use stage 3 with more ranks '
                   "or shard_size to fit the parameters)", param)
    opt = sections["offload_optimizer"]
    device = opt.get("device", "none")
    if zero.get("cpu_offload") not in (None, False, True):
        raise _err("zero_optimization.cpu_offload", "true or false", zero["cpu_offload"])
    if zero.get("cpu_offload") is True:  # DeepSpeed's older spelling of offload_optimizer.device "cpu"
        device = "cpu" if device in ("none", None) else device
    if device not in ("none", None, "cpu"):
        raise _err("zero_optimization.offload_optimizer.device", '"cpu" or "none" (NVMe offload is not built; '
                   "host memory is what zfunc offloads to)", device)
    if opt.get("ratio", 1.0) != 1.0:
        raise _err("zero_optimization.offload_optimizer.ratio", "1.0 (zfunc offloads all of the optimizer state; "
                   "a partial offload is not built)", opt["ratio"])
    pin = opt.get("pin_memory", False)
    if not isinstance(pin, bool):
        raise _err("zero_optimization.offload_optimizer.pin_memory", "true or false", pin)
    return ("cpu" if device == "cpu" else None), pin


def _refuse_unknown(ds: Mapping[str, Any]) -> None:
    """Every key zfunc does not honour, or honours only at some values, is an error naming it."""
    known = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "torch_autocast",
             "zero_optimization", "data_types", "communication_data_type", "gradient_allreduce_op",
             "managed_gradient_accumulation", *_HARMLESS, *_NUMERIC, *_DIVIDE}
    for key in ds:
        if key not in known:
            raise ConfigError(f"{key}: zfunc does not implement this DeepSpeed key (or it is misspelt), and it may "
                              "change the results; remove it")
    for key, allowed in _NUMERIC.items():
        if key in ds and (ds[key] not in allowed or isinstance(ds[key], bool) != isinstance(allowed[0], bool)):
            raise _err(key, f"{allowed[0]!r} (zfunc averages gradients over ranks in one step, in comm dtype; "
                       "other values change the numbers and are not implemented)", ds[key])
    if not isinstance(ds.get("prescale_gradients", False), bool):
        raise _err("prescale_gradients", "true or false", ds["prescale_gradients"])
    if _number(ds, "", "gradient_predivide_factor", 1.0) <= 0:
        raise _err("gradient_predivide_factor", "a number > 0", ds["gradient_predivide_factor"])
    zero = _section(ds, "zero_optimization")
    for key in zero:
        if key not in _ZERO_HANDLED | _ZERO_HARMLESS | {*_ZERO_ENGINE, "offload_optimizer", "offload_param", "cpu_offload"}:
            raise ConfigError(f"zero_optimization.{key}: zfunc does not implement this key (or it is misspelt); "
                              "remove it")
    for name, keys in _SECTION_KEYS.items():
        sec = _section(ds, name) or (_section(ds, "bfloat16") if name == "bf16" else {})
        for key in sec:
            if key not in keys:
                raise ConfigError(f"{name}.{key}: zfunc does not implement this key (or it is misspelt); remove it")
        for key in ("enabled", "consecutive_hysteresis", "fp16_master_weights_and_grads", "auto_cast",
                    "fp16_master_weights_and_gradients", "bf16_master_weights_and_grads", "bf16_optimizer_states",
                    "check_grad_overflow", "immediate_grad_update"):
            if key in sec and not isinstance(sec[key], bool):
                raise _err(f"{name}.{key}", "true or false", sec[key])
    gather_16bit_on_save(ds)  # its value checked here; the engine reads it
    bf16 = _section(ds, "bf16") or _section(ds, "bfloat16")
    if bf16.get("check_grad_overflow") is False:
        raise _err("bf16.check_grad_overflow", "true (zfunc always skips a step whose gradients are not finite)", False)
    if bf16.get("immediate_grad_update") is True:
        raise _err("bf16.immediate_grad_update", "false (zfunc accumulates gradients until the step)", True)
    sixteen = bool(bf16.get("enabled")) or bool(_section(ds, "fp16").get("enabled"))
    if zero.get("load_from_fp32_weights", True) is not True and (sixteen or not isinstance(
            zero["load_from_fp32_weights"], bool)):
        raise _err("zero_optimization.load_from_fp32_weights", "true (zfunc loads the fp32 master weights a "
                   "checkpoint holds; DeepSpeed's false rebuilds them from the 16-bit weights, which is not "
                   "implemented): remove the key", zero["load_from_fp32_weights"])


def deepspeed_muon_rule(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's choice of the parameters Muon trains: matrices (``ndim >= 2``) whose name holds
    neither "embed" nor "lm_head" (case-insensitive); the rest train with Adam. zfunc's Muon
    takes 2-D parameters only, so a 4-D convolution weight chosen here is an error at init.

    Examples:
        >>> import torch
        >>> w = torch.zeros(4, 4)
        >>> deepspeed_muon_rule("h.0.mlp.weight", w), deepspeed_muon_rule("wte.Embedding.weight", w)
        (True, False)
    """
    return param.ndim >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


_MUON_KEYS = {"lr", "momentum", "weight_decay", "ns_method", "muon_lr", "adam_lr", "betas", "eps", "per_head_muon"}


def _muon(params: dict[str, Any]) -> tuple[AdamConfig, tuple[ParamGroup, ...]]:
    """DeepSpeed's ``"type": "Muon"``: Muon for `deepspeed_muon_rule`'s matrices, AdamW for the
    rest, each half with DeepSpeed's defaults (Muon: lr 0.02, momentum 0.95, weight decay 0;
    Adam: lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight decay 0); ``muon_lr``/``adam_lr``
    override the shared ``lr``."""
    unknown = sorted(set(params) - _MUON_KEYS)
    if unknown:
        raise _err("optimizer.params", f"keys of Muon: {', '.join(sorted(_MUON_KEYS))}", unknown)
    if params.get("ns_method", "standard") != "standard":
        raise _err("optimizer.params.ns_method", '"standard" (zfunc runs the standard quintic Newton-Schulz of '
                   'torch.optim.Muon; DeepSpeed\'s "gram" is a faster fp16 evaluation of the same iteration)',
                   params["ns_method"])
    if params.get("per_head_muon"):
        raise _err("optimizer.params.per_head_muon", "false (zfunc orthogonalizes each matrix whole)", True)
    shared_wd = params.get("weight_decay", 0.0)
    betas = params.get("betas", (0.9, 0.95))
    if not isinstance(betas, (list, tuple)):
        raise _err("optimizer.params.betas", "a list of two numbers", betas)
    try:
        adam = AdamConfig(lr=params.get("adam_lr", params.get("lr", 3e-4)), betas=tuple(betas),
                          eps=params.get("eps", 1e-10), weight_decay=shared_wd)
        muon = MuonConfig(lr=params.get("muon_lr", params.get("lr", 0.02)), momentum=params.get("momentum", 0.95),
                          weight_decay=shared_wd)
    except ConfigError as e:
        raise ConfigError(str(e).replace("optimizer.", "optimizer.params.", 1)) from None
    return adam, (ParamGroup(deepspeed_muon_rule, optimizer=muon),)


def _optimizer(ds: Mapping[str, Any]) -> tuple[Any, tuple[ParamGroup, ...]]:
    """The optimizer record of the ``optimizer`` section (DeepSpeed's names for Adam, AdamW, SGD,
    Lion, Adagrad and Muon, case-insensitive, each with its own ``params``), and the parameter
    groups it implies (Muon's matrices)."""
    sec = _section(ds, "optimizer")
    kind = str(sec.get("type", "AdamW"))
    params = dict(sec.get("params") or {})
    if kind.lower() == "muon":
        return _muon(params)
    if "max_grad_norm" in params:
        raise ConfigError("optimizer.params.max_grad_norm: not supported; use the top-level gradient_clipping")
    record, accepted = {"adam": (AdamConfig, _ADAM_KEYS), "adamw": (AdamConfig, _ADAM_KEYS),
                        "sgd": (SGDConfig, {"lr", "momentum", "dampening", "weight_decay", "nesterov"}),
                        "lion": (LionConfig, {"lr", "betas", "weight_decay"}),
                        "adagrad": (AdagradConfig, {"lr", "lr_decay", "weight_decay", "eps",
                                                    "initial_accumulator_value"})}.get(kind.lower(), (None, None))
    if record is None:
        raise _err("optimizer.type", '"Adam", "AdamW", "SGD", "Lion", "Adagrad" or "Muon" (what zfunc implements)',
                   kind)
    if record is AdamConfig:
        # DeepSpeed: "Adam" means AdamW unless adam_w_mode is false.
        mode = _bool(params.pop("adam_w_mode", True), "optimizer.params.adam_w_mode")
        decoupled = mode if kind.lower() == "adam" else True  # (DeepSpeed's AdamW ignores adam_w_mode)
        if _bool(params.pop("torch_adam", False), "optimizer.params.torch_adam") and decoupled:
            params.setdefault("weight_decay", 0.01)  # DeepSpeed builds torch.optim.AdamW then: its default
        params["decoupled"] = decoupled
        accepted = accepted | {"decoupled"}
    elif record is LionConfig:  # DeepSpeed's FusedLion / DeepSpeedCPULion defaults (zfunc.lion's are the paper's)
        params.setdefault("lr", 1e-3)
        params.setdefault("betas", (0.9, 0.999))
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise _err("optimizer.params", f"keys of {kind}: {', '.join(sorted(accepted - {'decoupled'}))}", unknown)
    if "betas" in params:
        if not isinstance(params["betas"], (list, tuple)):
            raise _err("optimizer.params.betas", "a list of two numbers", params["betas"])
        params["betas"] = tuple(params["betas"])
    if "nesterov" in params:
        _bool(params["nesterov"], "optimizer.params.nesterov")
    try:
        return record(**params), ()
    except ConfigError as e:
        raise ConfigError(str(e).replace("optimizer.", "optimizer.params.", 1)) from None


_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay"}


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise _err(path, "true or false", v)
    return v


# The config ``scheduler.type`` values zfunc reads (DeepSpeed's ``VALID_LR_SCHEDULES``).
SCHEDULER_TYPES = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _scheduler(ds: Mapping[str, Any], lr: float) -> Any:
    sec = _section(ds, "scheduler")
    if not sec:
        return None
    kind, params = sec.get("type"), dict(sec.get("params") or {})
    factories = {"WarmupLR": schedules.warmup_lr, "WarmupDecayLR": schedules.warmup_decay_lr,
                 "WarmupCosineLR": schedules.warmup_cosine_lr}
    if kind in ("OneCycle", "LRRangeTest"):
        raise ConfigError(f"scheduler.type: {kind} runs in the engine (zfunc.initialize, on the optimizer it "
                          "returns); a zfunc.Config schedules the learning rate only: use a zfunc.schedules "
                          "formula, or set lr and betas per step with zfunc.set_hyperparams")
    if kind not in factories:
        raise _err("scheduler.type", f"one of {sorted(factories)} (OneCycle and LRRangeTest: in the engine)", kind)
    for key in ("warmup_min_lr", "warmup_max_lr"):
        if key in params and not is_finite_number(params[key]):
            raise _err(f"scheduler.params.{key}", "a number (zfunc takes no per-group lists: give each "
                       "ParamGroup its lr, and leave warmup_max_lr out for WarmupLR to rise to each group's own)",
                       params[key])
    last = params.pop("last_batch_iteration", -1)
    if not (isinstance(last, int) and not isinstance(last, bool) and last >= -1):
        raise _err("scheduler.params.last_batch_iteration", "an integer of at least -1", last)
    top: float | None = None
    if kind == "WarmupCosineLR":
        params["lr"] = lr  # a share of each group's lr
    elif kind == "WarmupLR":  # each group's own lr unless given (DeepSpeed 0.19)
        top = params.get("warmup_max_lr")
        params.setdefault("warmup_max_lr", lr)
    else:  # WarmupDecayLR: 0.001 unless given, every group alike (DeepSpeed 0.19)
        top = params.setdefault("warmup_max_lr", 0.001)
    accepted = set(inspect.signature(factories[kind]).parameters)
    for key in params:
        if key not in accepted:
            raise ConfigError(f"scheduler.params.{key}: not a parameter of {kind} (it takes "
                              f"{', '.join(sorted(accepted - {'lr'}))})")
    try:
        inner = factories[kind](**params)
    except TypeError as e:
        raise ConfigError(f"scheduler.params: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"scheduler.params.{e}") from None
    return _DeepSpeedSchedule(inner, kind, float(params.get("warmup_min_lr", 0.0)), top, lr, last + 1)


@dataclasses.dataclass(frozen=True)
class _DeepSpeedSchedule:
    """A DeepSpeed scheduler of the config as its object steps (``deepspeed.runtime.lr_schedules``,
    0.19): made before the first update with ``last_batch_iteration`` -1, it sets each group's lr
    to its value there (``warmup_min_lr``; 0 for ``WarmupCosineLR``), and steps after each update,
    so update ``u >= 1`` uses the formula at ``u - 1``; made at ``last_batch_iteration = k``, the
    first update keeps each group's own lr and update ``u`` uses the formula at ``k + u``
    (``start = k + 1``). Per group: ``WarmupCosineLR`` scales each group's lr; ``WarmupLR`` rises
    from ``warmup_min_lr`` to ``warmup_max_lr`` (``top``) for every group, or to each group's own
    lr when none was given; ``WarmupDecayLR`` likewise (``top`` 0.001 when not given)."""

    formula: Any  # the zfunc.schedules schedule (its ``gamma`` or ``ratio``)
    kind: str
    bottom: float
    top: float | None
    lr: float  # the optimizer's (the first group's)
    start: int

    def per_group(self, step: Any, lrs: torch.Tensor) -> torch.Tensor:
        """Each group's lr at applied update ``step``, the groups' own lrs ``lrs``."""
        u = torch.as_tensor(step)
        lrs = lrs.to(u.device, torch.float64)
        t = torch.clamp(u - 1 + self.start, min=0)
        if self.kind == "WarmupCosineLR":
            now = lrs * self.formula.ratio(t)
            first = lrs if self.start else torch.zeros_like(lrs)
        else:
            top = lrs if self.top is None else torch.full_like(lrs, self.top)
            now = self.bottom + (top - self.bottom) * self.formula.gamma(t)
            first = lrs if self.start else torch.full_like(lrs, self.bottom)
        return torch.where(u < 1, first, now)

    def __call__(self, step: Any) -> torch.Tensor:
        return self.per_group(step, torch.tensor([self.lr], dtype=torch.float64))[0]


def _dtype(v: Any, path: str) -> torch.dtype:
    if isinstance(v, torch.dtype):
        return v
    if str(v) not in _DTYPES:
        raise _err(path, '"fp32", "fp16" or "bf16"', v)
    return _DTYPES[str(v)]


def _shard_size(zero: Mapping[str, Any], stage: int) -> int | None:
    """``mics_shard_size`` as `zfunc.Config.shard_size` (-1, DeepSpeed's default, is off)."""
    hpz = zero.get("zero_hpz_partition_size", 1)
    if hpz != 1:
        raise _err("zero_optimization.zero_hpz_partition_size", "1: ZeRO++ hierarchical partitioning (a second, "
                   "per-node copy of the parameters beside world-wide sharding) is not built; use "
                   "mics_shard_size (zfunc's shard_size: shard within the node, replicate across nodes)", hpz)
    k = zero.get("mics_shard_size", -1)
    if k == -1:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise _err("zero_optimization.mics_shard_size", "-1 (off) or a positive integer dividing the world size", k)
    if stage == 0:
        raise _err("zero_optimization.mics_shard_size", "-1 at stage 0, which shards nothing (or use stage 1-3)", k)
    return k


def _reduce_op(op: Any) -> str:
    """DeepSpeed's ``gradient_allreduce_op`` as `zfunc.Config.grad_reduce`."""
    if op in ("mean", "avg"):
        return "mean"
    if op == "sum":
        return "sum"
    raise _err("gradient_allreduce_op", '"avg", "mean" or "sum"', op)


def read_config(ds: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    """A DeepSpeed config as a dict (read from a JSON path)."""
    if isinstance(ds, (str, os.PathLike)):
        with open(ds) as f:
            ds = json.load(f)
    if not isinstance(ds, Mapping):
        raise ConfigError(f"config: expected a dict or a JSON file path, got {type(ds).__name__}")
    return ds


def translate(ds: Mapping[str, Any] | str | os.PathLike,
              world_size: int = 1) -> tuple[dict[str, Any], BatchSizes]:
    """The `zfunc.Config` fields and the batch sizes of a DeepSpeed config (a dict or a JSON path).

    Examples:
        >>> from zfunc.core.deepspeed_config import translate
        >>> fields, sizes = translate({
        ...     "train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
        ...     "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        ...     "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, world_size=2)
        >>> fields["stage"], fields["grad_accum"], fields["precision"], fields["clip"], sizes.micro_batch_size
        (2, 2, 'bf16', 1.0, 8)
    """
    ds = read_config(ds)
    _refuse_unknown(ds)
    zero = _section(ds, "zero_optimization")
    offload, pin = _offload(zero)  # checked with the other keys, before anything is warned about
    harmless = [k for k in ds if k in _HARMLESS or k in _DIVIDE]
    harmless += [f"zero_optimization.{k}" for k in zero if k in _ZERO_HARMLESS]
    harmless += [f"zero_optimization.{sec}.{k}" for sec in ("offload_optimizer", "offload_param")
                 for k in (zero.get(sec) or {}) if k not in ("device", "pin_memory", "ratio")]
    if harmless:
        warnings.warn(f"zfunc accepts and does not use these DeepSpeed config keys (they change no numbers): "
                      f"{', '.join(sorted(harmless))}", stacklevel=3)

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise _err("world_size", "a positive integer", world_size)
    sizes = batch_sizes(ds, world_size)
    if not isinstance(ds.get("managed_gradient_accumulation", True), bool):
        raise _err("managed_gradient_accumulation", "true or false", ds["managed_gradient_accumulation"])
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise _err("zero_optimization.stage", "one of 0, 1, 2, 3", stage)
    clip = _number(ds, "", "gradient_clipping", 1.0)
    persist = int(_number(zero, "zero_optimization", "stage3_param_persistence_threshold", 100_000))
    shard_size = _shard_size(zero, stage)
    optimizer, groups = _optimizer(ds)
    if groups and _section(ds, "scheduler").get("type", "WarmupCosineLR") != "WarmupCosineLR":
        raise _err("scheduler.type", "WarmupCosineLR with Muon (DeepSpeed's WarmupLR and WarmupDecayLR set the Muon "
                   "and Adam halves to one learning rate; WarmupCosineLR scales each half's own)",
                   _section(ds, "scheduler")["type"])

    fp16, bf16 = _section(ds, "fp16"), _section(ds, "bf16") or _section(ds, "bfloat16")
    auto = _section(ds, "torch_autocast")
    if fp16.get("enabled") and bf16.get("enabled"):
        raise ConfigError("fp16.enabled and bf16.enabled: both are true; enable one of them")
    precision, master, moments, loss_scale = "fp32", torch.float32, torch.float32, None
    if fp16.get("enabled"):
        precision = "fp16"
        static = _number(fp16, "fp16", "loss_scale", 0.0)
        if static > FLOAT32_MAX:
            raise _err("fp16.loss_scale", "0 (dynamic) or a number up to 3.4e38", fp16["loss_scale"])
        if static > 0:
            loss_scale = static
        else:
            power = _number(fp16, "fp16", "initial_scale_power", 16)
            if power > 127:  # 2**128 is past float32's range: every step would overflow
                raise _err("fp16.initial_scale_power", "a number in [0, 127]", fp16["initial_scale_power"])
            consecutive = _bool(fp16.get("consecutive_hysteresis", False), "fp16.consecutive_hysteresis")
            try:
                loss_scale = DynamicLossScale(
                    init=2.0**power, window=fp16.get("loss_scale_window", 1000), hysteresis=fp16.get("hysteresis", 2),
                    min_scale=fp16.get("min_loss_scale", 1), consecutive_hysteresis=consecutive)
            except ConfigError as e:
                raise ConfigError("fp16." + str(e).replace("loss_scale.window", "loss_scale_window")
                                  .replace("loss_scale.min_scale", "min_loss_scale")
                                  .replace("loss_scale.hysteresis", "hysteresis")) from None
        if fp16.get("fp16_master_weights_and_gradients") or fp16.get("fp16_master_weights_and_grads"):
            master = torch.float16
    elif bf16.get("enabled"):
        precision = "bf16"
        if bf16.get("bf16_master_weights_and_grads"):
            master = torch.bfloat16
        if bf16.get("bf16_optimizer_states"):
            if master != torch.bfloat16:
                raise ConfigError("bf16.bf16_optimizer_states: needs bf16.bf16_master_weights_and_grads true")
            moments = torch.bfloat16
    autocast = None
    if auto.get("enabled"):
        autocast = _dtype(auto.get("dtype") or "bf16", "torch_autocast.dtype")
        if autocast == torch.float16 and precision == "bf16":
            raise _err("torch_autocast.dtype", "bf16 with bf16.enabled (bf16 weights; fp16 autocast would compute "
                       "below their range), or fp16 with fp16.enabled or neither", auto.get("dtype"))
        if autocast == torch.float16 and loss_scale is None:  # DeepSpeed's optimizers take a GradScaler() then
            loss_scale = DynamicLossScale.grad_scaler()
    types = _section(ds, "data_types")
    compute = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    # DeepSpeed accumulates micro-batch gradients in the model's dtype unless grad_accum_dtype says otherwise
    accum = _dtype(types["grad_accum_dtype"], "data_types.grad_accum_dtype") if types.get("grad_accum_dtype") \
        else compute
    if types.get("param_dtype") is not None and _dtype(types["param_dtype"], "data_types.param_dtype") != compute:
        raise _err("data_types.param_dtype", f"the enabled precision's dtype ({str(compute)[6:]}; DeepSpeed refuses "
                   "another too): set it to match fp16/bf16 'enabled', or leave it out", types["param_dtype"])
    buffers = _dtype(types["buffer_dtype"], "data_types.buffer_dtype") if types.get("buffer_dtype") else None
    if buffers is not None and types.get("keep_in_fp32_modules", "auto") != []:
        raise _err("data_types.keep_in_fp32_modules", "[] with data_types.buffer_dtype (zfunc casts every floating "
                   "buffer to buffer_dtype; keep buffers in their own dtype by leaving buffer_dtype out)",
                   types.get("keep_in_fp32_modules", "auto"))
    if types.get("keep_in_fp32_modules", "auto") not in ("auto", []):
        raise _err("data_types.keep_in_fp32_modules", '"auto" or [] (without buffer_dtype every buffer keeps its '
                   "own dtype already)", types["keep_in_fp32_modules"])
    # DeepSpeed reduces gradients in the model's dtype unless communication_data_type says otherwise
    comm_dtype = _dtype(ds["communication_data_type"], "communication_data_type") \
        if ds.get("communication_data_type") else (compute if compute != torch.float32 else None)
    fields = dict(stage=stage, precision=precision, optimizer=optimizer, param_groups=groups,
                  grad_accum=sizes.grad_accum,
                  clip=clip or None, loss_scale=loss_scale, master_dtype=master, moment_dtype=moments,
                  grad_accum_dtype=accum,
                  comm_dtype=comm_dtype,
                  autocast=autocast, lr_schedule=_scheduler(ds, optimizer.lr), persist_threshold=persist,
                  shard_size=shard_size, offload_optimizer=offload, offload_pin_memory=pin,
                  grad_reduce=_reduce_op(ds.get("gradient_allreduce_op", "mean")), buffer_dtype=buffers)
    return fields, sizes
