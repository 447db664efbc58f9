"""The differentiable `unit_params`: the whole of ZeRO in autograd.

A unit's full parameters in forward (all-gathered at stage 3), its gradient delivered to a
*sink* in backward (the transpose of the all-gather is a reduce-scatter), so gradients reach
their owners in whatever way backward is started (``torch.autograd.grad``, ``loss.backward()``,
``out.backward(g)``). Served as ``zfunc.comm.unit_params``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zfunc.distributed._vmap import VmapAsIs
from zfunc.distributed.comm import Group, all_gather, reduce_scatter
from zfunc.distributed.widen import widened
from zfunc.errors import refuse_create_graph

__all__ = ["unit_params"]


class _UnitParams(VmapAsIs, torch.autograd.Function):
    """A unit's full flat parameters in forward; its gradient delivered to ``sink`` in backward.

    Forward returns ``full`` when it already exists (stages 0-2), else all-gathers ``shard``
    (stage 3). Backward sends the gradient to ``sink`` (a zero-cost, shard- or full-shaped leaf
    in the accumulation dtype): reduce-scattered, summed over ranks, when ``scatter`` (stages 2-3,
    the transpose of the all-gather), else as it is.
    """

    @staticmethod
    def forward(sink: torch.Tensor, shard: torch.Tensor | None, full: torch.Tensor | None,
                group: Group, reduce_dtype: torch.dtype, scatter: bool,
                factor: Callable[[], float] | None = None) -> torch.Tensor:
        if full is None:
            return all_gather(shard, group)
        return full.view_as(full)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        sink, _, _, ctx.group, ctx.reduce_dtype, ctx.scatter = inputs[:6]
        ctx.factor = inputs[6] if len(inputs) > 6 else None
        ctx.sink_dtype = sink.dtype

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        refuse_create_graph(torch.is_grad_enabled())  # the sink's .grad would be replaced, not added to
        factor = 1.0 if ctx.factor is None else ctx.factor()
        if ctx.scatter:  # the reduce-scatter only reads its input: no copy to protect the gradient
            if factor != 1.0 and ctx.reduce_dtype.itemsize < 4:  # a 16-bit sum: the mean first
                grad, factor = grad * factor, 1.0
            wire = grad if grad.dtype == ctx.reduce_dtype else widened(grad.reshape(-1), ctx.reduce_dtype)
            grad = reduce_scatter(wire, "sum", ctx.group)
            if factor != 1.0:
                grad.mul_(factor)  # a tensor of our own
        elif factor != 1.0:
            grad = grad * factor
        return grad.to(ctx.sink_dtype), None, None, None, None, None, None


def unit_params(sink: torch.Tensor, shard: torch.Tensor | None, full: torch.Tensor | None,
                group: Group, reduce_dtype: torch.dtype, scatter: bool,
                factor: Callable[[], float] | None = None) -> torch.Tensor:
    """A unit's full flat parameters, differentiable with respect to ``sink``.

    ``full=None`` all-gathers ``shard`` in forward (ZeRO-3). With ``scatter`` the backward is a
    sum reduce-scatter (the transpose of all-gather), so ``sink`` receives this rank's shard of
    the gradient summed over ranks; without it ``sink`` receives the full local gradient.
    ``factor`` (called in backward) multiplies what ``sink`` receives: the data-parallel mean
    (`zfunc.autograd.average`).

    Examples:
        >>> import torch, zfunc
        >>> g = zfunc.comm.world()
        >>> sink = torch.zeros(()).expand(4).requires_grad_()
        >>> full = zfunc.comm.unit_params(sink, None, torch.arange(4.0), g, torch.float32, True)
        >>> (full * full).sum().backward()
        >>> sink.grad.tolist()
        [0.0, 2.0, 4.0, 6.0]
    """
    return _UnitParams.apply(sink, shard, full, group, reduce_dtype, scatter, factor)
