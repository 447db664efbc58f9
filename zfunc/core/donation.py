"""Donation, enforced: a state given to a step with ``donate=True`` cannot be used again.

With ``donate=True`` a step reuses the input state's buffers for its result, so the input's
tensors are the result's (or garbage). As JAX deletes donated buffers, zfunc takes the tensors
out of the donated state: each of its tensor fields becomes a `Donated` marker that raises,
naming ``donate``, on any use (arithmetic, a method, a torch function), and every step
function, `zfunc.full_params` and `zfunc.save` refuse the state at the door. Its static
fields (``cfg``, ``layout``) stay readable. While the donating call's backward runs, a mark on
the state (`giving`) refuses the step functions a gradient hook calls on the same state. This is
the one mutation of a state zfunc makes, and only of one the caller gave away.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from zfunc.autograd.swap import set_data

if TYPE_CHECKING:
    from zfunc.core.state import TrainState

__all__ = ["Donated", "donate_", "check_live", "is_donated", "giving", "check_not_giving"]


class Donated:
    """What a tensor field of a donated state reads as: any use raises ``RuntimeError``.

    Examples:
        >>> d = Donated("apply_step", "params")
        >>> try:
        ...     d.sum()
        ... except RuntimeError as e:
        ...     print(str(e)[:64])
        state.params: this state was donated to apply_step (donate=True)
    """

    __slots__ = ("by", "name")

    def __init__(self, by: str, name: str):
        object.__setattr__(self, "by", by)
        object.__setattr__(self, "name", name)

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(_message(self.by, f"state.{self.name}"))

    def __getattr__(self, attr: str) -> NoReturn:
        if attr in Donated.__slots__:  # (a copy made without __init__: nothing to name)
            raise AttributeError(attr)
        self._refuse()

    def __reduce_ex__(self, protocol: Any) -> NoReturn:  # pickling a donated state uses it
        self._refuse()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> NoReturn:
        marker = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, Donated))
        marker._refuse()

    def __repr__(self) -> str:
        return f"<donated to {self.by}>"

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __matmul__ = __pow__ = __neg__ = __getitem__ = __setitem__ = __iter__ = __len__ = _refuse
    __bool__ = __float__ = __int__ = __index__ = __array__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse


def _message(by: str, what: str) -> str:
    return (f"{what}: this state was donated to {by} (donate=True), which reused its buffers for the "
            "state it returned; use that state, or call without donate=True to keep this one")


def donate_(state: TrainState, by: str, new: TrainState | None = None,
            written: tuple[str, ...] = (), kept: tuple[torch.Tensor, ...] = ()) -> TrainState | None:
    """Take the tensors out of ``state``, given away to ``by`` with ``donate=True``; returns
    ``new`` (the state ``by`` made) holding tensors of its own.

    A tensor the caller kept from ``state`` before (``prev = state.params``, a leaf of
    `zfunc.tree.leaves`) must not silently read ``new``'s values: every tensor of the
    ``written`` fields (those ``by`` updates in place) whose memory ``new`` reuses, or that
    ``kept`` holds (buffers ``by`` keeps for later steps), is emptied (it keeps its dtype and
    device and holds no elements, so arithmetic with it fails on the shape), and ``new`` holds
    new tensor objects over that memory. A leaf kept from a donated state never aliases the next
    one; a view the caller made of one (``state.params[:4]``, ``.detach()``) does, as a view of a
    donated buffer does in JAX: copy what you keep (``.clone()``) before donating.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config())
        >>> state = zfunc.accumulate(state, {}, strict=False)
        >>> kept = state.params
        >>> later = zfunc.apply_step(state, donate=True)
        >>> try:
        ...     zfunc.apply_step(state)
        ... except RuntimeError as e:
        ...     print(str(e)[:48])
        apply_step: this state was donated to apply_step
        >>> later.step.item(), state.stage, kept.numel()
        (1, 2, 0)
    """
    from zfunc._tree import tree

    old = [t for name in written for t in tree.leaves(getattr(state, name)) if isinstance(t, torch.Tensor)]
    if new is not None:
        mine = {id(t) for t in old}
        new = tree.map(lambda t: t.detach() if isinstance(t, torch.Tensor) and id(t) in mine else t, new)
        reused = {_memory(t) for t in (*tree.leaves(new), *kept) if isinstance(t, torch.Tensor)}
        emptied = [t for t in old if _memory(t) in reused]
        set_data([(t, torch.empty(0, dtype=t.dtype, device=t.device)) for t in emptied])
        for t in emptied:  # another state holding the same tensor (one made from this without donating) is spent too
            t.zfunc_spent_by = by
        spares = getattr(getattr(state, "binding", None), "spares", None)
        if spares is not None and isinstance(state.compute, torch.Tensor) and isinstance(new.compute, torch.Tensor):
            spares.moved(state.compute, new.compute)  # the recompute leaves over its memory go with it
    for f in dataclasses.fields(state):
        if f.metadata.get("pytree_node", True):
            object.__setattr__(state, f.name, Donated(by, f.name))
    return new


def _memory(t: torch.Tensor) -> tuple[str, int]:
    """Where ``t``'s elements live (a tensor of none lives nowhere another could share)."""
    return str(t.device), t.untyped_storage().data_ptr() if t.numel() and t.device.type != "meta" else -id(t)


