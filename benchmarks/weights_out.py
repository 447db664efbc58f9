"""Weights out of a ZeRO-3 state: `zfunc.iter_full_params` against `zfunc.full_params` and one
all-gather of the whole model, in memory and time.

The e2e GPT (vocab 8192, context 128, 4 layers, d_model 512: 21M parameters, a unit per block and
the root holding the tied embedding), stage 3 on a local world of 2 gloo ranks, one thread each.

* memory: the peak of bytes allocated and not yet freed while the weights come out, beyond what was
  live before (the torch profiler's allocation records in time order, rank 0), for a loop that
  reads each tensor and lets it go; the goal is at most 1.2x the largest unit plus the rank's shard;
* time: the median of ``--repeats`` full iterations (every rank receiving, and ``dst=0``) against
  `full_params` and one all-gather of the whole arena in one piece (the least any way of getting
  every weight to every rank moves); the goal is at most 1.2x that all-gather.

    python benchmarks/weights_out.py
    python benchmarks/weights_out.py --repeats 20 --layers 8
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import zfunc
from zfunc.tools.memory import peak_allocated
from machine import cpu_line
from zfunc.models import GPT, GPTConfig
from zfunc.models.gpt import Block

MiB = 2**20


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(rank: int, layers: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = GPTConfig(vocab_size=8192, block_size=128, n_layer=layers, n_head=8, d_model=512)
    state = zfunc.init(GPT(shape), zfunc.Config(stage=3, units=[Block]), donate=True)

    def stream(dst=None):
        def go() -> None:
            for _, t in zfunc.iter_full_params(state, dst=dst):
                t.sum()  # a receiver reads it, then lets it go
        return go

    def whole() -> None:
        for t in zfunc.full_params(state).values():
            t.sum()

    def one_gather() -> None:
        zfunc.comm.all_gather(state.params, state.mesh.shard).sum()

    for fn in (stream(), whole, one_gather):  # warm up every path once
        fn()
    lay = state.layout
    out = {"unit": max(u.padded for u in lay.units) * 4, "shard": max(u.shard for u in lay.units) * 4,
           "model": lay.full_numel * 4, "units": len(lay.units), "params": lay.numel}
    for name, fn in (("stream", stream()), ("stream_dst0", stream(0)), ("full_params", whole),
                     ("all_gather", one_gather)):
        out[f"{name}_peak"] = peak_allocated(fn)
        out[f"{name}_s"] = _median_s(fn, repeats)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, 2 ranks x 1 thread (gloo), stage 3")
    print(cpu_line())
    per_rank = zfunc.launch(run, world_size=2, args=(args.layers, args.repeats))
    r = per_rank[0]
    slowest = {k: max(x[k] for x in per_rank) for k in r if k.endswith("_s")}
    print(f"{r['params'] / 1e6:.1f}M parameters in {r['units']} units; largest unit {r['unit'] / MiB:.1f} MiB, "
          f"rank shard of it {r['shard'] / MiB:.1f} MiB, whole model {r['model'] / MiB:.1f} MiB (fp32)\n")
    print("| how | peak extra MiB (rank 0) | vs largest unit | median s (slowest rank) | vs one all-gather |")
    print("|---|---|---|---|---|")
    for name, label in (("stream", "iter_full_params, every rank"), ("stream_dst0", "iter_full_params, dst=0"),
                        ("full_params", "full_params"), ("all_gather", "one all-gather of the arena")):
        print(f"| {label} | {r[name + '_peak'] / MiB:.1f} | {r[name + '_peak'] / r['unit']:.2f}x | "
              f"{slowest[name + '_s']:.4f} | {slowest[name + '_s'] / slowest['all_gather_s']:.2f}x |")
    bound = 1.2 * r["unit"] + r["shard"]
    q = r["stream_peak"]
    print(f"\ngoal peak <= 1.2 x largest unit + shard ({bound / MiB:.1f} MiB): {q / MiB:.1f} MiB -> "
          f"{'MET' if q <= bound else 'NOT MET'}")
    t = slowest["stream_s"] / slowest["all_gather_s"]
    print(f"goal time <= 1.2 x one all-gather: {t:.2f}x -> {'MET' if t <= 1.2 else 'NOT MET'}")


if __name__ == "__main__":
    main()
