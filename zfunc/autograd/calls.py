"""Which zfunc call is running, and which backward differentiates a call, read without touching
what the model returns.

Each binding keeps its own record (`InFlight`, as FSDP2 keeps a module's runtime in its
``FSDPState``): nothing here is process-wide. A forward call (`zfunc.autograd.bound.BoundModel`,
or the engine's routed call of the module) is *current* in its thread from its start to its end.
When it returns, a pre-hook goes on the autograd node of each tensor of its output: a node the
user's module made, whose values, dtypes and views stay as they are (an in-place op on the output
works as in torch). When a backward reaches one, the hook notes the backward's graph task on the
call (``call.tasks``) and counts the backward as running through the binding's calls (until
autograd's end of that backward): so a forward that activation checkpointing recomputes during
backward, outside zfunc's call, finds the call it belongs to
(`zfunc.autograd.binding.ModuleBinding._source`), and the recompute hooks act only then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from zfunc._tree import tree
from zfunc._probes import graph_task, is_transformed

__all__ = ["InFlight", "at_backward_end", "autograd_thread", "mark_outputs", "note_backwards", "tensors_in"]


class InFlight:
    """One binding's calls in flight: the forward call running in each thread (nested calls
    stack), how many run (``calls``, a plain count compiled hooks read without a graph break), and
    the backwards running through its calls' outputs (``backwards``, likewise; and their counts by
    graph task). A backward is forgotten at its end, or when autograd drops a raised backward's
    callbacks (`_Left`), whichever thread ran it.

    Examples:
        >>> import torch, types
        >>> flight = InFlight()
        >>> call = types.SimpleNamespace(tasks=set())
        >>> flight.enter(call); flight.current() is call, flight.calls
        (True, 1)
        >>> flight.leave(); flight.current(), flight.calls
        (None, 0)
    """

    def __init__(self) -> None:
        self.calls = 0
        self.backwards = 0
        # Unit modules and covering modules running now (`zfunc.autograd.recompute.Recompute._run`),
        # and whether any (what compiled hooks read: one value whatever the count)
        self.covered = 0
        self.any_covered = False
        # A backward's recomputations have the buffers (``any_whole``) and the parameters outside
        # the units (``params_in``) in the module now (`zfunc.autograd.backward_swap.BackwardSwap._swap_whole`)
        self.any_whole = False
        self.params_in = False
        self._running: dict[int, list[Any]] = {}  # thread -> its calls, innermost last
        self._entered: dict[int, int] = {}  # graph task -> backwards through it
        # graph task -> those through a call that was not itself a recomputation (`through_calls`)
        self._direct: dict[int, int] = {}
        self._own: dict[int, int] = {}  # graph task -> its thread: a backward zfunc runs itself (`running`)
        self._threads: dict[int, set[int]] = {}  # graph task -> the threads its markers ran in (`enclosing`)
        self.acting: dict[int, int] = {}  # graph task -> the backward it runs for (`task_now`)
        self.idle: Callable[[], Any] | None = None  # called when no backward runs through the calls any more
        self._lock = threading.Lock()

    def current(self) -> Any:
        """The forward call running now in this thread, or None."""
        stack = self._running.get(threading.get_ident())
        return stack[-1] if stack else None

    def enter(self, call: Any) -> None:
        """``call`` starts in this thread: it is the current one until `leave`."""
        with self._lock:
            self._running.setdefault(threading.get_ident(), []).append(call)
            self.calls += 1

    def leave(self) -> None:
        """This thread's current call ends."""
        me = threading.get_ident()
        with self._lock:
            stack = self._running[me]
            stack.pop()
            if not stack:
                del self._running[me]
            self.calls -= 1

    def __deepcopy__(self, memo: dict[int, Any]) -> InFlight:
        return self  # the binding's, as the binding is shared by a state's copies

    def __reduce__(self) -> tuple:
        return (InFlight, ())  # in another process nothing is in flight

    def task_now(self) -> int:
        """The graph task of the backward running now, or, for one zfunc runs at another's end on
        its behalf (`zfunc.autograd.rebind.Rebind.settle`), that other's."""
        task = graph_task()
        return self.acting.get(task, task)

    def through_calls(self, task: int) -> bool:
        """Whether backward ``task`` reached the outputs of one of the binding's calls that was
        not a recomputation (a whole call under a reentrant checkpoint runs again in backward,
        and the checkpoint's own backward through its outputs belongs to the backward around it)."""
        return task in self._direct

    def tasks(self) -> int:
        """How many backwards run through the calls' outputs now (one each, however many
        outputs it reaches)."""
        return len(self._entered)

    def nested(self) -> bool:
        """Whether the backward running now is one that a backward through a call's outputs
        started inside itself (reentrant activation checkpointing recomputes and differentiates a
        segment in a graph task of its own, also through a whole call recomputed in backward,
        `through_calls`): it belongs to that outer backward. One run on another backward's behalf
        (`task_now`) is not nested: it stands for that one."""
        task = graph_task()
        return bool(self._entered) and task not in self._direct and task not in self.acting

    def enclosing(self) -> int | None:
        """For a nested backward (`nested`): the backward through a call's outputs it runs inside,
        the one this thread entered (on CUDA, autograd's device thread runs both), or None when that
        is not one backward (two entered from this thread: not told apart, so not guessed)."""
        me = threading.get_ident()
        with self._lock:
            outer = [task for task, threads in self._threads.items() if me in threads]
        return outer[0] if len(outer) == 1 else None

    def around(self) -> int | None:
        """The innermost of the binding's direct backwards this thread runs now (through the
        outputs of a call that was not a recomputation, `through_calls`, or one zfunc runs or
        notes itself, `running`, `own`), or None: for a nested backward, the backward it belongs
        to. One thread's backwards nest, and a graph task's id grows with each backward: the
        innermost is the largest."""
        me = threading.get_ident()
        with self._lock:
            mine = [task for task, threads in self._threads.items() if me in threads and task in self._direct]
            mine.extend(task for task, thread in self._own.items() if thread == me)
        return max(mine) if mine else None

    def own(self, task: int) -> None:
        """Backward ``task``, running now (one through a loss the engine scaled,
        `zfunc.compat.engine.Engine.scale`), is one of the binding's direct backwards until it
        ends (`around`), as one `running` notes."""
        self._claim(task)
        at_backward_end(_Left(functools.partial(self._disown, task)))

    def _claim(self, task: int) -> None:
        with self._lock:
            self._own[task] = threading.get_ident()

    def _disown(self, *tasks: int) -> None:
        with self._lock:
            for task in tasks:
                self._own.pop(task, None)

    @contextlib.contextmanager
    def running(self, outs: Sequence[torch.Tensor]) -> Iterator[None]:
        """The backward from ``outs`` that zfunc runs inside the block (`zfunc.backward_step`, a
        pullback) is one of the binding's direct backwards (`around`), also where it reaches no
        call's outputs (a whole call under a reentrant checkpoint ran without autograd): a
        segment's backward inside it is seeded as it is, not as a backward around it."""
        tasks: list[int] = []

        def note(task: int) -> None:
            self._claim(task)
            tasks.append(task)

        handles = [note_backwards(t, note) for t in outs]
        try:
            yield
        finally:
            for handle in handles:
                if handle is not None:
                    handle.remove()
            self._disown(*tasks)

    def ran_here(self) -> bool:
        """Whether this thread runs a backward through one of the calls' outputs (its marker ran
        here): a thread that runs none (plain torch on the module meanwhile) recomputes nothing
        of theirs."""
        me = threading.get_ident()
        with self._lock:
            return any(me in threads for threads in self._threads.values())

    def _enter_backward(self, task: int, again: bool) -> None:
        with self._lock:
            self._entered[task] = self._entered.get(task, 0) + 1
            if not again:
                self._direct[task] = self._direct.get(task, 0) + 1
            self._threads.setdefault(task, set()).add(threading.get_ident())
            self.backwards += 1

    def _leave_backward(self, task: int, again: bool) -> None:
        with self._lock:
            self.backwards -= 1
            self._entered[task] -= 1
            if self._entered[task] == 0:
                del self._entered[task]
                self._threads.pop(task, None)
            if not again:
                self._direct[task] -= 1
                if self._direct[task] == 0:
                    del self._direct[task]
            none = self.backwards == 0
        if none and self.idle is not None:
            self.idle()


