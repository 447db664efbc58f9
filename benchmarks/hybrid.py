"""Hybrid sharding at world 4 (2 "nodes" x 2 ranks): bytes per process group, and step time.

zfunc ZeRO stages 1-3 over the whole world (flat, ``shard_size=None``) against hybrid sharding
(``shard_size=2``: shard within a node, replicate across the two), on the GPT of ``e2e.py``
(AdamW, clip 1.0, one fixed micro-batch of 8 x 128 tokens per rank), in one local gloo world of 4
ranks with one torch thread each, every contender built in the same processes and their steps
interleaved round-robin (background load hits all alike).

Traffic is counted by wrapping the collectives of ``zfunc.comm`` in this process: each call adds
its payload (all-reduce, reduce and broadcast: the tensor; reduce-scatter: its input; all-gather:
its output) to the group it ran over (a collective built of others counts once). A group *crosses nodes* when its ranks sit on more than one
node (node = rank // 2). Per step and rank the table shows the payload bytes over groups inside
one node and over groups crossing nodes; the design promises that hybrid sharding moves only one
all-reduce of a 1/shard_size gradient shard across nodes per step, where flat ZeRO moves all of
its gathers and reduce-scatters across them.

    python benchmarks/hybrid.py                   # stages 1-3, fp32
    python benchmarks/hybrid.py --steps 8 --stages 3
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import collections
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zfunc  # noqa: E402
from e2e import CLIP, LR, MODEL, WD, _batches, _build_model  # noqa: E402
from zfunc import comm  # noqa: E402
from zfunc.models import lm_loss  # noqa: E402

WORLD, PER_NODE = 4, 2
_COUNTS: collections.Counter = collections.Counter()  # (crosses nodes, collective) -> bytes
_COUNTING = [False]


def _crosses(group: comm.Group) -> bool:
    ranks = list(range(dist.get_world_size())) if group.pg is None else dist.get_process_group_ranks(group.pg)
    return len({r // PER_NODE for r in ranks}) > 1


_DEPTH = [0]  # a collective built of others (reduce_scatter_ of reduce_) counts once, outermost


def _counted(name: str, fn, payload):
    def wrapper(*args: Any, **kwargs: Any):
        _DEPTH[0] += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1
        group = next((x for x in (*args, *kwargs.values()) if isinstance(x, comm.Group)), None) or comm.world()
        if _COUNTING[0] and group.size > 1 and _DEPTH[0] == 0:
            _COUNTS[(_crosses(group), name)] += payload(args, out)
        return out
    return wrapper


def _install_counters() -> None:
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    comm.all_reduce = _counted("all_reduce", comm.all_reduce, lambda a, o: size(o))
    comm.all_reduce_ = _counted("all_reduce", comm.all_reduce_, lambda a, o: size(o))
    comm.reduce_scatter = _counted("reduce_scatter", comm.reduce_scatter, lambda a, o: size(a[0]))
    comm.reduce_scatter_ = _counted("reduce_scatter", comm.reduce_scatter_, lambda a, o: size(a[0]))
    comm.reduce_ = _counted("reduce", comm.reduce_, lambda a, o: size(a[0]))
    comm.all_gather = _counted("all_gather", comm.all_gather, lambda a, o: size(o))
    comm.all_gather_start = _counted("all_gather", comm.all_gather_start, lambda a, o: size(o[0]))
    comm.reduce_scatter_start = _counted("reduce_scatter", comm.reduce_scatter_start, lambda a, o: size(a[0]))
    comm.all_reduce_start = _counted("all_reduce", comm.all_reduce_start, lambda a, o: size(a[0]))
    comm.all_gather_range_start = _counted("all_gather", comm.all_gather_range_start,
                                           lambda a, o: (a[2] - a[1]) * a[0].element_size())
    comm.all_gather_into = _counted("all_gather_into", comm.all_gather_into, lambda a, o: size(o))
    comm.broadcast = _counted("broadcast", comm.broadcast, lambda a, o: size(o))


def _setup(stage: int, shard_size: int | None, precision: str):
    from zfunc.models.gpt import Block
    cfg = zfunc.Config(stage=stage, precision=precision, clip=CLIP, shard_size=shard_size,
                       optimizer=zfunc.adamw(lr=LR, weight_decay=WD), units=(Block,) if stage == 3 else None)
    box = {"state": zfunc.init(_build_model(), cfg, donate=True)}

    def step(batch: dict[str, torch.Tensor]) -> None:
        state, _ = zfunc.backward_step(box["state"], lm_loss, batch, donate=True)
        box["state"] = zfunc.apply_step(state, donate=True)
    return step, box


def run_rank(rank: int, stages: list[int], precision: str, warmup: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    _install_counters()
    names = [(f"zero{s}{'-hybrid' if k else ''}", s, k) for s in stages for k in (None, PER_NODE)]
    runs = {n: _setup(s, k, precision) for n, s, k in names}
    batches = [mbs[0] for mbs in _batches(rank, warmup + steps)]
    rec: dict[str, dict[str, Any]] = {n: {"times": [], "bytes": collections.Counter()} for n, _, _ in names}
    for b in batches[:warmup]:
        for n, _, _ in names:
            runs[n][0](b)
    for i, b in enumerate(batches[warmup:]):
        k = i % len(names)
        for n, _, _ in names[k:] + names[:k]:
            dist.barrier()
            _COUNTS.clear()
            _COUNTING[0] = True
            t0 = time.perf_counter()
            runs[n][0](b)
            rec[n]["times"].append(time.perf_counter() - t0)
            _COUNTING[0] = False
            rec[n]["bytes"].update(_COUNTS)
    for n, _, _ in names:
        rec[n]["loss"] = runs[n][1]["state"].metrics.loss.item()
        rec[n]["bytes"] = {key: v / steps for key, v in rec[n]["bytes"].items()}
    return rec


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, world {WORLD} = 2 nodes x {PER_NODE} ranks "
          f"(gloo, 1 thread each), GPT {MODEL}, {args.precision}, {args.steps} interleaved steps", flush=True)
    t0 = time.perf_counter()
    per_rank = zfunc.launch(run_rank, world_size=WORLD, threads=1, timeout=3600,
                            args=(stages, args.precision, args.warmup, args.steps))
    print(f"[{time.perf_counter() - t0:.0f} s]\n")
    head = ("| contender | step s (median) | vs flat | MiB/step/rank inside a node | MiB/step/rank across nodes "
            "| across: vs flat | across-node collectives | final loss |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    flat: dict[int, dict[str, float]] = {}
    for name in per_rank[0]:
        n = len(per_rank[0][name]["times"])
        median = statistics.median(max(r[name]["times"][i] for r in per_rank) for i in range(n))
        counts = per_rank[0][name]["bytes"]
        inside = sum(v for (cross, _), v in counts.items() if not cross)
        across = sum(v for (cross, _), v in counts.items() if cross)
        kinds = ", ".join(f"{c} {_mib(v)}" for (cross, c), v in sorted(counts.items()) if cross)
        stage = int(name[4])
        if "hybrid" not in name:
            flat[stage] = {"median": median, "across": across}
        ref = flat[stage]
        lines.append(f"| {name} | {median:.2f} | {median / ref['median']:.2f}x | {_mib(inside)} | {_mib(across)} | "
                     f"{ref['across'] / across if across else float('inf'):.1f}x less | {kinds} | "
                     f"{per_rank[0][name]['loss']:.4f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
