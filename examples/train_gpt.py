"""The main job: a character-level GPT trained with zfunc on a local world of gloo ranks.

The text is CPython's own help topics (``pydoc_data``), so nothing is downloaded. Every rank
reads its own random windows; the functional loop is ``state = step(state, batch)``.

    python examples/train_gpt.py                      # ZeRO-2, 2 ranks, 300 steps
    python examples/train_gpt.py --stage 1 --world-size 3 --grad-accum 2 --steps 50

Under ``torchrun`` the script is one rank of that world instead of starting its own.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.func import functional_call

import zfunc
from zfunc.tools.metrics import MetricsLog, peak_memory_mib, plot_run, step_record
from zfunc.models import GPT, CharCorpus, GPTConfig, lm_loss
from zfunc.core.train import split_micro_batches


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


HEADS = 4  # attention heads of the model: --d-model must be a multiple


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    p.add_argument("--world-size", type=_positive, default=2, help="local gloo ranks (default 2)")
    p.add_argument("--steps", type=_positive, default=300, help="optimizer steps (default 300)")
    p.add_argument("--grad-accum", type=_positive, default=1, help="micro-batches per step (default 1)")
    p.add_argument("--micro-batch", type=_positive, default=16, help="sequences per micro-batch per rank")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--layers", type=_positive, default=4)
    p.add_argument("--d-model", type=_positive, default=192, help=f"model width, a multiple of {HEADS}")
    p.add_argument("--block", type=_positive, default=64, help="context length in characters")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=_positive, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/gpt", help="directory for metrics.jsonl and metrics.png")
    args = p.parse_args(argv)
    if args.d_model % HEADS:
        p.error(f"argument --d-model: expected a multiple of {HEADS} (the attention heads), got {args.d_model}")
    return args


def generate(state: zfunc.TrainState, corpus: CharCorpus, prompt: str, n: int) -> str:
    """Greedy continuation of ``prompt`` with the state's full weights (call on every rank)."""
    params = zfunc.full_params(state)
    block = state.module.cfg.block_size
    idx = torch.tensor([[corpus.chars.index(c) for c in prompt if c in corpus.chars]])
    with torch.no_grad():
        for _ in range(n):
            logits = functional_call(state.module, params, (idx[:, -block:],), tie_weights=True)
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return corpus.decode(idx[0])


def train(rank: int, args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    corpus = CharCorpus.python_docs()
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=args.block, n_layer=args.layers,
                          n_head=HEADS, d_model=args.d_model))
    loss_scale = zfunc.DynamicLossScale() if args.precision == "fp16" else None
    cfg = zfunc.Config(stage=args.stage, precision=args.precision, grad_accum=args.grad_accum, clip=1.0,
                       optimizer=zfunc.adamw(lr=args.lr, weight_decay=0.1), loss_scale=loss_scale,
                       lr_schedule=zfunc.schedules.warmup_cosine_lr(
                           args.steps, lr=args.lr, warmup_num_steps=max(1, args.steps // 10),
                           warmup_min_ratio=0.1, cos_min_ratio=0.1, warmup_type="linear"))
    state = zfunc.init(model, cfg)
    world = state.group.size
    tokens_per_step = world * args.grad_accum * args.micro_batch * args.block
    if rank == 0:
        n = state.layout.numel
        rep = zfunc.memory_report(state)
        print(f"zfunc GPT: {n / 1e6:.2f}M parameters, ZeRO-{args.stage}, {args.precision}, "
              f"{world} rank{'s' if world > 1 else ''}, "
              f"{tokens_per_step} tokens/step; rank 0 holds {rep['total'] / 2**20:.1f} MiB of model state "
              f"(params {rep['params'] / 2**20:.1f}, grads {rep['grads'] / 2**20:.1f}, "
              f"optimizer {rep['optimizer'] / 2**20:.1f})", flush=True)
    log = MetricsLog(os.path.join(args.out, "metrics.jsonl"), rank=rank, total=args.steps,
                     tensorboard=os.path.join(args.out, "tb"))
    first = last = None
    start = time.perf_counter()
    for i in range(args.steps):
        t0 = time.perf_counter()
        batch = corpus.batch(args.micro_batch * args.grad_accum, args.block, seed=args.seed, step=i, rank=rank)
        for micro in split_micro_batches(batch, args.grad_accum):  # what zfunc.train_step does, timed
            state, _ = zfunc.backward_step(state, lm_loss, micro, donate=True)
        t1 = time.perf_counter()
        state = zfunc.apply_step(state, donate=True)
        rec = step_record(state)  # reads the device scalars: the step is done here
        t2 = time.perf_counter()
        rec.update(tokens_per_s=round(tokens_per_step / (t2 - t0)), fwd_bwd_ms=round(1e3 * (t1 - t0), 1),
                   step_ms=round(1e3 * (t2 - t1), 1), peak_mib=round(peak_memory_mib(state.device)))
        log.write(rec)
        first = rec["loss"] if first is None else first
        last = rec["loss"]
    elapsed = time.perf_counter() - start
    log.close()
    sample = generate(state, corpus, "The ", 60)
    summary = {"first_loss": first, "final_loss": last, "seconds": elapsed,
               "tokens_per_s": tokens_per_step * args.steps / elapsed,
               "skipped": int(state.scaler.skipped.item())}
    if rank == 0:
        png = plot_run(os.path.join(args.out, "metrics.jsonl"), os.path.join(args.out, "metrics.png"))
        print(f"\ndone: {args.steps} steps in {elapsed:.1f} s, loss {first:.3f} -> {last:.3f}, "
              f"{summary['tokens_per_s']:.0f} tokens/s, {summary['skipped']} skipped "
              f"step{'' if summary['skipped'] == 1 else 's'}")
        print(f"sample: {sample!r}")
        print(f"metrics: {os.path.join(args.out, 'metrics.jsonl')}, plot: {png}")
    return summary


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    zfunc.launch(train, world_size=args.world_size, args=(args,), threads=args.threads, timeout=3600)


if __name__ == "__main__":
    main()
