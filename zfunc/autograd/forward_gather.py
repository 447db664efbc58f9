"""Stages 1-2 with `Config.units`: the next forward gathers the step's parameters, unit by unit.

After the update each rank holds its new slice of the full compute buffer; the other slices
arrive by all-gather. Without units `zfunc.apply_step` gathers the whole buffer before it
returns (as DeepSpeed's ZeRO-1 and ZeRO-2 do). With units it returns at once, the state marked
``gathered=False``, and the next forward owns the gather (as FSDP2's): when the call starts it
issues the all-gather in pieces into the state's own buffer, first everything outside the units
(the *root*: embeddings, final norms, padding), then each unit's parameters in module order
(`start_gathers`); it waits for the root before the module runs and for each unit when its
module starts, so the later units' gathers overlap the earlier units' computation. The handles
live in the call, never in the state: the call waits for whatever is left before it returns,
and the state it hands on is ``gathered``.

Nothing reads a parameter before its piece is in:

- a state that is not ``gathered`` holds earlier values in the other ranks' slices; `settle`
  gathers them at once for a reader of ``compute`` in full. A checkpoint and
  `zfunc.full_params` read each rank's own slice only, which is always current;
- inside forward a unit's parameters are bound only while its module runs, as at stage 3; at
  any other moment the module holds placeholders (`Unbound`), so a unit's parameter used
  outside its module's forward fails loudly instead of reading the previous step's values.

Every rank issues the same pieces in the same order (the flag is the same on every rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from zfunc.distributed import comm
from zfunc._probes import recomputed
from zfunc.autograd.swap import Swapped, put_back, swap_in
from zfunc.distributed.layout import Layout

__all__ = ["GatherPlan", "Gathering", "plan_gathers", "start_gathers", "settle", "UnitViews", "Unbound"]

ROOT = -1  # the key of the root's pieces


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    """The pieces of the full compute buffer, as ``(start, stop)`` runs: ``root`` covers what no
    unit holds (padding included), ``units[i]`` unit ``i``'s parameters; ``names[i]`` their names.

    Examples:
        >>> from zfunc.distributed.layout import make_layout
        >>> lay = make_layout([[("a", (2,)), ("b", (3,)), ("c", (1,))]], world=2, rank=0, align=1)
        >>> plan = plan_gathers(lay, [["b"]])
        >>> plan.root, plan.units
        (((0, 2), (5, 6)), (((2, 5),),))
    """

    root: tuple[tuple[int, int], ...]
    units: tuple[tuple[tuple[int, int], ...], ...]
    names: tuple[tuple[str, ...], ...]


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``(start, stop)`` spans with touching ones merged."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(s for s in spans if s[0] < s[1]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def plan_gathers(layout: Layout, units: Sequence[Sequence[str]]) -> GatherPlan:
    """The pieces of a one-unit layout for ``units`` (each a list of parameter names).

    Examples:
        >>> from zfunc.distributed.layout import make_layout
        >>> lay = make_layout([[("a", (2,)), ("b", (3,)), ("c", (1,))]], world=1, rank=0, align=4)
        >>> plan_gathers(lay, [["a"], ["c"]])
        GatherPlan(root=((2, 5), (6, 8)), units=(((0, 2),), ((5, 6),)), names=(('a',), ('c',)))
    """
    (unit,) = layout.units
    where = {s.name: (s.offset, s.offset + s.numel) for s in unit.slots}
    unit_runs = [tuple(_runs([where[n] for n in names])) for names in units]
    held = _runs([r for runs in unit_runs for r in runs])
    root, at = [], 0
    for lo, hi in held:
        if at < lo:
            root.append((at, lo))
        at = hi
    if at < unit.padded:
        root.append((at, unit.padded))
    return GatherPlan(root=tuple(root), units=tuple(unit_runs), names=tuple(tuple(n) for n in units))


class Gathering:
    """One forward call's all-gathers: each key's (`ROOT` or a unit's index) handles. `wait` and
    `wait_all` may be called any number of times."""

    def __init__(self, works: dict[int, list[Any]]):
        self.works = works

    @property
    def pending(self) -> bool:
        return bool(self.works)

    def wait(self, key: int) -> None:
        for w in self.works.get(key, ()):
            w.wait()
        self.works.pop(key, None)

    def wait_all(self) -> None:
        for key in list(self.works):
            self.wait(key)


def start_gathers(state: Any) -> Gathering:
    """Start the all-gather of ``state.compute`` (rank ``r`` holds ``[r * shard, (r + 1) *
    shard)``) into the state's own buffer: with a gather plan (`Config.units`) piece by piece,
    the root first, then the units in order; else the whole buffer as one `ROOT` piece.

    Examples:
        >>> import torch, zfunc
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> g = start_gathers(zfunc.init(model, zfunc.Config(stage=1, units=["0"])))
        >>> g.pending, g.wait_all(), g.pending
        (True, None, False)
    """
    lay, compute, group = state.layout, state.compute, state.mesh.shard
    shard = lay.units[0].shard
    plan = state.binding.gather_plan
    order = [(ROOT, plan.root), *enumerate(plan.units)] if plan is not None else [(ROOT, ((0, compute.numel()),))]
    return Gathering({key: [comm.all_gather_range_start(compute, lo, hi, shard, group) for lo, hi in runs]
                      for key, runs in order})


def settle(state: Any) -> Any:
    """``state`` with ``compute`` holding every rank's slice: at stages 1-2 with `Config.units`
    after `zfunc.apply_step`, the other ranks' slices are all-gathered now (the next forward
    would gather them unit by unit); any other state is returned as it is. For a reader of the
    full compute buffer; checkpoints and `zfunc.full_params` need no settling.

    Examples:
        >>> import torch, zfunc
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> state = zfunc.init(model, zfunc.Config(stage=2, units=["0"]))
        >>> state = zfunc.apply_step(zfunc.accumulate(state, {}, strict=False))
        >>> bool(zfunc.settle(state).gathered)
        True
    """
    if bool(state.gathered):
        return state
    start_gathers(state).wait_all()
    return state.replace(gathered=torch.tensor(True))


# What may be asked of a placeholder: its metadata (properties are `__get__`), never its values.
_METADATA = frozenset({"__get__", "size", "dim", "ndimension", "numel", "nelement", "element_size",
                       "is_floating_point", "is_complex", "is_contiguous", "stride", "get_device", "__len__"})


class Unbound(torch.Tensor):
    """What a unit module holds in a parameter's place outside the unit's forward (stages 1-3):
    its shape, dtype and device can be read; any computation with it raises, naming the
    parameter. It holds no memory.

    Examples:
        >>> import torch
        >>> w = Unbound(torch.nn.Linear(2, 3).weight, "lin.weight", "lin")
        >>> w.shape, w.dtype
        (torch.Size([3, 2]), torch.float32)
        >>> try:
        ...     w.sum()
        ... except RuntimeError as e:
        ...     print(str(e)[:62])
        parameter 'lin.weight' of unit 'lin' was used outside the unit
    """

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, unit: str) -> Unbound:
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device,
                                                requires_grad=like.requires_grad)
        t.param_name, t.unit = name, unit
        return t

    def _refuse(self) -> RuntimeError:
        return RuntimeError(
            f"parameter {self.param_name!r} of unit {self.unit!r} was used outside the unit module's forward; "
            "with Config.units (stage 3, and stages 1-2 where it overlaps the step's all-gather) a unit's "
            "parameters exist only while its module runs. Leave that module out of Config.units (at stages 1-2, "
            "units=None gathers every parameter before the step returns)")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _METADATA:  # shape, dtype, device, numel(), is_floating_point(), ...: no values read
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if name in ("to", "type_as") and args and not isinstance(args[0], Unbound) and not kwargs:
            like = args[1]  # x.to(p) / x.type_as(p): only p's dtype and device are read
            if len(args) == 2 and isinstance(like, Unbound):
                return args[0].to(device=like.device, dtype=like.dtype)
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, Unbound):
                raise a._refuse()
        raise RuntimeError(f"a unit parameter was used outside its unit module's forward ({func})")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise RuntimeError(f"a unit parameter ({func}) was used outside its unit module's forward (Config.units)")

    def __repr__(self) -> str:
        return f"Unbound({self.param_name!r}, unit={self.unit!r}, shape={tuple(self.shape)})"


class UnitViews:
    """One forward call's unit parameters at stages 1-2: bound while the unit's module runs (after
    its gather is in), placeholders otherwise (see the module docstring)."""

    def __init__(self, views: dict[str, torch.Tensor], gathering: Gathering | None, born: int = -1):
        self.views, self.gathering, self.born = views, gathering, born  # born: `BoundModel.born`
        self.swapped: dict[int, Swapped] = {}

    def enter(self, i: int, slots: list[tuple[str, torch.nn.Module, str]]) -> None:
        """Unit ``i``'s module starts: wait for its gather, bind its parameters."""
        if self.gathering is not None:
            self.gathering.wait(i)
        self.swapped[i] = swap_in((owner._parameters, attr, self.views[name]) for name, owner, attr in slots)

    def leave(self, i: int) -> None:
        """Unit ``i``'s module is done. Inside zfunc's forward call its parameters stay bound (the
        call puts the placeholders back when it ends; the user's forward hooks see them); in a
        forward that autograd recomputes during backward the placeholders come back now."""
        swapped = self.swapped.pop(i, [])
        if recomputed(self.born):
            put_back(swapped)

    def drop_ahead(self) -> None:
        """Nothing is gathered ahead here (the stage-3 gatherer's interface)."""
