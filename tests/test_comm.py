"""zfunc's point-to-point sums on gloo (`zfunc.comm.Group.p2p`) against sums written out by hand.

Each rank's input is regenerated on every rank from its seed, so every rank knows the exact
expected result: its own slice plus the others' in rank order, in the input's dtype, and within
rounding of the float64 sum.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zfunc
from tests.helpers import run_ranks


def _inputs(world: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(100 + r)).to(dtype) for r in range(world)]


def _in_rank_order(xs: list[torch.Tensor], me: int) -> torch.Tensor:
    """This rank's part first, then every other rank's in rank order, as `_sum_to` adds them."""
    out = xs[me].clone()
    for r, x in enumerate(xs):
        if r != me:
            out.add_(x)
    return out


def _sums(rank: int, world: int, dtype: torch.dtype) -> dict:
    from zfunc import comm
    from zfunc.distributed.mesh import make_mesh

    mesh = make_mesh(comm.world(), None)
    group = mesh.shard
    n = 6 * world + 3 * world  # a multiple of the world, nothing round
    xs = _inputs(world, n, dtype)
    got: dict = {"has_p2p": group.p2p is not None, "world_has_p2p": mesh.world.p2p is not None}

    # reduce_ to every rank in turn, several in flight at once
    bufs = [xs[rank].clone() for _ in range(world)]
    handles = [comm.reduce_(bufs[dst], dst, "sum", group, async_op=True) for dst in range(world)]
    for h in handles:
        h.wait()
    got["reduce_exact"] = all(torch.equal(bufs[dst], _in_rank_order(xs, dst)) if dst == rank
                              else torch.equal(bufs[dst], xs[rank]) for dst in range(world))

    # reduce-scatter: slice r to rank r; the input is left as it was
    x = xs[rank].clone()
    out, handle = comm.reduce_scatter_start(x, "sum", group)
    handle.wait()
    k = n // world
    mine = _in_rank_order([t.narrow(0, rank * k, k) for t in xs], rank)
    got["scatter_exact"] = torch.equal(out, mine) and torch.equal(x, xs[rank])
    exact = sum(t.double() for t in xs).narrow(0, rank * k, k)
    got["scatter_err"] = (out.double() - exact).abs().max().item()

    # gloo's own reduces (no twin group): the same sums within rounding
    plain = dataclasses.replace(group, p2p=None)
    out2 = comm.reduce_scatter(xs[rank].clone(), "sum", plain)
    got["plain_err"] = (out2.double() - exact).abs().max().item()

    # the default group's collectives still line up (TORCH_DISTRIBUTED_DEBUG=DETAIL checks it)
    got["after"] = comm.all_reduce(torch.ones(3), "sum", mesh.world).tolist()
    return got


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_point_to_point_sums_are_the_sums_in_rank_order(world, dtype):
    tol = 1e-5 if dtype == torch.float32 else 0.05
    for got in run_ranks(_sums, world, world, dtype):
        assert got["has_p2p"] and not got["world_has_p2p"]
        assert got["reduce_exact"] and got["scatter_exact"]
        assert got["scatter_err"] < tol and got["plain_err"] < tol
        assert got["after"] == [float(world)] * 3


def test_a_world_of_one_has_no_twin_group():
    from zfunc.distributed.mesh import make_mesh

    mesh = make_mesh(zfunc.comm.world(), None)
    assert mesh.shard.p2p is None
    x = torch.arange(4.0)
    assert zfunc.comm.reduce_scatter(x).tolist() == [0.0, 1.0, 2.0, 3.0]
