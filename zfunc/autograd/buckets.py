"""Gradient buckets: gradients reduced during backward, overlapped with the rest of it.

At stages 0-2 the trainable parameters form one unit: one flat buffer of which rank ``r`` owns
the contiguous slice ``r``. A *bucket* is a run of whole parameters of that buffer holding about
``Config.bucket_mb`` of gradient. Buckets are cut from the end of the buffer, so backward
completes them roughly in order, last layers first (DDP's buckets, DeepSpeed's ``overlap_comm``).

In forward each bucket is one autograd node (`_Taps`) whose outputs are its parameters, views of
the compute buffer: one Python node per bucket, not per parameter. Its backward runs once every
gradient of the bucket's parameters is complete and puts each in place: added into the
accumulator where the sum will land, or copied into the bucket's staging buffer where it is only
sent (no bucket-sized gradient is concatenated). Then the bucket's collectives start,
asynchronously, and backward goes on computing. Every bucket node feeds one collector node
(`Collect`), which autograd runs after the last: it waits for the reductions and hands the
result to the sink.

Where backward reduces (`Config.shards_grads`: stage 2, stage 1 at ``grad_accum=1``), each
bucket is one reduce per rank that owns part of it. The owner's piece is reduced in place in the
gradient accumulator itself (the sink's ``.grad``: each parameter's gradient is added to the
accumulated shard as it arrives, so the sum lands there), or, when the accumulator's dtype is not
the reduce dtype, in a shard-sized result.

Stages 0-1 otherwise accumulate the full local gradient and reduce it once per step. The step's
last micro-batch (the accumulation boundary) folds that reduce into its backward (a `Fold`): the
gradients are added to the local accumulator and each bucket's sum reduced in place, all-reduced
at stage 0, reduced to each piece's owner at stage 1; `zfunc.apply_step` then finds the gradient
reduced (``TrainState.reduced``). The accumulator enters the reduce once per bucket (the first
call of the model whose gradient reaches it claims it): a second call of the model in the same
micro-batch reduces only its own gradient and adds the result once the first reduce is in.

Buckets start in a fixed order on every rank: a bucket not complete yet holds back the ones
after it, and the collector starts the rest, the parameters no gradient reached (this rank did
not use them) adding zeros. So every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import operator
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch._utils import _flatten_dense_tensors

from zfunc.distributed import comm
from zfunc.distributed._vmap import VmapAsIs
from zfunc.autograd.average import Average
from zfunc.autograd.calls import at_backward_end
from zfunc.autograd.rebind import Rebind
from zfunc.errors import refuse_create_graph
from zfunc.distributed.layout import Layout, Slot
from zfunc.distributed.pool import Pool
from zfunc.distributed.widen import add_into, copy_into

if TYPE_CHECKING:
    from zfunc.core.state import TrainState

__all__ = ["Bucket", "Fold", "TapPlan", "plan_buckets", "bucket_views", "reduce_group", "tap_plan"]

_IN_FLIGHT = 4  # reductions running at once (bounds the memory of non-owned bucket copies)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Elements ``[start, stop)`` of the flat buffer: whole parameters (and the padding, for the
    bucket at the end); ``pieces`` are ``(owner rank, start, stop)`` by owner."""

    start: int
    stop: int
    slots: tuple[Slot, ...]
    pieces: tuple[tuple[int, int, int], ...]


