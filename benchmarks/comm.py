"""Collectives on gloo: zfunc's point-to-point sums and broadcast all-gather against gloo's own.

One gradient of ``--numel`` floats (the benchmark GPT's 16.8M by default) in ``--bucket-mb``
buckets, on a local world of ``--world`` gloo ranks with one torch thread each. Every round runs
each variant once (rotating the order), so a busy machine slows all of them alike; the table
shows the median wall time of the slowest rank and the median CPU time (``time.process_time``,
gloo's threads included) over ``--rounds`` rounds, and each variant against gloo's own way of
doing the same (the sums against gloo's reduces, zfunc's all-gather against gloo's; both
all-gathers write a fresh output, as stage 3 does).

    python benchmarks/comm.py
    python benchmarks/comm.py --world 3 --rounds 21

Variants:

* ``all_reduce``            gloo's all-reduce per bucket (DDP's reduce, stage 0)
* ``reduce (gloo)``         one gloo reduce per owner's piece of each bucket (stages 1-2 before)
* ``reduce (p2p)``          the same sums through `zfunc.comm.reduce_` on a group with a
                            point-to-point twin (`zfunc.comm.Group.p2p`): what stages 1-2 run now
* ``reduce_scatter (gloo)`` gloo's own reduce-scatter per bucket
* ``all_gather (gloo)``     gloo's own flat all-gather of the shards
* ``all_gather (zfunc)``    `zfunc.comm.all_gather_start`: one broadcast per rank in flight at once
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import zfunc
from zfunc import comm
from zfunc.distributed.mesh import make_mesh


def _buckets(n: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(size, n - s)) for s in range(0, n, size)]


def _variants(x: torch.Tensor, bucket: int, group: comm.Group) -> dict[str, Any]:
    w, me = group.size, group.rank
    plain = comm.Group(rank=group.rank, size=group.size, pg=group.pg)  # no twin: gloo's reduces
    n = x.numel()

    def all_reduce() -> None:
        for h in [dist.all_reduce(x.narrow(0, s, k), async_op=True) for s, k in _buckets(n, bucket)]:
            h.wait()

    def reduces(g: comm.Group) -> Any:
        def run() -> None:
            handles = []
            for s, k in _buckets(n, bucket):
                piece = k // w
                handles += [comm.reduce_(x.narrow(0, s + o * piece, piece), o, "sum", g, async_op=True)
                            for o in range(w)]
            for h in handles:
                h.wait()
        return run

    def reduce_scatter() -> None:
        handles = []
        for s, k in _buckets(n, bucket):
            out = x.new_empty(k // w)
            handles.append(dist.reduce_scatter_tensor(out, x.narrow(0, s, k), async_op=True))
        for h in handles:
            h.wait()

    shard = x.narrow(0, me * (n // w), n // w).clone()

    def all_gather_gloo() -> None:
        dist.all_gather_into_tensor(x.new_empty(n), shard)

    def all_gather_zfunc() -> None:
        comm.all_gather_start(shard, group)[1].wait()

    return {"all_reduce": all_reduce, "reduce (gloo)": reduces(plain), "reduce (p2p)": reduces(group),
            "reduce_scatter (gloo)": reduce_scatter, "all_gather (gloo)": all_gather_gloo,
            "all_gather (zfunc)": all_gather_zfunc}


def run_rank(rank: int, numel: int, bucket_mb: float, rounds: int) -> dict[str, dict[str, list[float]]]:
    torch.set_num_threads(1)
    group = make_mesh(comm.world(), None).shard
    w = group.size
    bucket = max(w, int(bucket_mb * 2**20) // 4 // w * w)
    x = torch.randn(numel // (w * bucket) * (w * bucket) or w * bucket)
    runs = _variants(x, bucket, group)
    names = list(runs)
    out = {name: {"wall": [], "cpu": []} for name in names}
    for r in range(rounds + 1):  # round 0 warms up
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            runs[name]()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if r:
                out[name]["wall"].append(wall)
                out[name]["cpu"].append(cpu)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--numel", type=int, default=16_864_256, help="gradient elements (default: the e2e GPT's)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    per_rank = zfunc.launch(run_rank, world_size=args.world, threads=1, timeout=1800,
                            args=(args.numel, args.bucket_mb, args.rounds))
    print(f"gloo, {args.world} ranks x 1 thread, {args.numel / 1e6:.1f}M float32 in {args.bucket_mb:g} MiB "
          f"buckets, {args.rounds} rounds; medians (wall: slowest rank)")
    names = list(per_rank[0])
    wall = {n: statistics.median(max(r[n]["wall"][i] for r in per_rank) for i in range(args.rounds)) for n in names}
    cpu = {n: statistics.median(max(r[n]["cpu"][i] for r in per_rank) for i in range(args.rounds)) for n in names}
    ref = {"reduce": "reduce (gloo)", "reduce_scatter": "reduce (gloo)", "all_gather": "all_gather (gloo)",
           "all_reduce": "all_reduce"}
    print("| variant | wall ms | CPU ms | wall against |\n|---|---|---|---|")
    for n in names:
        base = ref[n.split(" ")[0]]
        against = "-" if base == n else f"{wall[n] / wall[base]:.2f}x {base}"
        print(f"| {n} | {wall[n] * 1e3:.1f} | {cpu[n] * 1e3:.1f} | {against} |")


if __name__ == "__main__":
    main()
