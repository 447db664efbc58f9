"""Run by the elastic test under torchrun: train 6 steps, checkpoint every step; on the first
attempt rank 1 dies at step ``fail_at``; torchrun restarts both ranks, which resume."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import zfunc
from tests.helpers import MODELS, snapshot


def main() -> None:
    out, fail_at = sys.argv[1], int(sys.argv[2])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, f"attempt-{attempt}"), "w").close()
    torch.manual_seed(0)
    state = zfunc.init(MODELS["gpt"][0](), zfunc.Config(stage=2, optimizer=zfunc.adamw(lr=1e-2)))
    ckpt = os.path.join(out, "ckpt")
    if os.path.exists(os.path.join(ckpt, "COMPLETE")):
        state = zfunc.load(ckpt, like=state)
    for i in range(int(state.step.item()), 6):
        if i == fail_at and attempt == 0 and rank == 1:
            os._exit(1)
        state, _ = zfunc.backward_step(state, MODELS["gpt"][1], MODELS["gpt"][2](i, rank, 2), donate=True)
        state = zfunc.apply_step(state, donate=True)
        zfunc.save(state, ckpt)
    torch.save(snapshot(state), os.path.join(out, f"final-{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
