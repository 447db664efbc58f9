"""Collectives as explicit ops: new tensors out, inputs untouched, string reduce ops.

Each runs over a `Group` (`zfunc.distributed.group`: the ranks of a ``torch.distributed``
process group, gloo on CPU, NCCL on GPU). A world of one needs no process group: every
collective is then the identity, so doctests and single-process runs work without
``torch.distributed`` initialised.

The differentiable `unit_params` is the whole of ZeRO in autograd: a unit's full parameters in
forward (all-gathered at stage 3), its gradient delivered to a *sink* in backward (the transpose
of the all-gather is a reduce-scatter), so gradients reach their owners in whatever way backward
is started (``torch.autograd.grad``, ``loss.backward()``, ``out.backward(g)``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zfunc.distributed._vmap import VmapAsIs
from zfunc.distributed.group import Group, init_from_env, world  # noqa: F401 (zfunc.comm.init_from_env too)
from zfunc.distributed.pool import Pool, buffer
from zfunc.errors import refuse_create_graph
from zfunc.distributed.widen import widened

__all__ = ["Group", "world", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "broadcast_",
           "all_gather_object", "unit_params", "all_reduce_start", "reduce_", "reduce_scatter_",
           "reduce_scatter_start", "all_gather_start", "all_gather_range_start", "gather",
           "gather_split"]

_OPS = {"sum": "SUM", "avg": "AVG", "max": "MAX", "min": "MIN"}

# torch 2.13 renamed the flat collectives; the old names warn on every call. One place knows.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_flat(out: torch.Tensor, x: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``out`` = every rank's ``x`` in rank order (``x`` may be this rank's slice of ``out``).

    On gloo, one broadcast per rank, all in flight at once: gloo's flat all-gather takes about
    twice as long as that on CPU (16.8M floats, 2 ranks: 67 ms against 37 ms). Other backends
    (NCCL) run their own all-gather. Returns a handle to wait on (done already without
    ``async_op``).
    """
    if dist.get_backend(group) != "gloo":
        work = _all_gather_single(out, x, group=group, async_op=async_op)
        return work if async_op else _Done()
    n, me = x.numel(), dist.get_rank(group)
    mine = out.narrow(0, me * n, n)
    if mine.data_ptr() != x.data_ptr():
        mine.copy_(x)
    size = dist.get_world_size(group)
    works = _Works([dist.broadcast(out.narrow(0, r * n, n),
                                   dist.get_global_rank(group, r) if group is not None else r,
                                   group=group, async_op=True) for r in range(size)])
    if not async_op:
        works.wait()
    return works


_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _op(op: str) -> Any:
    if op not in _OPS:
        raise ValueError(f"op: expected one of {sorted(_OPS)}, got {op!r}")
    return getattr(dist.ReduceOp, _OPS[op])


def all_reduce(x: torch.Tensor, op: str = "sum", group: Group | None = None) -> torch.Tensor:
    """Reduce ``x`` over the ranks of ``group``; every rank gets the result. ``x`` is untouched.

    Examples:
        >>> import torch, zfunc
        >>> zfunc.comm.all_reduce(torch.tensor([1.0, 2.0]), op="max").tolist()
        [1.0, 2.0]
    """
    group = group or world()
    out = x.clone()
    if group.size > 1:
        dist.all_reduce(out, op=_op(op), group=group.pg)
    return out


def all_reduce_(x: torch.Tensor, op: str = "sum", group: Group | None = None) -> torch.Tensor:
    """`all_reduce` in place (for donated buffers); returns ``x``."""
    all_reduce_start(x, op, group).wait()
    return x


def all_reduce_start(x: torch.Tensor, op: str = "sum", group: Group | None = None) -> Any:
    """`all_reduce_` started asynchronously: the sum is in ``x`` after ``handle.wait()`` (the
    stage 0 gradient buckets reduce this way while backward goes on).

    Examples:
        >>> import torch, zfunc
        >>> x = torch.tensor([1.0, 2.0])
        >>> zfunc.comm.all_reduce_start(x).wait(), x.tolist()
        (True, [1.0, 2.0])
    """
    group = group or world()
    if group.size == 1:
        return _Done()
    return dist.all_reduce(x, op=_op(op), group=group.pg, async_op=True)


class _Done:
    """The handle of a collective that had nothing to do (a world of one)."""

    def wait(self) -> bool:
        return True


