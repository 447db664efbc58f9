"""The module bound to a layout: how a forward call reaches the state's parameters.

A `ModuleBinding` is made once per (module, layout) by `zfunc.init` and is static metadata of
the state. It owns everything zfunc adds to the user's module: at stage 3 a forward pre-hook and
post-hook on each unit module (they gather the unit for the call that runs it; at stages 1-2 with
`Config.units` they wait for the unit's all-gather, `zfunc.autograd.forward_gather`), a pre-hook
on each module with a forward whose subtree holds parameters, and a post-hook on one whose
pre-hook put tensors in (only while a zfunc model's backward recomputes a forward, activation
checkpointing: `zfunc.autograd.recompute`), and, when the module was donated
(``init(..., donate=True)``), a guard that refuses direct calls (which stays). The hooks hold the
binding weakly: they leave the module when no state holds the binding, or at
`ModuleBinding.remove`. Per-call context (which state, which sinks) travels in the binding's
record of its calls in flight (`zfunc.autograd.calls.InFlight`, by thread) during the call and in
the call's autograd graph after it, never in attributes of the user's modules or tensors.

`ModuleBinding.bind` gives a `zfunc.autograd.bound.BoundModel`: the module as a function of its
inputs, running on one state's tensors.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

from zfunc.autograd import calls
from zfunc.autograd.average import Average
from zfunc.autograd.bound import BoundModel
from zfunc.autograd.buckets import Bucket, Fold, plan_buckets
from zfunc.autograd.direct_reads import DirectReads
from zfunc.distributed.pool import Pool
from zfunc.autograd.recompute import CALL as _CALL
from zfunc.autograd.recompute import RECOMPUTE as _RECOMPUTE
from zfunc.autograd.recompute import TRIGGER as _TRIGGER
from zfunc.autograd.recompute import Recompute
from zfunc.autograd.rebind import Spares
from zfunc.autograd.routing import Routing
from zfunc.autograd.swap import put_post, put_pre, set_data, take_post, take_pre
from zfunc.autograd.gather import UnitGatherer
from zfunc._probes import in_backward as _in_backward
from zfunc.distributed.layout import Layout
from zfunc.autograd.forward_gather import GatherPlan, Unbound, UnitViews, plan_gathers

if TYPE_CHECKING:
    from zfunc.core.state import TrainState

__all__ = ["ModuleBinding", "BoundModel", "was_donated"]

# The forward-hook dicts of a module that zfunc's hooks live in (for a copy of the module).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_state_dict_pre_hooks")


def was_donated(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters were donated to a state (``init(..., donate=True)``): it
    carries the refusing pre-hook a donation puts on it (the module says so itself; no registry).

    Examples:
        >>> import torch
        >>> was_donated(torch.nn.Linear(1, 1))
        False
    """
    return any(getattr(h, "refuses_donated", False) for h in module._forward_pre_hooks.values())


def _refuse_donated(module: torch.nn.Module) -> None:
    raise RuntimeError(
        f"{type(module).__name__} has no parameters of its own: they live in a zfunc state (the module was "
        "given to init(..., donate=True), or came with an unpickled state, which carries the module as code "
        "only). Run it through zfunc (backward_step, vjp, train_step or the engine), or read the "
        "weights with zfunc.full_params")


def _take_off(phases: dict[int, tuple[list, list]], ids: dict[tuple[int, bool], int], attached: set[int],
              posted: dict[int, torch.nn.Module]) -> None:
    """Take the call hooks of the phases in ``attached`` off their modules (`ModuleBinding.attach`
    put them there), and the recompute post-hooks (``posted``, `Recompute._post_on`), and empty
    them. (A hook table the user replaced meanwhile lacks them.)"""
    for phase in attached:
        pres, posts = phases.get(phase) or ((), ())
        key = ids[(phase, True)]
        for mod, _ in pres:
            take_pre(mod, key)
        key = ids[(phase, False)]
        for mod, _ in posts:
            take_post(mod, key)
    attached.clear()
    key = ids[(_RECOMPUTE, False)]
    for mod in posted.values():
        take_post(mod, key)
    posted.clear()


