"""Peak memory per rank while `zfunc.init` builds a ZeRO-3 state, and of `python -m zfunc.convert`.

Contenders, each in fresh processes (``zfunc.launch``), a local gloo world of ``--world`` ranks:

* ``eager``  the model built on the CPU as usual, then ``zfunc.init``: every rank holds the whole model;
* ``meta``  built under ``torch.device("meta")``, ``zfunc.init(..., init_fn=GPT._init)``: one unit
  at a time is materialized, each rank keeps its shard;
* ``weights``  built on meta, ``zfunc.init(..., weights=<safetensors>)``.

For each, the peak RSS a rank added during init (``ru_maxrss`` after init minus the RSS before the
model was built) is printed beside the target: this rank's shard of master + moments (12 bytes per
parameter in fp32 AdamW) plus the largest unit, x1.3.

``convert``: the checkpoint of that state, saved by the same world, consolidated into one
safetensors file by ``python -m zfunc.convert`` in one process: its peak added RSS against the
largest piece (one parameter), and its time against reading the checkpoint's files once.

    python benchmarks/init_memory.py                      # GPT ~185M parameters, world 4
    python benchmarks/init_memory.py --d-model 2048 --layers 20 --vocab 32000   # ~1B
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import zfunc  # noqa: E402
from zfunc.models import GPT, GPTConfig  # noqa: E402
from zfunc.models.gpt import Block  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_rank(rank: int, kind: str, cfg: GPTConfig, weights: str | None, save: str | None) -> dict:
    before = _rss()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    zcfg = zfunc.Config(stage=3, units=[Block])
    if kind == "eager":
        model = GPT(cfg)
        state = zfunc.init(model, zcfg, donate=True)
    else:
        with torch.device("meta"):
            model = GPT(cfg)
        state = zfunc.init(model, zcfg, init_fn=GPT._init if kind == "meta" else None,
                           weights=weights if kind == "weights" else None)
    seconds = time.perf_counter() - t0
    peak = _peak() - before
    shard = state.params.numel() * 4 + sum(getattr(state.opt, m).numel() * 4 for m in ("mu", "nu"))
    largest = max(u.padded for u in state.layout.units) * 4
    if save:
        zfunc.save(state, save)
    return {"peak": peak, "shard": shard, "largest": largest, "seconds": seconds,
            "params": state.layout.numel}


def _export(rank: int, cfg: GPTConfig, path: str) -> None:
    """The model's weights as one safetensors file (made from a meta build, one rank)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    state = zfunc.init(model, zfunc.Config(stage=3, units=[Block]), init_fn=GPT._init)
    zfunc.export(state, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--only", default="eager,meta,weights,convert")
    args = p.parse_args(argv)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=256, n_layer=args.layers, n_head=16, d_model=args.d_model)
    only = args.only.split(",")
    work = tempfile.mkdtemp()
    weights = os.path.join(work, "model.safetensors")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, world {args.world} (gloo), GPT {cfg}")
    if "weights" in only:
        zfunc.launch(_export, world_size=1, args=(cfg, weights), timeout=3600)
    rows = []
    ckpt = os.path.join(work, "ckpt")
    for kind in ("eager", "meta", "weights"):
        if kind not in only:
            continue
        save = ckpt if kind == "meta" and "convert" in only else None
        per = zfunc.launch(run_rank, world_size=args.world, args=(kind, cfg, weights, save), threads=1, timeout=3600)
        worst = max(per, key=lambda r: r["peak"])
        target = 1.3 * (worst["shard"] + worst["largest"])
        rows.append((kind, worst["params"], worst["peak"], worst["shard"], worst["largest"], target,
                     max(r["seconds"] for r in per)))
    print("\n| init | parameters | peak +RSS MiB/rank (worst) | shard (master+moments) MiB | largest unit MiB | "
          "target 1.3x(shard+unit) MiB | ratio to target | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, n, peak, shard, largest, target, secs in rows:
        print(f"| {kind} | {n / 1e6:.0f}M | {peak / 2**20:.0f} | {shard / 2**20:.0f} | {largest / 2**20:.0f} | "
              f"{target / 2**20:.0f} | {peak / target:.2f} | {secs:.1f} |")
    if "convert" in only and os.path.exists(ckpt):
        out = os.path.join(work, "converted.safetensors")
        code = ("import resource, time, sys, os\n"
                "from zfunc.io.convert import main\n"
                "with open('/proc/self/statm') as f: before = int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
                "t = time.perf_counter()\n"
                f"main([{ckpt!r}, {out!r}])\n"
                "print('seconds', time.perf_counter() - t)\n"
                "print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)\n")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        vals = dict(line.split() for line in done.stdout.splitlines() if line.split()[0] in ("seconds", "peak"))
        t = time.perf_counter()
        total = 0
        for root, _, files in os.walk(ckpt):
            for f in files:
                with open(os.path.join(root, f), "rb") as fh:
                    while chunk := fh.read(1 << 24):
                        total += len(chunk)
        read_once = time.perf_counter() - t
        largest_piece = cfg.vocab_size * cfg.d_model * 4
        print(f"\nconvert: {total / 2**20:.0f} MiB of checkpoint -> one file; peak +RSS "
              f"{int(vals['peak']) / 2**20:.0f} MiB = {int(vals['peak']) / largest_piece:.2f}x the largest piece "
              f"({largest_piece / 2**20:.0f} MiB, the embedding); {float(vals['seconds']):.1f} s = "
              f"{float(vals['seconds']) / read_once:.1f}x reading the files once ({read_once:.1f} s, page cache warm)")


if __name__ == "__main__":
    main()
