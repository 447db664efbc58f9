"""One Accelerate training loop (its own, no Trainer), run unchanged on DeepSpeed 0.19.8 and on zfunc.

``accelerator.accumulate``, ``accelerator.backward``, ``clip_grad_norm_`` (which, under DeepSpeed,
returns the engine's norm), a torch ``AdamW`` and ``LambdaLR`` handed to ``prepare``,
``save_state`` after half the steps, then ``load_state`` into a fresh Accelerator that runs the
second half again; ``unwrap_model`` names and ``get_state_dict`` at the end. Rank 0 writes, per
case, the per-step loss, grad norm and lr of the straight run and of the resumed half, and the
weights ``get_state_dict`` returned and the unwrapped module's parameter names.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv-ds/bin/torchrun --nproc-per-node 2 \\
        tests/hf/accelerate_run.py --reference --out tests/fixtures/hf acc_z2_fp32_gas2 ...
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m zfunc.compat.as_deepspeed \\
        tests/hf/accelerate_run.py --out /tmp/zf acc_z2_fp32_gas2 ...

A case name is ``acc_z<stage>_<fp32|bf16>_gas<n>[_frozen][_gc|_gcr]``: ``_frozen`` trains the
transformer blocks alone; ``_gc`` turns on the model's ``gradient_checkpointing_enable``
(non-reentrant), ``_gcr`` with ``use_reentrant=True``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import MICRO, dataset, drive, model, saved_tensor  # noqa: E402

STEPS = 4


def parse_case(name: str) -> dict:
    m = re.fullmatch(r"acc_z([123])_(fp32|bf16)_gas(\d)(_frozen)?(_gcr?)?", name)
    if m is None:
        raise SystemExit(f"bad case name {name!r}")
    return {"stage": int(m[1]), "precision": m[2], "gas": int(m[3]), "frozen": bool(m[4]),
            "checkpointing": (m[5] or "")[1:]}


def accelerator(case: dict):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    ds = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": case["gas"],
          "gradient_clipping": 1.0, "zero_optimization": {"stage": case["stage"]},
          "bf16": {"enabled": case["precision"] == "bf16"}}
    if case["stage"] == 3:
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds), gradient_accumulation_steps=case["gas"])


def prepared(case: dict):
    acc = accelerator(case)
    m = model()
    if case["frozen"]:  # the transformer blocks alone trained
        for name, p in m.named_parameters():
            p.requires_grad_(name.startswith("transformer.h."))
    if case["checkpointing"]:
        m.gradient_checkpointing_enable({"use_reentrant": case["checkpointing"] == "gcr"})
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    loader = torch.utils.data.DataLoader(dataset(), batch_size=MICRO, shuffle=False)
    m, opt, loader, sched = acc.prepare(m, opt, loader, sched)
    return acc, m, opt, loader, sched


def train(acc, m, opt, loader, sched, first: int, last: int, gas: int) -> list[dict]:
    """Optimizer steps ``first`` up to ``last`` (exclusive), reading the micro-batches they take."""
    logs, losses = [], []
    batches = iter(loader)
    for _ in range(first * gas):
        next(batches)
    m.train()
    for step in range(first, last):
        for _ in range(gas):
            batch = next(batches)
            with acc.accumulate(m):
                loss = m(**batch).loss
                losses.append(loss.detach().float())
                acc.backward(loss)
                norm = acc.clip_grad_norm_(m.parameters(), 1.0) if acc.sync_gradients else None
                opt.step()
                sched.step()
                opt.zero_grad()
        logs.append({"step": step + 1, "loss": float(torch.stack(losses).mean()), "grad_norm": float(norm),
                     "learning_rate": sched.get_last_lr()[0]})
        losses = []
    return logs


def run_case(name: str, work: str) -> dict:
    from accelerate.state import AcceleratorState

    case = parse_case(name)
    out = os.path.join(work, name)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if rank0:
        shutil.rmtree(out, ignore_errors=True)
    acc, m, opt, loader, sched = prepared(case)
    straight = train(acc, m, opt, loader, sched, 0, STEPS // 2, case["gas"])
    acc.save_state(os.path.join(out, "half"))
    straight += train(acc, m, opt, loader, sched, STEPS // 2, STEPS, case["gas"])
    names = sorted(n for n, _ in acc.unwrap_model(m).named_parameters())
    weights = acc.get_state_dict(m)
    result = {"logs": straight, "unwrapped_names": names}
    if rank0:
        result["weights"] = {k: saved_tensor(v) for k, v in sorted(weights.items())}
    del acc, m, opt, loader, sched
    AcceleratorState._reset_state(reset_partial_state=False)

    acc, m, opt, loader, sched = prepared(case)
    acc.load_state(os.path.join(out, "half"))
    result["resumed"] = train(acc, m, opt, loader, sched, STEPS // 2, STEPS, case["gas"])
    weights = acc.get_state_dict(m)
    if rank0:
        result["resumed_weights"] = {k: saved_tensor(v) for k, v in sorted(weights.items())}
    del acc, m, opt, loader, sched
    AcceleratorState._reset_state(reset_partial_state=False)
    return result


if __name__ == "__main__":
    drive(run_case)
