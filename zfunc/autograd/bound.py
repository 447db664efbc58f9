"""The module bound to one state: what ``loss_fn`` receives as ``model``.

A `BoundModel` is the user's module as a function of its inputs, running on one state's tensors
put in the module's entries for the call, as `torch.func.functional_call` puts them (through
the binding's list of entries and `zfunc.autograd.swap`). Its outputs are exactly what the module returns: gradients
through it are torch's, and only the parameters' gradients are averaged, where they enter the
state (`zfunc.autograd.average`). Its buffers' new values (BatchNorm statistics) are kept for
the state that follows.

It answers as a module does where that is meaningful: ``named_parameters()``/``parameters()``
give the tensors forward uses (at stages 0-2 views of the state's compute buffer whose gradients
reach the state; frozen parameters as they are), ``named_buffers()`` the call's buffers, and
``torch.func.functional_call(model, params, x)`` runs the module on the parameters given (the
others the state's), so torch.func recipes such as per-sample gradients are written inside
``loss_fn`` as in torch's tutorials.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.func import functional_call

from zfunc.autograd.swap import put_back, swap_in

from zfunc._tree import tree
from zfunc.autograd import calls
from zfunc.autograd.average import Average, ranks_averaged
from zfunc.autograd.buckets import Fold, bucket_views
from zfunc.autograd.rebind import Rebind
from zfunc.autograd.local import local_views
from zfunc.autograd.forward_gather import ROOT, Gathering, UnitViews, start_gathers
from zfunc.autograd.gather import UnitGatherer, check_same_units
from zfunc._probes import graph_task, recomputed

if TYPE_CHECKING:
    from zfunc.core.state import TrainState

__all__ = ["BoundModel"]


def _attribute(self: torch.nn.Module, name: str) -> Any:
    """A submodule, as a `_Submodule` view; a parameter or buffer read as an attribute is refused
    (the module's own tensor is not what forward uses, and no gradient of it reaches the state)."""
    modules = self.__dict__.get("_modules", {})
    if name in modules:
        return _Submodule(modules[name], f"{self.__dict__.get('_path', 'model')}.{name}")
    if name in self.__dict__.get("_parameters", {}) or name in self.__dict__.get("_buffers", {}):
        path = self.__dict__.get("_path", "model")
        key = f"{path[len('model.'):]}.{name}" if path != "model" else name
        raise AttributeError(
            f"{path}.{name}: the bound model's parameters and buffers are the state's, not the module's "
            f"attributes; use dict(model.named_parameters())[{key!r}] (or named_buffers())")
    raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


class _Submodule(torch.nn.Module):
    """A submodule of the bound model, for ``get_submodule`` and ``torch.func.functional_call``:
    it shares the user's submodule's containers, hands out its own submodules as views, refuses
    parameter and buffer reads (`_attribute`) and is not called on its own."""

    def __init__(self, module: torch.nn.Module, path: str):
        super().__init__()
        for name in ("_modules", "_parameters", "_buffers"):
            object.__setattr__(self, name, getattr(module, name))
        object.__setattr__(self, "_path", path)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    __getattr__ = _attribute

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._path}(...): a submodule of the bound model runs only inside the bound model's "
                           "call (its parameters are bound there); call the model itself")


