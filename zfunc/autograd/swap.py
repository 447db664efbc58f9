"""The one place zfunc changes a module's tensors and hook tables: its parameter (or buffer)
entries, the storage of a tensor the module holds, and the forward hooks a zfunc call puts on
it.

No public torch API puts a plain tensor in a parameter's place inside part of a forward
(`torch.func.functional_call` does it for a whole call, through the same dictionaries), so the
unit hooks, the recompute hooks and the engine's routing write ``Module._parameters`` /
``Module._buffers`` entries here (`swap_in`), and restore exactly what they took, in reverse
order (`put_back`); meta init swaps scratch tensors in the same way while a module's
``reset_parameters`` draws, and puts the real ones in for good. A tensor that must keep its
identity (an optimizer's groups, the user's references and ties hold it) gets other storage
through `set_data` (donation, a donated state's tensors emptied, the engine's views of its
state, ``GatheredParameters``, ``destroy()``) or, for a meta tensor that cannot take another device's data, `swap_tensor`.
A call's hooks go in the module's hook tables under one id per phase and kind (`put_pre`,
`put_post`) and leave them (`take_pre`, `take_post`): no ``RemovableHandle`` per module and call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Swapped", "swap_in", "put_back", "set_data", "swap_tensor", "put_pre", "take_pre", "put_post", "take_post"]

Swapped = list[tuple[dict[str, Any], str, Any]]  # (entries, key, what was there)


def swap_in(places: Iterable[tuple[dict[str, Any], str, Any]]) -> Swapped:
    """Put each ``value`` at ``entries[key]`` for ``(entries, key, value)`` in ``places``;
    return what was there, for `put_back`.

    Examples:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 1)
        >>> taken = swap_in([(lin._parameters, "bias", torch.zeros(1))])
        >>> type(lin.bias).__name__, put_back(taken), type(lin.bias).__name__
        ('Tensor', None, 'Parameter')
    """
    swapped = []
    for entries, key, value in places:
        swapped.append((entries, key, entries[key]))
        entries[key] = value
    return swapped


def put_back(swapped: Swapped) -> None:
    """Restore what `swap_in` took, last first (a name swapped twice ends as it began)."""
    for entries, key, original in reversed(swapped):
        entries[key] = original


def set_data(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each ``t`` of ``(t, value)`` over ``value``'s storage (its ``data`` set): ``t`` stays the
    same object, so whoever holds it keeps holding it.

    Examples:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 1)
        >>> w = lin.weight
        >>> set_data([(lin.weight, torch.zeros(1, 2))])
        >>> lin.weight is w, w.tolist()
        (True, [[0.0, 0.0]])
    """
    for t, value in pairs:
        t.data = value


def swap_tensor(t: torch.Tensor, other: torch.Tensor) -> None:
    """Exchange everything of ``t`` and ``other`` but their identities (`torch.utils.swap_tensors`):
    a ``meta`` parameter becomes a real one that every holder of it sees.

    Examples:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.empty(2, device="meta"))
        >>> swap_tensor(p, torch.nn.Parameter(torch.zeros(0)))
        >>> p.device.type, tuple(p.shape)
        ('cpu', (0,))
    """
    torch.utils.swap_tensors(t, other)


def put_pre(mod: torch.nn.Module, key: int, hook: Callable[..., Any]) -> None:
    """Put ``hook`` on ``mod`` as a forward pre-hook under ``key``, before the user's (a
    weight-norm hook reads the parameters it puts in).

    Examples:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 1)
        >>> _ = lin.register_forward_pre_hook(lambda m, a: None)
        >>> put_pre(lin, -1, print)
        >>> list(lin._forward_pre_hooks)[0], take_pre(lin, -1), -1 in lin._forward_pre_hooks
        (-1, None, False)
    """
    mod._forward_pre_hooks[key] = hook
    if len(mod._forward_pre_hooks) > 1:
        mod._forward_pre_hooks.move_to_end(key, last=False)


def take_pre(mod: torch.nn.Module, key: int) -> None:
    """Take the pre-hook `put_pre` put on ``mod`` under ``key`` off, if it is there."""
    mod._forward_pre_hooks.pop(key, None)


def put_post(mod: torch.nn.Module, key: int, hook: Callable[..., Any]) -> None:
    """Put ``hook`` on ``mod`` as a forward post-hook under ``key``, after the user's, run when
    the forward raised too (as ``always_call=True``). Torch reads a module's post-hooks after
    its forward: one put on from a pre-hook runs at the end of that call.

    Examples:
        >>> import torch
        >>> lin, seen = torch.nn.Linear(2, 1), []
        >>> put_pre(lin, -1, lambda m, a: put_post(m, -2, lambda m, a, out: seen.append(out.shape)))
        >>> _ = lin(torch.ones(3, 2)); take_post(lin, -2); take_pre(lin, -1)
        >>> seen, len(lin._forward_hooks), len(lin._forward_hooks_always_called)
        ([torch.Size([3, 1])], 0, 0)
    """
    mod._forward_hooks[key] = hook
    mod._forward_hooks_always_called[key] = True


def take_post(mod: torch.nn.Module, key: int) -> None:
    """Take the post-hook `put_post` put on ``mod`` under ``key`` off, if it is there."""
    mod._forward_hooks.pop(key, None)
    mod._forward_hooks_always_called.pop(key, None)