def _let_go(handles: list[RemovableHandle], armed: list[RemovableHandle], *call_hooks: Any) -> None:
    """A binding no state holds: every hook of it leaves the module (and torch's global table)."""
    _remove(handles, armed)
    _take_off(*call_hooks)


def _remove(*lists: list[RemovableHandle | None]) -> None:
    """Take each hook of ``lists`` off its module and empty the lists."""
    for handles in lists:
        for h in handles:
            if h is not None:
                h.remove()
        handles.clear()




class ModuleBinding(Routing, Recompute):
    """``module`` bound to ``layout``: the hooks zfunc adds to it, and `bind` for forward calls.

    Args:
        module: the user's module.
        layout: the state's `zfunc.distributed.layout.Layout`.
        stage: the ZeRO stage (hooks are installed at stage 3, and at stages 1-2 for ``units``).
        units: stages 1-2: ``(module name, parameter names)`` of each unit whose all-gather the
            next forward waits for when the module starts (`zfunc.autograd.forward_gather`); empty: none.

    Examples:
        >>> import torch, zfunc
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> state = zfunc.init(model, zfunc.Config(stage=3, units=["0"], persist_threshold=0))
        >>> seen = []  # during the call: the unit's hook on model[0]; between calls: none
        >>> _ = model[1].register_forward_pre_hook(lambda m, a: seen.append(len(model[0]._forward_pre_hooks)))
        >>> state, _ = zfunc.backward_step(state, lambda m, x: m(x).sum(), torch.ones(1, 2))
        >>> seen, len(model[0]._forward_pre_hooks)
        ([1], 0)
    """

    def __init__(self, module: torch.nn.Module, layout: Layout, stage: int,
                 units: Sequence[tuple[str, Sequence[str]]] = ()):
        self.module, self.layout, self.stage = module, layout, stage
        self._units = tuple((name, tuple(names)) for name, names in units)
        self.donated = False
        # Every hook holds the binding weakly: once no state holds it, it goes by reference
        # counting, and its hooks leave the module with it. ``_handles``: the engine's (the shim
        # keeps them while the engine lives); ``_specs``: the hooks a zfunc call needs, at most
        # one of each phase and kind on a module, on it from a call's start (`attach`) until no
        # call runs and no call's graph lives (`_detach_if_idle`).
        self._handles: list[RemovableHandle] = []
        self._specs: list[tuple[torch.nn.Module, bool, Callable[..., Any], int]] = []  # (module, pre?, hook, phase)
        self._removed = False
        self._attached: set[int] = set()  # the phases on the module now
        self._phases: dict[int, tuple[list, list]] = {}  # phase -> its ``(module, hook)`` pre-hooks, post-hooks
        # One hook id per phase and kind (pre or post), the same on every module: each module's
        # hook goes in under it (`attach`), so the blocks of a model compiled one by one trace
        # the same hook ids (Dynamo guards on them: an id per module would compile each block
        # apart). Negative, from this binding's own identity: torch's ids count up from 0 in each
        # process (an unpickled module carries the ids of the process that made its hooks), and
        # no live binding shares another's (a binding's hooks leave with it).
        self._ids = {(phase, pre): -(8 * id(self) + 2 * phase + pre)
                     for phase in (_CALL, _RECOMPUTE, _TRIGGER) for pre in (False, True)}
        # Until the first module of a backward runs (a recomputation): the one global pre-hook that
        # puts the call's tensors in and the unit recompute hooks on then (`Recompute._arm`); a
        # backward that recomputes nothing never has them.
        self._armed: list[RemovableHandle] = []
        # id(module) -> module: those a recompute pre-hook put the post-hook on, at the first run
        # it covered (`Recompute._post_on`); they leave with the call hooks
        self._posted: dict[int, torch.nn.Module] = {}
        self._static_posts: set[int] = set()  # the modules of two recompute pre-hooks: their post-hooks go on with them
        weakref.finalize(self, _let_go, self._handles, self._armed, self._phases, self._ids, self._attached,
                         self._posted)
        self.unit_order: list[int] = []  # stage 3: the units the last forward ran, in order
        self._members: list[Any] = []  # set by `route`
        self._probe: Any = None  # set by `route`
        # The other names of a tied parameter or buffer, by its first name: a call passes the
        # tensor under every name (torch's tie_weights=True searches the module each call).
        self.aliases: dict[str, list[str]] = {}
        for named in (module.named_parameters(remove_duplicate=False),
                      module.named_buffers(remove_duplicate=False)):
            first: dict[int, str] = {}
            for name, t in named:
                if first.setdefault(id(t), name) != name:
                    self.aliases.setdefault(first[id(t)], []).append(name)
        # Every name a parameter or buffer has -> its first name; and each entry of the module's
        # containers as ``(container, attribute, name)`` (what a bound model compares per call).
        self.canonical = {other: first for first, others in self.aliases.items() for other in others}
        modules = dict(module.named_modules(remove_duplicate=False))
        self.entries: list[tuple[dict[str, Any], str, str]] = []
        for kind, named in (("_parameters", module.named_parameters(remove_duplicate=False)),
                            ("_buffers", module.named_buffers(remove_duplicate=False))):
            for name, _ in named:
                parent, _, attr = name.rpartition(".")
                self.entries.append((getattr(modules[parent], kind), attr, name))
        self._frames: dict[int, list[Any]] = {}  # by thread (`Routing`)
        # The threads running the module for a zfunc call now (a forward, or a recomputation in
        # backward), with their depth: torch puts a call's tensors in the module's own entries,
        # so one thread at a time (`occupied`).
        self._users: dict[int, int] = {}
        self._users_lock = threading.RLock()  # reentrant: a weakref callback may run under it (`_call_gone`)
        self.flight = calls.InFlight()  # the calls running and the backwards through their outputs
        me = weakref.ref(self)
        self.flight.idle = lambda: me() is not None and me()._disarm()  # (`Recompute._arm`)
        self.reads = DirectReads(module, layout.names)  # a recomputation reading a parameter off the module
        # Unit parameters by name as the module holds them outside their unit's forward
        # (placeholders that refuse to compute), so the enclosing functional_call restores them.
        self.unit_params: dict[str, torch.Tensor] = {}
        self._buckets: tuple[Bucket, ...] | None = None
        self.tap_plans: dict[str, Any] = {}  # `zfunc.autograd.buckets.tap_plan`, by path
        self.spares = Spares()  # the recompute leaves kept between backwards (`zfunc.autograd.rebind`)
        # Large buffers kept between steps on the CPU (`zfunc.distributed.pool`): the gradient
        # accumulator, the bucket reduces' staging buffers and results.
        self.pool = Pool()
        self.gather_plan: GatherPlan | None = None  # stages 1-2 with units
        # The calls whose backward can still run (a `zfunc.autograd.rebind.Rebind` at stages 0-2, a
        # `UnitGatherer` at stage 3; each graph keeps its own), for a forward recomputed in
        # backward (`_source`): a weak reference each, whose callback detaches the hooks once the
        # last graph is gone; and what the recompute hooks swapped, per module.
        self._watch: set[weakref.ref] = set()
        self._last_source: tuple[int, weakref.ref] | None = None  # (graph task, its call): `_source`
        self._generation = 0  # counts what can change `_source`'s answer (a call added, a backward reaching one)
        # By thread: the recomputed modules running now, innermost last, each with what it puts in
        # (a unit), its subtree, graph task and what to undo (None: an enclosing one's
        # covers it), `_cover_in`; and each unit's index, module and slots.
        self._covering: dict[int, list[tuple[int, int, frozenset, int, Any]]] = {}
        self._unit_modules: list[tuple[int, torch.nn.Module, list[tuple[str, torch.nn.Module, str]]]] = []
        # A unit's index, or a covering module's id -> how deep its module runs now, and by thread
        # (`Recompute._run`): the recompute hooks below it are asleep
        self._running: dict[int, int] = {}
        self._runners: dict[int, dict[int, int]] = {}
        # What `BackwardSwap._swap_whole` put in for the backwards running now, by the id of its
        # undoing (`_Whole`, which autograd holds, not the binding): its thread, call, whether the
        # parameters went in (at stage 3 the buffers may go in first), and what went in the first
        # parameter entry (a call a gradient hook makes in that backward goes on top of it)
        self._wholes: dict[int, tuple[int, Any, bool, Any]] = {}
        if stage == 3:
            self._install_unit_hooks([(i, u.name, [s.name for s in u.slots]) for i, u in enumerate(layout.units)
                                      if u.name != "root"])
        elif units:
            self.gather_plan = plan_gathers(layout, [names for _, names in units])
            self._install_unit_hooks([(i, name, names) for i, (name, names) in enumerate(units)])
        self._install_recompute_hooks()
        for mod, is_pre, hook, phase in self._specs:
            self._phases.setdefault(phase, ([], []))[0 if is_pre else 1].append((mod, hook))
        # id(module) -> (module, its recompute pre-hook), for `Recompute._arm`'s global pre-hook
        self._recompute_pres = {id(mod): (mod, hook) for mod, hook in self._phases.get(_RECOMPUTE, ((), ()))[0]}
        self._recompute_post_key = self._ids[(_RECOMPUTE, False)]

    def occupy(self) -> None:
        """This thread starts running the module for a zfunc call (nested calls in one thread
        count up). Another thread doing so now is an error, before anything starts: a call
        puts its tensors in the module's entries (``functional_call``), which two threads
        cannot share.

        Raises:
            RuntimeError: another thread runs the module for a zfunc call now.
        """
        me = threading.get_ident()
        with self._users_lock:
            users = self._users
            if users and (len(users) > 1 or me not in users):
                raise RuntimeError(
                    f"{type(self.module).__name__} runs in a zfunc call in another thread now (a forward, or a "
                    "forward activation checkpointing recomputes in backward): a call puts its parameters in the "
                    "module's own entries, as torch.func.functional_call does, so two threads cannot run one module "
                    "at once. Run the calls one after another (a lock around them), or give each thread a module "
                    "of its own (zfunc.init of a copy.deepcopy of the model)")
            self._users[me] = self._users.get(me, 0) + 1

    def release(self, thread: int | None = None) -> None:
        """This thread's (or ``thread``'s) `occupy` ends; with it the last call, if no call's
        graph lives: the call hooks leave the module."""
        me = threading.get_ident() if thread is None else thread
        with self._users_lock:
            left = self._users.get(me, 0) - 1
            if left > 0:
                self._users[me] = left
                return
            self._users.pop(me, None)
        self._detach_if_idle()

    def attach(self, phase: int = _CALL) -> None:
        """Put one phase of the hooks zfunc needs on the module (`_specs`), unless they are
        there: the unit hooks at a call's start, the recompute hooks at the first module a backward
        through a call's outputs recomputes (`Recompute._arm`), so a forward, and a backward that
        recomputes nothing, run without them. Each pre-hook
        goes before the user's hooks (a weight-norm hook reads the unit's parameters)."""
        with self._users_lock:
            if phase in self._attached or self._removed:
                return
            pres, posts = self._phases.get(phase) or ((), ())
            self._attached.add(phase)
            key = self._ids[(phase, True)]
            for mod, hook in pres:  # before the user's own (a weight-norm hook reads the unit's parameters)
                put_pre(mod, key, hook)
            key = self._ids[(phase, False)]
            for mod, hook in posts:  # after them, and run when the forward raised too
                put_post(mod, key, hook)

    def _detach_if_idle(self) -> None:
        """Take the hooks off the module when no call runs and no call's graph lives (no
        backward can recompute a forward of it)."""
        if self._users or self._watch:  # read without the lock: whoever empties them calls this again
            return
        with self._users_lock:
            if not self._watch:
                self.take_off_now()

    def take_off_now(self) -> None:
        """Take the call hooks (and the armed global pre-hook) off now, though a call's graph may
        live (an engine's `destroy()`: a ``loss`` still referenced keeps its graph); a later call
        puts them on again. Nothing is taken off while a call runs."""
        with self._users_lock:
            if self._users:
                return
            _remove(self._armed)
            if self._attached:
                _take_off(self._phases, self._ids, self._attached, self._posted)

    def _disarm(self) -> None:
        """No backward runs through the calls any more (`calls.InFlight.idle`): the global
        pre-hook of `Recompute._arm` leaves torch's table (a graph kept alive after its backward, a
        loop's last ``loss``, leaves none behind; the next backward that reaches a call's outputs
        arms it again)."""
        with self._users_lock:
            if self.flight.backwards == 0:
                _remove(self._armed)

    def _call_gone(self, ref: weakref.ref) -> None:
        with self._users_lock:
            self._watch.discard(ref)
        self._detach_if_idle()

    @contextlib.contextmanager
    def occupied(self) -> Iterator[None]:
        """`occupy` and `attach` for the block, `release` after it. This thread's depth is put
        back as it was even if the block raised past a unit's post-hook (torch runs those only
        on an ``Exception``, not on a ``KeyboardInterrupt``)."""
        me = threading.get_ident()
        depth = self._users.get(me, 0)
        self.occupy()
        try:
            self.attach()
            yield
        finally:
            with self._users_lock:
                self._users[me] = depth + 1  # what a unit's post-hook skipped, forgotten
                if depth == 0:  # no unit's module runs in this thread once its outermost call is over
                    self._forget_runs(me)
            self.release()

    def buckets(self, state: TrainState) -> tuple[Bucket, ...]:
        """The gradient buckets of stages 0-2 (`zfunc.autograd.buckets`), planned on first use."""
        if self._buckets is None:
            cfg = state.cfg
            size = torch.empty((), dtype=cfg.reduce_dtype).element_size()
            self._buckets = plan_buckets(self.layout, max(1, int(cfg.bucket_mb * 2**20) // size))
        return self._buckets

    def _slots(self, names: list[str], buffers: bool = False) -> list[tuple[str, torch.nn.Module, str]]:
        """``(canonical name, owning module, attribute)`` for every name each parameter (or
        buffer) of ``names`` has (a tied weight has several)."""
        named = self.module.named_buffers if buffers else self.module.named_parameters
        canon = {id(p): n for n, p in named()}
        modules = dict(self.module.named_modules(remove_duplicate=False))
        wanted = set(names)
        out = []
        for a, p in named(remove_duplicate=False):
            if canon[id(p)] in wanted:
                parent, _, attr = a.rpartition(".")
                out.append((canon[id(p)], modules[parent], attr))
        return out

    def _install_unit_hooks(self, units: list[tuple[int, str, list[str]]]) -> None:
        """A pre-hook and a post-hook on each unit module ``(index, module name, parameter names)``.

        The pre-hook runs before any hook of the user's (a weight-norm hook reads the unit's
        parameters); a weight tied inside the unit is bound under every name it has."""
        modules = dict(self.module.named_modules(remove_duplicate=False))
        named = dict(self.module.named_parameters())
        for i, mname, names in units:
            slots = self._slots(names)
            self.unit_params.update({n: Unbound(named[n], n, mname) for n in names})
            mod = modules[mname]
            # Run eagerly inside compiled code (a graph break at each, in forward and recomputation
            # alike): Dynamo traces none of what they call (a unit's index would be a guard: a
            # recompile per unit, up to Dynamo's limit)
            enter, leave = torch.compiler.disable(self._enter_hook(i, slots, mod)), torch.compiler.disable(self._leave_hook(i))
            self._specs += [(mod, True, enter, _CALL), (mod, False, leave, _CALL)]
            self._unit_modules.append((i, mod, slots))

    def _call(self) -> UnitGatherer | UnitViews | None:
        """The units of this thread's zfunc call running now, if it is one of this binding's (a
        forward; a recomputation in backward goes through `_cover_in`)."""
        call = self.flight.current()
        return call.units if call is not None and call.state.binding is self else None

    def _enter_hook(self, i: int, slots: list, unit_module: torch.nn.Module) -> Any:
        me = weakref.ref(self)
        names = [n for n, _, _ in slots]
        places = [(owner._parameters, attr) for _, owner, attr in slots]
        below = frozenset(id(m) for m in unit_module.modules())

        def hook(mod: torch.nn.Module, args: Any) -> None:
            b = me()
            if b is None:
                return
            b._run(i, 1)  # (the post-hook always runs)
            call = b._call()
            if call is not None:  # a forward call
                b.occupy()  # (released by the post-hook, which always runs)
                call.enter(i, slots)
            elif (b.stage != 3 or b.flight.backwards) and b._cover_in(mod, i, names, places, below, slots):
                pass  # recomputed in backward (at stage 3 a backward through this binding's calls)
            elif b.donated:
                b._refuse()

        return hook

    def _leave_hook(self, i: int) -> Any:
        me = weakref.ref(self)

        def hook(mod: torch.nn.Module, args: Any, out: Any) -> None:
            b = me()
            if b is None:
                return
            b._run(i, -1)
            call = b._call()
            if call is not None:
                try:
                    call.leave(i)
                finally:
                    b.release()
            else:
                b._cover_out(mod)

        return hook

    def _refuse(self, *_: Any) -> None:
        if self.flight.current() is None and not _in_backward() and not self._members:  # routed calls are zfunc's
            _refuse_donated(self.module)

    def donate(self) -> None:
        """Free the module's own parameter storage (the state holds the parameters) and refuse
        direct calls from now on. What ``init(..., donate=True)`` does."""
        if self.donated:
            return
        named = dict(self.module.named_parameters())
        # the trained ones; frozen parameters stay the module's
        set_data([(named[n], torch.empty(0, dtype=named[n].dtype, device=named[n].device))
                  for n in self.layout.names])
        me, flight = weakref.ref(self), self.flight

        def refuse(mod: torch.nn.Module, args: Any) -> None:
            # Inside a zfunc call of this thread, or a recomputation in a backward through one (the
            # counts first: a compiled block's hook traces them without a break); a call in another
            # thread does not make a direct call here one
            if (flight.calls or flight.backwards) and (torch.compiler.is_compiling() or flight.current() is not None):
                return
            b = me()
            if b is not None:
                b._refuse()
            else:  # the state is gone: its parameters with it; the module stays empty
                _refuse_donated(mod)

        # These hooks stay when the binding goes: the parameters are empty for good. On the top module
        # and on every module holding trained parameters (a unit module called on its own).
        holders = {id(owner): owner for _, owner, _ in self._slots(list(self.layout.names))}
        guarded = {id(self.module): self.module, **holders}.values()
        refuse.refuses_donated = True  # what `was_donated` looks for
        self._refusing = [m.register_forward_pre_hook(refuse) for m in guarded]
        self.donated = True

    def give_back(self, values: dict[str, torch.Tensor]) -> None:
        """The reverse of `donate`: the module's trained parameters hold ``values`` (full
        tensors by name) again and direct calls run, so a new state can take the module over
        (a second ``zfunc.initialize`` of it, as DeepSpeed allows)."""
        if not self.donated:
            return
        _remove(self._refusing)
        named = dict(self.module.named_parameters())
        set_data([(named[n], values[n].detach().to(named[n].dtype).clone())
                  for n in self.layout.names])
        self.donated = False

    def skeleton(self) -> torch.nn.Module:
        """A copy of the module as code: its submodules, attributes and the user's own hooks,
        every parameter and buffer a tensor on the ``meta`` device of its shape and dtype (a
        trained parameter of its slot's shape, donated or not), tied ones still tied; zfunc's
        hooks left out. What a pickled state carries: never the weights, which are the state's.

        Raises:
            RuntimeError: a trained parameter's name at `zfunc.init` is not one the module has
                now (a module replaced since).

        Examples:
            >>> import torch, zfunc
            >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
            >>> state = zfunc.init(model, zfunc.Config(stage=3, units=["0"], persist_threshold=0))
            >>> code = state.binding.skeleton()
            >>> code[0].weight.device, code[0].weight.shape, len(code[0]._forward_pre_hooks)
            (device(type='meta'), torch.Size([2, 2]), 0)
        """
        shapes = {s.name: s.shape for u in self.layout.units for s in u.slots}
        named = dict(self.module.named_parameters())
        gone = [n for n in shapes if n not in named]
        if gone:  # the code would not rebuild this state's layout: refused before anything is written
            raise RuntimeError(
                f"the model's parameters {gone[:3]}{' and more' if len(gone) > 3 else ''} have other names now than "
                "at zfunc.init: a module was replaced since (torch.compile(block) put in a block's place wraps it "
                "as _orig_mod), so the module cannot be pickled as this state's code. Replace or compile the "
                "modules before zfunc.init; to keep the weights now, zfunc.save the state or take "
                "zfunc.full_params")
        memo: dict[int, Any] = {}
        for name, p in named.items():
            like = torch.empty(shapes.get(name, p.shape), dtype=p.dtype, device="meta")
            memo[id(p)] = torch.nn.Parameter(like, requires_grad=p.requires_grad)
        for b in self.module.buffers():
            memo[id(b)] = torch.empty_like(b, device="meta")
        ours = {h.id for h in self._handles} | set(self._ids.values())
        if self.donated:
            ours.update(h.id for h in self._refusing)
        out = copy.deepcopy(self.module, memo)
        for m in out.modules():
            for name in _HOOK_DICTS:
                hooks = getattr(m, name, None)
                for i in ours & set(hooks or ()):
                    del hooks[i]
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> ModuleBinding:
        """The binding itself: the module is code, shared by a state and its copies (as flax
        shares ``apply_fn``); the copy's tensors are its own, so it trains apart, and
        ``zfunc.tree.map`` works across the two."""
        return self

    def __reduce__(self) -> tuple:
        """Pickled as code (`skeleton`): the unpickled module has no weights of its own, so a
        direct call of it is refused as a donated module's is."""
        return _rebuilt, (self.skeleton(), self.layout, self.stage, self._units)

    @property
    def removed(self) -> bool:
        """Whether `remove` took the hooks away for good."""
        return self._removed

    def remove(self) -> None:
        """Take every hook zfunc added to the module away, for good, for every state sharing the
        binding (a state's copies included): units then run unbound, as at stages 1-2 without
        ``Config.units`` (a donated module stays empty); at stage 3, whose units are gathered by
        the hooks, a call refuses from then on."""
        with self._users_lock:
            self._removed = True
            _take_off(self._phases, self._ids, self._attached, self._posted)
        _remove(self._handles, self._armed)
        self.unit_params = {}
        self._members = []
        self.gather_plan = None  # no hook waits for a unit now: apply_step gathers before returning

    def bind(self, state: TrainState, sinks: Sequence[torch.Tensor], buffers: dict[str, torch.Tensor],
             fold: Fold | None = None, avg: Average | None = None, own: bool = False) -> BoundModel:
        """The module as a function of its inputs on ``state``'s parameters and ``buffers``,
        parameter gradients multiplied by ``avg.factor`` as they enter (default
        ``1 / (grad_accum * world)``); ``own``: for a call that runs its own backward
        (`BoundModel`)."""
        return BoundModel(state, list(sinks), buffers, fold, avg, own)

    def note_pending(self, call: Any) -> None:
        """``call`` (a `Rebind` or `UnitGatherer`) has a backward to come, when autograd records
        one: a forward recomputed in that backward may need it (`_source`); a whole call
        recomputed in backward too (its blocks may be recomputed in the backward through its
        outputs that a reentrant checkpoint runs)."""
        if torch.is_grad_enabled():
            me = weakref.ref(self)
            with self._users_lock:
                self._watch.add(weakref.ref(call, lambda ref: me() is not None and me()._call_gone(ref)))
                self._forget_source()
            # A backward reaching the call's outputs puts the recompute hooks on (`calls._entered`)
            call.on_backward = lambda first: me() is not None and me()._reached(first)


def _rebuilt(module: torch.nn.Module, layout: Layout, stage: int,
             units: Sequence[tuple[str, Sequence[str]]]) -> ModuleBinding:
    """An unpickled state's binding over the module's `ModuleBinding.skeleton`: direct calls of
    it are refused (it has no weights; the state has them)."""
    binding = ModuleBinding(module, layout, stage, units)
    binding.donate()
    return binding
