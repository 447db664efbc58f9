"""A backward's recomputations on the call's tensors, put in once (`BackwardSwap`): at the first
module a backward through a call's outputs recomputes (activation checkpointing), the call's
parameters outside the units and its buffers go in the module's entries, as
``torch.func.functional_call`` puts a call's in for the call, and stay until that backward ends,
so every recomputed layer runs with no hook of zfunc's. A mixin of
`zfunc.autograd.recompute.Recompute`, which finds the call and decides when.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any

import torch

from zfunc._probes import graph_task
from zfunc.autograd import calls
from zfunc.autograd.swap import put_back, swap_in

__all__ = ["BackwardSwap", "Outside"]


@dataclasses.dataclass(frozen=True)
class Outside:
    """What `BackwardSwap._swap_whole` puts in, laid out once: the parameters outside the units by
    every name they have (``names``, canonical, with each entry's ``places``), each once
    (``unique``), and the buffers as ``(name, entries, attribute)``."""

    names: list[str]
    places: list[tuple[dict, str]]
    unique: list[str]
    buffers: list[tuple[str, dict, str]]

    @classmethod
    def of(cls, slots: list[tuple[str, torch.nn.Module, str]], buffers: list[tuple[str, torch.nn.Module, str]]) -> Outside:
        """From ``(canonical name, owning module, attribute)`` slots of the parameters and buffers."""
        names = [n for n, _, _ in slots]
        return cls(names=names, places=[(owner._parameters, attr) for _, owner, attr in slots],
                   unique=list(dict.fromkeys(names)),
                   buffers=[(n, owner._buffers, attr) for n, owner, attr in buffers])


class BackwardSwap:
    """The swap for a backward's recomputations (``module``, ``flight``, ``stage``, ``_outside``,
    ``_wholes``, the ``_users_lock``, ``occupy``/``release`` are the binding's; ``_source``,
    ``_at_rest``, ``_arm`` the recompute binding's)."""

    module: torch.nn.Module
    flight: calls.InFlight
    stage: int
    _outside: Outside
    _wholes: dict[int, tuple[int, Any, bool, Any]]
    _users_lock: Any

    def _swap_whole(self, params: bool = True) -> bool:
        """In a forward recomputed during backward, at its first module that may read them: put
        the parameters outside the units and the buffers of the call whose backward this is
        (`Recompute._source`) in the module's entries, until that backward ends (`_Whole`), as
        ``functional_call`` puts a call's in for the call: the leaves of `zfunc.autograd.rebind.Rebind`
        over the call's compute buffer, the call's buffers as its forward left them. Every later
        recomputation in the backward, whichever module runs it, reads them there: no hook on a
        module of theirs. At stage 3 the parameters (the root, gathered again) go in only with
        ``params`` (a recomputed module holds one of them: its root recompute hook), the buffers
        at once: a backward that recomputes only units does not gather the root again. Whether
        what was asked is in now (nothing is put in in a backward that runs through none of the
        calls, plain torch on the module in another thread, nor inside a zfunc forward call).

        Raises:
            RuntimeError: another thread runs the module for a zfunc call now (`ModuleBinding.occupy`), or
                another binding's call has its tensors in the module (`Recompute._at_rest`).
        """
        outside = self._outside
        if not outside.names and not outside.buffers:
            return True
        task = graph_task()
        if task == -1 or self.flight.current() is not None:
            return False
        source = self._source(task)
        if source is None:
            return False
        me = threading.get_ident()
        params = params or self.stage != 3  # (at stages 0-2 views of the call's buffer: no cost to put in)
        with self._users_lock:
            done = [has for thread, call, has, _ in self._wholes.values() if thread == me and call is source]
        names, places, bufs = outside.names, outside.places, outside.buffers
        if done:
            if any(done) or not params or not names:
                return True
            bufs = []  # (in already: the parameters now)
        elif not params:
            names, places = [], []
        self.occupy()
        swapped: list = []
        try:
            views = source.whole(outside.unique) if names else {}
            # A call a gradient hook of this thread's backward made goes on top of that backward's
            # tensors (which are back when the call's own backward ends); any other tensor is checked
            now = places[0][0].get(places[0][1]) if names else None
            with self._users_lock:
                over = any(thread == me and first is now for thread, _, _, first in self._wholes.values())
            if not over:
                self._at_rest(self.module, names, places, views)
            given = source.buffers
            kept = [(entries, attr, n) for n, entries, attr in bufs if n in given]
            swapped = swap_in(itertools.chain(((entries, attr, views[n]) for n, (entries, attr) in zip(names, places)),
                                              ((entries, attr, given[n]) for entries, attr, n in kept)))
            whole = _Whole(self, me, source, swapped, [(entries, attr, n, given[n]) for entries, attr, n in kept])
        except BaseException:
            put_back(swapped)
            self.release()
            raise
        with self._users_lock:  # (from here on `whole` undoes it, when autograd runs it or lets it go)
            self._wholes[id(whole)] = (me, source, params, views[names[0]] if names else None)
            self.flight.params_in = self.flight.params_in or bool(names)
            self.flight.any_whole = True
        calls.at_backward_end(whole)
        return True

    def _unswap_whole(self, whole: _Whole) -> None:
        """The backward `_swap_whole` put ``whole`` in for ends (or raised): the module's entries
        hold what they held before, and a buffer the recomputations reassigned is the call's."""
        with self._users_lock:
            self._wholes.pop(id(whole), None)
            self.flight.params_in = any(has for _, _, has, _ in self._wholes.values())
            self.flight.any_whole = bool(self._wholes)
        try:
            for entries, attr, name, tensor in whole.put:
                now = entries[attr]
                if now is not tensor:
                    whole.source.buffers[name] = now
            put_back(whole.swapped)
        finally:
            self.release(whole.thread)
        if self.flight.backwards:  # (a nested backward's end: its outer one may recompute again)
            self._arm()


class _Whole:
    """What `BackwardSwap._swap_whole` put in for a backward, undone at its end: autograd runs it as
    the backward's final callback, or, when the backward raises and autograd drops its callbacks
    unrun, as it lets it go (`BackwardSwap._unswap_whole`). ``swapped``: for `put_back`; ``put``: the
    call's buffers put in, whose entries a recomputation may reassign (``self.n = self.n + 1``
    rather than in place), handed to the call as the forward's end does for its own forward."""

    __slots__ = ("binding", "thread", "source", "swapped", "put")

    def __init__(self, binding: BackwardSwap, thread: int, source: Any, swapped: list,
                 put: list[tuple[dict, str, str, torch.Tensor]]):
        self.binding: BackwardSwap | None = binding
        self.thread, self.source, self.swapped, self.put = thread, source, swapped, put

    def __call__(self) -> None:
        binding, self.binding = self.binding, None
        if binding is not None:
            binding._unswap_whole(self)

    def __del__(self) -> None:
        self()