def _entered(call: Any, flight: InFlight, again: bool, task: int) -> None:
    """Backward ``task`` reached the call's output: note it on the call, count it until it ends
    (``again``: the call is a recomputation, `mark_outputs`).

    Raises:
        RuntimeError: the call's weights were given to a step since its forward (a donating
            `zfunc.apply_step`, ``engine.step()``): its graph reads tensors that hold other values
            now, or none.
    """
    replaced = getattr(call, "replaced", None)
    if replaced is not None and replaced():
        raise RuntimeError(
            "this backward differentiates a forward whose weights a step has replaced since: the forward ran, "
            "then engine.step() (or zfunc.apply_step(..., donate=True)) gave its state's buffers to the next "
            "state, then the backward came (in plain torch an optimizer step between them fails too). Run the "
            "backward before the step, or run the forward again after it")
    call.tasks.add(task)
    first = flight.backwards == 0
    flight._enter_backward(task, again)  # (counted before the hooks are armed: `InFlight.idle` disarms at none)
    at_backward_end(_Left(functools.partial(flight._leave_backward, task, again)))  # at its end, or when it fails
    on_backward = getattr(call, "on_backward", None)  # the binding's recompute hooks are armed
    if on_backward is not None:
        on_backward(first)


def autograd_thread() -> bool:
    """Whether this thread was started outside Python: autograd's device threads (on CUDA every
    backward runs in one), as Python's ``threading`` shows such a thread (a dummy thread object)."""
    return isinstance(threading.current_thread(), threading._DummyThread)


