"""The one way zfunc puts tensors in a module's parameter (or buffer) entries, and takes them out.

No public torch API puts a plain tensor in a parameter's place inside part of a forward
(`torch.func.functional_call` does it for a whole call, through the same dictionaries), so the
unit hooks, the recompute hooks and the engine's routing write ``Module._parameters`` /
``Module._buffers`` entries here, and restore exactly what they took, in reverse order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["Swapped", "swap_in", "put_back"]

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
