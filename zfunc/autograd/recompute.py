"""The recompute binding: a forward that activation checkpointing recomputes during backward,
outside zfunc's call, runs on the parameters of the call whose backward it is. A mixin of
`zfunc.autograd.binding.ModuleBinding`. The parameters outside the units (every one at stages
0-2 without units) and the buffers go in the module's entries at the first module a backward
through a call's outputs recomputes, for the rest of that backward (`zfunc.autograd.backward_swap`,
from one global pre-hook armed until then, `Recompute._arm`): the recomputed modules run with no
hook of zfunc's. A unit's parameters go in per module, by a forward pre-hook on each module
inside a unit's module (`Recompute._install_recompute_hooks`; a post-hook on a module whose
pre-hook put tensors in, `Recompute._post_on`), put on at the first recomputation and acting only
while one runs. The call is found from the graph (`Recompute._source`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from zfunc._probes import compiled_anything, graph_task
from zfunc.autograd import calls
from zfunc.autograd.backward_swap import BackwardSwap, Outside
from zfunc.autograd.direct_reads import DirectReads
from zfunc.autograd.swap import put_back, put_post, swap_in

__all__ = ["Recompute", "CALL", "RECOMPUTE", "TRIGGER"]

CALL, RECOMPUTE, TRIGGER = 0, 1, 2  # the phases of `zfunc.autograd.binding.ModuleBinding.attach`


class Recompute(BackwardSwap):
    """The recompute hooks of a binding (``module``, ``unit_params``, ``flight``, ``reads``,
    ``_specs``, ``_slots``, ``_covering``, ``_watch``, ``_members``, the ``_users_lock``,
    ``occupy``/``release``/``attach`` are the binding's)."""

    module: torch.nn.Module
    unit_params: dict[str, torch.Tensor]
    flight: calls.InFlight
    reads: DirectReads
    _specs: list[Any]
    _covering: dict[int, list[tuple[int, int, frozenset, int, Any]]]
    _unit_modules: list[tuple[int, torch.nn.Module, list[tuple[str, torch.nn.Module, str]]]]
    _running: dict[int, int]
    _runners: dict[int, dict[int, int]]
    _above_some: set[int]
    stage: int
    _watch: set[weakref.ref]
    _members: list[Any]
    _users_lock: Any
    _generation: int
    _last_source: tuple[int, weakref.ref] | None
    _armed: list[Any]
    _attached: set[int]
    _removed: bool
    _recompute_pres: dict[int, tuple[torch.nn.Module, Any]]
    _recompute_post: Any
    _recompute_post_key: int
    _posted: dict[int, torch.nn.Module]
    _static_posts: set[int]
    _triggers: dict[int, tuple[torch.nn.Module, bool]]

    def _install_recompute_hooks(self) -> None:
        """What a forward autograd recomputes during backward (activation checkpointing),
        outside zfunc's call, needs to run on the call's tensors. The parameters outside the
        units and the buffers go in all at once (`_swap_whole`) when the first module that may
        read them is recomputed (``_triggers``: a module with a forward whose subtree holds one,
        the holder and each module above it, as a forward reads its children's parameters
        without calling them, ``nn.MultiheadAttention``'s ``out_proj.weight`` or a tied head's
        ``F.linear(h, self.emb.weight)``; and each unit's module), and stay until that backward
        ends: every later recomputation reads them off the module (also a read in the
        checkpointed function itself after a module of the model ran). In a process where
        ``torch.compile`` has run, a pre-hook on each of those modules puts them in instead of
        the global one (`TRIGGER`): a module compiled in place has it inside its compiled call,
        and its recomputation, unless a module outside the compiled code put them in already, is
        refused (`_refuse_compiled`). A read before any module of the model was recomputed
        in the backward (``h @ emb.weight.T`` alone in a segment) finds the module's own
        parameter: `zfunc.autograd.direct_reads` refuses it under reentrant checkpointing.
        A unit's parameters go in per module: each module with a forward inside a unit's module
        (a block's attention or MLP, checkpointed on its own) puts in its unit's parameters,
        gathered again at stage 3, unless the unit's module runs around it (its hooks are asleep
        meanwhile, in its thread). A module compiled in place (``module.compile()``) has these
        hooks inside its compiled call: a recomputation that needs them to put tensors in there
        is refused (`_refuse_compiled`)."""
        outside = [n for n, _ in self.module.named_parameters() if n not in self.unit_params]
        slots = self._slots(outside)
        buffers = self._slots([n for n, _ in self.module.named_buffers()], buffers=True)
        me, flight, running, runners = weakref.ref(self), self.flight, self._running, self._runners

        # Both hooks return at once where nothing is to be done: in a forward, and while a module
        # around it in this thread covers what it would put in (``within``: its unit's module
        # runs, or a module above it put its subtree's in; `_run` counts them, and
        # ``flight.any_covered`` whether any). Inside a compiled block that is all Dynamo traces of
        # them: there a module below another with hooks is asleep while any module runs covered
        # (the compiled block's own hooks, outside its compiled code, covered it, in the thread
        # that runs its graph), read without the module's own ``within`` (``nested`` is one value
        # for every block), so one graph serves every block.
        def asleep(within: tuple) -> bool:  # (some module runs covered now)
            if torch.compiler.is_compiling():
                return True
            thread = threading.get_ident()
            for key in within:
                if running.get(key) and thread in runners.get(key, ()):
                    return True
            return False

        def pre(unit: int, slots: list, below: frozenset, within: tuple) -> Any:
            names = [n for n, _, _ in slots]
            places = [(owner._parameters, attr) for _, owner, attr in slots]
            nested = bool(within)

            def hook(mod: torch.nn.Module, args: Any) -> None:
                if flight.backwards == 0 or nested and flight.any_covered and asleep(within):
                    return
                b = me()
                if b is None:
                    return
                if torch.compiler.is_compiling():  # traced, and no module outside the compiled code covers it
                    _refuse_compiled(b, mod)
                elif b._cover_in(mod, unit, names, places, below, slots):
                    b._post_on(mod)
            return hook

        def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
            # (on a module of one pre-hook from the first run its pre-hook covered: `_post_on`)
            b = me()
            if b is not None:
                b._cover_out(mod)

        def post_for(within: tuple) -> Any:
            # A module of two pre-hooks (its unit's, and the one for what lies outside the
            # units) has the two post-hooks that match them on from the start, each undoing its
            # own pre-hook's cover (asleep exactly when that one was).
            nested = bool(within)

            def hook(mod: torch.nn.Module, args: Any, out: Any) -> None:
                if flight.backwards == 0 or nested and flight.any_covered and asleep(within):
                    return
                b = me()
                if b is not None:
                    b._cover_out(mod)
            return hook

        tops = {id(top) for _, top, _ in self._unit_modules}

        def readers(top: torch.nn.Module) -> Any:
            """Each module of ``top``'s subtree whose forward may read parameters, once (by
            identity), with its subtree: not a module without a forward (``nn.ModuleList``,
            ``nn.ParameterList``), nor an ``nn.Sequential``, whose forward only calls its children,
            unless it is a unit's module (the modules inside it leave their part to it).
            ``readers`` yields a module before those below it."""
            seen: set[int] = set()
            for mod in top.modules():
                own = mod.__dict__.get("forward")  # a compiled module's (torch.compile's wrapper) is its own
                if id(mod) in seen or own is None and (type(mod).forward is torch.nn.Module.forward or (
                        type(mod).forward is torch.nn.Sequential.forward and id(mod) not in tops)):
                    continue
                seen.add(id(mod))
                yield mod, frozenset(id(m) for m in mod.modules())

        # A hook is asleep while a module around it covers what it would put in: its unit's module
        # runs (the unit hooks count it by the unit's index), or a module above it with hooks of
        # its kind put its subtree's in (`_cover_in` counts it by the module's id).
        above = _above(self.module)
        # id(module) -> (the module, its pre-hooks in the order they run, what each is asleep
        # under): its unit's covers first and is undone last
        hooks: dict[int, tuple[torch.nn.Module, list, list]] = {}
        keys: set[int] = set()  # the covering modules some hook's ``within`` holds (by id)
        hooked: set[int] = set()  # the modules with hooks of the kind being placed

        def place(mod: torch.nn.Module, unit: int | None) -> tuple[tuple, list, list]:
            """Where ``mod``'s hooks of the kind being placed go: what they are asleep under (its
            unit's module, the modules above it with hooks of that kind), its pre-hooks and
            what each is asleep under."""
            ancestors = tuple(a for a in above[id(mod)] if a in hooked)
            keys.update(ancestors)
            hooked.add(id(mod))
            _, pres, withins = hooks.setdefault(id(mod), (mod, [], []))
            return (() if unit is None else (unit,)) + ancestors, pres, withins

        # What lies outside the units (every parameter at stages 0-2 without units, the root's
        # at stage 3) and the buffers go in all at once, for the rest of the backward, when the
        # first module whose forward may read them is recomputed (`_swap_whole`).
        self._outside = Outside.of(slots, buffers)
        # (module, whether its subtree holds one of the parameters): the modules whose call in a
        # backward puts them in, each unit's module too (a read off another module inside it)
        readers_of = {}
        for mod, below in readers(self.module):
            holds = any(id(slot[1]) in below for slot in slots)
            if holds or any(id(slot[1]) in below for slot in buffers):
                readers_of[id(mod)] = (mod, holds)
        self._triggers = {id(top): (top, False) for _, top, _ in self._unit_modules}
        self._triggers.update(readers_of)
        for unit, top, unit_slots in self._unit_modules:
            hooked.clear()
            for mod, below in readers(top):
                if mod is not top and any(id(slot[1]) in below for slot in unit_slots):
                    within, pres, withins = place(mod, unit)
                    pres.insert(0, pre(unit, unit_slots, below, within))
                    withins.insert(0, within)
        # In a process where torch.compile has run (no global hook, `_arm`), each module whose
        # subtree holds one of them has a pre-hook that does what the global one does, from the
        # first backward through a call's outputs on (a phase of its own); inside compiled code a
        # module outside it (a compiled block's wrapper) put the call's tensors in already, or the
        # recomputation is refused.
        def trigger(params: bool) -> Any:
            def hook(mod: torch.nn.Module, args: Any) -> None:
                if flight.backwards == 0:
                    return
                b = me()
                if b is None:
                    return
                if torch.compiler.is_compiling():
                    if not (flight.params_in or not params and flight.any_whole):
                        _refuse_compiled(b, mod)
                    return
                b._recomputing(params)
            return hook

        self._specs += [(mod, True, trigger(holds), TRIGGER) for mod, holds in readers_of.values()]
        # At stage 3 the root's parameters go in at the first recomputed module that holds one
        # (gathering the root again is not free): a pre-hook on each such module, with no cover
        # to undo.
        roots = set()
        if self.stage == 3 and slots:
            root = trigger(True)
            roots.add(root)
            for mod, holds in self._triggers.values():
                if holds:
                    _, pres, withins = hooks.setdefault(id(mod), (mod, [], []))
                    pres.append(root)
                    withins.append(None)
        self._above_some = keys  # (`_cover_in` counts only these: no hook reads another's count)
        # One pre-hook a module. A module of one pre-hook gets the post-hook only once its
        # pre-hook covers (`_post_on`): the modules asleep below a covering one run with one hook,
        # not two. A module of more has their post-hooks from the start (one cover each to undo).
        self._recompute_post = post
        for mod, pres, withins in hooks.values():
            if len(pres) == 1:
                self._specs.append((mod, True, pres[0], RECOMPUTE))
            else:
                self._static_posts.add(id(mod))
                self._specs += [(mod, True, _all(pres), RECOMPUTE),
                                (mod, False, _all([post_for(w) for p, w in zip(pres, withins) if p not in roots]),
                                 RECOMPUTE)]

    def _cover_in(self, mod: torch.nn.Module, unit: int, names: list[str], places: list[tuple[dict, str]],
                  below: frozenset, slots: list) -> bool:
        """In a forward recomputed during backward: unless a module recomputed around this one
        in this backward put them in already (``mod`` in its subtree), put unit ``unit``'s
        parameters ``names`` (its module not running around ``mod``) of the call whose backward
        this is (`_source`: found from the graph) in place, until ``mod`` returns
        (`_cover_out`): views of the call's buffer, or at stage 3 the unit gathered again. The
        unit hooks of stages 1-2 call it for the unit's own module too
        (`ModuleBinding._enter_hook`). Whether ``mod`` runs on the call's tensors now."""
        me = threading.get_ident()
        stack = self._covering.get(me)
        task = graph_task()
        key = id(mod)
        if stack:
            for _, kind, covered, at, undo in stack:
                if kind == unit and at == task and undo is not None and key in covered:
                    stack.append((key, unit, covered, task, None))  # nothing to undo at its end
                    return True
        if task == -1 or self.flight.current() is not None:
            return False
        source = self._source(task)
        if source is None:
            return False
        self.occupy()
        try:
            if self.stage == 3:
                source.enter(unit, slots)
                undo: Any = (source, unit)
            else:
                views = source.views(names)
                self._at_rest(mod, names, places, views)
                undo = swap_in([(entries, attr, views[n]) for n, (entries, attr) in zip(names, places)])
        except BaseException:
            self.release()
            raise
        self._covering.setdefault(me, []).append((key, unit, below, task, undo))
        if key in self._above_some:
            self._run(key, 1)  # the hooks below it are asleep
        return True

    def _post_on(self, mod: torch.nn.Module) -> None:
        """A recompute pre-hook covered (`_cover_in` pushed a cover of ``mod``): the post-hook
        goes on ``mod``, in time for this run (torch reads a module's post-hooks after its
        forward), and stays with the other call hooks (`attach`) until they leave: a post-hook
        cannot leave the table torch is running it from."""
        if id(mod) not in self._posted and id(mod) not in self._static_posts:
            put_post(mod, self._recompute_post_key, self._recompute_post)
            self._posted[id(mod)] = mod

    def _cover_out(self, mod: torch.nn.Module) -> None:
        me = threading.get_ident()
        stack = self._covering.get(me)
        if stack and stack[-1][0] == id(mod):
            self._uncover(me, stack)

    def _uncover(self, me: int, stack: list) -> None:
        """Undo the innermost cover of thread ``me`` (its ``stack``)."""
        key, undo = stack[-1][0], stack.pop()[4]
        if not stack:
            del self._covering[me]
        if undo is None:
            return
        if key in self._above_some:
            self._run(key, -1)
        try:
            if type(undo) is tuple:  # a unit gathered again (stage 3)
                undo[0].leave(undo[1])
            else:
                put_back(undo)
        finally:
            self.release()

    def _at_rest(self, mod: torch.nn.Module, names: list[str], places: list[tuple[dict, str]],
                 views: dict[str, torch.Tensor]) -> None:
        """Before a covering swap: the first parameter entry holds a parameter (``nn.Parameter``,
        whatever object: the module's, one the engine or ``load_state_dict(assign=True)`` put
        there), or already this call's tensor (a module the covered one calls that holds some of
        the same). A plain tensor is another binding's swap: two states made by separate ``init``
        calls on one module, both differentiated by this backward, each covering the same
        modules (the first entry of them is enough to tell), would each recompute on the other's
        tensors.

        Raises:
            RuntimeError: naming the cause and what to do instead.
        """
        if not names:
            return
        entries, attr = places[0]
        now = entries.get(attr)
        if now is not views[names[0]] and not isinstance(now, torch.nn.Parameter):
            raise RuntimeError(
                f"{type(mod).__name__} runs during a backward (activation checkpointing recomputing it, or a call a "
                f"gradient hook makes), and {names[0]} holds another zfunc state's tensor: two states made by separate "
                "zfunc.init calls on one module are in this backward, and each would run on the other's parameters. Run "
                "each state's backward on its own, or init the second state from a copy.deepcopy of the model "
                "(a state's own copies, copy.deepcopy(state), share its binding and are told apart)")

    def _run(self, key: int, step: int) -> None:
        """A unit's module (``key`` its index) or a covering module (its id) starts (``step``
        1) or ends (-1) running in this thread: ``_running`` counts how deep, by key (what a
        compiled block's hooks read), ``_runners`` by thread too (an eager hook is asleep only
        under one running in its own thread). An entry that drops to 0 goes."""
        me = threading.get_ident()
        threads = self._runners.get(key)
        if step < 0 and not (threads and threads.get(me)):  # (forgotten when this thread's outermost call ended)
            return
        if threads is None:
            threads = self._runners[key] = {}
        depth = self._running.get(key, 0) + step
        mine = threads.get(me, 0) + step
        if mine > 0:
            threads[me] = mine
        else:
            threads.pop(me, None)
        if depth > 0:
            self._running[key] = depth
        else:
            self._running.pop(key, None)
            self._runners.pop(key, None)
        flight = self.flight
        flight.covered += step
        flight.any_covered = flight.covered > 0

    def _forget_runs(self, me: int) -> None:
        """Thread ``me`` runs no unit's or covering module (`_run`) any more."""
        for key, threads in list(self._runners.items()):
            if threads.get(me):
                self._run(key, -threads[me])

    def _source(self, task: int | None = None) -> Any:
        """The call whose backward is running now, for a forward recomputed in it: among the calls
        whose graph lives, the one this backward (or, for a reentrant segment's own backward, the
        one it runs inside) entered through its outputs (the marker on their nodes notes the graph
        task on it, `zfunc.autograd.calls`), else the only one, if a backward through a call's
        outputs runs in this thread (one that runs none, plain torch on the module in another
        thread meanwhile, gets None: it recomputes on the module's own). Two are ambiguous: refused. Kept for the backward's next recomputed module (a graph task's id is
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
        if not mine:
            # Another Python thread's backward, through none of the calls (plain torch on the
            # module meanwhile), recomputes nothing of theirs; autograd's own device threads (on
            # CUDA, where every backward runs) are not told apart.
            if not self.flight.ran_here() and not calls.autograd_thread():
                return None
            mine = live
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

    def _reached(self, first: bool) -> None:
        """A backward reached a call's outputs (``first``: while no other ran through the calls):
        the recompute hooks are armed (`_arm`), and which call a recomputation belongs to is found
        afresh (`_source`)."""
        with self._users_lock:
            self._forget_source()
        me = threading.get_ident()
        if first and self.flight.current() is None:
            # What a recomputation torch stopped past the post-hooks left in this thread (a
            # KeyboardInterrupt: torch runs them on an Exception only), undone before this
            # backward recomputes: its covers, and its counts of the modules running.
            stack = self._covering.get(me)
            while stack:
                self._uncover(me, stack)
            self._forget_runs(me)
        self._arm()
        if not self._members:  # (the engine checks its module's own gradients at step())
            self.reads.watch(graph_task())

    def _arm(self) -> None:
        """A backward reached a call's outputs: what the call puts in for a recomputation goes in
        when the first module that may read it is called while a backward runs (`_recomputing`),
        from one pre-hook in torch's global table until then (`_first_recompute`), so a backward
        that recomputes nothing puts nothing in and takes nothing off. It leaves the table then,
        when no backward runs through the calls any more (`_disarm`), or with the hooks once no
        call's graph lives. In a process where ``torch.compile`` has run, a pre-hook on each
        module that may read the call's tensors does it instead (`TRIGGER`, on at once): compiled
        code there (this model's blocks, compiled in place or wrapped, or any other module, in any
        thread) would trace the global hook, warn and recompile while it is in the table."""
        if compiled_anything():
            self.attach(RECOMPUTE)
            self.attach(TRIGGER)
            return
        with self._users_lock:
            if self._armed or self._removed or not (
                    self._triggers or self._recompute_pres and RECOMPUTE not in self._attached):
                return
            self._armed.append(torch.nn.modules.module.register_module_forward_pre_hook(
                _first_recompute(weakref.ref(self))))

    def _recomputing(self, params: bool = True) -> None:
        """A module that may read the call's tensors is called while a backward through a call's
        outputs runs (a recomputation): the parameters outside the units and the buffers go in
        for the rest of the backward (`_swap_whole`), and the unit recompute hooks on their
        modules (`attach`; ``params``: the module holds some of those parameters, `_swap_whole`);
        once all of it is in the global pre-hook of `_arm` leaves the table,
        unless another backward through the calls runs (another thread's): its first
        recomputation is the hook's too (and is refused while this one's tensors are in)."""
        if self._recompute_pres:
            self.attach(RECOMPUTE)
        if self._swap_whole(params):
            with self._users_lock:
                while self._armed and self.flight.tasks() <= 1:  # (another backward's recomputations need it)
                    self._armed.pop().remove()

    def _forget_source(self) -> None:
        """(Under the lock.) `_source`'s kept answer may be stale: found afresh next time."""
        self._generation += 1
        self._last_source = None


def _first_recompute(ref: weakref.ref) -> Any:
    """The global forward pre-hook of an armed binding (`Recompute._arm`): at the first call of
    one of its modules that may read the call's tensors while a backward runs, it puts them in
    (`Recompute._recomputing`, which takes it out of the table) and runs that module's own unit
    recompute hook, whose place in this call's hooks torch fixed before this one ran (global
    pre-hooks run before a module's own, as the recompute pre-hook goes before the user's). Any
    other call passes through (and a module whose hooks are on already runs its own). Inside
    compiled code it only runs the module's hook (tracing writes no hook table)."""

    def hook(mod: torch.nn.Module, args: Any) -> None:
        b = ref()
        if b is None or b.flight.backwards == 0:
            return
        found = b._recompute_pres.get(id(mod))
        if found is not None and found[0] is not mod:
            found = None
        trigger = b._triggers.get(id(mod))
        if trigger is not None and trigger[0] is not mod:
            trigger = None
        if found is None and trigger is None:
            return
        own = found is not None and RECOMPUTE not in b._attached  # (else it runs from the module's table)
        if not torch.compiler.is_compiling():
            b._recomputing(trigger is not None and trigger[1])
        if own:
            found[1](mod, args)
    return hook


@torch.compiler.disable
def _refuse_compiled(binding: Recompute, mod: torch.nn.Module) -> None:
    """A recompute hook runs inside compiled code with no module outside it covering its
    module: the module was compiled in place (``module.compile()``, whose hooks run inside its
    compiled call), or its ``torch.compile`` wrapper was put in its place after `zfunc.init` (the
    wrapper has no hooks of zfunc's), and activation checkpointing recomputes it. The call's
    parameters cannot be put in from there, so the recomputation is refused (outside one: nothing
    to do). Run eagerly (a graph break), so the check is the eager one."""
    if binding.flight.current() is None and graph_task() != -1:
        raise RuntimeError(
            f"activation checkpointing recomputes {type(mod).__name__} inside compiled code: it was compiled in "
            "place (module.compile()), or compiled with torch.compile after zfunc.init (zfunc's hooks are on the "
            "module inside the compiled wrapper). zfunc puts the call's parameters in with a hook on the module, and "
            "that hook runs inside the compiled call, where it cannot. Compile it with torch.compile(module) and put "
            "the result in its place (model.blocks[i] = torch.compile(block)) before zfunc.init, or name the module "
            "in Config.units (stages 1-3), whose hooks also run in the forward, with all of its parameters in its "
            "unit (persist_threshold=0 at stage 3) and no buffers in it")


def _all(hooks: list) -> Any:
    """One hook that runs ``hooks`` in order."""
    if len(hooks) == 1:
        return hooks[0]

    def hook(*args: Any) -> None:
        for h in hooks:
            h(*args)
    return hook


def _above(module: torch.nn.Module) -> dict[int, set[int]]:
    """``id(m)`` -> the ids of the modules above ``m`` under any of its names."""
    modules = dict(module.named_modules(remove_duplicate=False))
    out: dict[int, set[int]] = {}
    for name, mod in modules.items():
        ids = out.setdefault(id(mod), set())
        parts = name.split(".") if name else []
        ids.update(id(modules[".".join(parts[:k])]) for k in range(len(parts)))
    return out
