"""``deepspeed.initialize`` and its companions: a DeepSpeed config (or a `zfunc.Config`) and a
model become a `zfunc.Engine`; ``init_distributed`` and ``add_config_arguments`` as DeepSpeed's."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from zfunc.core.deepspeed_config import read_config, translate
from zfunc.compat.engine import Engine
from zfunc.compat.optimizer_view import plan_groups
from zfunc.compat.schedulers import SCHEDULERS, OneCycle
from zfunc.core.config import Config
from zfunc.core.materialize import on_meta
from zfunc.core.optim import OPTIMIZERS
from zfunc.distributed import comm
from zfunc.errors import ConfigError, DeepSpeedAssertion

__all__ = ["initialize", "init_distributed", "add_config_arguments"]


def initialize(model: torch.nn.Module, config: Mapping[str, Any] | str | os.PathLike | Config | None = None,
               model_parameters: Iterable[torch.nn.Parameter] | None = None, optimizer: Any = None,
               lr_scheduler: Any = None, *, group: comm.Group | None = None,
               **kwargs: Any) -> tuple[Engine, Any, None, Any]:
    """``deepspeed.initialize`` for zfunc: ``(engine, optimizer, None, lr_scheduler)``.

    Args:
        model: the module.
        config: a DeepSpeed config dict or JSON path (or a `zfunc.Config`).
        model_parameters: the parameters to train (the module's others stay fixed), or parameter
            groups: dicts with ``params`` and any of ``lr``, ``weight_decay``, ``betas``, ``eps``
            (other values come from the config's optimizer).
        optimizer: ``None`` (the config's), a `zfunc.adamw(...)`, or a torch Adam/AdamW: each of
            its parameter groups becomes a zfunc group with that group's hyperparameters; a group
            key zfunc cannot honour is a `ConfigError`.
        lr_scheduler: ``None`` (the config's ``scheduler``, if any), a torch ``LRScheduler``
            (built on ``optimizer``), or a callable taking the returned optimizer and returning
            one; it is stepped after each applied optimizer step, as DeepSpeed does.
        group: the ranks (default: the world).
        **kwargs: DeepSpeed's other keywords: ``config_params`` (``config``'s older name),
            ``args`` (its ``deepspeed_config`` is the config when ``config`` is not given),
            ``dist_init_required`` (``False``: the process group must be initialised already;
            otherwise it is initialised from the environment as needed), ``distributed_port``
            (taken from the environment, as torchrun sets it); ``training_data``,
            ``collate_fn``, ``mpu`` and ``mesh_param`` are refused (zfunc builds no data loader
            and has no model parallelism).

    Examples:
        >>> import torch, zfunc
        >>> engine, optimizer, _, scheduler = zfunc.initialize(
        ...     model=torch.nn.Linear(3, 1), config={"train_micro_batch_size_per_gpu": 2})
        >>> engine.cfg.stage, engine.config["train_micro_batch_size_per_gpu"], scheduler
        (0, 2, None)
    """
    config = _deepspeed_keywords(config, kwargs)
    group = group or comm.world()
    batch, managed, engine_scheduler, ds = None, True, None, None
    if isinstance(config, Config):
        cfg = config
    else:
        ds = read_config(config or {"train_micro_batch_size_per_gpu": 1})
        run, engine_scheduler = _engine_scheduler(ds, lr_scheduler)
        fields, batch = translate(run, world_size=group.size)
        cfg = Config(**fields)
        managed = ds.get("managed_gradient_accumulation", True)  # an engine setting (checked by translate)
    several = isinstance(optimizer, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in optimizer)
    if optimizer is not None and not (several or isinstance(optimizer, (*OPTIMIZERS, torch.optim.Optimizer))):
        raise ConfigError(f"optimizer: expected None, a zfunc optimizer (zfunc.adamw(...), sgd, lion, adagrad, muon), "
                          f"a torch.optim.Adam/AdamW/SGD/Adagrad/Muon or a list of them, got {type(optimizer).__name__}")
    fp32_states = [o for o in (optimizer if several else [optimizer]) if getattr(o, "fp32_optimizer_states", False)]
    if fp32_states and cfg.moment_dtype == torch.bfloat16:
        raise DeepSpeedAssertion("optimizer: a DeepSpeedCPUAdam built with fp32_optimizer_states=True keeps fp32 "
                                 "moments, but bf16.bf16_optimizer_states asks for bf16 ones; build it with "
                                 "fp32_optimizer_states=False, or leave bf16_optimizer_states out")
    plan = plan_groups(model, cfg.optimizer, optimizer=optimizer, model_parameters=model_parameters)
    if cfg.param_groups and plan.dicts is not None:  # DeepSpeed's Muon config made its groups
        if optimizer is not None or len(plan.groups) > 1 or plan.groups[0].values():
            raise ConfigError("optimizer: DeepSpeed's Muon config splits the parameters itself; pass no optimizer "
                              "and model_parameters as a plain list (no group dicts), or build a zfunc.Config with "
                              "zfunc.ParamGroup(..., optimizer=zfunc.muon(...))")
        cfg, plan = cfg.replace(freeze=plan.freeze), dataclasses.replace(plan, dicts=None)
    elif plan.dicts is not None:
        cfg = cfg.replace(optimizer=plan.optimizer, param_groups=plan.groups, freeze=plan.freeze)
    elif isinstance(optimizer, OPTIMIZERS):
        cfg = cfg.replace(optimizer=optimizer)
    if engine_scheduler is not None:  # DeepSpeed's OneCycle/LRRangeTest: checked now, built on the view
        cls, params = engine_scheduler
        groups = len(plan.dicts) if plan.dicts is not None else max(1, len(cfg.param_groups))
        cls(types.SimpleNamespace(param_groups=[{"lr": 0.0, "betas": (0.9, 0.999)} for _ in range(groups)]),
            **params)
        lr_scheduler = functools.partial(cls, **params)
    previous = _engine_of(model)
    if previous is not None:  # DeepSpeed lets a second engine take a module over, weights and all
        previous.destroy()  # its weights go back into the module first
    if torch.cuda.is_available() and not on_meta(model):  # DeepSpeed moves the module to its device
        model.to(torch.device("cuda", torch.cuda.current_device()))
    engine = Engine(model, cfg, group=group, batch=batch, optimizer_groups=plan.dicts, lr_scheduler=lr_scheduler,
                    managed=managed, deepspeed_masters=not isinstance(config, Config), ds_config=ds)
    return engine, engine.optimizer, None, engine.lr_scheduler


def _engine_of(model: torch.nn.Module) -> Engine | None:
    """The live engine whose module ``model`` is, if any."""
    from zfunc.compat.utils import owned, owner_of

    first = next(iter(model.parameters()), None)
    return owner_of(first)[0] if first is not None and owned(first) else None


def _deepspeed_keywords(config: Any, kwargs: dict[str, Any]) -> Any:
    """The config, after DeepSpeed's other `initialize` keywords are read or refused."""
    config_params = kwargs.pop("config_params", None)
    if config is None:  # DeepSpeed's: config wins when both are given
        config = config_params
    args = kwargs.pop("args", None)
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise ConfigError("initialize: a config came both as config= and as args.deepspeed_config; pass one")
        config = from_args
    required = kwargs.pop("dist_init_required", None)
    if required is False and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ConfigError("initialize: dist_init_required=False, but no process group is initialised; call "
                          "zfunc.init_distributed() (or torch.distributed.init_process_group) first, or leave it out")
    kwargs.pop("distributed_port", None)  # torchrun's MASTER_PORT is what the process group uses
    refused = {"training_data": "build the DataLoader yourself (zfunc returns None in its place)",
               "collate_fn": "build the DataLoader yourself (zfunc returns None in its place)",
               "mpu": "zfunc has no model parallelism; pass group= for the data-parallel ranks",
               "mesh_param": "zfunc has no model parallelism; pass group= for the data-parallel ranks"}
    for key in list(kwargs):
        if key in refused and kwargs[key] is None:
            del kwargs[key]
    for key in kwargs:
        if key in refused:
            raise ConfigError(f"initialize: {key} is not supported: {refused[key]}")
    if kwargs:
        raise TypeError(f"initialize: unexpected arguments {sorted(kwargs)}")
    return config


def _engine_scheduler(ds: dict[str, Any], lr_scheduler: Any) -> tuple[dict[str, Any], Any]:
    """``ds`` without a ``OneCycle``/``LRRangeTest`` scheduler section, and ``(class, params)`` for
    it (these run in the engine, on the returned optimizer; a `zfunc.Config` has no counterpart)."""
    sec = ds.get("scheduler") or {}
    cls = SCHEDULERS.get(sec.get("type")) if isinstance(sec, dict) else None
    if cls is None:
        return ds, None
    if lr_scheduler is not None:
        raise ConfigError("lr_scheduler: the config has a 'scheduler' section too; use one of them")
    params = dict(sec.get("params") or {})
    accepted = set(inspect.signature(cls).parameters) - {"optimizer"}
    for key in params:
        if key not in accepted:
            raise ConfigError(f"scheduler.params.{key}: not a parameter of {sec['type']} (it takes "
                              f"{', '.join(sorted(accepted))})")
    if cls is OneCycle:
        for key in ("cycle_min_lr", "cycle_max_lr"):
            if key not in params:
                raise ConfigError(f"scheduler.params.{key}: OneCycle needs it (DeepSpeed's has no default)")
    return {k: v for k, v in ds.items() if k != "scheduler"}, (cls, params)


def init_distributed(dist_backend: str | None = None, timeout: Any = None, init_method: str | None = None,
                     **kwargs: Any) -> None:
    """``deepspeed.init_distributed``: initialise the default process group from the
    environment (torchrun, the DeepSpeed launcher, Ray Train all set it); never twice.
    ``timeout`` and ``init_method`` go to ``torch.distributed.init_process_group``; DeepSpeed's
    other keywords (``distributed_port``, ``auto_mpi_discovery``, ``verbose``, ...) are read from
    the environment by torch instead.

    Examples:
        >>> import zfunc
        >>> zfunc.init_distributed()      # a world of one: nothing to do
    """
    del kwargs
    comm.init_from_env(dist_backend, timeout=timeout, init_method=init_method)


def add_config_arguments(parser: Any) -> Any:
    """``deepspeed.add_config_arguments``: add ``--deepspeed``, ``--deepspeed_config`` and
    ``--local_rank`` (which the DeepSpeed launcher passes) to an argparse parser.

    Examples:
        >>> import argparse, zfunc
        >>> p = zfunc.add_config_arguments(argparse.ArgumentParser())
        >>> p.parse_args(["--deepspeed_config", "ds.json", "--local_rank=0"]).deepspeed_config
        'ds.json'
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed-compatible configuration (zfunc)")
    group.add_argument("--deepspeed", default=False, action="store_true", help="use the DeepSpeed config")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config file")
    group.add_argument("--local_rank", "--local-rank", default=-1, type=int, help="set by launchers")
    return parser
