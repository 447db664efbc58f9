"""optree bound to the ``zfunc`` namespace.

Every zfunc record (`TrainState`, `AdamState`, `ScalerState`, `Metrics`) is registered in the
``zfunc`` optree namespace. Flattened without that namespace, such a record is a *leaf*: a silent
trap. ``zfunc.tree`` is optree with the namespace filled in, so user code never meets it.
"""

from __future__ import annotations

import sys

import optree

tree = optree.pytree.reexport(namespace="zfunc", module="zfunc.tree")
sys.modules.setdefault("zfunc.tree", tree)

dataclass = tree.dataclasses.dataclass
field = tree.dataclasses.field

__all__ = ["tree", "dataclass", "field"]
