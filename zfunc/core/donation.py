"""Donation, enforced: a state given to a step with ``donate=True`` cannot be used again.

With ``donate=True`` a step reuses the input state's buffers for its result, so the input's
tensors are the result's (or garbage). As JAX deletes donated buffers, zfunc takes the tensors
out of the donated state: each of its tensor fields becomes a `Donated` marker that raises,
naming ``donate``, on any use (arithmetic, a method, a torch function), and every step
function, `zfunc.full_params` and `zfunc.save` refuse the state at the door. Its static
fields (``cfg``, ``layout``) stay readable. This is the one mutation of a state zfunc makes,
and only of one the caller gave away.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from zfunc.core.state import TrainState

__all__ = ["Donated", "donate_", "check_live"]


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


def donate_(state: TrainState, by: str) -> None:
    """Take the tensors out of ``state``, given away to ``by`` with ``donate=True``.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config())
        >>> later = zfunc.apply_step(state, donate=True)
        >>> try:
        ...     zfunc.apply_step(state)
        ... except RuntimeError as e:
        ...     print(str(e)[:48])
        apply_step: this state was donated to apply_step
        >>> later.step.item(), state.stage
        (1, 2)
    """
    for f in dataclasses.fields(state):
        if f.metadata.get("pytree_node", True):
            object.__setattr__(state, f.name, Donated(by, f.name))


def check_live(state: TrainState, what: str) -> None:
    """Refuse a donated ``state`` at the door of ``what``."""
    marker = state.__dict__.get("params")
    if isinstance(marker, Donated):
        raise RuntimeError(_message(marker.by, what))
