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

import sys

import optree

tree = optree.pytree.reexport(namespace="zfunc", module="zfunc.tree")
sys.modules.setdefault("zfunc.tree", tree)

dataclass = tree.dataclasses.dataclass
field = tree.dataclasses.field

__all__ = ["tree", "dataclass", "field"]
