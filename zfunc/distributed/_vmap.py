"""`torch.func.vmap` through zfunc's autograd Functions.

zfunc's Functions work on the state's tensors (the compute buffer, sinks, collectors), which a
user's ``vmap`` over the bound model never batches. So one rule serves them all: apply the
Function to the inputs as they are, and an output is batched along the dim of its one batched
input.
"""

from __future__ import annotations

from typing import Any

import torch

from zfunc._probes import in_transform, unwrap_dead

__all__ = ["VmapAsIs"]


class VmapAsIs:
    """Mixin for an ``autograd.Function`` (before it in the bases) giving it the rule above.

    Examples:
        >>> import torch
        >>> class Twice(VmapAsIs, torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(x):
        ...         return x * 2
        ...     @staticmethod
        ...     def setup_context(ctx, inputs, output):
        ...         pass
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         return g * 2
        >>> torch.func.vmap(Twice.apply)(torch.ones(3, 2)).shape
        torch.Size([3, 2])
    """

    @classmethod
    def apply(cls, *args: Any) -> Any:
        """torch's ``Function.apply`` without the signature binding it does on every call of a
        Function with ``setup_context`` (``inspect.signature``, about 70 us on a CPU: more than
        the rest of the call). zfunc's Functions take every argument positionally, with no
        defaults, so there is nothing to bind; under a ``torch.func`` transform torch's own
        path runs."""
        if in_transform():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*unwrap_dead(args))

    @classmethod
    def vmap(cls, info: Any, in_dims: tuple, *args: Any) -> tuple[Any, Any]:
        del info
        batched = [d for d in in_dims if d is not None]
        if len(batched) > 1:
            raise NotImplementedError(f"zfunc's {cls.__name__} under torch.func.vmap takes one batched input")
        out = cls.apply(*args)
        dim = batched[0] if batched else None
        if isinstance(out, tuple):
            return out, tuple(dim if isinstance(o, torch.Tensor) else None for o in out)
        return out, dim