class BoundModel(torch.nn.Module):
    """The module as a function of its inputs, running on one state's tensors.

    Gradients of anything computed from its outputs reach ``sinks`` (see
    `zfunc.core.backward.sinks_into`), each multiplied by ``avg.factor`` as it enters.
    ``buffers`` (cloned by the caller unless donated) receive the buffers' new values, e.g.
    BatchNorm running statistics, for the state that follows (``new_buffers``). With ``fold``
    (stages 0-1, the step's last micro-batch) backward reduces the accumulator.

    Its submodules are the user's (``get_submodule``, ``named_modules``); reading a parameter or
    buffer as an attribute is refused (the module's own attribute is not what forward uses):
    ``dict(model.named_parameters())[name]`` is.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config())
        >>> def loss_fn(model, x):
        ...     names = [n for n, _ in model.named_parameters()]
        ...     out = torch.func.functional_call(model, {"bias": torch.zeros(1)}, (x,))
        ...     print(names, out.shape)
        ...     return model(x).sum()
        >>> state, loss = zfunc.backward_step(state, loss_fn, torch.ones(3, 2))
        ['weight', 'bias'] torch.Size([3, 1])
    """

    def __init__(self, state: TrainState, sinks: list[torch.Tensor], buffers: dict[str, torch.Tensor],
                 fold: Fold | None = None, avg: Average | None = None, own: bool = False):
        super().__init__()
        module = state.binding.module
        # The user's containers: functional_call and get_submodule reach the module through them.
        for name in ("_modules", "_parameters", "_buffers"):
            object.__setattr__(self, name, getattr(module, name))
        self.state, self.sinks, self.new_buffers, self.fold = state, sinks, buffers, fold
        # A model for a call that runs its own backward (``own``: `backward_step`, `vjp`) made
        # during a backward (by a gradient hook) is that call in it, and a recomputation in any
        # other; any other model's forward in a backward is autograd's recomputation (the
        # engine's, made anew by a checkpointed `engine(x)`): `zfunc._probes.recomputed`.
        self.born = graph_task() if own else -1
        self.avg = avg if avg is not None else Average(state.cfg.grad_accum, ranks_averaged(state),
                                                       state.binding.flight)
        # What the module's entries hold now: an entry that differs during a call was put there
        # by the caller (torch.func.functional_call over this model) and wins over the state's.
        self.resting = [entries[attr] for entries, attr, _ in state.binding.entries]
        self.param_views: dict[str, torch.Tensor] | None = None  # `named_parameters`, made once
        # Without units (stage 3: all in the root unit): the trained parameters' views and their
        # `Rebind` (stage 3: `UnitGatherer`), made by the
        # first of `named_parameters` and a forward call and used by both and every later call,
        # as a torch module's parameters are the same tensors in each (a hook on one, or
        # torch.autograd.grad with respect to it, sees every call's use).
        self._shared: tuple[dict[str, torch.Tensor], Rebind | UnitGatherer] | None = None
        # During a call (`prepare` to `finish`; the call's graph holds what a backward needs):
        self.gatherer: UnitGatherer | None = None  # stage 3
        self.units: UnitGatherer | UnitViews | None = None  # what the unit modules' hooks bind
        self.call: Any = None  # the call's `Rebind` or `UnitGatherer` (`ModuleBinding._source`)
        self.pending: Gathering | None = None  # stages 1-2: the other ranks' slices being gathered

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # never into the user's containers

    __getattr__ = _attribute

    @property  # type: ignore[override]
    def training(self) -> bool:
        """The user's module's mode (``train()``/``eval()`` set it)."""
        state = self.__dict__.get("state")  # (absent while nn.Module.__init__ runs)
        return True if state is None else state.binding.module.training

    @training.setter
    def training(self, mode: bool) -> None:
        del mode  # (nn.Module.__init__ sets it; the mode is the user's module's)

    def train(self, mode: bool = True) -> BoundModel:
        self.state.binding.module.train(mode)
        return self

    # -- a module's questions ------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters forward uses, under the module's names: trained ones as views of the
        state's compute buffer whose gradients reach the state (made once per bound model and, at
        stages 0-2 without units, the very tensors every forward call of it computes with, so a
        hook on one or ``torch.autograd.grad`` with respect to it sees the forward's use; made
        under ``no_grad``, they carry no gradient and are made again by the next use), frozen
        ones as they are.

        Raises:
            RuntimeError: at stage 3 with units, where a unit's parameters exist in full only
                while its module runs (the message names the alternatives).
        """
        state = self.state
        if state.stage == 3 and _has_units(state):
            raise RuntimeError(
                "model.named_parameters(): at ZeRO stage 3 a unit's parameters exist in full only while its module "
                "runs, so the bound model cannot hand them all out without gathering every unit at once. Read the "
                "weights with zfunc.full_params(state) (gathers the whole model); compute gradients with respect to "
                "inputs (torch.autograd.grad, torch.func.grad) as usual; or keep every parameter in the root unit "
                "(Config(units=[]), a larger persist_threshold) or use stage 0-2 for per-parameter torch.func recipes")
        param_views = self.param_views
        if param_views is None:
            # Made without autograd (under no_grad) they carry no gradient: kept only with it
            keep = torch.is_grad_enabled()
            if self._shared is not None:
                views, call = self._shared
            elif state.stage == 3:  # the root unit alone: gathered once, as a forward call does
                gatherer = UnitGatherer(state, self.sinks, [], self.avg, self.born)
                views, call = gatherer.root_views(), gatherer
                gatherer.hub = None  # the graph keeps the collector
                if keep:
                    self._shared = (views, call)
            else:
                views, call = self._views()
                if state.binding.gather_plan is None and keep:
                    self._shared = (views, call)
            if self.pending is not None:  # stages 1-2 after a step with units: every slice, now
                self.pending.wait_all()
                self.pending = None
            param_views = {**views, **state.frozen}
            if keep:
                self.param_views = param_views
            state.binding.note_pending(call)
        return self._named(state.binding.module.named_parameters(prefix="", recurse=recurse,
                                                                 remove_duplicate=remove_duplicate),
                           param_views, prefix)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The buffers forward uses (the call's copies; their new values go to the next state)."""
        return self._named(self.state.binding.module.named_buffers(prefix="", recurse=recurse,
                                                                   remove_duplicate=remove_duplicate),
                           self.new_buffers, prefix)

    def _named(self, names: Iterator[tuple[str, torch.Tensor]], values: dict[str, torch.Tensor],
               prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        canon = self.state.binding.canonical
        for name, _ in names:
            yield (f"{prefix}.{name}" if prefix else name), values[canon.get(name, name)]

    # -- a forward call ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.state.binding.occupied():
            return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        given = self._given()
        tensors, args, kwargs, contexts = self.prepare(args, kwargs)
        tensors.update(given)
        flight = self.state.binding.flight
        flight.enter(self)
        try:
            with contextlib.ExitStack() as stack:
                for c in contexts:
                    stack.enter_context(c)
                binding = self.state.binding
                for name, others in binding.aliases.items():
                    if name in tensors:
                        tensors.update({other: tensors[name] for other in others if other not in given})
                out = _run_on(binding, tensors, args, kwargs)
                for name in given.keys() & self.new_buffers.keys():  # a caller's buffer is not the state's
                    tensors[name] = self.new_buffers[name]
        except BaseException:
            with contextlib.suppress(Exception):  # collect the gathers started ahead (the error stays the news)
                if self.gatherer is not None:
                    self.gatherer.unwind()
                    self.gatherer.drop_ahead()
                if self.pending is not None:
                    self.pending.wait_all()
            raise
        finally:
            flight.leave()
        return self.finish(out, tensors)

    def _given(self) -> dict[str, torch.Tensor]:
        """The tensors a caller put in the module's entries for this call (functional_call over
        the bound model), by the module's names."""
        given = {name: entries[attr] for (entries, attr, name), rest in zip(self.state.binding.entries, self.resting)
                 if entries.get(attr) is not rest}
        binding = self.state.binding
        in_units = sorted(n for n in given if binding.canonical.get(n, n) in binding.unit_params)
        if in_units and self.state.stage < 3:
            raise RuntimeError(
                f"torch.func.functional_call over the bound model with Config.units (given {in_units[:3]}): a unit's "
                "parameters are bound as its module runs, so parameters given from outside cannot take their place. "
                "Leave those modules out of Config.units for functional_call with parameters of your own")
        if given and self.state.stage == 3 and _has_units(self.state):
            raise RuntimeError(
                f"torch.func.functional_call over the bound model at ZeRO stage 3 (given {sorted(given)[:3]}...): "
                "stage 3 binds each unit's parameters as its module runs, so parameters given from outside cannot "
                "take their place. Keep every parameter in the root unit (Config(units=[]), a larger "
                "persist_threshold) or use stage 0-2 for functional_call with parameters of your own")
        return given

    def _views(self) -> tuple[dict[str, torch.Tensor], Rebind]:
        """Stages 0-2: the trained parameters as views of the compute buffer whose gradients reach
        the sink (reduced in backward, or added into the local accumulator), and their `Rebind`."""
        state = self.state
        binding, cfg = state.binding, state.cfg
        if self.fold is not None:  # stages 0-1, the step's last micro-batch: reduced in backward
            views, rebind = bucket_views(state, self.sinks[0], binding.buckets(state), binding.pool, self.avg,
                                         self.fold)
        elif cfg.shards_grads and state.mesh.shard.size > 1:  # reduce-scattered bucket by bucket
            views, rebind = bucket_views(state, self.sinks[0], binding.buckets(state), binding.pool, self.avg)
        else:  # each gradient added into the local accumulator (a shard of one rank is all of it)
            views, rebind = local_views(state, self.sinks[0], binding.buckets(state), self.avg)
        rebind.frozen = state.frozen
        # Stages 1-2 after a step with units: this call gathers the other ranks' slices
        # (`zfunc.autograd.forward_gather`), all issued now, each waited for as its unit's module starts.
        self.pending = None if bool(state.gathered) else start_gathers(state)
        return views, rebind

    def prepare(self, args: tuple, kwargs: dict) -> tuple[dict[str, torch.Tensor], tuple, dict, list[Any]]:
        """What a call runs on (parameter views, frozen parameters, buffers), its inputs (cast to
        a low-precision model's dtype) and the contexts to run it in."""
        state = self.state
        lay, cfg, binding = state.layout, state.cfg, state.binding
        tensors = {**binding.unit_params, **state.frozen, **self.new_buffers}
        contexts: list[Any] = []
        if state.stage == 3 and binding.removed and _has_units(state):
            raise RuntimeError(
                f"{type(binding.module).__name__}'s zfunc hooks were removed (state.binding.remove(), for every state "
                "sharing the binding: its copies too), and at ZeRO stage 3 a unit's parameters are gathered by "
                "those hooks as its module runs: without them the module would run on its own tensors. Make a new "
                "state (zfunc.init, or zfunc.load of a zfunc.save of this one) instead of removing the hooks of one "
                "still in use")
        if state.stage == 3 and self._shared is not None:  # everything in the root unit (`named_parameters`)
            views, self.call = self._shared
            self.units = self.gatherer = self.call
            tensors.update(views)
        elif state.stage == 3:  # the root unit now; the others when their modules run
            hint = binding.unit_order or [i for i, u in enumerate(lay.units) if u.name != "root"]
            self.units = self.gatherer = gatherer = UnitGatherer(state, self.sinks, hint, self.avg, self.born)
            views = gatherer.root_views()
            tensors.update(views)
            self.call = gatherer
            if not _has_units(state) and torch.is_grad_enabled():  # (without autograd: no gradient to keep)
                self._shared = (views, gatherer)
                self.param_views = {**views, **state.frozen}
        elif self._shared is not None and binding.gather_plan is None:  # the tensors named_parameters gives
            views, self.call = self._shared
            tensors.update(views)
        else:
            views, self.call = self._views()
            if binding.gather_plan is None and torch.is_grad_enabled():  # (without autograd: no gradient to keep)
                self._shared = (views, self.call)
                self.param_views = {**views, **state.frozen}
            pending = self.pending
            if binding.gather_plan is not None:  # stages 1-2 with units: bound as their modules run
                if pending is not None:
                    pending.wait(ROOT)
                self.units = UnitViews({n: views.pop(n) for n in binding.unit_params}, pending, self.born)
            elif pending is not None:  # the hooks that would wait are gone (`ModuleBinding.remove`)
                pending.wait_all()
            tensors.update(views)
        self.call.buffers = self.new_buffers  # a recomputed forward's too (the dict: a reassigned one included)
        binding.note_pending(self.call)
        if cfg.autocast is None and cfg.compute_dtype != torch.float32:
            # Like FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True): a low-precision model
            # takes its floating-point inputs in its own dtype.
            args, kwargs = _cast_floats((args, kwargs), cfg.compute_dtype)
        if cfg.autocast:
            contexts.append(torch.autocast(state.device.type, dtype=cfg.autocast))
        return tensors, args, kwargs, contexts

    def finish(self, out: Any, tensors: dict[str, torch.Tensor]) -> Any:
        """After the forward: check the stage-3 units, keep the buffers' new values, and mark the
        outputs' nodes for the backwards that will reach them (`zfunc.autograd.calls`). The
        outputs themselves are returned as the module returned them."""
        state = self.state
        if self.pending is not None:  # a unit the forward did not run: its slices are gathered too
            self.pending.wait_all()
            self.pending = None
        if self.gatherer is not None:
            self.gatherer.hub = None  # the graph keeps the collector now (no cycle through it: see gather)
            self.gatherer.drop_ahead()  # what the forward's prefetch gathered and did not use
            if state.group.size > 1 and state.device.type == "cpu":
                check_same_units(self.gatherer.order, state.group)  # a host read: free on the CPU only
            if not recomputed(self.born):
                state.binding.unit_order = list(self.gatherer.order)  # the next forward's prefetch hint
        for name in self.new_buffers:  # a buffer the module reassigned (not updated in place)
            self.new_buffers[name] = tensors[name]
        # From here the call's graph holds the call (its outputs' nodes), the bound model does not
        call, self.call, self.gatherer, self.units = self.call, None, None, None
        if torch.is_grad_enabled():  # (a whole call recomputed in backward: its checkpoint's backward reaches them)
            calls.mark_outputs(out, call, state.binding.flight, again=recomputed(self.born))
        return out


def _has_units(state: TrainState) -> bool:
    """Stage 3 with units besides the root (gathered as their modules run)."""
    return any(u.name != "root" for u in state.layout.units)


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    return tree.map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x)


def _run_on(binding: Any, tensors: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
    """``binding.module(*args, **kwargs)`` with ``tensors`` (by name) in the module's entries, as
    ``torch.func.functional_call(module, tensors, ..., tie_weights=False, strict=False)`` runs it,
    through the binding's list of entries (``functional_call`` resolves every name's module and
    checks it, each call: ~4 us a tensor). A tensor forward put in an entry in place of the one
    given (a buffer reassigned) is what ``tensors`` holds afterwards, as ``functional_call`` leaves it."""
    places = [(entries, attr, name) for entries, attr, name in binding.entries if name in tensors]
    if len({name for _, _, name in places}) != len(tensors):  # a name the module's entries lack
        return functional_call(binding.module, tensors, args, kwargs, tie_weights=False, strict=False)
    taken = swap_in([(entries, attr, tensors[name]) for entries, attr, name in places])
    try:
        return binding.module(*args, **kwargs)
    finally:
        for entries, attr, name in places:
            now = entries.get(attr)
            if now is not tensors[name]:
                tensors[name] = now
        put_back(taken)