def is_donated(state: TrainState) -> bool:
    """Whether ``state`` was given away (`donate_`): its leaves are `Donated` markers."""
    return isinstance(state.__dict__.get("params"), Donated)


def check_live(state: TrainState, what: str) -> None:
    """Refuse a donated ``state`` at the door of ``what``, and one whose buffers another state's
    donation emptied (states made from one another without donating share them).

    Examples:
        >>> import torch, zfunc
        >>> own = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config())
        >>> s, _ = zfunc.backward_step(own, lambda m, x: m(x).sum(), torch.ones(1, 2))  # shares own's weights
        >>> _ = zfunc.apply_step(s, donate=True)
        >>> try:
        ...     zfunc.full_params(own)
        ... except RuntimeError as e:
        ...     print(str(e)[:66])
        full_params: this state shares its buffers with a state donated to
    """
    if is_donated(state):
        raise RuntimeError(_message(state.__dict__["params"].by, what))
    state.check_unspent(what)


@contextlib.contextmanager
def giving(state: TrainState, by: str, donate: bool = True) -> Iterator[None]:
    """With ``donate``, ``state`` is given to ``by`` while the block (its backward, which writes
    the state's gradient buffer as it goes) runs: `check_not_giving` refuses the step functions
    a gradient hook calls on it. Without, nothing."""
    if not donate:
        yield
        return
    object.__setattr__(state, "_zfunc_giving", by)
    try:
        yield
    finally:
        state.__dict__.pop("_zfunc_giving", None)


def check_not_giving(state: TrainState, what: str) -> None:
    """Refuse ``what`` on a state whose donating call's backward runs now (`giving`): that
    backward writes the state's gradient buffer as it goes, so a step a gradient hook of it
    makes would read the buffer half written (how much, depends on where the hook runs).

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(1, 1), zfunc.Config())
        >>> with giving(state, "backward_step"):
        ...     try:
        ...         check_not_giving(state, "apply_step")
        ...     except RuntimeError as e:
        ...         print(str(e)[:61])
        apply_step: this state was given to backward_step(..., donate
    """
    by = state.__dict__.get("_zfunc_giving")
    if by is not None:
        raise RuntimeError(
            f"{what}: this state was given to {by}(..., donate=True), whose backward is running now and writes the "
            f"state's gradient buffer as it goes (this call comes from a gradient hook of that backward). Call "
            f"{what} on the state {by} returns, or call {by} without donate=True")
