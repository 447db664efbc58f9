"""The recompute binding: a forward that activation checkpointing recomputes during backward,
outside zfunc's call, runs on the parameters of the call whose backward it is. A mixin of
`zfunc.autograd.binding.ModuleBinding`: forward pre/post hooks on each module whose forward reads
parameters outside the units (`Recompute._install_recompute_hooks`), put on when a backward
reaches a call's outputs (`Recompute._reached`) and acting only while one runs; the call is found
from the graph (`Recompute._source`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from zfunc._probes import graph_task
from zfunc.autograd import calls
from zfunc.autograd.direct_reads import DirectReads
from zfunc.autograd.swap import put_back, swap_in

__all__ = ["Recompute", "CALL", "RECOMPUTE"]

CALL, RECOMPUTE = 0, 1  # the phases of `zfunc.autograd.binding.ModuleBinding.attach`


class Recompute:
    """The recompute hooks of a binding (``module``, ``unit_params``, ``flight``, ``reads``,
    ``_specs``, ``_slots``, ``_rebound``, ``_watch``, ``_members``, the ``_users_lock``,
    ``occupy``/``release``/``attach`` are the binding's)."""

    module: torch.nn.Module
    unit_params: dict[str, torch.Tensor]
    flight: calls.InFlight
    reads: DirectReads
    _specs: list[Any]
    _rebound: dict[tuple[int, int], list[Any]]
    _watch: set[weakref.ref]
    _members: list[Any]
    _users_lock: Any
    _generation: int
    _last_source: tuple[int, weakref.ref] | None

    def _install_recompute_hooks(self) -> None:
        """Hooks on each module whose forward reads parameters outside the units: when autograd
        recomputes a forward during backward (activation checkpointing), outside zfunc's call,
        the module runs on the latest call's parameters (`_rebind_in`), not on the module's own.
        A parameter is read by the forward of the module holding it, or, when that module has no
        forward (``nn.ParameterList``, ``nn.ParameterDict``), by its nearest ancestor's. A module's
        hooks put in its whole subtree's parameters, not only its own: a forward may read a
        child's parameter without calling the child (``nn.MultiheadAttention`` reads
        ``out_proj.weight`` in its own forward). A module holding no parameter of its own has no
        hooks: its reads of its children's parameters are not covered (`zfunc.autograd.direct_reads`
        refuses them under reentrant checkpointing)."""
        outside = [n for n, _ in self.module.named_parameters() if n not in self.unit_params]
        modules = dict(self.module.named_modules(remove_duplicate=False))
        path_of: dict[int, str] = {}
        for path, mod in modules.items():
            path_of.setdefault(id(mod), path)
        owners: dict[int, list[tuple[str, torch.nn.Module, str]]] = {}
        reader: dict[int, torch.nn.Module] = {}
        for slot in self._slots(outside):
            path, mod = path_of[id(slot[1])], slot[1]
            while path and type(mod).forward is torch.nn.Module.forward:  # never called: its parent reads it
                path = path.rpartition(".")[0]
                mod = modules[path]
            owners.setdefault(id(mod), []).append(slot)
            reader[id(mod)] = mod
        held = [slot for slots in owners.values() for slot in slots]
        for key in owners:  # each reader's subtree (by identity: a module may sit under two paths)
            below = {id(m) for m in reader[key].modules()}
            mine = {(id(owner), attr) for _, owner, attr in owners[key]}
            owners[key] += [slot for slot in held if id(slot[1]) in below and (id(slot[1]), slot[2]) not in mine]
        me, flight = weakref.ref(self), self.flight

        def pre(slots: list) -> Any:
            def hook(mod: torch.nn.Module, args: Any) -> None:
                if flight.backwards == 0:  # a forward: nothing to do (and compiled blocks trace this)
                    return
                b = me()
                if b is not None:
                    b._rebind_in(mod, slots)
            return hook

        def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
            if flight.backwards == 0:
                return
            b = me()
            if b is not None:
                b._rebind_out(mod)

        for key, slots in owners.items():
            mod = reader[key]
            self._specs += [(mod, True, pre(slots), RECOMPUTE), (mod, False, post, RECOMPUTE)]

    def _rebind_in(self, mod: torch.nn.Module, slots: list[tuple[str, torch.nn.Module, str]]) -> bool:
        """In a forward recomputed during backward: put the parameters of the call whose backward
        this is in place (`_source`: found from the graph)."""
        if self.flight.current() is not None:
            return False
        task = graph_task()
        if task == -1:
            return False
        source = self._source(task)
        if source is None:
            return False
        self.occupy()
        try:
            views = source.views([n for n, _, _ in slots])
            self._rebound.setdefault((threading.get_ident(), id(mod)), []).append(
                swap_in([(owner._parameters, attr, views[n]) for n, owner, attr in slots]))
        except BaseException:
            self.release()
            raise
        return True

    def _source(self, task: int | None = None) -> Any:
        """The call whose backward is running now, for a forward recomputed in it: among the calls
        whose graph lives, the one this backward (or, for a reentrant segment's own backward, the
        one it runs inside) entered through its outputs (the marker on their nodes notes the graph
        task on it, `zfunc.autograd.calls`), else the only one. Two are
        ambiguous: refused. Kept for the backward's next recomputed module (a graph task's id is
        never reused)."""
        task = graph_task() if task is None else task
        last = self._last_source
        if last is not None and last[0] == task:
            found = last[1]()
            if found is not None:
                return found
        with self._users_lock:  # another thread may add a call meanwhile
            live = [c for c in (ref() for ref in self._watch) if c is not None]
            generation = self._generation
        mine = [c for c in live if task in c.tasks]
        if not mine and self.flight.nested():  # a reentrant segment's own backward: its outer one's call
            outer = self.flight.enclosing()
            mine = [c for c in live if outer in c.tasks]
        mine = mine or live
        if len(mine) > 1:
            raise RuntimeError(
                f"activation checkpointing recomputes part of {type(self.module).__name__} during backward, "
                f"and {len(mine)} forward calls of it through zfunc are differentiated by this backward (the model "
                "called twice in one loss, or on its own output): zfunc cannot tell which call's parameters and "
                "gradients the recomputation belongs to (a state and its copy.deepcopy share the module, so "
                "their calls count as two calls of it). Run each call's backward on its own, or leave "
                "checkpointing out of a model called more than once per backward")
        if not mine:
            return None
        with self._users_lock:  # kept unless a call was added or reached meanwhile (another thread)
            if self._generation == generation:
                self._last_source = (task, weakref.ref(mine[0]))
        return mine[0]

    def _rebind_out(self, mod: torch.nn.Module) -> None:
        stack = self._rebound.get((threading.get_ident(), id(mod)))
        if stack:
            put_back(stack.pop())
            self.release()

    def _reached(self) -> None:
        """A backward reached a call's outputs: the recompute hooks go on, and which call a
        recomputation belongs to is found afresh (`_source`)."""
        with self._users_lock:
            self._forget_source()
        self.attach(RECOMPUTE)
        if not self._members:  # (the engine checks its module's own gradients at step())
            self.reads.watch(graph_task())

    def _forget_source(self) -> None:
        """(Under the lock.) `_source`'s kept answer may be stale: found afresh next time."""
        self._generation += 1
        self._last_source = None