def reduce_(x: torch.Tensor, dst: int, op: str = "sum", group: Group | None = None, *,
            async_op: bool = False, pool: Pool | None = None) -> Any:
    """Reduce ``x`` over the ranks into rank ``dst``'s ``x``, in place (a rank within ``group``).

    Keep ``x`` unchanged until the handle is waited for; on the other ranks it is scratch
    afterwards. Returns a handle whose ``wait()`` returns once the result is in place (at once
    without ``async_op``). Where the group has a gloo twin (``group.p2p``) a sum of host tensors
    is point-to-point: every other rank sends its ``x`` to ``dst`` (and it is left as it was),
    which adds them in rank order once they are in (`_sum_to`; its receive buffers come from
    ``pool`` and go back to it, when given); otherwise it is the backend's reduce (gloo's uses
    ``x`` as scratch).

    Examples:
        >>> import torch, zfunc
        >>> x = torch.tensor([1.0, 2.0])
        >>> zfunc.comm.reduce_(x, 0).wait(), x.tolist()
        (True, [1.0, 2.0])
    """
    group = group or world()
    if group.size == 1:
        return _Done()
    if op == "sum" and group.p2p is not None and x.device.type == "cpu":
        handle = _sum_to(x, dst, group, lambda parts: _add_all(x, parts, pool), pool)
    else:
        handle = dist.reduce(x, _global(group, dst), op=_op(op), group=group.pg, async_op=True)
    if not async_op:
        handle.wait()
    return handle


def _global(group: Group, r: int) -> int:
    """The default group's rank of ``group``'s rank ``r``."""
    return r if group.pg is None else dist.get_global_rank(group.pg, r)


class _Summed:
    """A sum built of point-to-point messages: ``wait()`` waits for them, then runs ``finish``
    (the adds) once."""

    def __init__(self, works: list[Any], keep: list[torch.Tensor], finish: Any = None):
        self.works, self.keep, self.finish = works, keep, finish  # keep: what the messages read or fill

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        if self.finish is not None:
            self.finish(self.keep)
        self.works, self.keep, self.finish = [], [], None
        return True


def _sum_to(x: torch.Tensor, dst: int, group: Group, finish: Any, pool: Pool | None = None) -> _Summed:
    """Rank ``dst`` receives every other rank's ``x`` and calls ``finish(received)`` (in rank
    order) when they are in; every other rank sends its ``x`` to ``dst``.

    On gloo on this CPU the sums of a 16.9M-float gradient in 25 MiB buckets take about half the
    time of gloo's reduces at 2 ranks (25 ms against 55; its reduce-scatter 64) and two thirds at
    3 (`benchmarks/comm.py`): gloo's reduce and reduce-scatter move and add more than a direct
    exchange does. The receiver holds one buffer like ``x`` per other rank until the wait.
    Between two ranks, messages arrive in the order they were sent, and every rank starts its
    sums in the same order, so each message meets the receive meant for it.
    """
    if group.rank != dst:
        return _Summed([dist.isend(x, _global(group, dst), group=group.p2p)], [x])
    parts = [buffer(pool, x.numel(), x.dtype, x.device) for _ in range(group.size - 1)]
    sources = [r for r in range(group.size) if r != dst]
    works = [dist.irecv(p.view(x.shape), _global(group, r), group=group.p2p) for p, r in zip(parts, sources)]
    return _Summed(works, parts, finish)


def _add_all(out: torch.Tensor, parts: list[torch.Tensor], pool: Pool | None = None) -> None:
    for p in parts:
        out.add_(p.view(out.shape))
        if pool is not None:
            pool.give(p)


def _slice_len(x: torch.Tensor, group: Group, what: str) -> int:
    if x.numel() % group.size:
        raise ValueError(f"{what}: {x.numel()} elements do not divide by the group size {group.size}; pad the "
                         "buffer to a multiple of it")
    return x.numel() // group.size


_CHUNK = 1 << 22  # elements per reduce when a reduce-scatter is built of gloo's reduces


