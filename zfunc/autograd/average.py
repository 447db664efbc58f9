"""Where the data-parallel average is applied: to parameter gradients as they enter zfunc.

zfunc never scales what the model returns or takes: a gradient through the model with respect to
anything but its parameters (an input gradient, a penalty with ``create_graph=True``, ``jvp``) is
torch's. The mean over ranks and micro-batches is a factor on each parameter gradient where it
enters the state (a bucket's tap, a stage-3 unit's reduce-scatter): ``1 / (grad_accum * world)``
for a backward seeded with the loss as it is (``backward_step``, ``vjp``, a plain
``loss.backward()`` through the engine), ``1 / world`` while the engine's own ``backward(loss)``
runs, whose seed carries the ``1 / grad_accum`` as DeepSpeed's does. The loss scale is never
here: it multiplies the loss (or a `zfunc.vjp` cotangent) and is divided out in the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

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


# Engine backwards running now whose seed carries 1 / grad_accum: while one runs, every engine's
# parameter gradients enter times 1 / world (one loss may reach several engines).
SEEDED = 0


class Average:
    """The factor a parameter gradient is multiplied by where it enters zfunc, read when it
    arrives (so one forward's graph serves a backward of either kind).

    Args:
        micro_batches: micro-batches per optimizer step (``grad_accum``).
        ranks: ranks averaged over (`ranks_averaged`).

    Examples:
        >>> avg = Average(micro_batches=4, ranks=2)
        >>> avg.factor
        0.125
        >>> with avg.seeded():          # the seed carries 1 / micro_batches already
        ...     avg.factor
        0.5
        >>> avg.factor
        0.125
    """

    def __init__(self, micro_batches: int, ranks: int):
        self.micro_batches, self.ranks = micro_batches, ranks

    @property
    def factor(self) -> float:
        return 1.0 / (self.ranks if SEEDED else self.micro_batches * self.ranks)

    def current(self) -> float:
        """The factor now (for a backward that reads it when it runs)."""
        return self.factor

    @staticmethod
    @contextlib.contextmanager
    def seeded() -> Iterator[None]:
        """While a backward runs whose seed is divided by ``micro_batches`` already (every
        engine's factor then leaves it out: a loss over several engines has one seed)."""
        global SEEDED
        SEEDED += 1
        try:
            yield
        finally:
            SEEDED -= 1
