"""A parameter that a forward recomputed in backward read straight from the module, refused.

Activation checkpointing runs part of the model again during backward, outside zfunc's call;
the recompute binding (`zfunc.autograd.recompute`) puts the call's parameters in the module's
entries at the first module the backward recomputes, until the backward ends. A segment that
reads a parameter before that (``h @ emb.weight.T`` alone in a checkpointed function of its own)
gets the module's own tensor instead. Under reentrant checkpointing the segment's own backward then adds
that part of the gradient to the module's own ``.grad``, where nothing trains on it:
`DirectReads` sees it when the backward ends and raises, naming the parameters. (Under
non-reentrant checkpointing the same read computes with the module's own values and no gradient
lands there: not detected.) The engine checks the same ``.grad`` at ``step()`` on its own
(`zfunc.compat.engine`), so a routed module is not watched here.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

from zfunc.autograd.calls import at_backward_end

__all__ = ["DirectReads"]


class DirectReads:
    """The module's trained parameters (its own tensors, by name) and, for each backward through
    a call's outputs, their ``.grad`` as it reached them (`watch`); at that backward's end a
    gradient that appeared or grew since is refused (`check`).

    Examples:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 1)
        >>> reads = DirectReads(lin, ["weight", "bias"])
        >>> before = reads.grads()
        >>> lin(torch.ones(1, 2)).sum().backward()
        >>> try:
        ...     reads.check(before)
        ... except RuntimeError as e:
        ...     print(str(e)[:73])
        a backward through a zfunc call put gradients in the .grad of the model's
    """

    def __init__(self, module: torch.nn.Module, names: Sequence[str]):
        # The module's own tensors, held here: its entries hold another call's while one runs
        # (in another thread too), so they are not read for this.
        own = dict(module.named_parameters())
        self.params = [(name, own[name]) for name in names if name in own]
        # By graph task. A backward that raises drops its final callbacks unrun: its record is
        # let go once `_KEPT` newer ones exist (no tensor is held: ids and versions only).
        self._before: dict[int, dict[str, tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def grads(self) -> dict[str, tuple[int, int]]:
        """Each trained parameter's ``.grad`` now: its id and version (an add in place changes it).
        One pass over the parameters in each backward: kept to attribute reads."""
        return {name: (id(g), g._version) for name, p in self.params if (g := p.grad) is not None}

    def watch(self, task: int) -> None:
        """Backward ``task`` reached a call's outputs: note the gradients now, check them at its
        end (after what else it queued: its gradients are handed over first)."""
        if task in self._before or task == -1:
            return
        with self._lock:  # (another thread's backward may watch at once)
            while len(self._before) >= _KEPT:
                self._before.pop(next(iter(self._before)))
            self._before[task] = self.grads()
        at_backward_end(_Ended(weakref.ref(self), task))

    def check(self, before: dict[str, tuple[int, int]]) -> None:
        """Refuse a gradient that appeared or grew in a trained parameter's own ``.grad`` since
        ``before`` (`grads`).

        Raises:
            RuntimeError: naming the parameters and what to do instead.
        """
        now = self.grads()
        stray = [name for name, seen in now.items() if before.get(name) != seen]
        if stray:
            raise RuntimeError(
                f"a backward through a zfunc call put gradients in the .grad of the model's own {stray[:3]}"
                f"{' and more' if len(stray) > 3 else ''}, which zfunc never trains on: the module's own "
                "tensors were used outside zfunc's call. Either a reentrant activation-checkpointed segment read a "
                "parameter before any module of the model was recomputed in this backward (such as h @ emb.weight.T "
                "alone in the checkpointed function: zfunc puts a call's parameters in the module's entries at the "
                "first module a backward recomputes; at stage 3 a root parameter at the first module holding part "
                "of the root): read it inside a module's forward, or keep it "
                "out of the segment (use_reentrant=False does not help: the recomputation would compute with the "
                "module's own values); or the loss computed with the original module's parameters (a penalty "
                "over model.parameters()): use the bound model loss_fn receives (its named_parameters()), or "
                "Config weight_decay for L2")

    def forget(self, task: int) -> dict[str, tuple[int, int]] | None:
        with self._lock:
            return self._before.pop(task, None)


_KEPT = 16  # records of backwards under way, at most (more at once than any real run has)


class _Ended:
    """A watched backward's end (autograd's final callback): its check, queued once more when
    it first runs, so it runs after every callback the backward queued meanwhile (the call's
    own reduces finish before a refusal)."""

    __slots__ = ("ref", "task", "again")

    def __init__(self, ref: weakref.ref, task: int):
        self.ref, self.task, self.again = ref, task, True

    def __call__(self) -> None:
        if self.again:
            self.again = False
            at_backward_end(self)
            return
        reads = self.ref()
        before = None if reads is None else reads.forget(self.task)
        if before is not None:
            reads.check(before)
