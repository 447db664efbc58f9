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


def _combining(plain: Callable[..., Any], in_place: bool, keyed: bool) -> Callable[..., Any]:
    """``plain`` (one of optree's map functions), after which each record of the result made
    from several trees (a `zfunc.core.state.TrainState` from two states: an EMA) settles its
    bookkeeping leaves against the records it was made from (``combined``): a combination of
    states holds every rank's slice of ``compute`` only where all of them did. In place, a
    state's ``params`` that lies in its ``compute`` is written once (`_deferring`). ``keyed``:
    ``func`` takes a path or accessor first."""

    @functools.wraps(plain)
    def combine(func: Callable[..., Any], first: Any, /, *rests: Any, is_leaf: Callable[[Any], bool] | None = None,
                none_is_leaf: bool = False, namespace: str = "zfunc") -> Any:
        if in_place:  # a state's params that is its compute (or a view of it) is written once
            aliased = _aliased_params(first, is_leaf, none_is_leaf, namespace)
            if aliased:
                func = _deferring(func, aliased, keyed)
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


def _aliased_params(first: Any, is_leaf: Callable[[Any], bool] | None, none_is_leaf: bool,
                    namespace: str) -> dict[int, int]:
    """For each state in ``first`` whose ``params`` lies in its ``compute`` (fp32 weights: the
    master copy is the compute copy, or this rank's slice of it), the place of its ``params``
    among ``first``'s leaves -> the place of its ``compute``. Only states' own two fields are
    looked at."""
    stop = _is_record if is_leaf is None else (lambda x: _is_record(x) or is_leaf(x))
    items = [first] if _is_record(first) else tree.leaves(first, is_leaf=stop, none_is_leaf=none_is_leaf,
                                                          namespace=namespace)
    out: dict[int, int] = {}
    at = 0
    for x in items:
        leaves = tree.leaves(x, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=namespace)
        p, c = (x.__dict__.get("params"), x.__dict__.get("compute")) if _is_record(x) else (None, None)
        if (len(leaves) > 1 and leaves[0] is p and leaves[1] is c and type(p) is torch.Tensor
                and type(c) is torch.Tensor and p.device == c.device and p.device.type != "meta" and c.numel()
                and p.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()):
            out[at] = at + 1
        at += len(leaves)
    return out


def _deferring(func: Callable[..., Any], pairs: dict[int, int], keyed: bool) -> Callable[..., Any]:
    """``func`` for an in-place map, where each ``params`` leaf of ``pairs`` (a place among the
    leaves, in the order the map visits them) lies in the ``compute`` leaf it maps to: ``func``
    runs on ``compute`` first, and on ``params`` after it only if that wrote nothing in place (a
    function that updates every leaf, an EMA, writes the shared memory once; one that picks
    ``params`` by its path still updates it). ``keyed``: a path or accessor comes first."""
    seen = iter(range(sys.maxsize))
    later = {c: p for p, c in pairs.items()}
    held: dict[int, tuple] = {}

    def at(*args: Any) -> Any:
        i = next(seen)
        if i in pairs:  # params: after its compute
            held[i] = args
            return None
        if i not in later:
            return func(*args)
        compute = args[1 if keyed else 0]
        version = compute._version
        func(*args)
        params_args = held.pop(later[i])
        if compute._version == version:
            func(*params_args)
        return None
    return at


for _name in ("map", "map_with_path", "map_with_accessor"):
    setattr(tree, _name, _combining(getattr(tree, _name), False, _name != "map"))
    setattr(tree, _name + "_", _combining(getattr(tree, _name + "_"), True, _name != "map"))

dataclass = tree.dataclasses.dataclass
field = tree.dataclasses.field

__all__ = ["tree", "dataclass", "field"]
