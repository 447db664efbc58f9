"""`train_step`: a whole optimizer step over one batch, split into micro-batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from einops import rearrange

from zfunc._tree import tree
from zfunc.core.backward import USED_UP, backward_step
from zfunc.core.donation import donate_
from zfunc.errors import ConfigError
from zfunc.core.state import TrainState
from zfunc.core.update import apply_step

__all__ = ["train_step", "split_micro_batches"]


def split_micro_batches(batch: Any, n: int) -> list[Any]:
    """Split dim 0 of every tensor in ``batch`` into ``n`` micro-batches.

    Non-tensor leaves and 0-dim tensors are passed to every micro-batch as they are. A list or
    tuple is a container: each tensor in it is split along its own dim 0 (stack per-sample
    tensors into one first). Every split tensor has the same dim 0 (the batch), and arrays of
    other libraries are refused (convert them with ``torch.as_tensor``): passed whole, each
    micro-batch would get all of them. With ``n == 1`` the batch is the micro-batch, as it is.

    Raises:
        ConfigError: naming the leaf and what to do.

    Examples:
        >>> import torch
        >>> from zfunc.core.train import split_micro_batches
        >>> parts = split_micro_batches({"x": torch.arange(6).reshape(6, 1)}, 3)
        >>> [p["x"].flatten().tolist() for p in parts]
        [[0, 1], [2, 3], [4, 5]]
    """
    if n == 1:  # the batch is the one micro-batch, whatever its leaves
        return [batch]
    leaves, spec = tree.flatten(batch)
    split = []
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if len(sizes) > 1:
        raise ConfigError(f"batch: its tensors' dim 0 differ ({sorted(sizes)}); train_step splits every tensor "
                          "along dim 0 into the micro-batches, so each must hold the whole batch there (give a "
                          "tensor that is not per sample, such as class weights, to loss_fn through a closure)")
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) and getattr(leaf, "ndim", 0) and hasattr(leaf, "__array__"):
            raise ConfigError(f"batch: a {type(leaf).__module__}.{type(leaf).__name__} of shape {list(leaf.shape)} "
                              "would go whole to every micro-batch; convert it with torch.as_tensor")
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if leaf.shape[0] % n:
                raise ConfigError(
                    f"batch: a tensor of shape {list(leaf.shape)} cannot be split into grad_accum={n} "
                    f"micro-batches along dim 0; make its dim 0 a multiple of {n} or change grad_accum")
            split.append(rearrange(leaf, "(g b) ... -> g b ...", g=n))
        else:
            split.append(None)
    return [tree.unflatten(spec, [s[i] if s is not None else leaf for s, leaf in zip(split, leaves)])
            for i in range(n)]


def train_step(loss_fn: Callable[..., Any], *, has_aux: bool = False,
               donate: bool = True) -> Callable[[TrainState, Any], TrainState]:
    """A function ``(state, batch) -> state`` doing one optimizer step on ``batch``.

    Dim 0 of every tensor in ``batch`` is split into ``cfg.grad_accum`` micro-batches; each runs
    `backward_step`, then `apply_step` updates. The step donates the state it is given (as JAX's
    ``donate_argnums`` would): do not use that state again.

    Args:
        loss_fn: ``(model, micro_batch) -> loss`` (``(loss, aux)`` with ``has_aux``; aux is
            dropped).
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
        donate: reuse the input state's buffers (default ``True``).

    Examples:
        >>> import torch, zfunc
        >>> torch.manual_seed(0) and None
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config(grad_accum=2, optimizer=zfunc.adamw(lr=0.1)))
        >>> step = zfunc.train_step(lambda model, b: ((model(b["x"]) - b["y"]) ** 2).mean())
        >>> batch = {"x": torch.ones(4, 2), "y": torch.zeros(4, 1)}
        >>> for _ in range(3):
        ...     state = step(state, batch)
        >>> state.step.item(), round(state.metrics.loss.item(), 4)
        (3, 0.0343)
    """
    def step(state: TrainState, batch: Any) -> TrainState:
        given = state
        try:
            for i, micro in enumerate(split_micro_batches(batch, state.cfg.grad_accum)):
                # The state given is read, not written, until the step's end: a micro-batch that
                # fails leaves it whole (the first one's gradients are new memory anyway)
                state, _ = backward_step(state, loss_fn, micro, has_aux=has_aux, donate=donate and i > 0)
            new = apply_step(state, donate=donate)
        except BaseException as e:
            if state is not given:  # (the note of a donating micro-batch concerns train_step's own state)
                e.__notes__ = [n for n in getattr(e, "__notes__", []) if USED_UP not in n]
                e.add_note("train_step: the state given to it is whole; go on from it")
            raise
        if donate:  # (apply_step reused its weights and optimizer state, which it shares)
            donate_(given, "train_step")
        return new

    return step
