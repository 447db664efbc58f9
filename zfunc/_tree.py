"""optree bound to the ``zfunc`` namespace.

Every zfunc record (`TrainState`, `AdamState`, `ScalerState`, `Metrics`) is registered in the
``zfunc`` optree namespace. Flattened without that namespace, such a record is a *leaf*: a silent
trap. ``zfunc.tree`` is optree with the namespace filled in, so user code never meets it.

Examples:
    >>> import torch, zfunc
    >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config())
    >>> len(zfunc.tree.leaves(state)) > 10, len(__import__("optree").tree_leaves(state))
    (True, 1)
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import optree
import torch

tree = optree.pytree.reexport(namespace="zfunc", module="zfunc.tree")
sys.modules.setdefault("zfunc.tree", tree)


def _is_record(x: Any) -> bool:
    """A record whose bookkeeping a map over several trees settles (`TrainState.combined`)."""
    return callable(getattr(type(x), "combined", None))


def _combining(plain: Callable[..., Any], in_place: bool) -> Callable[..., Any]:
    """``plain`` (one of optree's map functions), after which each record of the result made
    from several trees (a `zfunc.core.state.TrainState` from two states: an EMA) settles its
    bookkeeping leaves against the records it was made from (``combined``): a combination of
    states holds every rank's slice of ``compute`` only where all of them did."""

    @functools.wraps(plain)
    def combine(func: Callable[..., Any], first: Any, /, *rests: Any, is_leaf: Callable[[Any], bool] | None = None,
                none_is_leaf: bool = False, namespace: str = "zfunc") -> Any:
        if in_place:  # a leaf over memory another leaf holds (a state's params over its compute) is updated once
            within = _within_others(tree.leaves(first, is_leaf=is_leaf, none_is_leaf=none_is_leaf,
                                                namespace=namespace))
            if within:
                func = _skipping(func, within)
        out = plain(func, first, *rests, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=namespace)
        if not rests:
            return out
        if _is_record(first):  # states themselves (an EMA): no walk
            if in_place:
                first.combined([first, *rests], True)
                return out
            return out.combined([first, *rests], False) if _is_record(out) else out
        stop = _is_record if is_leaf is None else (lambda x: _is_record(x) or is_leaf(x))  # the user's leaves too
        leaves, spec = tree.flatten(first, is_leaf=stop, none_is_leaf=none_is_leaf, namespace=namespace)
        spots = [i for i, x in enumerate(leaves) if _is_record(x)]
        if not spots:  # no state in it: nothing to settle
            return out
        # Each tree (and the result) up to the first's records: a later tree may be deeper there
        sources = [spec.flatten_up_to(t) for t in rests]
        made = leaves if in_place else spec.flatten_up_to(out)
        for i in spots:
            if _is_record(made[i]):
                made[i] = made[i].combined([leaves[i], *(s[i] for s in sources)], in_place)
        return out if in_place else spec.unflatten(made)

    return combine


def _within_others(leaves: list[Any]) -> set[int]:
    """The places of the tensors among ``leaves`` whose memory lies within another one's (the
    same tensor again, or a view of it: at fp32 a state's ``params`` is its ``compute``, or a
    slice of it): an in-place map updates that memory once, through the other (the first of
    equal ones)."""
    by_storage: dict[int, list[tuple[int, int, int]]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.numel() and x.device.type != "meta":
            start = x.data_ptr()
            end = start + x.element_size() * (1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride())))
            by_storage.setdefault(x.untyped_storage().data_ptr(), []).append((start, end, i))
    out: set[int] = set()
    for spans in by_storage.values():
        for a, b, i in spans:
            if any(j != i and a2 <= a and b <= b2 and ((a2, b2) != (a, b) or j < i) for a2, b2, j in spans):
                out.add(i)
    return out


def _skipping(func: Callable[..., Any], places: set[int]) -> Callable[..., Any]:
    """``func``, not called at the leaves in ``places`` (counted in the order an in-place map
    visits them)."""
    seen = iter(range(sys.maxsize))

    def at(*args: Any) -> Any:
        return None if next(seen) in places else func(*args)
    return at


for _name in ("map", "map_with_path", "map_with_accessor"):
    setattr(tree, _name, _combining(getattr(tree, _name), False))
    setattr(tree, _name + "_", _combining(getattr(tree, _name + "_"), True))

dataclass = tree.dataclasses.dataclass
field = tree.dataclasses.field

__all__ = ["tree", "dataclass", "field"]