def at_backward_end(fn: Callable[[], Any]) -> None:
    """Run ``fn`` when the backward running now ends, as autograd's final callback (in the thread
    that ran the backward). A backward that raises drops its callbacks unrun.

    Examples:
        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> seen = []
        >>> y = (x * 2).sum()
        >>> _ = y.grad_fn.register_prehook(lambda g: at_backward_end(lambda: seen.append(x.grad is not None)))
        >>> y.backward(); seen
        [True]
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class _Left:
    """``done()`` at a backward's end, run by autograd as its final callback, or, when the
    backward raises and autograd drops its callbacks unrun, as it lets this go: either way once,
    whichever thread ran it (on CUDA, autograd's device thread). A backward stops being counted
    (`_entered`), or being the binding's own (`InFlight.own`)."""

    __slots__ = ("done",)

    def __init__(self, done: Callable[[], Any]):
        self.done: Callable[[], Any] | None = done

    def __call__(self) -> None:
        done, self.done = self.done, None
        if done is not None:
            done()

    def __del__(self) -> None:
        self()


def mark_outputs(out: Any, call: Any, flight: InFlight, again: bool = False) -> None:
    """Put the backward marker (module docstring) on the autograd node of each tensor in ``out``
    (the graph keeps ``call`` and ``flight``, its binding's record, from then on, as long as it
    lives). Tensors under a ``torch.func`` transform are left alone: their nodes belong to the
    transform. ``again``: the call is a recomputation in backward (a whole call under a reentrant
    checkpoint), whose outputs a nested backward differentiates on behalf of the one around it.

    Examples:
        >>> import torch, types
        >>> call, flight = types.SimpleNamespace(tasks=set()), InFlight()
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = x * 2
        >>> mark_outputs({"y": y}, call, flight)
        >>> y.sum().backward()
        >>> len(call.tasks), y.requires_grad, flight.backwards
        (1, True, 0)
    """
    seen: set[int] = set()
    for t in tensors_in(out):
        fn = t.grad_fn
        if fn is None or id(fn) in seen or is_transformed(t):
            continue
        seen.add(id(fn))
        note_backwards(t, functools.partial(_entered, call, flight, again))


def note_backwards(t: torch.Tensor, note: Callable[[int], Any]) -> Any:
    """Call ``note(task)`` with the graph task of each backward that reaches ``t``'s autograd node,
    before the node runs (``t`` and the gradients are left alone). Returns the hook's handle (None
    for a tensor without a node).

    Examples:
        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> loss = (x * 2).sum()
        >>> tasks = []
        >>> handle = note_backwards(loss, tasks.append)
        >>> loss.backward(); handle.remove(); len(tasks)
        1
    """
    fn = t.grad_fn
    if fn is None:
        return None

    def hook(grad_outputs: Any) -> None:
        note(graph_task())

    return fn.register_prehook(hook)


def tensors_in(x: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    """The tensors in ``x``: pytree leaves, and inside mappings optree does not know (Hugging
    Face's ``ModelOutput``), dataclasses and plain objects' attributes (a
    ``torch.distributions.Distribution``), ``depth`` levels deep. Nothing is rebuilt or changed.

    Examples:
        >>> import torch, types
        >>> obj = types.SimpleNamespace(loc=torch.zeros(2), note="x")
        >>> [t.shape for t in tensors_in((torch.ones(1), {"obj": obj}))]
        [torch.Size([1]), torch.Size([2])]
    """
    for leaf in tree.leaves(x):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif depth == 0 or isinstance(leaf, (str, bytes, int, float, bool, type, torch.nn.Module)):
            continue
        elif isinstance(leaf, Mapping):
            for v in list(leaf.values()):
                yield from tensors_in(v, depth - 1)
        elif dataclasses.is_dataclass(leaf):
            for f in dataclasses.fields(leaf):
                yield from tensors_in(getattr(leaf, f.name, None), depth - 1)
        elif hasattr(leaf, "__dict__") and not callable(leaf):
            for v in list(vars(leaf).values()):
                yield from tensors_in(v, depth - 1)
