"""Where the data-parallel average is applied: to parameter gradients as they enter zfunc.

zfunc never scales what the model returns or takes: a gradient through the model with respect to
anything but its parameters (an input gradient, a penalty with ``create_graph=True``, ``jvp``) is
torch's. The mean over ranks and micro-batches is a factor on each parameter gradient where it
enters the state (a bucket's tap, a stage-3 unit's reduce-scatter): ``1 / (grad_accum * world)``
for a backward seeded with the loss as it is (``backward_step``, ``vjp``, a plain
``loss.backward()`` through the engine), ``1 / world`` in a backward the engine's own
``backward(loss)`` started, whose seed carries the ``1 / grad_accum`` as DeepSpeed's does (that
backward alone: another thread's backward meanwhile keeps its factor). The loss scale is never
here: it multiplies the loss (or a `zfunc.vjp` cotangent) and is divided out in the step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from zfunc._probes import graph_task
from zfunc.autograd import calls

if TYPE_CHECKING:
    from zfunc.core.state import TrainState

__all__ = ["Average", "ranks_averaged"]


def ranks_averaged(state: TrainState) -> int:
    """The ranks a gradient is averaged over: the world, or 1 with ``Config.grad_reduce="sum"``.

    Examples:
        >>> import torch, zfunc
        >>> ranks_averaged(zfunc.init(torch.nn.Linear(1, 1), zfunc.Config()))
        1
    """
    return state.group.size if state.cfg.grad_reduce == "mean" else 1


# The backwards an engine's ``backward(loss)`` started (their seed carries 1 / grad_accum), by
# graph task, each with the thread that ran its first node; filled and emptied by `Average.seeded`.
# Every engine's parameter gradients in such a backward enter times 1 / world (one loss may reach
# several engines), and so do those of a backward nested in it in that thread (reentrant
# checkpointing differentiates a segment in a graph task of its own). Any other backward,
# whichever thread runs it, keeps 1 / (grad_accum * world). On CUDA autograd runs every thread's
# backward on its device thread: a reentrant segment's backward that another thread starts while
# an engine's own backward runs there is taken as nested in it (not measured: no GPU here).
SEEDED: dict[int, int] = {}
_LOCK = threading.Lock()


def seeded_now(flight: calls.InFlight | None = None) -> bool:
    """Whether the backward running now is one whose seed carries ``1 / grad_accum`` (above). A
    backward in the thread of a seeded one is nested in it unless it reached one of the calls'
    outputs itself (``flight``, the binding's record): reentrant checkpointing differentiates a
    segment in a graph task of its own, whose outputs were made under ``no_grad`` and so are not
    marked, whether the call is inside the segment or the segment inside the call. With the
    binding's record, a segment's backward is seeded as the innermost backward around it in its
    thread is, of the seeded ones and the binding's own (`calls.InFlight.around`): a step a
    gradient hook of a seeded backward makes has its own factor, and an engine's backward inside
    a hook of a step its own."""
    if not SEEDED:
        return False
    task = graph_task() if flight is None else flight.task_now()
    if task in SEEDED:
        return True
    me = threading.get_ident()
    if flight is None:
        return me in SEEDED.values()
    if flight.through_calls(task):
        return False
    with _LOCK:  # the innermost of this thread's seeded backwards and the binding's own around it
        inside = [t for t, thread in SEEDED.items() if thread == me]
    around = flight.around()
    if around is not None:
        inside.append(around)
    return bool(inside) and max(inside) in SEEDED


class _Mark:
    """Notes the backwards that reach a seeded loss (`SEEDED`), and forgets them."""

    __slots__ = ("tasks",)

    def __init__(self) -> None:
        self.tasks: list[int] = []

    def __call__(self, task: int) -> None:
        with _LOCK:
            SEEDED[task] = threading.get_ident()
        self.tasks.append(task)

    def forget(self) -> None:
        with _LOCK:
            for task in self.tasks:
                SEEDED.pop(task, None)


class Average:
    """The factor a parameter gradient is multiplied by where it enters zfunc, read when it
    arrives (so one forward's graph serves a backward of either kind).

    Args:
        micro_batches: micro-batches per optimizer step (``grad_accum``).
        ranks: ranks averaged over (`ranks_averaged`).
        flight: the binding's calls in flight (`zfunc.autograd.calls.InFlight`), which tells a
            backward nested in an engine's own backward.

    Examples:
        >>> import torch
        >>> avg = Average(micro_batches=4, ranks=2)
        >>> w = torch.ones(1, requires_grad=True)
        >>> seen = []
        >>> _ = w.register_hook(lambda g: seen.append(avg.factor))
        >>> loss = (w * 2).sum()
        >>> with Average.seeded(loss):   # its seed carries 1 / micro_batches already
        ...     loss.backward(torch.tensor(0.25))
        >>> (w * 2).sum().backward()      # a backward seeded with the loss as it is
        >>> seen, avg.factor
        ([0.5, 0.125], 0.125)
    """

    def __init__(self, micro_batches: int, ranks: int, flight: calls.InFlight | None = None):
        self.micro_batches, self.ranks, self.flight = micro_batches, ranks, flight

    @property
    def factor(self) -> float:
        return 1.0 / (self.ranks if seeded_now(self.flight) else self.micro_batches * self.ranks)

    def current(self) -> float:
        """The factor now (for a backward that reads it when it runs)."""
        return self.factor

    @staticmethod
    @contextlib.contextmanager
    def seeded(loss: torch.Tensor) -> Iterator[None]:
        """The backward from ``loss`` run inside the block has a seed divided by
        ``micro_batches`` already: every engine's factor leaves it out there (a loss over several
        engines has one seed); backwards elsewhere meanwhile are not affected."""
        mark = _Mark()
        handle = calls.note_backwards(loss, mark)
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()
            mark.forget()
