"""ZeRO-3: a unit's parameters exist in full only while its module runs.

Forward gathers the *root* unit (parameters outside every unit, and the small ones below the
persistence threshold) once per call. Every other unit is gathered when its module starts (the
`zfunc.autograd.binding.ModuleBinding`'s forward pre-hook calls `UnitGatherer.enter`), through the
differentiable `_GatherUnit` (its backward starts the unit's reduce-scatter asynchronously;
a collector node hands the shards to the sinks at the end of backward), and released when the
module returns (`UnitGatherer.leave`). Autograd would keep the gathered
buffer alive until backward through the tensors it saves; a saved-tensor hook replaces each such
tensor with a recipe (unit, offset, size, stride) that gathers the unit again when backward
needs it. So the gathered parameters alive at any moment stay near one unit plus the root, plus
the ``Config.prefetch`` units gathered ahead.

Prefetch (FSDP2's, DeepSpeed's): while a unit computes, the all-gathers of the next
``Config.prefetch`` units run. Forward predicts "next" from the order the previous forward of the
same model ran its units (the layout's order on the first), backward from the order this forward
ran the units whose saved tensors it will regather, reversed. Both are the same on every rank, so
every rank issues the same collectives in the same order; a wrong prediction only costs a gather.

Every rank must run the same units in the same order (as with DeepSpeed and FSDP).
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from zfunc.distributed import comm
from zfunc.distributed._vmap import VmapAsIs
from zfunc.autograd.average import Average
from zfunc.autograd.buckets import Collect
from zfunc._probes import hooks_active, in_transform, plain, recomputed, sole_owner
from zfunc.autograd.swap import Swapped, put_back, swap_in
from zfunc.errors import refuse_create_graph

__all__ = ["UnitGatherer", "track_gathered", "check_same_units"]

_STATS = {"live": 0, "peak": 0, "tracking": 0}


def _count_bytes(full: torch.Tensor) -> torch.Tensor:
    """``full``, counted while a `track_gathered` block runs (a finalizer per buffer then; none
    otherwise)."""
    if not _STATS["tracking"]:
        return full
    n = full.numel() * full.element_size()
    _STATS["live"] += n
    _STATS["peak"] = max(_STATS["peak"], _STATS["live"])
    weakref.finalize(full, _release, n)
    return full


def _release(n: int) -> None:
    _STATS["live"] -= n


@contextlib.contextmanager
def track_gathered() -> Iterator[dict[str, int]]:
    """Measure the peak bytes of gathered stage-3 parameters alive inside the block.

    Examples:
        >>> from zfunc.autograd.gather import track_gathered
        >>> with track_gathered() as stats:
        ...     pass
        >>> stats["peak"]
        0
    """
    base = _STATS["live"]
    _STATS["peak"] = base
    _STATS["tracking"] += 1
    out = {"peak": 0}
    try:
        yield out
    finally:
        _STATS["tracking"] -= 1
        out["peak"] = _STATS["peak"] - base


class _Recipe:
    """A saved tensor that was a view of a gathered unit: enough to rebuild it later."""

    __slots__ = ("gatherer", "index", "offset", "size", "stride")

    def __init__(self, gatherer: UnitGatherer, index: int, t: torch.Tensor):
        self.gatherer, self.index = gatherer, index
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()


_IN_FLIGHT = 2  # units whose reduce-scatter may still run while backward goes on


class _UnitReducer:
    """One forward call's stage-3 reduce-scatters, asynchronous: a unit's starts as soon as its
    backward is done and is waited for at most ``_IN_FLIGHT`` units later, or at the end by the
    collector node (`zfunc.autograd.buckets.Collect`), which hands each sink its unit's shard. The graph
    holds it (the collector's context) and it holds the gatherer weakly: no reference cycle keeps
    a call, and the state it ran on, alive after its graph is gone."""

    def __init__(self, gatherer: UnitGatherer):
        self.state, self.units = gatherer.state, len(gatherer.sinks)
        self.gatherer = weakref.ref(gatherer)  # the regathered copies and prefetches, while it lives
        self.pending: collections.deque = collections.deque()
        self.results: dict[int, torch.Tensor] = {}

    def start(self, i: int, grad: torch.Tensor, factor: float) -> None:
        """Unit ``i``'s gradient is complete: reduce-scatter it, times ``factor`` (the
        data-parallel mean): on the shard once it is in, or before the sum when that is 16-bit."""
        st = self.state
        dtype = st.cfg.reduce_dtype
        if factor != 1.0 and dtype.itemsize < 4:  # a 16-bit sum: the mean first, as stages 0-2 take it
            wire, factor = (grad * factor).to(dtype), 1.0
        else:  # float32: the shard is scaled once it is in (a rank's part, not the unit)
            wire = grad.to(dtype)  # only read by the reduce-scatter
        out, handle = comm.reduce_scatter_start(wire, "sum", st.mesh.shard)
        self.pending.append((i, out, handle, factor))
        gatherer = self.gatherer()
        if gatherer is not None:
            gatherer._done(i)  # the unit's backward is done: its regathered copy is not needed
        while len(self.pending) > _IN_FLIGHT:
            self._finish_one()

    def _finish_one(self) -> None:
        i, out, handle, factor = self.pending.popleft()
        handle.wait()
        if factor != 1.0:
            out.mul_(factor)
        if i in self.results:  # the unit ran twice in this call
            self.results[i].add_(out)
        elif out.untyped_storage().nbytes() > out.numel() * out.element_size():
            self.results[i] = out.clone()  # a shard of the unit-sized scratch: keep the shard, let it go
        else:
            self.results[i] = out

    def finish(self) -> list[torch.Tensor | None]:
        while self.pending:
            self._finish_one()
        out = [self.results.pop(i, None) for i in range(self.units)]
        self.results.clear()
        gatherer = self.gatherer()
        if gatherer is not None:
            gatherer.drop_ahead()  # backward is over: nothing more to prefetch for
        return out


class _GatherUnit(VmapAsIs, torch.autograd.Function):
    """A unit all-gathered in forward (or taken from its prefetch); its backward starts the unit's
    asynchronous reduce-scatter (`_UnitReducer`); the gradient reaches the sink through the
    collector ``hub``."""

    @staticmethod
    def forward(hub: torch.Tensor, gatherer: UnitGatherer, i: int) -> torch.Tensor:
        return gatherer.fetch(i)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.reducer, ctx.i, ctx.avg = inputs[1].reducer, inputs[2], inputs[1].avg

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        refuse_create_graph(torch.is_grad_enabled())
        ctx.reducer.start(ctx.i, grad, ctx.avg.factor)
        return torch.zeros((), dtype=torch.float32, device=grad.device), None, None


def _settled(ahead: dict[int, tuple[torch.Tensor, Any]]) -> list[torch.Tensor]:
    """Wait for the prefetches in ``ahead``, empty it and return their buffers (their handles,
    which hold views of them, are gone by then)."""
    for _, handle in ahead.values():
        handle.wait()
    out = [full for full, _ in ahead.values()]
    ahead.clear()
    return out


class UnitGatherer:
    """One forward call's stage-3 gathering: the sinks that receive each unit's gradient, the unit
    buffers gathered for the call (by storage address, while their module runs) and those
    gathered ahead of use. ``hint``: the units the previous forward ran, in order."""

    def __init__(self, state: Any, sinks: list[torch.Tensor], hint: list[int], avg: Average, born: int = -1):
        self.state, self.sinks, self.avg = state, sinks, avg
        self.born = born  # the backward its call was made in (`BoundModel.born`)
        self.live: dict[int, int] = {}  # storage address -> unit index, during the unit's forward
        self.regathered: dict[int, torch.Tensor] = {}
        self.swapped: dict[int, Swapped] = {}  # unit -> what to restore
        # unit -> its saved-tensor hooks, the buffer's address and the buffer, while it runs
        self.hooks: dict[int, tuple[Any, int, torch.Tensor]] = {}
        self.pool = state.binding.pool  # gathered buffers, reused once nothing reads them (`_recycle`)
        self.order: list[int] = []  # the units this call ran, in order
        self.entry: dict[int, int] = {}  # unit -> its place in `order`, while its module runs
        self.saved: set[int] = set()  # places in `order` whose saved tensors backward regathers
        self.ahead: dict[int, tuple[torch.Tensor, Any]] = {}  # prefetched unit -> (buffer, handle)
        self.hint, self.on_track = hint, True
        self.tasks: set[int] = set()  # the backwards that differentiate this call (`graph_task`)
        self.buffers: dict[str, torch.Tensor] = {}  # the call's buffers, by name (set by its bound model)
        self._root_again: dict[str, torch.Tensor] | None = None  # `views`, gathered in backward
        self.expect: list[int] | None = None  # backward's regathers in order, known at the first
        self.next_back = 0  # where backward is in `expect`
        # Gradients reduce-scatter asynchronously through a collector, except in a forward that
        # autograd recomputes inside backward (reentrant checkpointing) or one without autograd.
        self.reducer: _UnitReducer | None = None
        if torch.is_grad_enabled() and not recomputed(born):
            self.reducer = _UnitReducer(self)
            self.hub = Collect.apply(self.reducer, *sinks)  # dropped after forward (the graph keeps it)
        self.depth = state.cfg.prefetch if self.reducer is not None and state.mesh.shard.size > 1 else 0

    def _done(self, i: int) -> None:
        full = self.regathered.pop(i, None)
        if full is not None:
            self._recycle(full)

    def replaced(self) -> bool:
        """Whether the call's state gave its compute shard away since its forward (a donating
        step emptied it)."""
        compute = self.state.compute
        return not isinstance(compute, torch.Tensor) or compute.numel() == 0  # (a donated state's marker)

    def _recycle(self, full: torch.Tensor) -> None:
        """A gathered unit nothing needs any more back to the pool, if no tensor over it is left
        (a view something kept, a saved tensor no hook turned into a recipe): then it is only
        let go."""
        if sole_owner(full):
            self.pool.give(full)

    def _shard(self, i: int) -> torch.Tensor:
        lay = self.state.layout
        return lay.arena_slice(self.state.compute, lay.units[i])

    def _prefetch(self, units: list[int]) -> None:
        for i in units:
            if i not in self.ahead:
                with plain():
                    out, handle = comm.all_gather_start(self._shard(i), self.state.mesh.shard, pool=self.pool)
                self.ahead[i] = (_count_bytes(out), handle)

    def fetch(self, i: int) -> torch.Tensor:
        """Unit ``i``'s full buffer: its prefetch once complete, else gathered now."""
        got = self.ahead.pop(i, None)
        if got is None:
            with plain():
                return _count_bytes(comm.all_gather(self._shard(i), self.state.mesh.shard, pool=self.pool))
        got[1].wait()
        return got[0]

    def drop_ahead(self) -> None:
        """A forward or backward is over: wait for and drop the prefetches nothing used, and
        rewind backward's place in `expect` (for a second backward over the same graph)."""
        for full in _settled(self.ahead):
            self._recycle(full)
        self.next_back = 0

    def gather(self, i: int) -> torch.Tensor:
        """Unit ``i`` in full, differentiable: its backward reduce-scatters into sink ``i``."""
        st = self.state
        if self.reducer is not None and not recomputed(self.born):
            return _GatherUnit.apply(self.hub, self, i)
        return _count_bytes(comm.unit_params(self.sinks[i], self._shard(i), None, st.mesh.shard, st.cfg.reduce_dtype,
                                             True, self.avg.current))

    def regather(self, i: int) -> torch.Tensor:
        """Unit ``i`` in full again, for backward (shared by the saved tensors that need it); the
        units backward will regather next start gathering."""
        full = self.regathered.get(i)
        if full is None:
            full = self.regathered[i] = self.fetch(i)
            if self.depth:
                self._prefetch_backward(i)
        return full

    def _prefetch_backward(self, i: int) -> None:
        """Backward regathers unit ``i``: start the ones expected after it."""
        if self.expect is None:
            self.expect = [self.order[k] for k in sorted(self.saved, reverse=True)]
        if i in self.expect[self.next_back:]:
            self.next_back = self.expect.index(i, self.next_back) + 1
            self._prefetch(self.expect[self.next_back:self.next_back + self.depth])

    def root_views(self) -> dict[str, torch.Tensor]:
        """The root unit's parameters (gathered once per call), by name."""
        lay = self.state.layout
        views: dict[str, torch.Tensor] = {}
        for i, unit in enumerate(lay.units):
            if unit.name == "root":
                views.update(lay.views(unit, self.gather(i)))
        if self.depth:
            self._prefetch(self.hint[:self.depth])
        return views

    def views(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Root or frozen parameters ``names`` for a forward recomputed in backward (activation
        checkpointing, outside zfunc's call): the root gathered again once, its gradient
        reduce-scattered into its sink directly (`comm.unit_params`)."""
        frozen = self.state.frozen
        if self._root_again is None and any(n not in frozen for n in names):
            lay = self.state.layout
            self._root_again = {}
            # Differentiable even in a run under no_grad (a nested segment's first run): the inner
            # segments' recomputations use the same gathered root, and their gradients must reach it.
            with torch.enable_grad():
                for i, unit in enumerate(lay.units):
                    if unit.name == "root":
                        self._root_again.update(lay.views(unit, self.gather(i)))
        return {n: frozen[n] if n in frozen else self._root_again[n] for n in names}

    def whole(self, names: list[str]) -> dict[str, torch.Tensor]:
        """`views` for every recomputation of a backward at once
        (`zfunc.autograd.backward_swap.BackwardSwap._swap_whole`)."""
        return self.views(names)

    def enter(self, i: int, slots: list[tuple[str, torch.nn.Module, str]]) -> None:
        """Unit ``i``'s module starts: its parameters become views of the gathered unit, and
        while it runs, tensors autograd saves from them are stored as recipes (`_saving`)."""
        full = self.gather(i)
        self.entry[i] = len(self.order)
        self.order.append(i)
        if self.depth and not recomputed(self.born):
            p = len(self.order)
            self.on_track = self.on_track and self.hint[p - 1:p] == [i]
            if self.on_track:
                self._prefetch(self.hint[p:p + self.depth])
        views = self.state.layout.views(self.state.layout.units[i], full)
        # Restored by `leave`, and by the enclosing functional_call if forward raises.
        self.swapped[i] = swap_in((owner._parameters, attr, views[name]) for name, owner, attr in slots)
        if self.reducer is not None and not recomputed(self.born) and not in_transform() and not hooks_active():
            key = full.untyped_storage().data_ptr()
            self.live[key] = i  # what the saved-tensor hooks look up
            hooks = self._saving()
            hooks.__enter__()
            self.hooks[i] = (hooks, key, full)

    def leave(self, i: int) -> None:
        """Unit ``i``'s module is done: release the gathered buffer (autograd keeps recipes)."""
        hooks = self.hooks.pop(i, None)
        if hooks is not None:
            hooks[0].__exit__(None, None, None)
            self.live.pop(hooks[1], None)
        put_back(self.swapped.pop(i, []))
        if hooks is not None:  # saved tensors of it are recipes: the buffer is free unless a view lives
            self._recycle(hooks[2])

    def unwind(self) -> None:
        """A forward that raised past its units' post-hooks (torch runs those only on an
        ``Exception``): pop the saved-tensor hooks they would have popped, innermost first. The
        module's entries are the enclosing ``functional_call``'s to restore."""
        for i in reversed(list(self.hooks)):
            hooks, key, _ = self.hooks.pop(i)
            hooks.__exit__(None, None, None)
            self.live.pop(key, None)
        self.swapped.clear()

    def _saving(self) -> Any:
        """Saved-tensor hooks for the time one unit's module runs: a saved tensor that views a
        gathered unit is stored as a recipe and regathered when backward needs it. Pushed per
        unit, never around the whole call: a ``torch.func`` transform (which refuses saved-tensor
        hooks) in the code around the units runs as it would without zfunc. None are pushed
        inside a transform (autograd keeps the gathered units it saves until backward, as
        without ZeRO-3) or under the user's own saved-tensor hooks (activation checkpointing,
        ``save_on_cpu``), which then decide what is kept."""
        def pack(t: torch.Tensor) -> Any:
            try:
                i = self.live.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
            except RuntimeError:  # no storage to read: a tensor of a trace (torch.func.linearize's make_fx)
                i = None
            if i is None:
                # Not the tensor itself: an op's saved output would hold its own node through it, a
                # cycle through C++ no collector breaks (a graph dropped without backward would
                # live on). Autograd gives the unpacked tensor its history back.
                return t.detach()
            self.saved.add(self.entry[i])
            return _Recipe(self, i, t)

        def unpack(x: Any) -> torch.Tensor:
            if not isinstance(x, _Recipe):
                return x
            return x.gatherer.regather(x.index).as_strided(x.size, x.stride, x.offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def check_same_units(order: list[int], group: comm.Group) -> None:
    """Raise on every rank if the ranks ran different stage-3 units (or in another order).

    Units of equal size gathered in a different order would silently mix up parameters; one small
    all-reduce after forward catches it. (A rank that skips a unit issues fewer collectives: torch's
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` or the process group's timeout catches that.)
    """
    h = 0
    for i in order:
        h = (h * 1_000_003 + i + 1) % (1 << 61)
    seen = comm.all_reduce(torch.tensor([h, -h], dtype=torch.int64), "max", group)
    try:
        agree = seen[0].item() == -seen[1].item()
    except RuntimeError:  # a traced forward (torch.func.linearize's make_fx) has no values to compare
        return
    if not agree:
        raise RuntimeError(
            f"stage 3: the ranks ran different units in this forward (this rank ran {len(order)}: "
            f"{order[:8]}...); every rank must run the same unit modules in the same order. Put modules "
            "that only some ranks run in the root unit (leave them out of Config.units)")
