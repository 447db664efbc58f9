"""The local accumulator's path (stages 0-1, and stage 2 on one rank): each bucket's gradients
added, times the data-parallel factor, straight into the full local accumulator as backward
delivers them, through the same bucket taps (`zfunc.autograd.buckets._Taps`) the reducing path
uses. No gradient of the whole unit is assembled and nothing is reduced in backward here (the
step's last micro-batch at stages 0-1 reduces in backward through `zfunc.autograd.buckets.Fold`
instead).
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import TYPE_CHECKING

import torch
from torch._utils import _flatten_dense_tensors

from zfunc.autograd.average import Average
from zfunc.autograd.buckets import Bucket, Collect, _bucket_taps, _flat_if_free, _keep, _joinable, _largest, _shaped, runs, tap_plan
from zfunc.autograd.rebind import Rebind
from zfunc.distributed.widen import add_into

if TYPE_CHECKING:
    from zfunc.core.state import TrainState

__all__ = ["local_views"]


class _InPlace:
    """The collector's reducer for `local_views` (``hub = Collect.apply(_InPlace(sink), sink)``):
    the gradients are in the accumulator already, so the collector hands the sink a zero that
    holds no memory (its hooks still run)."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, sink: torch.Tensor):
        self.shape, self.dtype, self.device = sink.shape, sink.dtype, sink.device

    def finish(self) -> list[torch.Tensor]:
        return [torch.zeros((), dtype=self.dtype, device=self.device).expand(self.shape)]


class _AddLocal:
    """A `_Taps` taker for `local_views`: each gradient, keyed by its offset in the unit, added
    times ``avg.factor`` into the accumulator ``sink.grad``.

    ``many`` adds a bucket's gradients at once (a model of many small parameters spends most of
    its backward overhead here): of those of the accumulator's dtype laid out contiguously, each
    run of small ones back to back (`zfunc.autograd.buckets.runs`; an fp32 or fp64 accumulator) is
    concatenated and added in one ``add_``, and the rest go in one ``torch._foreach_add_`` over
    views that one ``split`` makes of the accumulator; the others one by one. The sums are
    ``add_``'s, element for element.

    Examples:
        >>> import torch, types
        >>> sink = torch.zeros(6, requires_grad=True); sink.grad = torch.zeros(6)
        >>> add = _AddLocal(sink, types.SimpleNamespace(factor=0.5))
        >>> add.many((4, 0, 3), (torch.ones(2), torch.full((2,), 4.0), None))
        >>> add(2, torch.ones(1)); sink.grad.tolist()
        [2.0, 2.0, 0.5, 0.0, 0.5, 0.5]
    """

    __slots__ = ("sink", "avg")

    def __init__(self, sink: torch.Tensor, avg: Average):
        self.sink, self.avg = sink, avg

    def __call__(self, start: int, grad: torch.Tensor) -> None:
        grad = _flat_if_free(grad)
        add_into(_shaped(self.sink.grad.narrow(0, start, grad.numel()), grad), grad, self.avg.factor)

    def many(self, keys: tuple, grads: tuple) -> None:
        acc, factor = self.sink.grad, self.avg.factor
        arrived = list(map(operator.is_not, grads, itertools.repeat(None)))
        if not all(arrived):  # not reached in this graph (used only inside reentrant checkpoints)
            keys, grads = itertools.compress(keys, arrived), itertools.compress(grads, arrived)
        batch = []
        for key, grad in zip(keys, grads):
            if grad.numel() == 0:  # empty: at the offset of the parameter after it
                continue
            if grad.dtype == acc.dtype and grad.is_contiguous():
                batch.append((None, key, None, grad))
            else:  # another dtype (the widening kernel), or strided (written in one pass as it is)
                self(key, grad)
        if len(batch) < 2:
            for _, key, _, grad in batch:
                self(key, grad)
            return
        batch.sort(key=operator.itemgetter(1))
        if not _joinable(acc):  # 16 bits: one by one (`_joinable`)
            rest = [(key, grad) for _, key, _, grad in batch]
        else:
            rest = []
            for _, start, _, run in runs(batch):
                if len(run) == 1:
                    rest.append((start, run[0]))
                    continue
                flat = _flatten_dense_tensors(run)  # one concatenation, one add
                region = acc.narrow(0, start, flat.numel())
                region.add_(flat) if factor == 1.0 else region.add_(flat, alpha=factor)
        if not rest:
            return
        sizes, picks, srcs = [], [], []
        start = end = rest[0][0]
        for key, grad in rest:
            if key > end:  # a gap (a parameter not reached, alignment): split off, left alone
                sizes.append(key - end)
            picks.append(len(sizes))
            sizes.append(grad.numel())
            srcs.append(grad.view(-1))
            end = key + grad.numel()
        parts = acc.narrow(0, start, end - start).split_with_sizes(sizes)
        dsts = [parts[i] for i in picks]
        if factor == 1.0:
            torch._foreach_add_(dsts, srcs)
        else:
            torch._foreach_add_(dsts, srcs, alpha=factor)


def local_views(state: TrainState, sink: torch.Tensor, buckets: tuple[Bucket, ...],
                avg: Average) -> tuple[dict[str, torch.Tensor], Rebind]:
    """Parameter views of ``state.compute`` (stages 0-1, one unit) whose gradients backward adds,
    times ``avg.factor``, bucket by bucket, into the full local accumulator ``sink.grad``: no flat
    gradient of the whole unit is assembled first (a concatenation and a fresh unit-sized buffer
    per micro-batch). Also the call's `Rebind`."""
    add, inplace = _AddLocal(sink, avg), _InPlace(sink)
    hub = Collect.apply(inplace, sink)
    plan = tap_plan(state.binding, "local", buckets)
    rebind = _keep(hub, Rebind(state.compute, plan, add.many, _largest(buckets),
                               functools.partial(Collect.apply, inplace, sink), state.binding.flight,
                               state.binding.spares))
    return _bucket_taps(hub, state.compute, add.many, plan), rebind
