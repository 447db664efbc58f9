"""Gradients into the state: `backward_step`, `vjp` and `accumulate`.

Forward binds the module to the state's parameters through `zfunc.comm.bind_unit`, whose
backward delivers each unit's gradient to a *sink* leaf: full at stages 0-1, reduce-scattered to
this rank's shard at stages 2-3. So any way of running backward gives the same gradients.

The loss scale and the ``1 / (grad_accum * world)`` factor are applied to the cotangent entering
the model outputs (and removed again from the cotangent leaving the model inputs), so a
non-scalar backward with a user-given gradient is scaled too, and models compose.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.func import functional_call

from zfunc import comm
from zfunc._tree import tree
from zfunc.gather import Binding
from zfunc.state import TrainState

__all__ = ["backward_step", "vjp", "accumulate", "bind", "cotangent_factor", "sinks_into", "grad_views"]


class _ScaleCotangent(torch.autograd.Function):
    """Identity forward; backward multiplies the cotangent by ``factor`` (a device scalar)."""

    @staticmethod
    def forward(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (factor,) = ctx.saved_tensors
        return grad * factor.to(grad.dtype), None


def _scale_tree(x: Any, factor: torch.Tensor) -> tuple[Any, int]:
    """``x`` with every differentiable tensor passed through `_ScaleCotangent`, and their count.

    Mappings optree does not know (e.g. Hugging Face's ``ModelOutput``) are copied with their
    values scaled, so their gradients are scaled too.
    """
    count = 0

    def scale(t: Any) -> Any:
        nonlocal count
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            count += 1
            return _ScaleCotangent.apply(t, factor)
        if isinstance(t, Mapping) and not isinstance(t, torch.Tensor):
            out = copy.copy(t)
            for k in list(t.keys()):
                out[k] = tree.map(scale, t[k])
            return out
        return t

    return tree.map(scale, x), count


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    return tree.map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x)


def cotangent_factor(state: TrainState) -> torch.Tensor:
    """``loss_scale / (grad_accum * world)``: what a model-output cotangent is multiplied by."""
    return state.scaler.scale / (state.cfg.grad_accum * state.group.size)


def grad_views(state: TrainState, grads: torch.Tensor) -> list[torch.Tensor]:
    """Each unit's part of a gradient buffer: its full flat buffer (stages 0-1) or its shard."""
    lay = state.layout
    return [grads.narrow(0, 0, u.padded) if state.stage < 2 else lay.arena_slice(grads, u) for u in lay.units]


def sinks_into(state: TrainState, grads: torch.Tensor) -> list[torch.Tensor]:
    """One zero-memory leaf per unit whose ``.grad`` is that unit's part of ``grads``.

    Backward accumulates each unit's gradient (full at stages 0-1, this rank's reduce-scattered
    shard at stages 2-3) straight into ``grads``, in place.
    """
    dt = state.cfg.grad_accum_dtype
    sinks = []
    for part in grad_views(state, grads):
        sink = torch.zeros((), dtype=dt, device=state.device).expand(part.numel()).requires_grad_()
        sink.grad = part
        sinks.append(sink)
    return sinks


def bind(state: TrainState, sinks: Sequence[torch.Tensor]) -> Callable[..., Any]:
    """The module as a function of its inputs, running on ``state``'s parameters.

    Gradients of anything computed from its outputs reach ``sinks`` (see `sinks_into`).
    """
    lay, cfg, group = state.layout, state.cfg, state.group
    factor = cotangent_factor(state)

    def model(*args: Any, **kwargs: Any) -> Any:
        tensors = dict(state.frozen)
        if state.stage == 3:  # the root unit now; the others when their modules run
            binding = Binding(state, sinks)
            tensors.update(binding.root_views())
            hooks = binding.saved_tensor_hooks()
        else:
            (unit,) = lay.units
            full = comm.bind_unit(sinks[0], None, state.compute, group, cfg.reduce_dtype, state.stage == 2)
            tensors.update(lay.views(unit, full))
            hooks = contextlib.nullcontext()
        if cfg.autocast is None and cfg.compute_dtype != torch.float32:
            # Like FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True): a low-precision model
            # takes its floating-point inputs in its own dtype.
            args, kwargs = _cast_floats((args, kwargs), cfg.compute_dtype)
        (args, kwargs), _ = _scale_tree((args, kwargs), 1 / factor)
        ctx = (torch.autocast(state.device.type, dtype=cfg.autocast) if cfg.autocast
               else contextlib.nullcontext())
        with ctx, hooks:
            out = functional_call(state.module, tensors, args, kwargs, tie_weights=True, strict=False)
        scaled, count = _scale_tree(out, factor)
        if count == 0 and torch.is_grad_enabled():
            raise TypeError(
                f"zfunc found no differentiable tensor in the model's output (a {type(out).__name__}) to "
                "attach the loss scale and 1/(grad_accum * world) to; return tensors, or tuples, lists, "
                "dicts or dataclasses registered with zfunc.tree")
        return scaled

    return model


def backward_step(state: TrainState, loss_fn: Callable[..., Any], batch: Any, *,
                  has_aux: bool = False, donate: bool = False) -> tuple[TrainState, Any]:
    """Run ``loss_fn(model, batch)`` and accumulate its gradient into the state.

    One micro-batch: stage 2-3 gradients are reduce-scattered to their owners during backward;
    stages 0-1 keep the full local gradient until `apply_step`.

    Args:
        state: the `TrainState`.
        loss_fn: ``(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), where
            ``model`` is the module bound to the state's parameters.
        batch: anything ``loss_fn`` takes.
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
        donate: reuse ``state``'s gradient buffer (``state`` must not be used again).

    Returns:
        ``(new_state, loss)``, or ``(new_state, (loss, aux))`` with ``has_aux``; ``loss`` is
        detached and unscaled.

    Examples:
        >>> import torch, zfunc
        >>> torch.manual_seed(0) and None
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config(stage=2))
        >>> def loss_fn(model, batch):
        ...     return ((model(batch["x"]) - batch["y"]) ** 2).mean()
        >>> batch = {"x": torch.ones(4, 2), "y": torch.zeros(4, 1)}
        >>> state, loss = zfunc.backward_step(state, loss_fn, batch)
        >>> round(loss.item(), 4), state.micro_step.item()
        (0.0432, 1)
    """
    grads = state.grads if donate else state.grads.clone()
    out = loss_fn(bind(state, sinks_into(state, grads)), batch)
    loss, aux = out if has_aux else (out, None)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise TypeError(f"loss_fn must return a scalar tensor{' first' if has_aux else ''}; "
                        f"got {type(loss).__name__}" + (f" of shape {list(loss.shape)}"
                                                        if isinstance(loss, torch.Tensor) else ""))
    loss.backward()  # into `grads` through the sinks (plain backward: reentrant checkpointing works)
    loss = loss.detach().reshape(())
    new = state.replace(grads=grads, micro_step=state.micro_step + 1, loss_sum=state.loss_sum + loss.float())
    return new, ((loss, aux) if has_aux else loss)


def vjp(state: TrainState, fn: Callable[..., Any], *args: Any,
        argnums: Sequence[int] = (), donate: bool = False) -> tuple[Any, Callable[..., Any]]:
    """Run ``fn(model, *args)`` now; accumulate ``d<out, cotangent>/d params`` later.

    For custom gradient flows: two models on two process groups, one model's output feeding the
    other. The cotangent may be any pytree of tensors shaped like ``out`` (non-scalar too).

    Args:
        state: the `TrainState`.
        fn: ``(model, *args) -> out``, a tensor or a pytree of tensors.
        *args: inputs of ``fn``.
        argnums: positions in ``args`` whose cotangents the pullback also returns (they must be
            floating-point tensors), as `torch.func.vjp` would.
        donate: the pullback may reuse ``state``'s gradient buffer.

    Returns:
        ``(out, pullback)``: ``out`` detached; ``pullback(cotangent, retain_graph=False)`` returns
        the new state, or ``(new_state, arg_cotangents)`` when ``argnums`` is given.

    Examples:
        >>> import torch, zfunc
        >>> torch.manual_seed(0) and None
        >>> state = zfunc.init(torch.nn.Linear(2, 3), zfunc.Config(stage=1))
        >>> x = torch.ones(4, 2)
        >>> out, pullback = zfunc.vjp(state, lambda model, x: model(x), x, argnums=(0,))
        >>> state, (dx,) = pullback(torch.ones_like(out))
        >>> out.shape, dx.shape, state.micro_step.item()
        (torch.Size([4, 3]), torch.Size([4, 2]), 1)
    """
    grads = state.grads if donate else state.grads.clone()
    sinks = sinks_into(state, grads)
    args = list(args)
    wrt = []
    for i in argnums:
        a = args[i]
        if not (isinstance(a, torch.Tensor) and a.is_floating_point()):
            raise TypeError(f"argnums: argument {i} must be a floating-point tensor")
        args[i] = a.detach().requires_grad_()
        wrt.append(args[i])
    out = fn(bind(state, sinks), *args)
    outs, spec = tree.flatten(out)

    def pullback(cotangent: Any, *, retain_graph: bool = False) -> Any:
        cots, cspec = tree.flatten(cotangent)
        if cspec != spec:
            raise ValueError(f"pullback: the cotangent's structure {cspec} differs from the output's {spec}")
        for o, c in zip(outs, cots):
            if o.shape != c.shape:
                raise ValueError(f"pullback: cotangent shape {list(c.shape)} differs from output shape "
                                 f"{list(o.shape)}")
        torch.autograd.backward(outs, cots, retain_graph=retain_graph)
        new = state.replace(grads=grads, micro_step=state.micro_step + 1)
        if not argnums:
            return new
        return new, tuple(torch.zeros_like(a) if a.grad is None else a.grad for a in wrt)

    return tree.map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out), pullback


