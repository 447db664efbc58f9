"""Disaggregated training: an encoder on rank 0 and a language model on rank 1, joined by zfunc.vjp.

Each model has its own ZeRO state on its own process group (``Group.of_ranks([0])`` and
``Group.of_ranks([1])``). Per step:

1. rank 0 runs the encoder forward (``zfunc.vjp``) and sends the activations to rank 1;
2. rank 1 runs the language model forward and backward (``zfunc.vjp`` with ``argnums=(0,)``) and
   sends the cotangent of the activations, a non-scalar tensor, back to rank 0;
3. rank 0 calls the encoder's pullback with that cotangent;
4. each rank applies its optimizer step (``zfunc.apply_step``) on its own group.

At the end, every rank trains both models jointly in one process (one backward, one
``torch.optim.AdamW``) on the same data. The script prints the largest parameter difference
from that reference, which should be about 1e-7.

    python examples/two_models_vjp.py
    python examples/two_models_vjp.py --steps 20 --encoder-stage 3 --lm-stage 2
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import zfunc
from zfunc.comm import Group

ENCODER, LM = 0, 1  # the rank each model trains on


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--batch", type=int, default=16, help="images per step (default 16)")
    p.add_argument("--width", type=int, default=64, help="hidden width of both models (default 64)")
    p.add_argument("--encoder-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--lm-stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--lr", type=float, default=1e-2)
    return p.parse_args(argv)


class Encoder(nn.Module):
    """A stand-in vision encoder: 8x8 one-channel images -> 4 tokens of width ``d``."""

    def __init__(self, d: int):
        super().__init__()
        self.patch = nn.Linear(16, d)  # 4 patches of 4x4 pixels
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = images.unfold(1, 4, 4).unfold(2, 4, 4).reshape(images.shape[0], 4, 16)
        h = self.patch(patches)
        return h + self.mlp(h)


class LanguageModel(nn.Module):
    """A stand-in language model reading the image tokens and predicting one label per image."""

    def __init__(self, d: int, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            tokens = tokens + block(tokens)
        return self.head(tokens.mean(1))


def make_models(d: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return Encoder(d), LanguageModel(d)


def data(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s images and labels (both ranks can draw them; each uses its half)."""
    g = torch.Generator().manual_seed(step)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 8, 8, generator=g) + labels[:, None, None] / 5
    return images, labels


def lm_loss(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens), labels)


def train(rank: int, args: argparse.Namespace) -> list[dict[str, object]]:
    assert dist.get_world_size() == 2, "run on a world of exactly 2 ranks"
    # Every rank creates both groups, in the same order (new_group is collective).
    groups = {ENCODER: Group.of_ranks([ENCODER]), LM: Group.of_ranks([LM])}
    encoder, lm = make_models(args.width)
    opt = zfunc.adamw(lr=args.lr)
    if rank == ENCODER:
        cfg = zfunc.Config(stage=args.encoder_stage, optimizer=opt)
        state = zfunc.init(encoder, cfg, group=groups[ENCODER])
    else:
        cfg = zfunc.Config(stage=args.lm_stage, optimizer=opt)
        state = zfunc.init(lm, cfg, group=groups[LM])
    shape = (args.batch, 4, args.width)  # the activations that cross between the ranks
    losses = []
    for step in range(args.steps):
        images, labels = data(step, args.batch)
        if rank == ENCODER:
            h, pullback = zfunc.vjp(state, lambda model, x: model(x), images)
            dist.send(h.contiguous(), dst=LM)
            dh = torch.empty(shape)
            dist.recv(dh, src=LM)                              # d loss / d activations
            state = pullback(dh)
        else:
            h = torch.empty(shape)
            dist.recv(h, src=ENCODER)
            loss, pullback = zfunc.vjp(state, lm_loss, h, labels, argnums=(0,))
            state, (dh,) = pullback(torch.ones(()))
            dist.send(dh.contiguous(), dst=ENCODER)
            losses.append(loss.item())
            if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
                print(f"step {step + 1:3d} | loss {loss.item():.4f} | |dh| {dh.norm().item():.4f}",
                      flush=True)
        state = zfunc.apply_step(state)
    trained = zfunc.full_params(state)

    # The reference: both models in one process, one backward through both, one AdamW.
    ref_encoder, ref_lm = make_models(args.width)
    ref_opt = torch.optim.AdamW([*ref_encoder.parameters(), *ref_lm.parameters()], lr=args.lr)
    for step in range(args.steps):
        images, labels = data(step, args.batch)
        ref_opt.zero_grad()
        lm_loss(ref_lm, ref_encoder(images), labels).backward()
        ref_opt.step()
    reference = ref_encoder if rank == ENCODER else ref_lm
    diff = max((trained[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    mine = {"rank": rank, "diff": diff, "first": losses[0] if losses else None,
            "last": losses[-1] if losses else None}
    return zfunc.comm.all_gather_object(mine, zfunc.comm.world())  # both ranks' results, on both


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    # A fresh local world of 2 gloo ranks (under torchrun with 2 processes: that world).
    results = zfunc.launch(train, world_size=2, args=(args,), timeout=600)[0]
    if dist.is_initialized():  # under torchrun: leave the process group cleanly; rank 0 reports
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return
    by_rank = {r["rank"]: r for r in results}
    lm = by_rank[LM]
    print(f"language-model loss {lm['first']:.3f} -> {lm['last']:.3f}")
    for rank, name in ((ENCODER, "encoder"), (LM, "language model")):
        print(f"max parameter difference from the joint reference, {name} (rank {rank}): "
              f"{by_rank[rank]['diff']:.1e}")
    worst = max(r["diff"] for r in results)
    assert worst < 1e-5, worst
    print(f"check: both models match one joint backward and AdamW step (max difference {worst:.1e} < 1e-5)")


if __name__ == "__main__":
    main()
