"""The engine's routing: calls of the user's module itself (``engine.module(x)``, as
DeepSpeed's users and Hugging Face make them) run on the engine's state, as calls of the bound
model do. A mixin of `zfunc.autograd.binding.ModuleBinding`: two hooks on the top module, kept
while the engine lives (the shim's one standing exception to call-scoped hooks), taken off by
`Routing.unroute` or once the engine is gone.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from zfunc.autograd import calls
from zfunc.autograd.swap import Swapped, put_back, swap_in

if TYPE_CHECKING:
    from zfunc.autograd.bound import BoundModel

__all__ = ["Routing"]


class Routing:
    """`route`, `hold` and `unroute` for a binding (``module``, ``_handles``, ``_members``,
    ``_frames``, ``entries``, ``canonical``, ``flight``, ``occupy``/``release``/``attach`` are the
    binding's)."""

    module: torch.nn.Module
    _handles: list[RemovableHandle]
    _members: list[Any]
    _probe: tuple[tuple[dict[str, Any], str], tuple[dict[str, Any], str]] | None
    _users: dict[int, int]
    _frames: dict[int, list[Any]]
    layout: Any
    flight: calls.InFlight

    def route(self, bound: Callable[[], BoundModel | None]) -> None:
        """Calls of the module itself run on the state ``bound()`` binds, as calls of the bound
        model do (the engine's ``engine.module``): same parameters, gradients into the state.
        Two hooks on the top module do it; once ``bound()`` gives None (the engine is gone) they
        take themselves off (`unroute`) and the call runs on the module's own tensors."""
        self._members = [(entries, attr, self.canonical.get(name, name)) for entries, attr, name in self.entries]
        # The first and the last trained parameter's entries: at rest each holds a parameter (`_foreign`)
        trained = [(entries, attr) for entries, attr, name in self._members if name in self.layout.names]
        self._probe = (trained[0], trained[-1]) if trained else None
        me = weakref.ref(self)
        self._handles.append(self.module.register_forward_pre_hook(
            lambda mod, args, kwargs: me()._route_in(bound, args, kwargs) if me() else None,
            with_kwargs=True, prepend=True))
        self._handles.append(self.module.register_forward_hook(
            lambda mod, args, kwargs, out: me()._route_out(out) if me() else None, with_kwargs=True,
            always_call=True))

    def hold(self, handle: RemovableHandle) -> None:
        """Another hook on the module that leaves it with the binding (the engine's own)."""
        self._handles.append(handle)

    def unroute(self) -> None:
        """Take the engine's hooks (`route`, `hold`) off the module; the hooks a call puts on
        stay available to every state sharing the binding (`destroy()` of an engine whose
        state was copied leaves the copy working)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._members = []

    def _route_in(self, bound: Callable[[], BoundModel | None], args: tuple, kwargs: dict) -> Any:
        frames = self._frames.setdefault(threading.get_ident(), [])  # this thread's routed calls
        if self.flight.current() is not None or self._foreign():  # a zfunc call runs the module already
            frames.append(None)
            return None
        model = bound()
        if model is None:  # the engine is gone: its hooks go, this call runs as the module's own
            self.unroute()
            return None
        frames.append(None)
        self.occupy()
        try:
            self.attach()
            tensors, args, kwargs, contexts = model.prepare(args, kwargs)
        except BaseException:
            self.release()
            raise
        # As functional_call does for the whole call (no public API can do it from hooks): the
        # module's entries become the state's tensors until `_route_out` puts them back.
        members = [(entries, attr, name) for entries, attr, name in self._members if name in tensors]
        restore = (swap_in((entries, attr, tensors[name]) for entries, attr, name in members),
                   [name for _, _, name in members])
        stack = contextlib.ExitStack()
        self.flight.enter(model)
        try:
            for c in contexts:
                stack.enter_context(c)
        except BaseException:
            self.flight.leave()
            self._put_back(restore, tensors)
            self.release()
            raise
        frames[-1] = (model, tensors, restore, stack)
        return args, kwargs

    def _foreign(self) -> bool:
        """Whether another state's zfunc call has its tensors in the module's entries now (a
        state made by ``zfunc.init(engine.module, ...)`` runs it; it puts in every parameter,
        the first and the last among them): that call runs on its own state, not routed to the
        engine's. (While a call of this binding runs, in any thread, the entries hold its
        tensors: routed, which refuses another thread's call.)"""
        probe = self._probe
        return (probe is not None and not self._users
                and not any(isinstance(entries.get(attr), torch.nn.Parameter) for entries, attr in probe))

    def _route_out(self, out: Any) -> Any:
        me = threading.get_ident()
        frames = self._frames.get(me)
        frame = frames.pop() if frames else None
        if frames is not None and not frames:
            del self._frames[me]
        if frame is None:
            return None
        model, tensors, restore, stack = frame
        try:
            stack.close()
            self.flight.leave()
            self._put_back(restore, tensors)
        finally:
            self.release()
        return model.finish(out, tensors)

    @staticmethod
    def _put_back(restore: tuple[Swapped, list[str]], tensors: dict[str, torch.Tensor]) -> None:
        swapped, names = restore
        for (entries, attr, _), name in zip(swapped, names):
            tensors[name] = entries[attr]  # a buffer the module reassigned is its new value
        put_back(swapped)
