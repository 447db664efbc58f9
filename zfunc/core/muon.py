"""Muon's step on a sharded arena: every matrix orthogonalized whole.

ZeRO cuts each unit's flat buffer into equal shards, so a matrix can lie across two or more
ranks. Muon's momentum and update are per element and stay sharded; only Newton-Schulz needs
the whole matrix. The step is three parts:

1. the momentum pass (`zfunc_kernels.fused_muon_momentum`) over this rank's Muon runs gives the
   matrix to orthogonalize, ``u``, for the pieces this rank owns;
2. the pieces of the matrices that cross a shard boundary are exchanged in one all-gather over
   the shard group (each rank sends its pieces of those matrices only; matrices inside one
   shard cost nothing; every rank plans it from the optimizer's groups and joins it, whatever it
   owns, sending zeros where it owns no piece); every rank that owns part of a matrix
   orthogonalizes it whole (a crossing matrix is orthogonalized by each of its owners, as
   DeepSpeed does), and keeps its own piece of the result, scaled by the matrix's lr factor;
3. the update pass (`zfunc_kernels.fused_muon_apply`) applies it and writes the compute copy.

Why not one owner per matrix: the other owners would need the result back (a second exchange),
and the momentum would have to move to the owner; gathering the momentum-updated pieces moves
each crossing matrix once and keeps the state where ZeRO put it. Stage 0 holds everything on
every rank and exchanges nothing (each rank orthogonalizes every matrix, as DDP with
`torch.optim.Muon` does).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

import zfunc_kernels
from zfunc.core.opt_state import Run
from zfunc.distributed import comm
from zfunc.distributed.layout import Layout

__all__ = ["Matrix", "plan", "newton_schulz", "muon_step", "exchanged_numel"]


@dataclasses.dataclass(frozen=True)
class Matrix:
    """One Muon parameter: its shape and group, ``pieces[r] = (at, length)`` on rank ``r``
    (``at``: in that rank's Muon pieces sent, for a crossing matrix), and ``local = (packed
    position, offset in the matrix, length)`` of this rank's piece (``None``: not here)."""

    name: str
    shape: tuple[int, int]
    group: int
    crossing: bool
    pieces: tuple[tuple[int, int], ...]
    local: tuple[int, int, int] | None


@dataclasses.dataclass(frozen=True)
class Plan:
    matrices: tuple[Matrix, ...]
    send: int  # elements each rank sends (the longest rank's crossing pieces)


def _packed(position: int, optimizer_runs: Sequence[Run]) -> int:
    for r in optimizer_runs:
        if r.start <= position < r.start + r.length:
            return r.at + position - r.start
    raise AssertionError(f"arena position {position} is in none of the optimizer's runs")


