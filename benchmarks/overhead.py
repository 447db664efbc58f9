"""Per-parameter overhead: one micro-batch's forward and backward of a model with many small
parameters, through `zfunc.backward_step` at world 1, against the same model in plain torch.

The model is a bank of 256 small MLP experts between an input and an output projection (1,028
parameter tensors, 0.3M elements), each expert on its own slice of the tokens, as a
mixture-of-experts layer runs them: Python work per parameter shows, arithmetic does not. With
``--model blocks``, a stack of 48 small transformer blocks (817 parameter tensors): under
checkpointing each block is one segment of eight parameter-holding layers, as a transformer is
checkpointed layer by layer.
Each round times every contender once, in turn (``time.perf_counter``, one thread); the table
gives the median over rounds, the ratio of medians to plain torch (forward, ``backward()``
into ``.grad``, ``zero_grad(set_to_none=True)``), and the median of each round's own ratio
(*paired*: a round's contenders run moments apart, so a slow stretch of a shared machine weighs on
them alike). Objects alive after the warm-up are frozen
(``gc.freeze``), so a full collection, which scans every object the process holds, does not
land on one contender at random.

With ``--world N`` (N > 1) every contender runs on a local world of N gloo ranks, one thread
each, where the gradients are reduced in backward: plain torch is ``DistributedDataParallel``
(its C++ reducer: buckets of 25 MiB, all-reduced as they complete), zfunc's stage 0 all-reduces
each bucket in the micro-batch's backward (``grad_accum=1``: the step's boundary), stage 2
reduces each bucket to its owners. Each contender's round starts after a barrier; its time is
the slowest rank's.

Usage::

    PYTHONPATH=. python benchmarks/overhead.py [--rounds 30] [--experts 256] [--checkpoint nonreentrant]
    PYTHONPATH=. python benchmarks/overhead.py --world 2
    PYTHONPATH=. python benchmarks/overhead.py --model blocks --checkpoint reentrant
"""

from __future__ import annotations

import argparse
import copy
import gc
import platform
import statistics
import time
from collections.abc import Callable

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


class _Attention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1) @ self.v(x))


class _Block(nn.Module):
    """A pre-norm transformer block: attention and an MLP, eight parameter-holding layers."""

    def __init__(self, d: int):
        super().__init__()
        self.n1, self.att, self.n2 = nn.LayerNorm(d), _Attention(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.att(self.n1(x))
        return x + self.mlp(self.n2(x))


class BlockStack(nn.Module):
    """``blocks`` small transformer blocks (width 16, 17 parameter tensors each) after an input
    projection, each checkpointed as a whole when ``checkpoint`` is set: what checkpointing a
    transformer layer by layer recomputes."""

    def __init__(self, blocks: int = 48, d: int = 16, checkpoint: str | None = None):
        super().__init__()
        self.checkpoint = checkpoint
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = (block(x) if self.checkpoint is None else
                 torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant"))
        return x


def _model(kind: str, size: int, checkpoint: str | None) -> tuple[nn.Module, torch.Tensor]:
    """The model of ``kind`` and a batch's shape: `ExpertBank` of ``size`` experts (4 tokens
    each), or `BlockStack` of ``size`` blocks (2 sequences of 8 tokens)."""
    if kind == "experts":
        return ExpertBank(size, checkpoint=checkpoint), (4 * size, 16)
    return BlockStack(size, checkpoint=checkpoint), (2, 8, 16)


def loss_fn(model, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def contenders(model: nn.Module, x: torch.Tensor, world: int) -> dict[str, Callable[[], None]]:
    """Plain torch (``DistributedDataParallel`` at ``world`` > 1) and zfunc stages 0 and 2, each one
    micro-batch's forward and backward."""
    ref = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ref = DistributedDataParallel(copy.deepcopy(model), static_graph=model.checkpoint == "reentrant")

    def plain() -> None:
        loss_fn(ref, x).backward()
        ref.zero_grad(set_to_none=True)

    states = {stage: zfunc.init(model, zfunc.Config(stage=stage, grad_accum=1)) for stage in (0, 2)}

    def through(stage: int) -> Callable[[], None]:
        def run() -> None:
            zfunc.backward_step(states[stage], loss_fn, x)  # the input state is kept: same work each time
        return run

    return {"torch" if world == 1 else "torch DDP": plain, "zfunc stage 0": through(0), "zfunc stage 2": through(2)}


def timings(rank: int, kind: str, size: int, checkpoint: str | None, rounds: int,
            world: int) -> dict[str, list[float]]:
    """Seconds per round of each contender (on rank ``rank`` of a world of ``world``)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, shape = _model(kind, size, checkpoint)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(rank))
    runs = contenders(model, x, world)
    sync = torch.distributed.barrier if world > 1 else (lambda: None)
    for fn in runs.values():  # warm-up
        for _ in range(3):
            fn()
    # What lives now (torch, numba, the model, the states) is moved out of the collector's view:
    # a full collection scans it otherwise (~200 ms here), and it lands on whichever contender's
    # call happens to trigger it. The young collections each call causes stay in its time.
    gc.collect()
    gc.freeze()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            sync()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _cpu() -> str:
    """The CPU's model name and whether it has AVX-512 (torch's kernels, and so rounding and speed,
    differ with it)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name} ({'avx512f' if ' avx512f' in info else 'no avx512f'})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--model", choices=["experts", "blocks"], default="experts",
                    help="a bank of small experts (default), or a stack of small transformer blocks")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--checkpoint", choices=["reentrant", "nonreentrant"], default=None,
                    help="each expert under torch.utils.checkpoint, for every contender (torch's included)")
    ap.add_argument("--world", type=int, default=1, help="local gloo ranks (default 1: no process group)")
    args = ap.parse_args()
    size = args.experts if args.model == "experts" else args.blocks
    run_args = (args.model, size, args.checkpoint, args.rounds, args.world)
    per_rank = ([timings(0, *run_args)] if args.world == 1 else
                zfunc.launch(timings, world_size=args.world, threads=1, timeout=3600, args=run_args))
    rounds = {k: [max(r[k][i] for r in per_rank) for i in range(args.rounds)] for k in per_rank[0]}  # slowest rank
    base = next(iter(rounds))
    model = _model(args.model, size, None)[0]
    n_params = len(list(model.parameters()))
    print(f"# {_cpu()}, torch {torch.__version__}, {args.world} rank(s) x 1 thread, model {args.model}: "
          f"{n_params} parameter tensors, {sum(p.numel() for p in model.parameters())} elements, "
          f"{args.rounds} rounds, checkpointing: {args.checkpoint or 'none'}")
    print(f"{'contender':<16} {'median ms':>10} {'vs torch':>9} {'paired':>7}")
    for name, ts in rounds.items():
        med = statistics.median(ts)
        paired = statistics.median(t / b for t, b in zip(ts, rounds[base]))
        print(f"{name:<16} {med * 1e3:>10.2f} {med / statistics.median(rounds[base]):>8.2f}x {paired:>6.2f}x")


if __name__ == "__main__":
    main()
