"""A call's parameters again for a forward that activation checkpointing recomputes during
backward, outside zfunc's call (`Rebind`): leaves over the call's compute buffer whose gradients
reach the call's gradient path in batches, and, for a backward that never reaches the call's
collector, a collector run at its end on its behalf.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zfunc._probes import graph_task, has_grad_hooks
from zfunc.autograd.calls import at_backward_end, note_backwards

if TYPE_CHECKING:
    from zfunc.autograd.buckets import TapPlan

__all__ = ["Rebind", "Spares"]


class Rebind:
    """A forward call's parameters again, for a forward that autograd recomputes during backward
    (activation checkpointing runs the module outside zfunc's call): leaves over the same compute
    buffer, made per backward when a recomputed module first asks for them and shared by every
    module recomputed in it. Under non-reentrant checkpointing only their values matter (the
    call's own graph carries the gradients). Under reentrant checkpointing each segment's own
    backward accumulates its gradients into those leaves' ``.grad`` in torch's engine, as torch
    does for a plain model (a Python node of zfunc's per segment costs more than the segment's
    arithmetic in a model of small layers), and `collect` hands them to ``take(keys, grads)``, the
    call's batch taker: once more than ``limit`` elements (a bucket's) were handed out since the
    last collect (`views`, per recomputed module), bucket by bucket as segments finish (`whole`,
    every parameter for a backward at once), when the collector runs, and when the backward ends.
    So about a bucket or two of gradient waits outside the accumulator, and buckets still
    complete, and start their reduce, one after another during backward. The call's graph keeps
    the rebind alive, and nothing else: it exists exactly while the call's backward can still run.

    Examples:
        >>> import torch
        >>> from zfunc.autograd.buckets import TapPlan
        >>> from zfunc.distributed.layout import Slot
        >>> got = []
        >>> rb = Rebind(torch.arange(4.0), TapPlan.of([[(0, Slot("w", (2, 2), 0))]]), lambda k, g: got.extend(g), 100)
        >>> w = rb.views(["w"])["w"]
        >>> (w * 3).sum().backward(); w.is_leaf, w.tolist(), got
        (True, [[0.0, 1.0], [2.0, 3.0]], [])
        >>> rb.collect(); got[0].tolist()
        [[3.0, 3.0], [3.0, 3.0]]
    """

    def __init__(self, compute: torch.Tensor, plan: TapPlan, take: Any, limit: int,
                 collector: Callable[[], torch.Tensor] | None = None, flight: Any = None,
                 spares: Spares | None = None):
        self.compute, self.plan, self.take, self.limit = compute, plan, take, limit
        self.spares = spares  # leaves over ``compute`` that earlier backwards made, reused (`Spares`)
        self.collector, self.flight = collector, flight  # what `settle` needs: a new collector node
        self._owed = False  # gradients handed over since the call's collector last ran
        self.frozen: dict[str, torch.Tensor] = {}  # the call's frozen parameters, by name
        self.tasks: set[int] = set()  # the backwards that differentiate this call (`zfunc._probes.graph_task`)
        self.buffers: dict[str, torch.Tensor] = {}  # the call's buffers, by name (set by its bound model)
        self._made: dict[int, dict[str, torch.Tensor]] = {}  # by backward (graph task): the leaves handed out in it
        self._spare: dict[int, dict[str, torch.Tensor]] = {}  # by backward: earlier backwards' leaves not handed out yet
        self._since = 0  # elements handed out since the last collect
        self._hooked: dict[int, list[Any]] = {}  # by backward: the handles of `whole`'s bucket hooks
        self._ready: dict[int, int] = {}  # by backward: the bucket whose first parameter's gradient came last (`_bucket_in`)
        self._fired: dict[int, set[int]] = {}  # by backward: the buckets whose first parameter has a gradient

    def replaced(self) -> bool:
        """Whether the call's compute buffer was given away since its forward (a donating step
        emptied it)."""
        return self.compute.numel() == 0

    def views(self, names: list[str], whole: bool = False) -> dict[str, torch.Tensor]:
        """Parameters ``names`` (trained or frozen) as the call had them. With ``whole`` (for
        `whole`, every parameter for the backward at once) handing them out collects nothing."""
        task = graph_task()
        made = self._made.get(task)
        if made is None:
            made = self._made[task] = {}
            if task != -1:  # collected and forgotten when that backward ends
                at_backward_end(functools.partial(_backward_ended, weakref.ref(self), task))
                self._spare[task] = self.spares.take(self.compute) if self.spares is not None else {}
        out = {}
        for n in names:
            if n in self.frozen:
                out[n] = self.frozen[n]
                continue
            leaf = made.get(n)
            if leaf is None:
                spare = self._spare.get(task)
                leaf = spare.pop(n, None) if spare else None
                if leaf is None:
                    _, (offset, shape, stride) = self.plan.by_name[n]
                    c = self.compute
                    # (detached: not a view holding ``compute`` alive, as a kept leaf must not be)
                    leaf = c.as_strided(shape, stride, c.storage_offset() + offset).detach().requires_grad_()
                made[n] = leaf
                if not whole:
                    self._since += leaf.numel()
                    if self._since > self.limit:  # the earlier segments' backwards are done: theirs in
                        self.collect(made)
            out[n] = leaf
        return out

    def whole(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Parameters ``names`` (in the module's order) for every recomputation of the backward
        running now, handed out at once (`zfunc.autograd.backward_swap.BackwardSwap._swap_whole`). Under
        reentrant checkpointing each bucket's gradients are handed to ``take`` once the first of
        its parameters in ``names`` has one and the next bucket's first one has too: the segments
        run their backwards last to first, so that one's gradient comes last, and about two
        buckets wait outside the accumulator (from the second backward on, and only while no
        backward saw a bucket's first parameter differentiated twice, `Spares.early`). What comes
        later, or in another order, is handed over when the collector runs or the backward ends,
        as `views`' are."""
        task = graph_task()
        out = self.views(names, whole=True)
        made = self._made.get(task)
        if task == -1 or made is None or task in self._hooked:
            return out
        first: dict[int, str] = {}
        bucket = self.plan.bucket
        for n in names:
            if n in made:
                first.setdefault(bucket[n], n)
        ref = weakref.ref(self)
        self._hooked[task] = [made[n].register_post_accumulate_grad_hook(functools.partial(_bucket_in, ref, task, k))
                              for k, n in first.items()]
        return out

    def collect(self, made: dict[str, torch.Tensor] | None = None) -> None:
        """Hand ``take`` the gradients the leaves of ``made`` (else of the backward running now)
        hold, and clear them."""
        made = self._made.get(graph_task()) if made is None else made
        self._since = 0
        if not made:
            return
        keys, grads, by_name = [], [], self.plan.by_name
        for name, leaf in made.items():
            g = leaf.grad
            if g is not None:
                leaf.grad = None
                keys.append(by_name[name][0])
                grads.append(g)
        if keys:
            self._owed = True
            self.take(tuple(keys), tuple(grads))

    def settle(self) -> None:
        """A backward through the call's outputs ends. If gradients were handed over since the
        call's collector last ran (its graph held none of the taps of the call's forward: every
        trained parameter was used inside reentrant checkpoints, whose own backwards delivered the
        gradients), run a collector of the same reducer now: it finishes the reduces they started
        and hands the sinks the result, as the call's collector would have (the sinks' hooks run
        too, and see the backward that ends, ``flight.task_now``: the engine counts it and checks
        its loss scale). A backward nested in it (a segment's) does not settle: its outer one does."""
        if not self._owed or self.collector is None:
            return
        self._owed = False
        outer, ran = graph_task(), []  # (autograd's final callbacks run in the backward that ends)
        with torch.enable_grad():
            hub = self.collector()

        def acts(task: int) -> None:
            ran.append(task)
            self.flight.acting[task] = outer

        if self.flight is not None:
            note_backwards(hub, acts)
        try:
            hub.backward()
        finally:
            for task in ran:
                self.flight.acting.pop(task, None)