def reduce_scatter_(x: torch.Tensor, op: str = "sum", group: Group | None = None) -> torch.Tensor:
    """`reduce_scatter` for a buffer the caller does not need afterwards (kept for callers that
    donate; zfunc's reduce-scatters leave ``x`` unchanged on every backend now).

    Examples:
        >>> import torch, zfunc
        >>> zfunc.comm.reduce_scatter_(torch.arange(4.0)).tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    out, handle = reduce_scatter_start(x, op, group)
    handle.wait()
    return out


class _Works:
    """Several collectives' handles as one."""

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def reduce_scatter_start(x: torch.Tensor, op: str = "sum", group: Group | None = None) -> tuple[torch.Tensor, Any]:
    """`reduce_scatter` started asynchronously: ``(out, handle)``, ``out`` valid after
    ``handle.wait()``; ``x`` is only read (keep it unchanged until then).

    With ``group.p2p`` (gloo) a sum of host tensors is a direct exchange: each rank sends slice
    ``r`` of its ``x`` to rank ``r`` and adds what it receives to its own slice in rank order
    (`_sum_to`).
    Without it, on gloo, one reduce per slice (on a copy of ``x``: gloo's reduce uses its input
    as scratch); otherwise (NCCL) the backend's reduce-scatter.

    Examples:
        >>> import torch, zfunc
        >>> out, handle = zfunc.comm.reduce_scatter_start(torch.arange(4.0))
        >>> handle.wait(), out.tolist()
        (True, [0.0, 1.0, 2.0, 3.0])
    """
    group = group or world()
    x = x.reshape(-1).contiguous()
    n = _slice_len(x, group, "reduce_scatter")
    if group.size == 1:
        return x, _Done()
    if op != "sum" or group.p2p is None or x.device.type != "cpu":
        if dist.get_backend(group.pg) == "gloo":  # gloo's reduces, a few in flight: faster than its reduce-scatter
            out = x.clone()
            works = [reduce_(out.narrow(0, r * n + i, min(_CHUNK, n - i)), r, op, group, async_op=True)
                     for r in range(group.size) for i in range(0, n, _CHUNK)]
            return out.narrow(0, group.rank * n, n), _Works(works)
        out = x.new_empty(n)
        return out, _reduce_scatter_flat(out, x, op=_op(op), group=group.pg, async_op=True)
    mine = x.narrow(0, group.rank * n, n)

    def finish(parts: list[torch.Tensor]) -> None:  # mine + the others', in rank order, into parts[0]
        parts[0].add_(mine)
        _add_all(parts[0], parts[1:])

    works = [_sum_to(x.narrow(0, r * n, n), r, group, finish if r == group.rank else None)
             for r in range(group.size)]
    received = works[group.rank].keep
    return received[0], _Works(works)