def accumulate(state: TrainState, grads: dict[str, torch.Tensor], *, donate: bool = False) -> TrainState:
    """Add one micro-batch's gradients, computed elsewhere, to the state.

    ``grads`` maps parameter names (as ``model.named_parameters()``) to this rank's full local
    gradient of its micro-batch loss; missing names count as zero. They are treated exactly as
    `backward_step` treats its own: averaged over ranks and micro-batches, scaled by the loss
    scale, and at stages 2-3 reduce-scattered now.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config(stage=0))
        >>> state = zfunc.accumulate(state, {"weight": torch.ones(1, 2)})
        >>> state.grads[:3].tolist(), state.micro_step.item()
        ([1.0, 1.0, 0.0], 1)
    """
    lay, cfg = state.layout, state.cfg
    unknown = set(grads) - set(lay.names)
    if unknown:
        raise KeyError(f"accumulate: {sorted(unknown)} are not trainable parameters of the model; "
                       f"expected names from {list(lay.names)[:5]}...")
    factor = cotangent_factor(state)
    unit_grads = []
    for unit in lay.units:
        for s in unit.slots:
            g = grads.get(s.name)
            if g is not None and tuple(g.shape) != s.shape:
                raise ValueError(f"accumulate: gradient of {s.name!r} has shape {list(g.shape)}, "
                                 f"expected {list(s.shape)}")
        flat = lay.flatten_unit(unit, grads, cfg.reduce_dtype, state.device).mul_(factor.to(cfg.reduce_dtype))
        if state.stage >= 2:
            flat = comm.reduce_scatter(flat, "sum", state.group)
        unit_grads.append(flat.to(cfg.grad_accum_dtype))
    grads = state.grads if donate else state.grads.clone()
    for part, g in zip(grad_views(state, grads), unit_grads):
        part.add_(g)
    return state.replace(grads=grads, micro_step=state.micro_step + 1)
