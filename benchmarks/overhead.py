"""Per-parameter overhead: one micro-batch's forward and backward of a model with many small
parameters, through `zfunc.backward_step` at world 1, against the same model in plain torch.

The model is a bank of 256 small MLP experts between an input and an output projection (1,028
parameter tensors, 0.3M elements), each expert on its own slice of the tokens, as a
mixture-of-experts layer runs them: Python work per parameter shows, arithmetic does not.
Each round times every contender once, in turn (``time.perf_counter``, one thread); the table
gives the median over rounds and the ratio of medians to plain torch (forward, ``backward()``
into ``.grad``, ``zero_grad(set_to_none=True)``). Objects alive after the warm-up are frozen
(``gc.freeze``), so a full collection, which scans every object the process holds, does not
land on one contender at random.

Usage::

    PYTHONPATH=. python benchmarks/overhead.py [--rounds 30] [--experts 256] [--checkpoint nonreentrant]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time

import torch
import torch.utils.checkpoint
from torch import nn

import zfunc


class ExpertBank(nn.Module):
    """``experts`` two-layer MLPs, each on its own slice of the tokens."""

    def __init__(self, experts: int = 256, d: int = 16, hidden: int = 32, checkpoint: str | None = None):
        super().__init__()
        self.checkpoint = checkpoint  # None, "reentrant" or "nonreentrant": each expert recomputed in backward
        self.inp = nn.Linear(d, d)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))
                                     for _ in range(experts))
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        parts = torch.chunk(h, len(self.experts))
        if self.checkpoint is None:
            outs = [e(p) for e, p in zip(self.experts, parts)]
        else:
            reentrant = self.checkpoint == "reentrant"
            outs = [torch.utils.checkpoint.checkpoint(e, p, use_reentrant=reentrant)
                    for e, p in zip(self.experts, parts)]
        return self.out(torch.cat(outs))


def loss_fn(model, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--checkpoint", choices=["reentrant", "nonreentrant"], default=None,
                    help="each expert under torch.utils.checkpoint, for every contender (torch's included)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ExpertBank(args.experts, checkpoint=args.checkpoint)
    x = torch.randn(4 * args.experts, 16)
    n_params = len(list(model.parameters()))

    def plain() -> None:
        loss_fn(model, x).backward()
        model.zero_grad(set_to_none=True)

    states = {stage: zfunc.init(model, zfunc.Config(stage=stage, grad_accum=1)) for stage in (0, 2)}

    def through(stage: int):
        def run() -> None:
            zfunc.backward_step(states[stage], loss_fn, x)  # the input state is kept: same work each time
        return run

    contenders = {"torch": plain, "zfunc stage 0": through(0), "zfunc stage 2": through(2)}
    for fn in contenders.values():  # warm-up
        for _ in range(3):
            fn()
    # What lives now (torch, numba, the model, the states) is moved out of the collector's view:
    # a full collection scans it otherwise (~200 ms here), and it lands on whichever contender's
    # call happens to trigger it. The young collections each call causes stay in its time.
    gc.collect()
    gc.freeze()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["torch"])
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread, "
          f"{n_params} parameter tensors, {sum(p.numel() for p in model.parameters())} elements, "
          f"{args.rounds} rounds, checkpointing: {args.checkpoint or 'none'}")
    print(f"{'contender':<16} {'median ms':>10} {'vs torch':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<16} {med * 1e3:>10.2f} {med / base:>8.2f}x")


if __name__ == "__main__":
    main()
