"""ZeRO-3: a unit's parameters exist in full only while its module runs.

Forward gathers the *root* unit (parameters outside every unit, and the small ones below the
persistence threshold) once per call. Every other unit is gathered by a forward pre-hook on its
module, through the differentiable `zfunc.comm.bind_unit` (so its gradient is reduce-scattered
when its backward is done), and released by the post-hook. Autograd would keep the gathered
buffer alive until backward through the tensors it saves; a saved-tensor hook replaces each such
tensor with a recipe (unit, offset, size, stride) that gathers the unit again when backward
needs it. So the gathered parameters alive at any moment stay near one unit plus the root.

Every rank must run the same units in the same order (as with DeepSpeed and FSDP).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from zfunc import comm

__all__ = ["Binding", "track_gathered", "install_hooks"]

_STATS = {"live": 0, "peak": 0}


def _count_bytes(full: torch.Tensor) -> torch.Tensor:
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
        >>> from zfunc.gather import track_gathered
        >>> with track_gathered() as stats:
        ...     pass
        >>> stats["peak"]
        0
    """
    base = _STATS["live"]
    _STATS["peak"] = base
    out = {"peak": 0}
    try:
        yield out
    finally:
        out["peak"] = _STATS["peak"] - base


class _Recipe:
    """A saved tensor that was a view of a gathered unit: enough to rebuild it later."""

    __slots__ = ("binding", "index", "offset", "size", "stride")

    def __init__(self, binding: Binding, index: int, t: torch.Tensor):
        self.binding, self.index = binding, index
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()


class Binding:
    """One forward call's view of a stage-3 state: which sinks receive the gradients, and the
    unit buffers gathered for it (by storage address, while their module runs)."""

    def __init__(self, state: Any, sinks: list[torch.Tensor]):
        self.state, self.sinks = state, sinks
        self.live: dict[int, int] = {}  # storage address -> unit index, during the unit's forward
        self.regathered: dict[int, torch.Tensor] = {}
        for i, sink in enumerate(sinks):  # the graph holds the sinks, so this binding lives as long as it
            sink._zfunc_binding = self
            # The unit's backward is done when its gradient reaches the sink: drop the regathered
            # copy then. (Deciding by graph order, never by object lifetimes, keeps every rank's
            # collectives in the same order.)
            sink.register_post_accumulate_grad_hook(lambda _, i=i: self._done(i))
        me = weakref.ref(self)
        for mod in install_hooks(state):
            mod._zfunc_binding = me

    def _done(self, i: int) -> None:
        self.regathered.pop(i, None)

    def _shard(self, i: int) -> torch.Tensor:
        lay = self.state.layout
        return lay.arena_slice(self.state.compute, lay.units[i])

    def gather(self, i: int) -> torch.Tensor:
        """Unit ``i`` in full, differentiable: its backward reduce-scatters into sink ``i``."""
        st = self.state
        full = comm.bind_unit(self.sinks[i], self._shard(i), None, st.group, st.cfg.reduce_dtype, True)
        return _count_bytes(full)

    def regather(self, i: int) -> torch.Tensor:
        """Unit ``i`` in full again, for backward (shared by the saved tensors that need it)."""
        full = self.regathered.get(i)
        if full is None:
            full = self.regathered[i] = _count_bytes(comm.all_gather(self._shard(i), self.state.group))
        return full

    def root_views(self) -> dict[str, torch.Tensor]:
        lay = self.state.layout
        views: dict[str, torch.Tensor] = {}
        for i, unit in enumerate(lay.units):
            if unit.name == "root":
                views.update(lay.views(unit, self.gather(i)))
        return views

    def saved_tensor_hooks(self) -> Any:
        def pack(t: torch.Tensor) -> Any:
            i = self.live.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
            return t if i is None else _Recipe(self, i, t)

        def unpack(x: Any) -> torch.Tensor:
            if not isinstance(x, _Recipe):
                return x
            return x.binding.regather(x.index).as_strided(x.size, x.stride, x.offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _modules(state: Any) -> dict[str, torch.nn.Module]:
    return dict(state.module.named_modules())


def install_hooks(state: Any) -> list[torch.nn.Module]:
    """Once per layout: pre/post forward hooks on each unit's module that swap its parameters
    for views of the gathered unit (from the binding of the forward call that runs it).

    Returns the unit modules (remembered on the root module, so a forward does not walk the
    module tree again).
    """
    lay, root = state.layout, state.module
    known = root.__dict__.get("_zfunc_units")
    if known is not None and known[0] is lay:
        return known[1]
    modules = _modules(state)
    units = []
    for i, unit in enumerate(lay.units):
        if unit.name == "root":
            continue
        mod = modules[unit.name]
        units.append(mod)
        if getattr(mod, "_zfunc_hooked", None) is lay:
            continue
        slots = [(s, *_owner(modules, s.name)) for s in unit.slots]
        mod.register_forward_pre_hook(_pre_hook(i, slots))
        mod.register_forward_hook(_post_hook(slots))
        mod._zfunc_hooked = lay
    root._zfunc_units = (lay, units)
    return units


def _owner(modules: dict[str, torch.nn.Module], name: str) -> tuple[torch.nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return modules[parent], attr


def _pre_hook(i: int, slots: list) -> Any:
    def hook(mod: torch.nn.Module, args: Any) -> None:
        ref = getattr(mod, "_zfunc_binding", None)
        binding = ref() if ref is not None else None
        if binding is None:
            raise RuntimeError(f"module {type(mod).__name__} holds stage-3 shards; call it through zfunc "
                               "(backward_step, vjp, train_step or the engine), not directly")
        full = binding.gather(i)
        binding.live[full.untyped_storage().data_ptr()] = i
        views = binding.state.layout.views(binding.state.layout.units[i], full)
        mod._zfunc_saved = [(owner, attr, owner._parameters[attr]) for s, owner, attr in slots]
        for s, owner, attr in slots:
            owner._parameters[attr] = views[s.name]

    return hook


def _post_hook(slots: list) -> Any:
    def hook(mod: torch.nn.Module, args: Any, out: Any) -> None:
        ref = getattr(mod, "_zfunc_binding", None)
        binding = ref() if ref is not None else None
        for s, owner, attr in slots:
            if binding is not None:
                binding.live.pop(owner._parameters[attr].untyped_storage().data_ptr(), None)
        for owner, attr, original in mod.__dict__.pop("_zfunc_saved", []):
            owner._parameters[attr] = original

    return hook
