"""Online RL with weight sync: a policy trained at ZeRO-3, its weights pushed every k steps into a
generation model in another process, which samples rollouts the policy then trains on.

Three processes (one gloo world): ranks 0 and 1 train the policy (`zfunc.init` over
``Group.of_ranks([0, 1])``, stage 3); rank 2 is the generator, a plain torch copy of the same
model. Every ``--sync-every`` steps:

1. the trainers iterate ``zfunc.iter_full_params(state, dst=0)`` together: one unit is gathered to
   rank 0 at a time (rank 1 takes part and receives nothing), and rank 0 sends each tensor to the
   generator over a group of the two of them, which receives it straight into its parameter, so
   neither side holds a second copy of the model;
2. the generator samples rollouts, scores them (the toy reward: the share of even tokens) and
   sends tokens and rewards to both trainers;
3. each trainer takes its half and runs a REINFORCE step (advantage = reward - mean reward) with
   `zfunc.train_step`.

The script checks that after every sync the generator holds the trainer's weights bitwise, and
that the mean reward rose.

    python examples/rl_weight_sync.py
    python examples/rl_weight_sync.py --steps 30 --sync-every 2
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zfunc
from zfunc.comm import Group
from zfunc.models import GPT, GPTConfig
from zfunc.models.gpt import Block

TRAINERS, GENERATOR = [0, 1], 2
SHAPE = GPTConfig(vocab_size=16, block_size=16, n_layer=2, n_head=2, d_model=32)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=24, help="policy optimizer steps (default 24)")
    p.add_argument("--sync-every", type=int, default=1, help="steps between weight pushes (default 1)")
    p.add_argument("--rollouts", type=int, default=32, help="sequences sampled per sync (default 32)")
    p.add_argument("--length", type=int, default=12, help="tokens generated per rollout (default 12)")
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def reward(tokens: torch.Tensor) -> torch.Tensor:
    """The toy task: the share of even tokens in each generated sequence."""
    return (tokens % 2 == 0).float().mean(dim=1)


@torch.no_grad()
def sample(model: torch.nn.Module, n: int, length: int, g: torch.Generator) -> torch.Tensor:
    """``n`` sequences of ``length`` tokens after a start token 0 (``(n, length + 1)``)."""
    seq = torch.zeros(n, 1, dtype=torch.long)
    for _ in range(length):
        probs = F.softmax(model(seq)[:, -1], dim=-1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=g)], dim=1)
    return seq


def pg_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """REINFORCE: minus the advantage-weighted log-probability of each generated sequence."""
    logp = F.log_softmax(model(batch["tokens"][:, :-1]), dim=-1)
    taken = logp.gather(-1, batch["tokens"][:, 1:, None]).squeeze(-1).sum(dim=1)
    return -(batch["advantage"] * taken).mean()


def push(state: zfunc.TrainState, rank: int, sync: Group) -> int:
    """Trainer side of a weight push; returns the tensors sent (on rank 0; 0 on rank 1)."""
    sent = 0
    for name, t in zfunc.iter_full_params(state, dst=0):  # rank 1 iterates too, receiving nothing
        dist.broadcast_object_list([name], src=0, group=sync.pg)
        dist.broadcast(t, src=0, group=sync.pg)
        sent += 1
    if rank == 0:
        dist.broadcast_object_list([None], src=0, group=sync.pg)  # the end of this push
    return sent


def receive(model: torch.nn.Module, sync: Group) -> int:
    """Generator side: each tensor lands in the parameter of that name."""
    params, got = dict(model.named_parameters()), 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=sync.pg)
        if box[0] is None:
            return got
        dist.broadcast(params[box[0]].data, src=0, group=sync.pg)
        got += 1


def run(rank: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    trainers = Group.of_ranks(TRAINERS)  # every rank takes part in making each group
    sync = Group.of_ranks([0, GENERATOR])
    n, length = args.rollouts, args.length
    tokens = torch.zeros(n, length + 1, dtype=torch.long)
    rewards = torch.zeros(n)
    history, checks = [], []
    if rank == GENERATOR:
        model = GPT(SHAPE).requires_grad_(False).eval()
        g = torch.Generator().manual_seed(1)
    else:
        cfg = zfunc.Config(stage=3, units=[Block], clip=1.0, persist_threshold=0,
                           optimizer=zfunc.adamw(lr=args.lr, weight_decay=0.0))
        state = zfunc.init(GPT(SHAPE), cfg, group=trainers)
        step = zfunc.train_step(pg_loss)
    for i in range(args.steps):
        if i % args.sync_every == 0:
            if rank == GENERATOR:
                receive(model, sync)
                # what the trainer holds now, to check the push against (sent on the world group)
                for p in model.parameters():
                    theirs = p.clone()
                    dist.broadcast(theirs, src=0)
                    checks.append(torch.equal(theirs, p))
                tokens = sample(model, n, length, g)
                rewards = reward(tokens[:, 1:])
            else:
                push(state, rank, sync)
                full = zfunc.full_params(state)
                for name, _ in state.module.named_parameters():
                    dist.broadcast(full[name].clone(), src=0)
        dist.broadcast(tokens, src=GENERATOR)
        dist.broadcast(rewards, src=GENERATOR)
        history.append(rewards.mean().item())
        if rank == 0:
            print(f"step {i:3d}  mean reward {history[-1]:.3f}", flush=True)
        if rank != GENERATOR:
            half = slice(rank * n // 2, (rank + 1) * n // 2)
            batch = {"tokens": tokens[half], "advantage": (rewards - rewards.mean())[half]}
            state = step(state, batch)
    return {"rewards": history, "checks": checks}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    results = zfunc.launch(run, world_size=3, args=(args,))
    rewards, checks = results[0]["rewards"], results[GENERATOR]["checks"]
    assert checks and all(checks), "the generator's weights differ from the trainer's after a push"
    print(f"check: after each of {args.steps // args.sync_every + (args.steps % args.sync_every > 0)} pushes "
          "the generator held the trainer's weights bitwise")
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first, f"the mean reward did not rise: {first:.3f} -> {last:.3f}"
    print(f"check: the mean reward rose from {first:.3f} to {last:.3f}")


if __name__ == "__main__":
    main()
