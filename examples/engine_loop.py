"""A DeepSpeed training loop running on zfunc: only the import differs.

The ``train`` function below is ordinary DeepSpeed code: ``deepspeed.initialize``, ``engine(x)``,
``engine.backward(loss)``, ``engine.step()``. Here ``deepspeed`` is ``zfunc``. An MLP learns to
classify points labelled by a fixed random "teacher" network. Each rank draws its own batches.

    python examples/engine_loop.py                           # ZeRO-2, 2 local gloo ranks
    python examples/engine_loop.py --stage 3 --grad-accum 4
    torchrun --nproc-per-node 2 examples/engine_loop.py      # one rank per torchrun process
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import zfunc as deepspeed  # the only change: this line was `import deepspeed`
from zfunc import launch   # starts the local ranks in main(); not part of the DeepSpeed code


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="local gloo ranks (default 2)")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    p.add_argument("--grad-accum", type=int, default=2, help="gradient_accumulation_steps (default 2)")
    p.add_argument("--micro-batch", type=int, default=32, help="train_micro_batch_size_per_gpu (default 32)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--local_rank", type=int, default=-1, help="passed by the DeepSpeed launcher; unused")
    return p.parse_args(argv)


def batches(seed: int, n: int, size: int):
    """``n`` batches of 16-d points labelled by a fixed random teacher network (the same for every seed)."""
    t = torch.Generator().manual_seed(123)
    w1, w2 = torch.randn(16, 32, generator=t), torch.randn(32, 4, generator=t)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(size, 16, generator=g)
        yield x, (torch.tanh(x @ w1) @ w2).argmax(-1)


def train(rank: int, args: argparse.Namespace) -> dict[str, object]:
    torch.manual_seed(0)
    d = args.hidden
    model = nn.Sequential(nn.Linear(16, d), nn.GELU(), nn.Linear(d, d), nn.GELU(), nn.Linear(d, 4))
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 3e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 5,
            "total_num_steps": args.steps, "warmup_type": "linear"}},
        "zero_optimization": {"stage": args.stage},
    }
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config)

    def held_out() -> tuple[float, float]:
        """Loss and accuracy on 1024 held-out points (the same on every rank)."""
        engine.eval()
        with torch.no_grad():
            x, y = next(batches(99, 1, 1024))
            logits = engine(x)
        engine.train()
        return nn.functional.cross_entropy(logits, y).item(), (logits.argmax(-1) == y).float().mean().item()

    before = held_out()
    applied = 0
    for x, y in batches(1000 + rank, args.steps * args.grad_accum, args.micro_batch):
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        if engine.was_step_applied():         # True after the step that ends an accumulation
            applied += 1
            if rank == 0 and engine.global_steps % 10 == 0:
                print(f"step {engine.global_steps:3d} | loss {loss.item():.4f} | lr {engine.get_lr()[0]:.2e}"
                      f" | grad norm {engine.get_global_grad_norm():.3f}", flush=True)
    after = held_out()
    return {"rank": rank, "before": before, "after": after, "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps, "applied": applied, "skipped": engine.skipped_steps}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    # A fresh local world of gloo ranks; under torchrun, this process as one rank of its world.
    results = launch(train, world_size=args.world_size, args=(args,), timeout=600)
    if torch.distributed.is_initialized():  # under torchrun: leave the process group cleanly
        torch.distributed.destroy_process_group()
    for r in results:
        if r["rank"] != 0:
            continue
        (loss0, acc0), (loss1, acc1) = r["before"], r["after"]
        print(f"held-out loss {loss0:.3f} -> {loss1:.3f}, accuracy {acc0:.1%} -> {acc1:.1%}")
        assert r["global_steps"] == args.steps and r["micro_steps"] == args.steps * args.grad_accum, r
        assert r["applied"] == args.steps and r["skipped"] == 0, r
        print(f"check: {r['global_steps']} optimizer steps from {r['micro_steps']} micro-steps, none skipped")
        assert loss1 < loss0, r
        print("check: the held-out loss fell")


if __name__ == "__main__":
    main()