def plan_buckets(layout: Layout, bucket_elements: int) -> tuple[Bucket, ...]:
    """Buckets of about ``bucket_elements`` over a one-unit layout, the end of the buffer first.

    Examples:
        >>> from zfunc.distributed.layout import make_layout
        >>> lay = make_layout([[("a", (4,)), ("b", (4,)), ("c", (2,))]], world=2, rank=0, align=1)
        >>> [(b.start, b.stop, [s.name for s in b.slots], b.pieces) for b in plan_buckets(lay, 6)]
        [(4, 10, ['b', 'c'], ((0, 4, 5), (1, 5, 10))), (0, 4, ['a'], ((0, 0, 4),))]
    """
    (unit,) = layout.units
    groups: list[list[Slot]] = []
    size = 0
    for s in reversed(unit.slots):
        if groups and size + s.numel <= bucket_elements:
            groups[-1].insert(0, s)
            size += s.numel
        else:
            groups.append([s])
            size = s.numel
    out = []
    for i, slots in enumerate(groups):
        start = slots[0].offset
        stop = unit.padded if i == 0 else slots[-1].offset + slots[-1].numel
        pieces = tuple((r, max(start, r * unit.shard), min(stop, (r + 1) * unit.shard))
                       for r in range(layout.world) if max(start, r * unit.shard) < min(stop, (r + 1) * unit.shard))
        out.append(Bucket(start=start, stop=stop, slots=tuple(slots), pieces=pieces))
    return tuple(out)


class Fold:
    """The accumulation boundary of stages 0-1 (see the module docstring): which buckets' local
    accumulator went into a reduce already. One per micro-batch, shared by every call of the
    model in it; `done` once every bucket was reduced. ``enabled`` is read when a backward
    reaches a bucket: the engine clears it when the boundary moves off this micro-batch after its
    forward (Accelerate sets the boundary between forward and backward), and the gradients are
    then only added locally.

    Examples:
        >>> f = Fold(2)
        >>> f.folded[0] = True
        >>> f.done, f.started
        (False, True)
    """

    def __init__(self, n: int):
        self.enabled = True
        self.folded = [False] * n
        self.handles: dict[int, list[Any]] = {}  # a folded bucket's reduces (a later call waits for them)

    @property
    def done(self) -> bool:
        return all(self.folded)

    @property
    def started(self) -> bool:
        return any(self.folded)

    def reset(self) -> None:
        """Forget the folds (a fresh accumulator behind the same sinks)."""
        self.folded = [False] * len(self.folded)
        self.handles = {}


def reduce_group(state: TrainState) -> comm.Group:
    """The ranks a stage 0-2 gradient is reduced over: the world at stage 0, else the shard group.

    Examples:
        >>> import torch, zfunc
        >>> reduce_group(zfunc.init(torch.nn.Linear(1, 1), zfunc.Config(stage=0))).size
        1
    """
    return state.mesh.world if state.stage == 0 else state.mesh.shard