def _backward_ended(ref: weakref.ref, task: int) -> None:
    rebind = ref()
    if rebind is not None:
        for handle in rebind._hooked.pop(task, ()):
            handle.remove()
        rebind._ready.pop(task, None)
        fired = rebind._fired.pop(task, None)
        if fired is not None and rebind.spares is not None and rebind.spares.early is None:
            rebind.spares.early = True  # (a backward with no bucket's first parameter differentiated twice)
        made = rebind._made.pop(task, None)
        spare = rebind._spare.pop(task, None)
        if made is not None:
            rebind.collect(made)
            if rebind.spares is not None:  # (their gradients handed over and cleared)
                rebind.spares.give(rebind.compute, {**spare, **made} if spare else made)
            if task in rebind.tasks:  # through the call's outputs, not a segment's nested backward
                rebind.settle()


def _bucket_in(ref: weakref.ref, task: int, k: int, leaf: torch.Tensor) -> None:
    """The first parameter of bucket ``k`` in the module's order has its gradient (`Rebind.whole`):
    the gradients of the bucket whose first one came before go to the call's batch taker, and
    bucket ``k``'s wait for the next (a parameter used in the segment and outside it gets its other
    part from the call's graph meanwhile, before its bucket can start; the collector takes what
    is left)."""
    rebind = ref()
    made = None if rebind is None else rebind._made.get(task)
    if made is None:
        return
    fired = rebind._fired.setdefault(task, set())
    spares = rebind.spares
    if k in fired and spares is not None:  # a segment applied again (a block shared by two): not bucket by bucket
        spares.early = False
    fired.add(k)
    if spares is not None and spares.early:
        earlier, rebind._ready[task] = rebind._ready.get(task), k
        if earlier is not None and earlier != k:
            rebind.collect({n: made[n] for n in rebind.plan.names[earlier] if n in made})


