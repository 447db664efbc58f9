"""``deepspeed.checkpointing``: activation checkpointing as DeepSpeed's module offers it, on
``torch.utils.checkpoint`` (reentrant, as DeepSpeed's ``checkpoint`` is). zfunc recomputes a
checkpointed block through the same gathers and gradient taps as its forward; DeepSpeed's extra
memory options (activations partitioned across ranks, kept on the CPU, contiguous buffers) are
not implemented and are refused by name."""

from __future__ import annotations

from typing import Any

import torch.utils.checkpoint

from zfunc.errors import ConfigError

__all__ = ["checkpoint", "configure", "is_configured"]

_configured = False


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's ``checkpointing.configure``: with every memory option off (their default),
    nothing to set; an option on is refused.

    Examples:
        >>> from zfunc.compat import checkpointing
        >>> checkpointing.configure(None, partition_activations=False)
        >>> checkpointing.configure(None, checkpoint_in_cpu=True)
        Traceback (most recent call last):
        ...
        zfunc.errors.ConfigError: checkpointing.configure: checkpoint_in_cpu=True is not implemented ...
    """
    global _configured
    del deepspeed_config, num_checkpoints, synchronize, profile  # change neither numbers nor memory here
    if mpu_ is not None:
        raise ConfigError("checkpointing.configure: mpu_ is not supported (zfunc has no model parallelism)")
    for name, value in (("partition_activations", partition_activations),
                        ("contiguous_checkpointing", contiguous_checkpointing),
                        ("checkpoint_in_cpu", checkpoint_in_cpu)):
        if value:
            raise ConfigError(f"checkpointing.configure: {name}=True is not implemented by zfunc; leave it off "
                              "(activations are recomputed on each rank, in device memory)")
    _configured = True


def is_configured() -> bool:
    """Whether `configure` was called."""
    return _configured


def checkpoint(function: Any, *args: Any) -> Any:
    """DeepSpeed's ``checkpointing.checkpoint(function, *args)``: ``function(*args)`` with its
    activations recomputed in backward (``torch.utils.checkpoint``, reentrant)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)
