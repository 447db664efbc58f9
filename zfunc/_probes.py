"""Read-only queries of torch's autograd and functorch state that have no public equivalent,
in one place: which backward runs, whether a transform runs (and a tensor is a transform's),
whether saved-tensor hooks are in force, the functorch switches zfunc's Functions use,
whether a tensor is the only one over its memory, and whether torch.compile has run.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["graph_task", "in_backward", "in_transform", "hooks_active", "plain", "is_transformed",
           "unwrap_dead", "sole_owner", "tensors_over", "compiled_anything", "recomputed"]


def in_backward() -> bool:
    """Whether autograd is running a backward now (reentrant activation checkpointing recomputes a
    forward inside one). A read-only query of autograd's engine; no public equivalent."""
    return graph_task() != -1


def recomputed(born: int) -> bool:
    """Whether a forward runs inside a backward other than the one its call was made in
    (``born``: `graph_task` when the call was made, -1 outside any backward): a forward autograd
    recomputes (activation checkpointing), not a call a gradient hook makes during a backward.

    Examples:
        >>> recomputed(graph_task())  # a call made here, running here
        False
    """
    task = graph_task()
    return task != -1 and task != born


def in_transform() -> bool:
    """Whether a ``torch.func`` transform (grad, vjp, vmap, functionalize) is running (torch's own
    test in ``Function.apply``); no public equivalent."""
    return torch._C._are_functorch_transforms_active()


def graph_task() -> int:
    """The id of the backward autograd is running now (-1 outside one): how a forward recomputed
    in backward finds the call being differentiated (`zfunc.autograd.binding.ModuleBinding._source`)."""
    return torch._C._current_graph_task_id()


def hooks_active() -> bool:
    """Whether saved-tensor hooks are in force (the user's: activation checkpointing, offload).
    A read of autograd's hook stack; no public equivalent."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def compiled_anything() -> bool:
    """Whether ``torch.compile`` has compiled a frame in this process (Dynamo's count of the
    frames it evaluated, which ``torch._dynamo.reset()`` keeps): compiled code may then run
    anywhere in it, and a hook in torch's global table would make a compiled module warn and
    recompile. A read of Dynamo's counters; no public equivalent.

    Examples:
        >>> isinstance(compiled_anything(), bool)
        True
    """
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and bool(dynamo.utils.counters["frames"]["total"])


def has_grad_hooks(t: torch.Tensor) -> bool:
    """Whether a hook was registered on ``t`` (``register_hook``,
    ``register_post_accumulate_grad_hook``) and is still there: a read of the tensor's hook
    tables; no public equivalent.

    Examples:
        >>> t = torch.zeros(2, requires_grad=True)
        >>> h = t.register_hook(lambda g: g)
        >>> has_grad_hooks(t), h.remove(), has_grad_hooks(t)
        (True, None, False)
    """
    return bool(t._backward_hooks) or bool(t._post_accumulate_grad_hooks)


def plain() -> Any:
    """Tensors made inside it are plain ones, even where a ``torch.func`` transform runs (a user's
    ``grad`` around the model): the collectives' buffers are the state's, never the transform's.
    A functorch switch; no public equivalent."""
    return torch._C._DisableFuncTorch()


def is_transformed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``torch.func`` transform's wrapper (its autograd node is the transform's)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def unwrap_dead(args: tuple) -> tuple:
    """``args`` with the wrappers of finished transforms unwrapped, as ``Function.apply`` does."""
    return torch._functorch.utils.unwrap_dead_wrappers(args)


def tensors_over(t: torch.Tensor) -> int:
    """How many tensors are over ``t``'s memory, ``t`` included (views, tensors autograd saved).
    A Python storage object someone keeps (``t.untyped_storage()``) is not counted.

    Examples:
        >>> x = torch.empty(4)
        >>> v = x[:2]
        >>> tensors_over(x)
        2
    """
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1  # less the storage object made to ask


def sole_owner(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor over its memory (`tensors_over`): then, once ``t`` is let
    go, nothing reads that memory any more and it can be reused.

    Examples:
        >>> x = torch.empty(4)
        >>> sole_owner(x)
        True
        >>> v = x[:2]
        >>> sole_owner(x)
        False
    """
    return tensors_over(t) <= 1