class _Reducer:
    """One backward's reductions. Each parameter's gradient is put in place as it arrives (added
    into the accumulator, or copied into its bucket's staging buffer); a bucket's reduce starts
    once all its parameters are in, in bucket order; the collector waits for them all."""

    def __init__(self, state: TrainState, buckets: tuple[Bucket, ...], pool: Pool, sink: torch.Tensor,
                 fold: Fold | None, avg: Average, plan: TapPlan):
        self.buckets, self.state, self.pool, self.sink, self.fold = buckets, state, pool, sink, fold
        self.avg = avg  # the data-parallel mean, applied as each gradient is put in place
        self.group = reduce_group(state)
        self.dtype = state.cfg.reduce_dtype
        (unit,) = state.layout.units
        # Where owner r's piece sits in the buffer reduced into: the accumulator is a shard
        # (`Config.shards_grads`) or the full local gradient (a fold).
        self.shard = unit.shard if fold is None else 0
        # Each parameter's tap key: its place in this list (offsets are not unique: a parameter
        # of no elements shares its offset with the next), as `tap_plan` numbers them.
        self.slots = plan.flat
        self.keys = plan.keys
        self.recomputed: weakref.WeakMethod | None = None  # the call's `Rebind.collect`
        self._reset()

    def _reset(self) -> None:
        n = len(self.buckets)
        self.missing: list[set[int]] = [set(keys) for keys in self.keys]  # tap keys not arrived yet
        self.opened = [False] * n
        self.folds = [False] * n  # the bucket's gradient goes into the accumulator, reduced there
        self.staged: list[torch.Tensor | None] = [None] * n  # else it is gathered here first
        self.busy = [0] * n  # collectives still reading a bucket's staging buffer
        self.complete = [False] * n
        self.next = 0
        self.works: collections.deque = collections.deque()
        self.out: torch.Tensor | None = None
        self.direct = False  # reducing into the accumulator (sink.grad) itself

    def many(self, keys: tuple[int, ...], grads: tuple[torch.Tensor | None, ...]) -> None:
        """`take` each gradient that arrived (None: nothing reached that parameter in this graph),
        all of them in place before a bucket they complete starts. Small gradients that lie back
        to back in one bucket (`runs`) go in place as one."""
        arrived = list(map(operator.is_not, grads, itertools.repeat(None)))
        items = []
        join = _joinable(self.dtype, self.sink.grad)
        for key, grad in zip(itertools.compress(keys, arrived), itertools.compress(grads, arrived)):
            k, slot = self.slots[key]
            if k < self.next or not join or grad.dtype != self.dtype or not grad.is_contiguous():
                self._put(key, grad)  # refused there; another dtype or strided: one by one, as it is
            else:
                items.append(((k, key not in self.missing[k]), slot.offset, key, grad))
        items.sort(key=operator.itemgetter(0, 1))
        for (k, again), offset, js, run in runs(items):
            if len(run) == 1:
                self._put(js[0], run[0])
                continue
            if not self.opened[k]:
                self._open(k)
            self._place(k, offset, _flatten_dense_tensors(run), again=again)
            self.missing[k].difference_update(js)
            if not self.missing[k]:
                self.complete[k] = True
        self._advance()

    def _put(self, j: int, grad: torch.Tensor) -> None:
        """Parameter ``j``'s gradient (``self.slots[j]``) in place. (It comes in parts when
        reentrant activation checkpointing recomputes a forward that uses it during backward.)"""
        k, slot = self.slots[j]
        if k < self.next:
            raise RuntimeError(
                f"gradient of {slot.name!r} arrived after its bucket's reduce had started: the parameter is used "
                "inside a reentrant activation checkpoint and elsewhere (or in two of them). Use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), torch's recommended mode")
        if not self.opened[k]:
            self._open(k)
        self._place(k, slot.offset, _flat_if_free(grad), again=j not in self.missing[k])
        self.missing[k].discard(j)
        if not self.missing[k]:
            self.complete[k] = True

    def _advance(self) -> None:
        """Start the complete buckets, in order, once what recomputed segments left in their
        leaves (`Rebind.collect`) joined them."""
        if self.next < len(self.buckets) and self.complete[self.next] and self.recomputed is not None:
            collect = self.recomputed()
            if collect is not None:
                collect()
        while self.next < len(self.buckets) and self.complete[self.next]:
            self._start(self.next)
            self.next += 1

    def _open(self, k: int) -> None:
        """Decide where bucket ``k``'s gradients go, at its first one (or at the end, unreached)."""
        self.opened[k] = True
        if self.out is None:
            acc = self.sink.grad
            # Reduced straight into the accumulator when it is fp32 (its own rank's gradient added
            # before the reduce, no staging buffer). A bf16/fp16 accumulator gets each reduced sum
            # added once instead: the sum rounds the same on every owner, as DeepSpeed's does.
            wide = acc is not None and acc.dtype == self.dtype and acc.element_size() >= 4
            self.direct = self.fold is not None or wide
            if self.direct:
                self.out = acc
            else:
                self.out = self.pool.take(self.state.layout.units[0].shard, self.dtype, self.state.device)
        if self.fold is not None and not (self.fold.enabled and self.fold.folded[k]):
            if self.fold.enabled:
                self.fold.folded[k] = True  # this call's gradient joins the accumulator, reduced once
            self.folds[k] = True  # (not at the boundary after all: only added to the accumulator)
        else:
            b = self.buckets[k]
            self.staged[k] = self.pool.take(b.stop - b.start, self.dtype, self.state.device)

    def _place(self, k: int, offset: int, grad: torch.Tensor, again: bool = False) -> None:
        n, factor = grad.numel(), self.avg.factor
        if self.folds[k]:  # the step's last micro-batch at stages 0-1: into the local accumulator
            add_into(_shaped(self.out.narrow(0, offset, n), grad), grad, factor)
            return
        b, staged = self.buckets[k], self.staged[k]
        flat = None
        for owner, start, stop in b.pieces:
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo >= hi:
                continue
            if hi - lo == n:  # the whole gradient, as it came (a transposed one is not copied first)
                part = grad
            else:
                flat = grad.reshape(-1) if flat is None else flat
                part = flat.narrow(0, lo - offset, hi - lo)
            if self.fold is None and self.direct and owner == self.group.rank:  # straight into our shard
                add_into(_shaped(self.out.narrow(0, lo - owner * self.shard, hi - lo), part), part, factor)
            else:  # a second part of the gradient adds to the first
                (add_into if again else copy_into)(_shaped(staged.narrow(0, lo - b.start, hi - lo), part), part, factor)

    def _start(self, k: int) -> None:
        b = self.buckets[k]
        if not self.opened[k]:
            self._open(k)
        staged = self.staged[k]
        if staged is not None:  # what no gradient reached adds zero (unused parameters, padding)
            for j in self.missing[k]:
                slot = self.slots[j][1]
                staged.narrow(0, slot.offset - b.start, slot.numel).zero_()
            end = b.slots[-1].offset + b.slots[-1].numel
            staged.narrow(0, end - b.start, b.stop - end).zero_()
        self.missing[k] = set()
        if self.folds[k]:
            if self.fold.enabled:
                self._fold(k)
        elif self.state.stage == 0:
            self._all_reduce_add(k, staged)
        else:
            self._reduce_pieces(k, staged)
        self._unstage(k)
        while len(self.works) > _IN_FLIGHT:
            self._wait()

    def _fold(self, k: int) -> None:
        """The bucket's first reduce at the boundary: local accumulator plus this gradient, reduced
        in place (at stage 1 the pieces other ranks own are sent, or scratch to the backend)."""
        b = self.buckets[k]
        if self.state.stage == 0:
            handles = [comm.all_reduce_start(self.out.narrow(0, b.start, b.stop - b.start), "sum", self.group)]
        else:
            handles = [comm.reduce_(self.out.narrow(0, start, stop - start), owner, "sum", self.group, async_op=True)
                       for owner, start, stop in b.pieces]
        self.fold.handles[k] = handles
        self.works.extend((h, None, None, None) for h in handles)

    def _settle_fold(self, k: int) -> None:
        """A later call's gradient of a bucket the accumulator went into a reduce with: that reduce
        must be in before anything is added where it lands."""
        if self.fold is not None:
            for h in self.fold.handles.get(k, ()):
                h.wait()

    def _reduce_pieces(self, k: int, staged: torch.Tensor) -> None:
        """One reduce per owner of the bucket; the owner's lands on its accumulated piece."""
        b = self.buckets[k]
        for owner, start, stop in b.pieces:
            piece = staged.narrow(0, start - b.start, stop - start)
            if owner == self.group.rank:  # reduced straight into its place in this rank's buffer
                mine = self.out.narrow(0, start - owner * self.shard, stop - start)
                if self.fold is not None:  # a later call at the boundary: onto the reduced sum
                    self._settle_fold(k)
                    add_into(mine, piece)
                elif not self.direct:
                    mine.copy_(piece)
                # (direct at stage 2: the gradients were added into ``mine`` as they arrived)
                self.works.append((comm.reduce_(mine, owner, "sum", self.group, async_op=True, pool=self.pool),
                                   None, None, None))
            else:  # sent from the staging buffer (only read)
                self.busy[k] += 1
                self.works.append((comm.reduce_(piece, owner, "sum", self.group, async_op=True), staged, None, k))

    def _all_reduce_add(self, k: int, staged: torch.Tensor) -> None:
        """Stage 0, a bucket reduced already in this micro-batch: all-reduce this gradient alone and
        add the sum to the reduced accumulator once it is in."""
        b = self.buckets[k]
        self._settle_fold(k)
        region = self.out.narrow(0, b.start, b.stop - b.start)
        self.busy[k] += 1
        self.works.append((comm.all_reduce_start(staged, "sum", self.group), staged, region, k))

    def _wait(self) -> None:
        work, buf, add_to, k = self.works.popleft()  # buf: a buffer of ours the collective works on
        work.wait()
        if add_to is not None:
            add_to.add_(buf)
        if k is not None:
            self.busy[k] -= 1
            self._unstage(k)

    def _unstage(self, k: int) -> None:
        """Bucket ``k``'s staging buffer back to the pool once no collective reads it any more."""
        if self.busy[k] == 0 and self.staged[k] is not None:
            self.pool.give(self.staged[k])
            self.staged[k] = None

    def finish(self) -> list[torch.Tensor]:
        """Start what is not complete (unused parameters add zeros), wait for all, and return the
        shard (a broadcast zero when it was reduced into the accumulator)."""
        for k in range(self.next, len(self.buckets)):
            self._start(k)
        while self.works:
            self._wait()
        out, direct = self.out, self.direct
        self._reset()  # a second backward over the same graph (retain_graph) starts afresh
        if out is None:  # no bucket at all (nothing to reduce)
            out, direct = self.sink.grad, True
        if direct:  # the sum is in the accumulator already: a zero that holds no memory, so the
            # sink's accumulation (and its hooks, which the engine counts on) still runs
            return [torch.zeros((), dtype=out.dtype, device=out.device).expand(out.shape)]
        # Back to the pool once autograd has added it to the sink, at the end of this backward.
        at_backward_end(lambda: self.pool.give(out))
        return [out]


