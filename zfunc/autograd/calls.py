"""Which zfunc call is running, and which backward differentiates a call, read without touching
what the model returns.

A forward call (`zfunc.autograd.bound.BoundModel`) is *current* from its start to its end (a
context variable, and ``CALLS``, a plain count that compiled hooks read without a graph break).
When it returns, a pre-hook goes on the autograd node of each tensor of its output: a node the
user's module made, whose values, dtypes and views stay as they are (an in-place op on the output
works as in torch). When a backward reaches one, the hook notes the backward's graph task on the
call (``call.tasks``) and counts the backward as running (``BACKWARDS``, until autograd's end of
that backward): so a forward that activation checkpointing recomputes during backward, outside
zfunc's call, finds the call it belongs to (`zfunc.autograd.binding.ModuleBinding._source`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from zfunc._tree import tree
from zfunc._probes import graph_task, is_transformed

__all__ = ["CALLS", "BACKWARDS", "ENTERED", "current", "enter", "leave", "nested", "mark_outputs", "note_backwards",
           "tensors_in"]

# The forward call running now, and how many run (any thread).
_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("zfunc_call", default=None)
CALLS = 0
# Backwards running through a zfunc call's outputs now: how many (``BACKWARDS``, a plain count
# compiled hooks read), and their counts by graph task. Each is forgotten at its backward's end,
# or when autograd drops a raised backward's callbacks (`_Left`), whichever thread ran it.
BACKWARDS = 0
ENTERED: dict[int, int] = {}
_LOCK = threading.Lock()


def nested() -> bool:
    """Whether the backward running now is one a backward through a call's outputs started inside
    itself (reentrant activation checkpointing recomputes and differentiates a segment in a
    graph task of its own): it belongs to that outer backward."""
    return bool(ENTERED) and graph_task() not in ENTERED


def current() -> Any:
    """The forward call running now in this context, or None."""
    return _CURRENT.get()


def enter(call: Any) -> contextvars.Token:
    """``call`` starts: it is the current one until `leave`."""
    global CALLS
    CALLS += 1
    return _CURRENT.set(call)


def leave(token: contextvars.Token) -> None:
    global CALLS
    CALLS -= 1
    _CURRENT.reset(token)


def _entered(call: Any, grad_outputs: Any) -> None:
    """A backward reached the call's output: note it on the call, count it until it ends."""
    del grad_outputs
    global BACKWARDS
    task = graph_task()
    call.tasks.add(task)
    on_backward = getattr(call, "on_backward", None)  # the binding's recompute hooks go on
    if on_backward is not None:
        on_backward()
    with _LOCK:
        ENTERED[task] = ENTERED.get(task, 0) + 1
        BACKWARDS += 1
    torch.autograd.Variable._execution_engine.queue_callback(_Left(task))  # at its end, or when it fails


class _Left:
    """A backward's end, run by autograd as its final callback, or, when the backward raises
    and autograd drops its callbacks unrun, as it lets this go: either way the backward stops
    being counted, whichever thread ran it (on CUDA, autograd's device thread)."""

    __slots__ = ("task",)

    def __init__(self, task: int):
        self.task: int | None = task

    def __call__(self) -> None:
        task, self.task = self.task, None
        if task is not None:
            _left(task)

    def __del__(self) -> None:
        self()


def _left(task: int) -> None:
    global BACKWARDS
    with _LOCK:
        BACKWARDS -= 1
        ENTERED[task] -= 1
        if ENTERED[task] == 0:
            del ENTERED[task]


def mark_outputs(out: Any, call: Any) -> None:
    """Put the backward marker (module docstring) on the autograd node of each tensor in ``out``
    (the graph keeps ``call`` from then on, as long as it lives). Tensors under a ``torch.func``
    transform are left alone: their nodes belong to the transform.

    Examples:
        >>> import torch, types
        >>> call = types.SimpleNamespace(tasks=set())
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = x * 2
        >>> mark_outputs({"y": y}, call)
        >>> y.sum().backward()
        >>> len(call.tasks), y.requires_grad
        (1, True)
    """
    seen: set[int] = set()
    for t in tensors_in(out):
        fn = t.grad_fn
        if fn is None or id(fn) in seen or is_transformed(t):
            continue
        seen.add(id(fn))
        _prehook(fn, functools.partial(_entered, call))


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

    return _prehook(fn, hook)


def _prehook(fn: Any, hook: Callable[[Any], None]) -> Any:
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
