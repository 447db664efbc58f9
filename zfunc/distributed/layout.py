"""Where every parameter lives: units, zero padding, and each rank's contiguous arena.

Trainable parameters are grouped into *units* (the whole model for stages 0-2, usually one
block each for stage 3). A unit's parameters are flattened into one buffer, zero-padded to a
multiple of ``world * align``, and cut into ``world`` equal slices: rank ``r`` owns slice ``r``.
On each rank the owned slices of all units sit back to back in one *arena* per role (master,
moments, gradient), so the optimizer is one kernel over one contiguous buffer.

The layout is computed once from names and shapes and is static metadata of the state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import torch
from einops import rearrange

__all__ = ["Slot", "Unit", "Layout", "make_layout", "master_view"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One parameter inside its unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    group: int = 0  # its parameter group (hyperparameters); a unit keeps each group contiguous

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Unit:
    """Parameters flattened together; ``padded`` elements, ``shard`` of them per rank."""

    name: str
    slots: tuple[Slot, ...]
    numel: int
    padded: int
    shard: int
    arena_offset: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """The static map from parameter names to flat buffers for one rank of one world.

    Examples:
        >>> import torch
        >>> from zfunc.distributed.layout import make_layout
        >>> lay = make_layout([[("w", (3, 3)), ("b", (3,))]], world=2, rank=1, align=4)
        >>> u = lay.units[0]
        >>> u.numel, u.padded, u.shard, lay.owned(u)
        (12, 16, 8, (8, 16))
    """

    units: tuple[Unit, ...]
    world: int
    rank: int
    align: int

    @property
    def arena_numel(self) -> int:
        """Elements of this rank's arena (its slices of every unit)."""
        return sum(u.shard for u in self.units)

    @property
    def full_numel(self) -> int:
        """Elements of all units' padded flat buffers together."""
        return sum(u.padded for u in self.units)

    @functools.cached_property
    def full_starts(self) -> tuple[int, ...]:
        """Where each unit's padded flat buffer starts when all of them lie back to back (stage 0)."""
        return tuple(sum(u.padded for u in self.units[:i]) for i in range(len(self.units)))

    @property
    def numel(self) -> int:
        """Trainable elements without padding."""
        return sum(u.numel for u in self.units)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for u in self.units for s in u.slots)

    @functools.cached_property
    def groups(self) -> tuple[int, ...]:
        """The parameter groups that hold parameters, ascending."""
        return tuple(sorted({s.group for u in self.units for s in u.slots}))

    @functools.cached_property
    def group_of(self) -> dict[str, int]:
        """Each parameter's group, by name."""
        return {s.name: s.group for u in self.units for s in u.slots}

    @functools.cached_property
    def arena_segments(self) -> tuple[tuple[int, int, int], ...]:
        """``(group, start, length)`` runs of one parameter group covering this rank's arena."""
        return self._segments(full=False)

    @functools.cached_property
    def full_segments(self) -> tuple[tuple[int, int, int], ...]:
        """``(group, start, length)`` runs covering all units' padded flat buffers (stage 0)."""
        return self._segments(full=True)

    def _segments(self, full: bool) -> tuple[tuple[int, int, int], ...]:
        out: list[list[int]] = []
        base = 0
        for u in self.units:
            lo, hi = (0, u.padded) if full else self.owned(u)
            for i, s in enumerate(u.slots):  # a slot's run reaches the next slot (the last: the padding)
                end = u.slots[i + 1].offset if i + 1 < len(u.slots) else u.padded
                a, b = max(lo, s.offset), min(hi, end)
                if a >= b:
                    continue
                if out and out[-1][0] == s.group and out[-1][1] + out[-1][2] == base + a - lo:
                    out[-1][2] += b - a
                else:
                    out.append([s.group, base + a - lo, b - a])
            base += hi - lo
        return tuple((g, start, n) for g, start, n in out)

    def owned(self, unit: Unit) -> tuple[int, int]:
        """The ``[start, stop)`` range of ``unit``'s flat buffer that this rank owns."""
        return self.rank * unit.shard, (self.rank + 1) * unit.shard

    def owned_start_len(self, unit: Unit) -> tuple[int, int]:
        """`owned` as ``(start, length)``, the arguments of ``Tensor.narrow``."""
        return self.rank * unit.shard, unit.shard

    def arena_slice(self, arena: torch.Tensor, unit: Unit) -> torch.Tensor:
        """``unit``'s part of a rank arena (a view)."""
        return arena.narrow(0, unit.arena_offset, unit.shard)

    def flatten_unit(self, unit: Unit, tensors: Mapping[str, torch.Tensor],
                     dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A new padded flat buffer holding ``tensors`` (missing names are zeros)."""
        flat = torch.zeros(unit.padded, dtype=dtype, device=device)
        for s in unit.slots:
            t = tensors.get(s.name)
            if t is not None:
                flat.narrow(0, s.offset, s.numel).copy_(t.detach().reshape(-1))
        return flat

    def views(self, unit: Unit, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter-shaped views into ``unit``'s flat buffer (differentiable).

        One ``split`` makes them all, so backward assembles the flat gradient with one
        concatenation (a ``narrow`` per parameter would zero-fill a whole flat buffer each).
        """
        sizes = [s.numel for s in unit.slots]
        pad = flat.numel() - sum(sizes)
        parts = torch.split(flat, sizes + [pad] if pad else sizes)
        return {s.name: p.view(s.shape) for s, p in zip(unit.slots, parts)}

    def rank_slices(self, unit: Unit, flat: torch.Tensor) -> torch.Tensor:
        """``unit``'s flat buffer seen as ``(world, shard)``: row ``r`` is what rank ``r`` owns."""
        return rearrange(flat, "(r s) -> r s", r=self.world)


def make_layout(units: Sequence[Sequence[tuple]], *, world: int, rank: int,
                align: int = 4, names: Sequence[str] | None = None) -> Layout:
    """Lay out ``units`` (each a list of ``(name, shape)`` or ``(name, shape, group)``) for
    ``rank`` of ``world`` ranks.

    Within a unit, parameters are ordered by group (stably), so each group is one run of the
    unit's flat buffer. Each unit is padded to a multiple of ``world * align`` elements, so every
    shard has the same size and (for ``align=4`` and 4-byte dtypes) starts 16-byte aligned.

    Examples:
        >>> lay = make_layout([[("w", (2, 2), 0), ("b", (2,), 1), ("v", (2,), 0)]], world=2, rank=0, align=1)
        >>> [s.name for s in lay.units[0].slots], lay.arena_segments, lay.full_segments
        (['w', 'v', 'b'], ((0, 0, 4),), ((0, 0, 6), (1, 6, 2)))
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    out, arena = [], 0
    for i, unit in enumerate(units):
        slots, offset = [], 0
        entries = sorted(((e[0], e[1], e[2] if len(e) > 2 else 0) for e in unit), key=lambda e: e[2])
        for name, shape, group in entries:
            slot = Slot(name=name, shape=tuple(int(d) for d in shape), offset=offset, group=group)
            slots.append(slot)
            offset += slot.numel
        multiple = world * align
        padded = max(multiple, -(-offset // multiple) * multiple)
        uname = names[i] if names is not None else f"unit{i}"
        out.append(Unit(name=uname, slots=tuple(slots), numel=offset, padded=padded,
                        shard=padded // world, arena_offset=arena))
        arena += padded // world
    return Layout(units=tuple(out), world=world, rank=rank, align=align)


def master_view(compute: torch.Tensor, layout: Layout, stage: int) -> torch.Tensor:
    """This rank's master part of a full compute buffer, as a view (stages 0-2, one unit).

    Examples:
        >>> import torch
        >>> lay = make_layout([[("w", (6,))]], world=2, rank=1, align=1)
        >>> master_view(torch.arange(6.0), lay, stage=2).tolist()
        [3.0, 4.0, 5.0]
    """
    if stage == 0:
        return compute
    (unit,) = layout.units
    return compute.narrow(0, *layout.owned_start_len(unit))
