"""``deepspeed.zero`` names: `Init`, DeepSpeed's way of building a model too big for one rank.

Under `Init` a model is built on the ``meta`` device (no memory, no values); `zfunc.init` and
`zfunc.initialize` then materialize it one unit at a time, each rank keeping only its shard
(`zfunc.core.materialize`). FSDP2 users write ``with torch.device("meta"):`` for the same.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from zfunc.errors import ConfigError

__all__ = ["Init"]

# DeepSpeed's keywords that zfunc takes as they are (their values change nothing here), with the
# values it can honour; anything else is refused by name.
_ACCEPTED = {"module": (None,), "data_parallel_group": None, "mem_efficient_linear": (True, False),
             "remote_device": (None, "cuda", "cpu_no_offload"), "pin_memory": (False, True),
             "config_dict_or_path": None, "config": None, "enabled": (True, False), "dtype": (None,), "mpu": (None,)}


class Init(contextlib.AbstractContextManager):
    """Build the model inside on the ``meta`` device, as ``deepspeed.zero.Init()`` partitions it
    at construction.

    ``enabled=False`` builds normally. DeepSpeed's other keywords are accepted where they change
    nothing here (``config_dict_or_path``, ``data_parallel_group``, ``mem_efficient_linear``,
    ``pin_memory``); ``dtype``, ``module`` (converting a built model) and a ``remote_device`` of
    ``"cpu"`` or ``"nvme"`` are refused with what to do instead.

    Examples:
        >>> import torch, zfunc
        >>> with zfunc.zero.Init():
        ...     model = torch.nn.Linear(4, 2)
        >>> model.weight.is_meta
        True
        >>> state = zfunc.init(model, zfunc.Config(stage=3))
        >>> state.params.shape, model.weight.is_meta
        (torch.Size([12]), True)
    """

    def __init__(self, **kwargs: Any):
        for key, value in kwargs.items():
            if key not in _ACCEPTED:
                raise ConfigError(f"zero.Init: {key!r} is not a keyword zfunc takes (it takes {sorted(_ACCEPTED)})")
            allowed = _ACCEPTED[key]
            if allowed is not None and value not in allowed:
                hint = {"dtype": "build the model in its own dtype and set the config's precision",
                        "module": "build the model inside the context instead",
                        "remote_device": "use offload_optimizer in the config; parameters are not offloaded"}[key]
                raise ConfigError(f"zero.Init: {key}={value!r} is not supported: {hint}")
        self.enabled = kwargs.get("enabled", True)
        self._device: Any = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._device = torch.device("meta")
            self._device.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None