_KEPT_SETS = 2  # leaf sets a `Spares` keeps per buffer: as many backwards recomputing on it at once


class Spares:
    """The leaves `Rebind` made over a compute buffer, kept for the next backward that recomputes
    on the same buffer (a binding keeps one): a model of many small parameters spends more
    making a leaf per parameter per backward (a view, ``requires_grad_``) than recomputing them.
    A backward takes a set (`take`) and gives it back at its end, every gradient collected
    (`give`): two running at once never share one. A set is kept only while its buffer lives
    and still holds the same memory (a weak reference to the buffer drops it with the buffer, so
    no memory outlives its state); a donated buffer's successor, a new tensor over the same
    memory, takes the sets over (`moved`).

    Examples:
        >>> import torch
        >>> spares, compute = Spares(), torch.zeros(4)
        >>> leaf = compute[:2].detach().requires_grad_()
        >>> spares.give(compute, {"w": leaf})
        >>> spares.take(compute)["w"] is leaf, spares.take(compute)
        (True, {})
        >>> spares.give(compute, {"w": leaf}); del compute
        >>> len(spares._by)
        0
    """

    __slots__ = ("_by", "early", "__weakref__")

    def __init__(self) -> None:
        # Whether `Rebind.whole` hands reentrant segments' gradients over bucket by bucket: not
        # before a backward showed no bucket's first parameter differentiated twice (None: none
        # ran yet; False for good once one was, a block applied in two segments, whose second
        # part would come after its bucket started). Until then at the collector and the end.
        self.early: bool | None = None
        # id(buffer) -> (a weak reference to it, where its memory is, the leaf sets)
        self._by: dict[int, tuple[weakref.ref, tuple, list[dict[str, torch.Tensor]]]] = {}

    def take(self, compute: torch.Tensor) -> dict[str, torch.Tensor]:
        """A set of leaves over ``compute`` (by name) that no backward uses, or an empty one."""
        entry = self._by.get(id(compute))
        if entry is None or entry[0]() is not compute or entry[1] != _where(compute):
            return {}
        try:
            return entry[2].pop()
        except IndexError:  # none left (another thread's backward took the last)
            return {}

    def give(self, compute: torch.Tensor, leaves: dict[str, torch.Tensor]) -> None:
        """Keep ``leaves`` (over ``compute``, none holding a gradient) for a later backward, but
        one the recomputed forward put a gradient hook on (a hook on ``self.weight`` made in ``forward``):
        that hook belongs to that recomputation, as on the fresh leaf a later one gets."""
        if compute.numel() == 0:  # given away meanwhile (donated): its memory is another state's
            return
        entry = self._entry(compute)
        if len(entry[2]) < _KEPT_SETS:
            entry[2].append({n: leaf for n, leaf in leaves.items() if not has_grad_hooks(leaf)})

    def moved(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``new`` holds ``old``'s memory now (a donation made it; ``old`` is emptied): the sets
        over it go with it."""
        entry = self._by.pop(id(old), None)
        if entry is not None and entry[0]() is old and entry[2] and entry[1] == _where(new):
            self._entry(new)[2].extend(entry[2][:_KEPT_SETS])

    def _entry(self, compute: torch.Tensor) -> tuple[weakref.ref, tuple, list[dict[str, torch.Tensor]]]:
        key, where = id(compute), _where(compute)
        entry = self._by.get(key)
        if entry is None or entry[0]() is not compute or entry[1] != where:
            entry = self._by[key] = (weakref.ref(compute, functools.partial(_forget, weakref.ref(self), key)), where, [])
        return entry


def _where(t: torch.Tensor) -> tuple:
    """Where ``t``'s elements are: a set of leaves over it is valid while this is unchanged."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype, t.device


def _forget(ref: weakref.ref, key: int, _: Any) -> None:
    """A buffer with kept leaves is gone: they go too."""
    spares = ref()
    if spares is not None:
        spares._by.pop(key, None)