@functools.lru_cache(maxsize=32)
def plan(layout: Layout, full: bool, groups: tuple[int, ...], optimizer_runs: tuple[Run, ...]) -> Plan:
    """Where each matrix of one Muon optimizer (parameter ``groups``) lies: on this rank and, for
    the crossing ones, on every rank (``full``: stage 0, where every rank holds everything).

    ``groups`` come from the config, never from ``optimizer_runs``: a rank that owns nothing of
    the optimizer has no runs, yet plans (and joins) the same exchange as the others."""
    world = 1 if full else layout.world
    sent = [0] * world
    out = []
    for i, unit in enumerate(layout.units):
        for s in unit.slots:
            if s.group not in groups:
                continue
            lo, hi = s.offset, s.offset + s.numel
            owners = range(lo // unit.shard, (hi - 1) // unit.shard + 1) if not full else [0]
            crossing = len(owners) > 1
            pieces = [(0, 0)] * world
            for r in owners:
                a, b = (lo, hi) if full else (max(lo, r * unit.shard), min(hi, (r + 1) * unit.shard))
                pieces[r] = (sent[r], b - a)
                if crossing:
                    sent[r] += b - a
            local = None
            me = 0 if full else layout.rank
            if me in owners:
                a, b = (lo, hi) if full else (max(lo, me * unit.shard), min(hi, (me + 1) * unit.shard))
                base = layout.full_starts[i] if full else unit.arena_offset - me * unit.shard
                local = (_packed(base + a, optimizer_runs), a - lo, b - a)
            out.append(Matrix(s.name, s.shape, s.group, crossing, tuple(pieces), local))
    return Plan(tuple(out), max(sent))


def exchanged_numel(layout: Layout, full: bool, groups: tuple[int, ...],
                    optimizer_runs: tuple[Run, ...]) -> int:
    """Elements one rank receives in a Muon step's exchange (``world * send``; 0 when no matrix
    crosses a shard boundary)."""
    p = plan(layout, full, groups, optimizer_runs)
    return 0 if p.send == 0 else p.send * (1 if full else layout.world)


def newton_schulz(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of ``torch.optim.Muon``, in ``dtype``: ``x`` scaled to
    Frobenius norm 1 (at least ``eps``), then ``steps`` times ``x = a x + (b A + c A^2) x``
    with ``A = x x^T``, on the wide orientation of ``x``.

    Examples:
        >>> import torch
        >>> g = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
        >>> o = newton_schulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        >>> s = torch.linalg.svdvals(o.float())   # near 1, not exactly (the iteration's design)
        >>> o.dtype, o.shape, bool(((s > 0.5) & (s < 1.5)).all())
        (torch.bfloat16, torch.Size([4, 6]), True)
    """
    a, b, c = coefficients
    tall = x.size(0) > x.size(1)
    y = x.to(dtype)
    if tall:
        y = y.T
    y = y / y.norm().clamp(min=eps)
    for _ in range(steps):
        gram = y @ y.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.addmm(y, poly, y, beta=a)
    return y.T if tall else y


def muon_step(opt, groups: tuple[int, ...], optimizer_runs: tuple[Run, ...], master: torch.Tensor,
              grad: torch.Tensor, momentum_buffer: torch.Tensor, compute: torch.Tensor | None,
              lrs: torch.Tensor, table: dict[str, list[float]], scalars: zfunc_kernels.StepScalars,
              layout: Layout, full: bool, shard: comm.Group) -> None:
    """One Muon step over this rank's runs of one Muon optimizer (parameter ``groups``), in place
    (``master``, ``momentum_buffer``, ``compute``). ``scalars``: the step's unscale, clip and skip
    (its ``step`` is read, never advanced); ``lrs``/``table``: each group's lr and hyperparameters.

    Every rank of ``shard`` calls it (the exchange is a collective), skipped step or not, and
    whether it owns part of the optimizer's matrices or none (no runs: it sends zeros).
    """
    n = momentum_buffer.numel()
    u = torch.zeros(n, dtype=torch.float32, device=master.device)
    one = torch.ones((), dtype=torch.float32, device=master.device)

    for r in optimizer_runs:
        s = scalars._replace(step=scalars.step.clone(), lr=lrs[r.group])
        hyper = zfunc_kernels.MuonMomentumHyper(table["momentum"][r.group], opt.nesterov)
        zfunc_kernels.fused_muon_momentum(u.narrow(0, r.at, r.length), r.part(grad),
                                          momentum_buffer.narrow(0, r.at, r.length), s, hyper)
    p = plan(layout, full, groups, optimizer_runs)
    gathered = None
    if p.send:
        me = 0 if full else layout.rank
        send = torch.zeros(p.send, dtype=torch.float32, device=master.device)
        for m in p.matrices:
            if m.crossing and m.local is not None:
                at, length = m.pieces[me]
                send.narrow(0, at, length).copy_(u.narrow(0, m.local[0], length))
        gathered = comm.all_gather(send, shard).view(-1, p.send)
    o = torch.zeros(n, dtype=torch.float32, device=master.device)
    for m in p.matrices:
        if m.local is None:
            continue
        at, offset, length = m.local
        if m.crossing:
            whole = torch.cat([gathered[r].narrow(0, a, k) for r, (a, k) in enumerate(m.pieces) if k])
        else:
            whole = u.narrow(0, at, length)
        ortho = newton_schulz(whole.view(m.shape), opt.ns_coefficients, opt.ns_steps, table["eps"][m.group],
                              opt.ns_dtype)
        piece = ortho.reshape(-1).narrow(0, offset, length).float()
        o.narrow(0, at, length).copy_(piece).mul_(opt.lr_ratio(m.shape))
    for r in optimizer_runs:
        s = scalars._replace(step=scalars.step.clone(), lr=lrs[r.group], inv_scale=one, clip_coef=one)
        zfunc_kernels.fused_muon_apply(r.part(master), o.narrow(0, r.at, r.length), s,
                                       zfunc_kernels.MuonApplyHyper(table["weight_decay"][r.group]),
                                       compute=r.part(compute))
