"""Muon's exchange whatever each rank owns: every rank joins the same all-gather in the same
order, a rank owning nothing of a Muon optimizer (or only some of its groups) included.

The cases are chosen from the real layouts (`_ownership`), so each pattern comes from the layout
code itself: a rank owning nothing of a crossing matrix's optimizer ("idle"), a matrix on three
or more ranks ("span3"), a matrix wholly on one rank ("whole"). Gradients are exact (the model
returns every weight; the loss is linear with dyadic coefficients), so the sharded run equals the
one-process run bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zfunc
from tests.helpers import run_ranks
from zfunc.core import opt_state
from zfunc.core.muon import plan
from zfunc.distributed.layout import make_layout

# Each kind: the optimizer of each parameter group (group 0: the embedding; 1, 2: the linears,
# alternating), and its Muon optimizers. "adamw+muon" is the report's; "two-muon" adds a second Muon
# optimizer; "muon-default": Config.optimizer is Muon and steps groups 0 and 1.
KINDS = {"adamw+muon": ((0, 1), (1,)), "two-muon": ((0, 1, 2), (1, 2)), "muon-default": ((0, 0), (0,))}
SHAPES = [(vocab, dims) for vocab in (1, 5, 20) for dims in ((4, 8, 4), (4, 4, 4), (4, 2, 3), (4, 12, 2, 2),
                                                          (4, 3, 5, 2), (4, 6, 6, 6))]


class _Chain(nn.Module):
    """An embedding, then bias-free linears; ``forward`` returns every weight exactly (the rows
    of the embedding, each linear applied to the identity), so a loss linear in them has exact
    gradients."""

    def __init__(self, vocab: int, dims: tuple[int, ...]):
        super().__init__()
        self.emb = nn.Embedding(vocab, dims[0])
        self.lins = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:]))

    def forward(self, _):
        return [self.emb(torch.arange(self.emb.num_embeddings))] + [l(torch.eye(l.in_features)) for l in self.lins]


def _linear_loss(model, batch):
    return sum((o * c).sum() for o, c in zip(model(None), batch["c"]))


def _group(kind: str, i: int) -> int:  # the linear i's parameter group
    return {"adamw+muon": 1, "two-muon": 1 + i % 2, "muon-default": i % 2}[kind]


def _config(kind: str, stage: int, per_module: bool) -> zfunc.Config:
    mu = zfunc.muon(lr=0.02, ns_dtype=torch.float32)
    linear = lambda k: lambda n, p: n.startswith("lins.") and _group(kind, int(n.split(".")[1])) == k  # noqa: E731
    groups = {"adamw+muon": [zfunc.ParamGroup(linear(1), optimizer=mu)],
              "two-muon": [zfunc.ParamGroup(linear(1), optimizer=mu),
                           zfunc.ParamGroup(linear(2), optimizer=zfunc.muon(lr=0.03, ns_dtype=torch.float32))],
              "muon-default": [zfunc.ParamGroup(linear(1), lr=0.03)]}[kind]
    return zfunc.Config(stage=stage, optimizer=mu if kind == "muon-default" else zfunc.adamw(lr=1e-2),
                        param_groups=groups, persist_threshold=0,  # stage 3: one unit, or one per linear
                        units=([nn.Linear] if per_module else []) if stage == 3 else None)


def _train(rank: int, vocab: int, dims: tuple[int, ...], kind: str, stage: int, per_module: bool,
           data_world: int | None = None) -> dict[str, torch.Tensor]:
    """3 steps; ``data_world``: one process on the mean of that many ranks' coefficients."""
    world = data_world or zfunc.comm.world().size
    shapes = [(vocab, dims[0])] + [(a, b) for a, b in zip(dims, dims[1:])]  # W^T: a linear of the identity

    def coefficients(step, r):  # world * k / 4: a rank's share, the sum over ranks and the mean are exact
        g = torch.Generator().manual_seed(1000 * step + r)
        return [world * torch.randint(-8, 9, s, generator=g).float() / 4 for s in shapes]

    torch.manual_seed(0)
    state = zfunc.init(_Chain(vocab, dims), _config(kind, stage, per_module))
    step = zfunc.train_step(_linear_loss)
    for i in range(3):
        if data_world is None:
            c = coefficients(i, rank)
        else:
            cs = [coefficients(i, r) for r in range(world)]
            c = [sum(x[j] for x in cs) / world for j in range(len(shapes))]
        state = step(state, {"c": c})
    return zfunc.full_params(state)


def _ownership(world: int, vocab: int, dims: tuple[int, ...], kind: str, per_module: bool) -> frozenset[str]:
    """What the layouts give each Muon optimizer: "idle" (a rank with no run of it, or runs of only
    some of its groups, while a matrix crosses a boundary), "span3" (a matrix on 3+ ranks),
    "whole" (a matrix on one rank)."""
    owner, muon_optimizers = KINDS[kind]
    entries = [("emb.weight", (vocab, dims[0]), 0)] + [
        (f"lins.{i}.weight", (b, a), _group(kind, i)) for i, (a, b) in enumerate(zip(dims, dims[1:]))]
    units = [[e] for e in entries] if per_module else [entries]
    layouts = [make_layout(units, world=world, rank=r, align=4) for r in range(world)]
    found = set()
    for k in muon_optimizers:
        groups = tuple(g for g, o in enumerate(owner) if o == k)
        runs = [opt_state._runs(lay, False, owner)[k] for lay in layouts]
        p = plan(layouts[0], False, groups, runs[0])
        crossing = {m.group for m in p.matrices if m.crossing}
        if any(crossing - {r.group for r in rs} for rs in runs):
            found.add("idle")
        for m in p.matrices:
            owners = sum(1 for _, n in m.pieces if n)
            found |= {"span3"} if owners >= 3 else {"whole"} if owners == 1 else set()
    return frozenset(found)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_joins_the_exchange_whatever_it_owns(world):
    """A rank that owns nothing of a Muon optimizer still joins its all-gather (an empty plan
    there would make gloo abort every rank and NCCL hang). Gradients exact, so the sharded run
    is the one-process run bit for bit."""
    chosen, covered = [], set()  # the first shape showing each (kind, pattern)
    for kind in KINDS:
        for vocab, dims in SHAPES:
            for per_module in (False, True):
                found = {(kind, f) for f in _ownership(world, vocab, dims, kind, per_module)}
                if found - covered:
                    chosen.append((vocab, dims, kind, per_module))
                    covered |= found
    assert {f for k, f in covered if k == "adamw+muon"} == ({"whole"} if world == 2 else {"idle", "span3", "whole"})
    for vocab, dims, kind, per_module in chosen:
        ref, = run_ranks(_train, 1, vocab, dims, kind, 0, False, world)
        for stage in (1, 2, 3) if not per_module else (3,):
            for out in run_ranks(_train, world, vocab, dims, kind, stage, per_module):
                assert all(torch.equal(out[n], ref[n]) for n in ref), (vocab, dims, kind, stage, per_module)
