"""The loss scale and ``1 / (grad_accum * world)`` on the cotangents at the model's boundary.

Every differentiable tensor the model returns passes through `ScaleCotangent`, an identity in
forward whose backward multiplies the cotangent by ``factor`` (a device scalar): so a loss, a
non-scalar ``out.backward(grad)`` and a `zfunc.vjp` cotangent are all scaled the same way. The
model's floating-point inputs get ``1 / factor`` on the cotangent that leaves them, so chained
models compose without scaling twice.

`scale_tree` reaches tensors inside zfunc pytrees, mappings optree does not know (Hugging
Face's ``ModelOutput``), dataclasses, and plain objects that keep tensors in their attributes
(``torch.distributions.Distribution``); an object whose tensors it cannot reach is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import types
from collections.abc import Mapping
from typing import Any

import torch

from zfunc._tree import tree
from zfunc.autograd._vmap import VmapAsIs
from zfunc.autograd.gather import graph_task

__all__ = ["ScaleCotangent", "scale_tree", "BACKWARDS"]

# Backwards running through a zfunc model's outputs now. Outside them (every forward) the
# recompute hooks return at once on reading it: a plain global, so torch.compile traces them.
# A backward that raises never lowers it; each zfunc forward outside a backward resets it.
BACKWARDS = 0


def _backward_entered() -> None:
    global BACKWARDS
    BACKWARDS += 1
    torch.autograd.Variable._execution_engine.queue_callback(_backward_left)  # at the end of this backward


def _backward_left() -> None:
    global BACKWARDS
    BACKWARDS -= 1

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
          enum.Enum, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, range, slice)


class ScaleCotangent(VmapAsIs, torch.autograd.Function):
    """Identity forward; backward multiplies the cotangent by ``factor`` (a device scalar).

    A backward that builds a graph through it (``create_graph=True``, ``torch.func.grad`` of
    the model) is refused unless ``exact``: a gradient of that gradient reaches the parameters
    without passing the factor, so it would train ``1 / factor`` times too strongly.

    ``call`` (on a model's outputs): the forward call they came from; the node keeps it as long
    as the graph lives, and each backward through it notes its graph task in ``call.tasks``, so a
    forward recomputed later in that backward finds its call from the graph.

    Examples:
        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> ScaleCotangent.apply(x, torch.tensor(0.5)).sum().backward()
        >>> x.grad.tolist()
        [0.5, 0.5]
    """

    @staticmethod
    def forward(x: torch.Tensor, factor: torch.Tensor, exact: bool = True, call: Any = None) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[1])
        ctx.exact = inputs[2] if len(inputs) > 2 else True
        ctx.call = inputs[3] if len(inputs) > 3 else None

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.call is not None:
            ctx.call.tasks.add(graph_task())
            _backward_entered()
        if torch.is_grad_enabled() and not ctx.exact:
            raise RuntimeError(
                "a gradient of a gradient through a zfunc model (create_graph=True, torch.func.grad of the "
                "model) is exact only with grad_accum * world == 1 and no loss scaling: zfunc puts "
                "loss_scale / (grad_accum * world) on the model's output cotangent, which second-order terms "
                "do not pass. Compute such terms with grad_accum=1 on one rank, or outside the zfunc model")
        (factor,) = ctx.saved_tensors
        if grad.dtype == torch.float16:  # a loss scale >= 65536 is inf in fp16: multiply in fp32
            return (grad.float() * factor).to(torch.float16), None, None, None
        return grad * factor.to(grad.dtype), None, None, None


def _differentiable(t: Any) -> bool:
    """A floating-point tensor that requires grad (or one ``torch.func`` wraps, whose wrapper
    does not say: the identity forward costs nothing if it does not)."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point()
            and (t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t)))


def scale_tree(x: Any, factor: torch.Tensor, exact: bool = True, call: Any = None) -> tuple[Any, int]:
    """``x`` with every differentiable tensor passed through `ScaleCotangent` (``exact``: whether
    second-order terms through it are right; ``call``: the forward call of a model's outputs), and
    their count.

    Containers are rebuilt (shallow copies), never changed in place.

    Raises:
        TypeError: an object holds a differentiable tensor where zfunc cannot replace it (in
            ``__slots__``, say); its type is named.

    Examples:
        >>> import torch
        >>> d = torch.distributions.Normal(torch.zeros(2, requires_grad=True), torch.ones(2))
        >>> scaled, count = scale_tree((torch.ones(1, requires_grad=True), d), torch.tensor(2.0))
        >>> count, type(scaled[1]).__name__, scaled[1] is d
        (2, 'Normal', False)
    """
    count = 0

    def walk(obj: Any) -> Any:
        return tree.map(leaf, obj)

    def leaf(t: Any) -> Any:
        nonlocal count
        if isinstance(t, torch.Tensor):
            if not _differentiable(t):
                return t
            count += 1
            return ScaleCotangent.apply(t, factor, exact, call)
        if isinstance(t, _ATOMS):
            return t
        if isinstance(t, Mapping):  # a mapping optree does not know, e.g. Hugging Face's ModelOutput
            out = copy.copy(t)
            for k in list(t.keys()):
                out[k] = walk(t[k])
            return out
        if dataclasses.is_dataclass(t):
            names = [f.name for f in dataclasses.fields(t)]
        elif hasattr(t, "__dict__"):
            names = list(vars(t))
        else:
            names = []
        slots = [s for cls in type(t).__mro__ for s in getattr(cls, "__slots__", ()) if s not in names]
        hidden = [s for s in slots if any(_differentiable(v) for v in tree.leaves(getattr(t, s, None)))]
        if hidden:
            raise TypeError(
                f"zfunc cannot attach the loss scale and 1/(grad_accum * world) to the differentiable "
                f"tensor in {type(t).__name__}.{hidden[0]} (a __slots__ attribute) of the model's output; "
                f"return tensors, containers, dataclasses or objects keeping tensors in their __dict__, "
                f"or register {type(t).__name__} with zfunc.tree")
        changed = {}
        for name in names:
            value = getattr(t, name)
            new = walk(value)
            if new is not value:
                changed[name] = new
        if not changed:
            return t
        out = copy.copy(t)
        for name, new in changed.items():
            object.__setattr__(out, name, new)
        return out

    try:
        return walk(x), count
    finally:
        walk = leaf = None  # noqa: F841 - the two closures hold each other: free them without the collector
