"""Several optimizers in one state: which optimizer steps each parameter group, and where each
optimizer's moments lie.

Optimizer 0 is `Config.optimizer`: it steps group 0 and every `zfunc.ParamGroup` without an
optimizer of its own; its state is ``TrainState.opt``. Each group with one
(``ParamGroup.optimizer``) is optimizer ``k = 1, 2, ...`` in group order, its state
``TrainState.group_opts[k - 1]``. An optimizer's moments cover only the elements of its own groups
on this rank, packed in arena order (the full buffer's order at stage 0): a `Run` of one group at
``start`` of the arena lies at ``at`` of its optimizer's moments. With one optimizer the packing is
the identity and the moments are shaped like ``TrainState.params``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zfunc.core.config import Config
    from zfunc.core.state import TrainState
    from zfunc.distributed.layout import Layout

__all__ = ["Run", "optimizers", "optimizer_of", "runs", "records", "init_records", "spread", "pack"]


@dataclasses.dataclass(frozen=True)
class Run:
    """``length`` elements of parameter group ``group`` at ``start`` of the arena (stage 0: of the
    full buffer), at ``at`` of its optimizer's packed moments."""

    group: int
    start: int
    length: int
    at: int

    def part(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This run's part of an arena-shaped ``t`` (``None`` stays ``None``)."""
        return None if t is None else t.narrow(0, self.start, self.length)


def optimizers(cfg: Config) -> tuple[Any, ...]:
    """Each optimizer of the run: `Config.optimizer`, then each group's own, in group order.

    Examples:
        >>> import zfunc
        >>> cfg = zfunc.Config(param_groups=[zfunc.ParamGroup("b", lr=0.1), zfunc.ParamGroup("w", optimizer=zfunc.muon())])
        >>> [o.name for o in optimizers(cfg)], optimizer_of(cfg)
        (['adam', 'muon'], (0, 0, 1))
    """
    return (cfg.optimizer, *(g.optimizer for g in cfg.param_groups if g.optimizer is not None))


def optimizer_of(cfg: Config) -> tuple[int, ...]:
    """Each parameter group's optimizer (an index into `optimizers`); group 0 first."""
    out, k = [0], 0
    for g in cfg.param_groups:
        if g.optimizer is not None:
            k += 1
        out.append(k if g.optimizer is not None else 0)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _runs(layout: Layout, full: bool, owner: tuple[int, ...]) -> tuple[tuple[Run, ...], ...]:
    per: list[list[Run]] = [[] for _ in range(max(owner) + 1)]
    at = [0] * len(per)
    for g, start, n in (layout.full_segments if full else layout.arena_segments):
        k = owner[g]
        per[k].append(Run(g, start, n, at[k]))
        at[k] += n
    return tuple(tuple(r) for r in per)


def runs(cfg: Config, layout: Layout) -> tuple[tuple[Run, ...], ...]:
    """Each optimizer's runs on this rank (`Run`), in arena order.

    Examples:
        >>> import torch, zfunc
        >>> cfg = zfunc.Config(stage=0, param_groups=[zfunc.ParamGroup("weight", optimizer=zfunc.muon())])
        >>> state = zfunc.init(torch.nn.Linear(3, 2), cfg)
        >>> runs(cfg, state.layout)
        ((Run(group=0, start=0, length=2, at=0),), (Run(group=1, start=2, length=6, at=0),))
    """
    return _runs(layout, cfg.stage == 0, optimizer_of(cfg))


def numel(optimizer_runs: tuple[Run, ...]) -> int:
    """Elements of one optimizer's packed moments."""
    return sum(r.length for r in optimizer_runs)


def records(state: TrainState) -> tuple[Any, ...]:
    """Each optimizer's state record, in `optimizers` order."""
    return (state.opt, *state.group_opts)


def init_records(cfg: Config, layout: Layout, like: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    """Fresh optimizer states (``moment_init``, count 0) placed like ``like`` (the master
    weights: the device, or pinned host memory under offload): ``(opt, group_opts)``."""
    out = []
    for opt, rs in zip(optimizers(cfg), runs(cfg, layout)):
        n = numel(rs)
        moments = {name: torch.full((n,), opt.moment_init, dtype=cfg.moment_dtype, device=like.device,
                                    pin_memory=like.is_pinned()) for name in opt.moments}
        out.append(opt.state_class(**moments, count=torch.zeros((), dtype=torch.int64, device=like.device)))
    return out[0], tuple(out[1:])


def spread(packed: torch.Tensor, optimizer_runs: tuple[Run, ...], total: int) -> torch.Tensor:
    """One optimizer's packed moment laid out like the master (``total`` elements; zeros where
    other optimizers' groups lie). Returns ``packed`` itself when the packing is the identity."""
    if numel(optimizer_runs) == total:
        return packed
    out = torch.zeros(total, dtype=packed.dtype, device=packed.device)
    for r in optimizer_runs:
        out.narrow(0, r.start, r.length).copy_(packed.narrow(0, r.at, r.length))
    return out


def pack(flat: torch.Tensor, optimizer_runs: tuple[Run, ...]) -> torch.Tensor:
    """The inverse of `spread`: one optimizer's elements of a master-shaped ``flat``, packed."""
    if numel(optimizer_runs) == flat.numel():
        return flat
    if not optimizer_runs:
        return flat[:0].clone()
    return torch.cat([flat.narrow(0, r.start, r.length) for r in optimizer_runs])
