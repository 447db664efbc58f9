"""A Hugging Face causal LM trained through zfunc's DeepSpeed-compatible shim.

The model is built from a small ``GPT2Config``. Nothing is downloaded: there are no pretrained
weights and no tokenizer, and the inputs are random token ids with a repeating pattern, so the
loss has something to learn. The Hugging Face model returns its ``ModelOutput`` untouched, and
``engine.backward(outputs.loss)`` works as it does with DeepSpeed. For Trainer, Accelerate and
Lightning, which call DeepSpeed themselves, see ``docs/huggingface.md`` (``zfunc.as_deepspeed``).
Without ``transformers`` installed, the script says so and exits 0.

    python examples/hf_causal_lm.py                         # ZeRO-2, one process
    python examples/hf_causal_lm.py --stage 3 --world-size 2 --steps 20
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

import zfunc


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=1, help="local gloo ranks (default 1)")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch per rank")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    return p.parse_args(argv)


def batch(step: int, rank: int, n: int, seq: int, vocab: int) -> torch.Tensor:
    """Random token ids, each sequence a random 4-token motif repeated (learnable in-context)."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    motif = torch.randint(0, vocab, (n, 4), generator=g)
    return motif.repeat(1, seq // 4 + 1)[:, :seq]


def train(rank: int, args: argparse.Namespace) -> dict[str, object]:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": args.stage},
    }
    engine, _, _, _ = zfunc.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    engine.train()
    losses = []
    for step in range(args.steps):
        ids = batch(step, rank, args.micro_batch, args.seq, config.vocab_size)
        outputs = engine(input_ids=ids, labels=ids)      # a transformers ModelOutput
        engine.backward(outputs.loss)
        engine.step()
        losses.append(outputs.loss.item())
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {engine.global_steps:3d} | loss {losses[-1]:.4f} | "
                  f"grad norm {engine.get_global_grad_norm():.3f}", flush=True)
    n = zfunc.memory_report(engine.state)["total"] / 2**20
    return {"rank": rank, "first": losses[0], "last": losses[-1], "mib": n,
            "params": engine.state.layout.numel, "steps": engine.global_steps}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if importlib.util.find_spec("transformers") is None:
        print("transformers is not installed: skipping this example (pip install transformers)")
        sys.exit(0)
    results = zfunc.launch(train, world_size=args.world_size, args=(args,), timeout=600)
    if torch.distributed.is_initialized():  # under torchrun: leave the process group cleanly
        torch.distributed.destroy_process_group()
    for r in results:
        if r["rank"] != 0:
            continue
        print(f"GPT-2 with {r['params']:,} parameters, ZeRO-{args.stage}: loss {r['first']:.3f} -> "
              f"{r['last']:.3f} in {r['steps']} steps; rank 0 holds {r['mib']:.2f} MiB of training state")
        assert r["steps"] == args.steps and r["last"] < r["first"], r
        print("check: the loss fell")


if __name__ == "__main__":
    main()