# A gradient of at most this many elements joins a run (`runs`): copying it once into the run's
# concatenation costs less than a call into torch of its own (a few microseconds each on a CPU,
# where ``_foreach_add_`` too loops over its tensors); a larger one goes in place where it is. A
# run stops growing at RUN elements (its concatenation is a temporary).
SMALL = 1 << 14
RUN = 1 << 20
_WIDE = frozenset({torch.float32, torch.float64})


def _joinable(*dtypes: Any) -> bool:
    """Whether runs of gradients of these dtypes (or tensors') go in place as one: one dtype
    throughout, fp32 or fp64. A sum or copy into or from 16 bits is rounded by kernels that treat
    a vectorised body and its tail, or a short and a long tensor (the widening kernel,
    `zfunc.distributed.widen`), differently, so a run's elements could round otherwise than one
    by one; those go one by one."""
    found = {getattr(d, "dtype", d) for d in dtypes if d is not None}
    return len(found) == 1 and found <= _WIDE


def runs(items: list[tuple[Any, int, Any, torch.Tensor]]) -> list[tuple[Any, int, list[Any], list[torch.Tensor]]]:
    """``(group, offset, keys, gradients)`` for each run of ``items`` (``(group, offset, key,
    gradient)``, sorted by group and offset, gradients of one dtype: `_joinable`) whose small
    gradients (`SMALL`) of one group lie back to back (up to `RUN` elements a run); any other
    gradient is a run of its own. A run of several is put in place as one
    (``torch._utils._flatten_dense_tensors``, one concatenation): one call into torch, not one per
    parameter, for a model of many small parameters.

    Examples:
        >>> import torch
        >>> items = [(0, 0, "a", torch.ones(2)), (0, 2, "b", torch.ones(3)), (0, 6, "c", torch.ones(1)),
        ...          (0, 7, "d", torch.ones(1 << 15)), (1, 0, "e", torch.ones(1)), (1, 1, "f", torch.ones(1))]
        >>> [(g, offset, keys) for g, offset, keys, _ in runs(items)]
        [(0, 0, ['a', 'b']), (0, 6, ['c']), (0, 7, ['d']), (1, 0, ['e', 'f'])]
    """
    out: list[tuple[Any, int, list[Any], list[torch.Tensor]]] = []
    end, last, size = -1, None, 0  # where the last run of small gradients ends, its group and size
    for group, offset, key, grad in items:
        n = grad.numel()
        if n <= SMALL and offset == end and group == last and size + n <= RUN:
            out[-1][2].append(key)
            out[-1][3].append(grad)
            size += n
        else:
            out.append((group, offset, [key], [grad]))
            size = n
        end, last = (offset + n, group) if n <= SMALL else (-1, None)
    return out


