"""Memory allocated in one zfunc step, counted exactly by the torch profiler.

The e2e benchmark's GPT, a local world of 2 gloo ranks, one grad_accum-1 step after two warm-up
steps; the sum of every allocation the profiler records on rank 0 (``profile_memory=True``). Unlike
wall time or page faults this is the same on every run, so two versions of zfunc compare directly:
``--root`` imports zfunc from another checkout (a worktree of an earlier commit, say).

    python benchmarks/alloc_probe.py
    python benchmarks/alloc_probe.py --root /tmp/zfunc-before
    python benchmarks/alloc_probe.py --faults      # minor page faults of one step, DDP and zfunc

``--faults`` runs `e2e.py`'s own contenders (DDP, zfunc ZeRO-1..3 with units), each in a fresh
world: three steps, then the minor page faults of the fourth on each rank. Every buffer of 32 MiB
or more glibc hands out is mapped afresh, so this counts what a step allocates anew.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def rank_fn(rank: int, root: str, stage: int, precision: str) -> int:
    sys.path.insert(0, root)
    sys.path.insert(1, HERE)
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import e2e
    import zfunc

    torch.set_num_threads(1)
    batches = e2e._batches(rank, 3, 1)
    cfg = zfunc.Config(stage=stage, clip=e2e.CLIP, precision=precision,
                       optimizer=zfunc.adamw(lr=e2e.LR, weight_decay=e2e.WD))
    box = {"state": zfunc.init(e2e._build_model(), cfg, donate=True)}

    def step(micro_batches: list) -> None:
        state = box["state"]
        for mb in micro_batches:
            state, _ = zfunc.backward_step(state, e2e.lm_loss, mb, donate=True)
        box["state"] = zfunc.apply_step(state, donate=True)

    step(batches[0])
    step(batches[1])
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(batches[2])
    return sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0)


def faults_fn(rank: int, root: str, name: str) -> int:
    sys.path.insert(0, root)
    sys.path.insert(1, HERE)
    import resource

    import torch

    import e2e

    torch.set_num_threads(1)
    batches = e2e._batches(rank, 4, 1)
    step, _ = e2e._setup_ddp("fp32", 1) if name == "ddp" else e2e._setup_zfunc(int(name[-1]), "fp32", 1)
    for b in batches[:3]:
        step(b)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(batches[3])
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default=os.path.dirname(HERE), help="the checkout whose zfunc to import")
    p.add_argument("--faults", action="store_true", help="minor page faults of one step instead")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated (bf16 is slow without AVX-512)")
    args = p.parse_args(argv)
    sys.path.insert(0, args.root)
    import zfunc

    if args.faults:
        print(f"zfunc from {os.path.dirname(zfunc.__file__)}; minor page faults of the 4th step, per rank")
        print("| contender | rank 0 | rank 1 |\n|---|---|---|")
        for name in ("ddp", "zero1", "zero2", "zero3"):
            r = zfunc.launch(faults_fn, world_size=2, threads=1, args=(args.root, name))
            print(f"| {name} | {r[0]} | {r[1]} |", flush=True)
        return

    print(f"zfunc from {os.path.dirname(zfunc.__file__)}; MiB allocated per grad_accum-1 step, rank 0 of 2")
    print("| precision | zero0 | zero1 | zero2 | zero3 |\n|---|---|---|---|---|")
    for precision in args.precisions.split(","):
        cells = [zfunc.launch(rank_fn, world_size=2, threads=1, args=(args.root, stage, precision))[0] / 2**20
                 for stage in range(4)]
        print(f"| {precision} | " + " | ".join(f"{c:.0f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