def reduce_scatter(x: torch.Tensor, op: str = "sum", group: Group | None = None) -> torch.Tensor:
    """Reduce a flat ``x`` over the ranks; rank ``r`` gets slice ``r`` of ``size`` equal slices.

    ``x.numel()`` must divide by the group size (zfunc pads its buffers to make it so).

    Examples:
        >>> import torch, zfunc
        >>> zfunc.comm.reduce_scatter(torch.arange(4.0)).tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    group = group or world()
    if group.size == 1:
        x = x.reshape(-1)
        _slice_len(x, group, "reduce_scatter")
        return x.clone()
    return reduce_scatter_(x, op, group)


def all_gather(x: torch.Tensor, group: Group | None = None, *, pool: Pool | None = None) -> torch.Tensor:
    """Concatenate the flat ``x`` of every rank, in rank order (into a buffer of ``pool``'s, when
    given).

    Examples:
        >>> import torch, zfunc
        >>> zfunc.comm.all_gather(torch.tensor([1.0, 2.0])).tolist()
        [1.0, 2.0]
    """
    out, handle = all_gather_start(x, group, pool=pool)
    handle.wait()
    return out


def all_gather_start(x: torch.Tensor, group: Group | None = None, *,
                     pool: Pool | None = None) -> tuple[torch.Tensor, Any]:
    """`all_gather` started asynchronously: ``(out, handle)``, ``out`` valid after ``handle.wait()``
    (stage 3 gathers the next unit this way while the current one computes).

    Examples:
        >>> import torch, zfunc
        >>> out, handle = zfunc.comm.all_gather_start(torch.tensor([1.0, 2.0]))
        >>> handle.wait(), out.tolist()
        (True, [1.0, 2.0])
    """
    group = group or world()
    x = x.reshape(-1)
    if group.size == 1:
        return x.clone(), _Done()
    n = x.numel() * group.size
    out = buffer(pool, n, x.dtype, x.device)
    return out, _all_gather_flat(out, x.contiguous(), group.pg, async_op=True)


def gather(x: torch.Tensor, dst: int, group: Group | None = None) -> torch.Tensor | None:
    """Concatenate the flat ``x`` of every rank, in rank order, on rank ``dst`` only (a rank
    within ``group``); the others send theirs and get ``None``. Only ``dst`` holds the whole.

    Examples:
        >>> import torch, zfunc
        >>> zfunc.comm.gather(torch.tensor([1.0, 2.0]), dst=0).tolist()
        [1.0, 2.0]
    """
    group = group or world()
    x = x.reshape(-1).contiguous()
    if group.size == 1:
        return x.clone()
    out = torch.empty(x.numel() * group.size, dtype=x.dtype, device=x.device) if group.rank == dst else None
    parts = list(out.chunk(group.size)) if out is not None else None
    dist.gather(x, gather_list=parts, dst=_global(group, dst), group=group.pg)
    return out


def gather_split(x: torch.Tensor, sizes: Sequence[int], group: Group | None = None, *,
                 dst: int | None = None) -> list[torch.Tensor] | None:
    """The concatenation of every rank's flat ``x`` in rank order, cut at ``sizes`` into tensors
    with storage of their own (what lies beyond ``sum(sizes)`` is dropped): on every rank, or
    with ``dst`` on that rank of ``group`` alone (the others send their parts and get ``None``).

    Each piece goes straight from the rank that holds it into its tensor (a broadcast per piece,
    or a message to ``dst``), so no buffer of the whole concatenation exists anywhere, and a
    receiver that lets go of a tensor frees it alone.

    Examples:
        >>> import torch, zfunc
        >>> [t.tolist() for t in zfunc.comm.gather_split(torch.arange(5.0), [2, 2])]
        [[0.0, 1.0], [2.0, 3.0]]
    """
    group = group or world()
    x = x.reshape(-1)
    n, me = x.numel(), group.rank
    if sum(sizes) > n * group.size:
        raise ValueError(f"gather_split: sizes add up to {sum(sizes)}, more than the {n * group.size} "
                         "elements of the concatenation")
    receive = dst is None or dst == me
    # messages to dst on the shard group's gloo twin where there is one (host tensors only)
    p2p = group.p2p if group.p2p is not None and x.device.type == "cpu" else group.pg
    out = [torch.empty(k, dtype=x.dtype, device=x.device) for k in sizes] if receive else None
    works, start = [], 0
    for i, k in enumerate(sizes):
        for r in range(start // n if n else 0, group.size):
            lo, hi = max(start, r * n), min(start + k, (r + 1) * n)
            if lo >= hi:
                break
            mine = x.narrow(0, lo - r * n, hi - lo) if r == me else None
            into = out[i].narrow(0, lo - start, hi - lo) if out is not None else None
            if r == me and into is not None:
                into.copy_(mine)
            if group.size == 1:
                continue
            if dst is None:
                works.append(dist.broadcast(into, _global(group, r), group=group.pg, async_op=True))
            elif r == me and me != dst:
                works.append(dist.isend(mine.contiguous(), _global(group, dst), group=p2p))
            elif me == dst and r != dst:
                works.append(dist.irecv(into, _global(group, r), group=p2p))
        start += k
    for w in works:
        w.wait()
    return out


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: Group) -> torch.Tensor:
    """`all_gather` into a given flat buffer (for donated state); ``x`` may be this rank's own
    slice of ``out`` (gathered in place). Returns ``out``."""
    if group.size == 1:
        if out.data_ptr() != x.data_ptr():
            out.copy_(x.reshape(-1))
        return out
    _all_gather_flat(out, x.reshape(-1).contiguous(), group=group.pg)
    return out


def all_gather_range_start(out: torch.Tensor, start: int, stop: int, shard: int, group: Group) -> Any:
    """Fill ``out[start:stop]`` in place from the ranks that own it, asynchronously: rank ``r``
    owns ``out[r * shard:(r + 1) * shard]`` and holds its part already. One broadcast per rank
    owning part of the range (an all-gather of one range of the flat buffer). Returns a handle;
    ``out[start:stop]`` is complete once it is waited for.

    Examples:
        >>> import torch, zfunc
        >>> out = torch.arange(6.0)
        >>> zfunc.comm.all_gather_range_start(out, 1, 4, 3, zfunc.comm.world()).wait(), out.tolist()
        (True, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    """
    if group.size == 1:
        return _Done()
    works = []
    for r in range(group.size):
        lo, hi = max(start, r * shard), min(stop, (r + 1) * shard)
        if lo < hi:
            works.append(dist.broadcast(out.narrow(0, lo, hi - lo), _global(group, r), group=group.pg, async_op=True))
    return _Works(works)


def broadcast(x: torch.Tensor, src: int = 0, group: Group | None = None) -> torch.Tensor:
    """Every rank gets rank ``src``'s ``x`` (``src`` is a rank within ``group``).

    Examples:
        >>> import torch, zfunc
        >>> zfunc.comm.broadcast(torch.tensor([3.0])).tolist()
        [3.0]
    """
    return broadcast_(x.clone(), src, group)


def broadcast_(x: torch.Tensor, src: int = 0, group: Group | None = None) -> torch.Tensor:
    """`broadcast` into ``x`` itself (returned).

    Examples:
        >>> import torch, zfunc
        >>> zfunc.comm.broadcast_(torch.tensor([3.0])).tolist()
        [3.0]
    """
    group = group or world()
    if group.size > 1:
        global_src = src if group.pg is None else dist.get_global_rank(group.pg, src)
        dist.broadcast(x, src=global_src, group=group.pg)
    return x


def all_gather_object(obj: Any, group: Group | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (for checks at init, never per step).

    Examples:
        >>> import zfunc
        >>> zfunc.comm.all_gather_object({"rank": 0})
        [{'rank': 0}]
    """
    group = group or world()
    if group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.pg)
    return out


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


_DEPRECATED = {"bind_unit": ("unit_params", "0.3")}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new, removal = _DEPRECATED[name]
        warnings.warn(f"zfunc.comm.{name} is deprecated and will be removed in {removal}; use "
                      f"zfunc.comm.{new}", DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