def _flat_if_free(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` flattened when that is a view; a strided one (a transposed matmul's) as it is."""
    return grad.view(-1) if grad.is_contiguous() else grad


def _shaped(region: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``region`` (flat, contiguous) viewed in ``grad``'s shape: a strided gradient is written
    in one pass, without a contiguous copy of it first."""
    return region.view(grad.shape) if grad.dim() != 1 else region


class Collect(VmapAsIs, torch.autograd.Function):
    """The node every gradient piece feeds (``hub = Collect.apply(reducer, *sinks)``): autograd runs
    its backward after all of them, and it delivers ``reducer.finish()``, one result per sink (None
    for a sink nothing reached), to the sinks, once the call's `Rebind` (`_keep`) handed over the
    gradients its leaves hold."""

    @staticmethod
    def forward(reducer: Any, *sinks: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32, device=sinks[0].device)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.reducer, ctx.dtypes = inputs[0], [s.dtype for s in inputs[1:]]

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple:
        rebind = getattr(ctx, "keep", None)
        if rebind is not None:
            rebind.collect()
            rebind._owed = False
        results = ctx.reducer.finish()
        return (None, *(None if r is None else r.to(dt) for r, dt in zip(results, ctx.dtypes)))


class _Taps(VmapAsIs, torch.autograd.Function):
    """A bucket's parameters as views of the compute buffer, one node for all of them
    (``places``: ``(offset, shape, stride)`` of each, `_places`). Its backward hands the gradients
    autograd has for them to ``take(keys, grads)`` (None: nothing reached that parameter in this
    graph; it may come later from a recomputed forward, or adds zeros at the end) and feeds ``hub``
    a zero, so the hub's node runs after every bucket's."""

    @staticmethod
    def forward(hub: torch.Tensor, flat: torch.Tensor, take: Any, keys: tuple, places: tuple) -> tuple:
        # one as_strided per parameter: a custom Function's view outputs cost per view op
        return tuple(flat.as_strided(shape, stride, offset) for offset, shape, stride in places)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.take, ctx.keys, ctx.device = inputs[2], inputs[3], inputs[1].device
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        refuse_create_graph(torch.is_grad_enabled())
        ctx.take(ctx.keys, grads)
        return torch.zeros((), dtype=torch.float32, device=ctx.device), None, None, None, None


def _bucket_taps(hub: torch.Tensor, compute: torch.Tensor, take: Any, plan: TapPlan) -> dict[str, torch.Tensor]:
    """Every parameter of ``plan``'s buckets as a view of ``compute`` whose gradient reaches
    ``take(keys, grads)``, one `_Taps` node per bucket."""
    views = {}
    base = compute.storage_offset()
    for k in range(len(plan.buckets)):
        places = plan.places[k]
        if base:
            places = tuple((base + offset, shape, stride) for offset, shape, stride in places)
        outs = _Taps.apply(hub, compute, take, plan.keys[k], places)
        views.update(zip([s.name for _, s in plan.buckets[k]], outs))
    return views


@functools.lru_cache(maxsize=None)
def _places(slots: tuple[Slot, ...]) -> tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]:
    """``(offset, shape, contiguous strides)`` of each slot (computed once per bucket)."""
    out = []
    for s in slots:
        strides, step = [], 1
        for d in reversed(s.shape):
            strides.append(step)
            step *= max(d, 1)
        out.append((s.offset, s.shape, tuple(reversed(strides))))
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class TapPlan:
    """Buckets of ``(key, slot)`` laid out for their taps once, not per call: each bucket's keys
    and ``(offset, shape, stride)`` places (in the buffer), each parameter's key and place by
    name, and every ``(bucket, slot)`` in order. A binding keeps one per path (`tap_plan`).

    Examples:
        >>> from zfunc.distributed.layout import Slot
        >>> plan = TapPlan.of([[(0, Slot("w", (2, 2), 0)), (1, Slot("b", (2,), 4))]])
        >>> plan.keys, plan.places, plan.by_name["b"]
        (((0, 1),), (((0, (2, 2), (2, 1)), (4, (2,), (1,))),), (1, (4, (2,), (1,))))
    """

    buckets: tuple[tuple[tuple[Any, Slot], ...], ...]
    keys: tuple[tuple[Any, ...], ...]
    places: tuple[tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...], ...]
    flat: tuple[tuple[int, Slot], ...]  # ``(bucket, slot)`` of every parameter, bucket by bucket
    by_name: dict[str, tuple[Any, tuple[int, tuple[int, ...], tuple[int, ...]]]]  # name -> (key, place)
    names: tuple[tuple[str, ...], ...]  # each bucket's parameter names
    bucket: dict[str, int]  # name -> its bucket's index

    @classmethod
    def of(cls, buckets: Sequence[Sequence[tuple[Any, Slot]]]) -> TapPlan:
        buckets = tuple(tuple(b) for b in buckets)
        return cls(buckets=buckets, keys=tuple(tuple(key for key, _ in b) for b in buckets),
                   places=tuple(_places(tuple(s for _, s in b)) for b in buckets),
                   by_name={s.name: (key, _places.__wrapped__((s,))[0]) for b in buckets for key, s in b},
                   flat=tuple((k, s) for k, b in enumerate(buckets) for _, s in b),
                   names=tuple(tuple(s.name for _, s in b) for b in buckets),
                   bucket={s.name: k for k, b in enumerate(buckets) for _, s in b})


def tap_plan(binding: Any, path: str, buckets: tuple[Bucket, ...]) -> TapPlan:
    """The binding's `TapPlan` of ``buckets`` for ``path``: ``"local"`` (keyed by offset,
    `zfunc.autograd.local`) or ``"reduce"`` (keyed by place in the reducer's list, `_Reducer`),
    made on first use."""
    plan = binding.tap_plans.get(path)
    if plan is None:
        if path == "local":
            plan = TapPlan.of([[(s.offset, s) for s in b.slots] for b in buckets])
        else:
            keyed = itertools.count()
            plan = TapPlan.of([[(next(keyed), s) for s in b.slots] for b in buckets])
        binding.tap_plans[path] = plan
    return plan


def bucket_views(state: TrainState, sink: torch.Tensor, buckets: tuple[Bucket, ...], pool: Pool,
                 avg: Average, fold: Fold | None = None) -> tuple[dict[str, torch.Tensor], Rebind]:
    """Parameter views of ``state.compute`` whose gradients reach ``sink`` bucket by bucket
    (reduced into the full local accumulator with ``fold``, else reduce-scattered), each
    multiplied by ``avg.factor`` as it is put in place. Each parameter is its own tap: no
    bucket-sized gradient is concatenated in backward. Also the call's `Rebind`."""
    plan = tap_plan(state.binding, "reduce", buckets)
    reducer = _Reducer(state, buckets, pool, sink, fold, avg, plan)
    hub = Collect.apply(reducer, sink)
    compute = state.compute  # at stages 1-2 with units, each piece read after forward gathered it (zfunc.autograd.forward_gather)
    rebind = _keep(hub, Rebind(compute, plan, reducer.many, _largest(buckets),
                               functools.partial(Collect.apply, reducer, sink), state.binding.flight,
                               state.binding.spares))
    reducer.recomputed = weakref.WeakMethod(rebind.collect)
    return _bucket_taps(hub, compute, reducer.many, plan), rebind


def _largest(buckets: tuple[Bucket, ...]) -> int:
    """Elements in the largest of ``buckets`` (what a `Rebind` lets wait)."""
    return max((b.stop - b.start for b in buckets), default=0)


def _keep(hub: torch.Tensor, rebind: Rebind) -> Rebind:
    """``rebind``, kept alive by the collector's node as long as the call's graph is (none
    without one: a forward under ``no_grad`` has nothing to recompute)."""
    if hub.grad_fn is not None:
        hub.grad_fn.keep = rebind
    return rebind
