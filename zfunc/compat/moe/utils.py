"""``deepspeed.moe.utils``: what DeepSpeed-style training code calls on any model.

DeepSpeed's checkpoint and training examples pass their parameter groups through
`split_params_into_different_moe_groups_for_optimizer`, which splits expert parameters into
groups of their own. zfunc trains dense models only (no expert parallelism): groups without
expert parameters come back as they are, and an expert parameter is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from zfunc.errors import ConfigError

__all__ = ["split_params_into_different_moe_groups_for_optimizer", "is_moe_param"]


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether DeepSpeed marks ``param`` as an expert parameter (``param.allreduce is False``).

    Examples:
        >>> import torch
        >>> is_moe_param(torch.nn.Linear(2, 2).weight)
        False
    """
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | None = 178956971
                                                         ) -> list[dict[str, Any]]:
    """DeepSpeed's parameter-group splitter: ``param_groups`` (a group dict, or a list or tuple of
    them) as a list of groups, unchanged when no parameter is an expert's.

    Raises:
        ConfigError: a parameter is an expert's (zfunc has no expert parallelism).

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> groups = split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "lr": 0.1})
        >>> len(groups), len(groups[0]["params"]), groups[0]["lr"]
        (1, 2, 0.1)
    """
    if isinstance(param_groups, Mapping):
        param_groups = [param_groups]
    if not isinstance(param_groups, (list, tuple)):
        raise ConfigError(f"param_groups: expected a dict or a list/tuple of dicts, got {type(param_groups).__name__}")
    out = []
    for i, group in enumerate(param_groups):
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params) if isinstance(params, Iterable) else []
        experts = [k for k, p in enumerate(params) if is_moe_param(p)]
        if experts:
            raise ConfigError(f"param_groups[{i}]: parameters {experts[:5]} are experts' (allreduce=False): zfunc "
                              "trains dense models only, with no expert parallelism")
        out.append({**group, "params": params})
    return out
