"""The functional loop on a local world of gloo ranks: ``state = step(state, batch)``.

A small character-level GPT (``zfunc.models``) learns CPython's help topics. Each rank reads its
own random windows of the text. The script checks that the loss falls and that every rank ends
with the same full weights.

    python examples/functional_loop.py                          # ZeRO-2 on 2 ranks, 40 steps
    python examples/functional_loop.py --stage 3 --grad-accum 2 --steps 20
    torchrun --nproc-per-node 2 examples/functional_loop.py     # the same under torchrun
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch

import zfunc
from zfunc.tools.metrics import MetricsLog, step_record
from zfunc.models import GPT, CharCorpus, GPTConfig, lm_loss


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="local gloo ranks (default 2)")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch per rank")
    p.add_argument("--block", type=int, default=32, help="context length in characters")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def fingerprint(params: dict[str, torch.Tensor]) -> str:
    """A hash of the full weights, to compare across ranks."""
    h = hashlib.sha256()
    for name, t in params.items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def train(rank: int, args: argparse.Namespace) -> dict[str, object]:
    corpus = CharCorpus.python_docs(max_chars=200_000)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=args.block, n_layer=args.layers,
                          n_head=4, d_model=args.d_model))
    cfg = zfunc.Config(
        stage=args.stage, grad_accum=args.grad_accum, clip=1.0,
        optimizer=zfunc.adamw(lr=args.lr, weight_decay=0.1),
        lr_schedule=zfunc.schedules.warmup_cosine_lr(args.steps, lr=args.lr, warmup_min_ratio=0.1,
                                                     warmup_num_steps=max(1, args.steps // 10),
                                                     cos_min_ratio=0.1, warmup_type="linear"))
    state = zfunc.init(model, cfg)            # rank 0's weights, this rank's shards
    world = state.group.size
    if rank == 0:
        mib = zfunc.memory_report(state)["total"] / 2**20
        print(f"GPT with {state.layout.numel:,} parameters, ZeRO-{args.stage}, {world} ranks: "
              f"rank 0 holds {mib:.2f} MiB of training state", flush=True)

    step = zfunc.train_step(lm_loss)          # (state, batch) -> state; donates its input
    start = time.perf_counter()
    losses = []
    with MetricsLog(None, rank=rank, total=args.steps) as log:
        for i in range(args.steps):
            batch = corpus.batch(args.micro_batch * args.grad_accum, args.block, seed=0, step=i, rank=rank)
            state = step(state, batch)
            rec = step_record(state)          # plain numbers (reading them syncs with the device)
            losses.append(rec["loss"])
            if i % max(1, args.steps // 8) == 0 or i == args.steps - 1:
                log.write({"step": rec["step"], "loss": round(rec["loss"], 4),
                           "grad_norm": round(rec["grad_norm"], 4), "lr": round(rec["lr"], 6)})
    seconds = time.perf_counter() - start
    weights = zfunc.comm.all_gather_object(fingerprint(zfunc.full_params(state)), state.group)
    return {"rank": rank, "world": world, "first": losses[0], "last": losses[-1], "seconds": seconds,
            "weights": weights, "steps": int(state.step.item())}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    # A fresh local world of gloo ranks; under torchrun, this process as one rank of its world.
    results = zfunc.launch(train, world_size=args.world_size, args=(args,), timeout=600)
    if torch.distributed.is_initialized():  # under torchrun: leave the process group cleanly
        torch.distributed.destroy_process_group()
    for r in results:
        if r["rank"] != 0:
            continue
        print(f"loss {r['first']:.3f} -> {r['last']:.3f} in {r['steps']} steps, {r['seconds']:.1f} s")
        assert r["last"] < r["first"], "the loss did not fall"
        print("check: the loss fell")
        assert len(set(r["weights"])) == 1, r["weights"]
        print(f"check: all {r['world']} ranks hold the same full weights ({r['weights'][0]})")


if __name__ == "__main__":
    main()
