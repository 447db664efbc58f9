"""One Hugging Face ``Trainer`` script, run unchanged on DeepSpeed 0.19.8 and on zfunc.

Each rank of a ``torchrun`` world runs the cases named on the command line in turn and rank 0
writes, per case, what a user reads: the per-step ``loss``, ``grad_norm`` and ``learning_rate``
Trainer logs, and the weights ``trainer.save_model`` wrote (by name).

    # DeepSpeed (its venv, see DEVELOPERS.md): the reference numbers
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv-ds/bin/torchrun --nproc-per-node 2 \\
        tests/hf/trainer_run.py --reference --out tests/fixtures/hf z1_fp32_gas2 ...
    # zfunc: the same script, through the switch
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m zfunc.compat.as_deepspeed \\
        tests/hf/trainer_run.py --out /tmp/zf z1_fp32_gas2 ...

A case name is ``z<stage>_<fp32|bf16>_gas<n>[_sgd][_resume][_fromconfig|_pretrained][_frozen][_gc|_gcr]``: ``_sgd``
trains with Trainer's own optimizer (``torch.optim.SGD``, no clipping, no DeepSpeed ``optimizer``
block); ``_resume`` stops at half the steps with a ``save_steps`` checkpoint and resumes from it
in a fresh Trainer; ``_fromconfig`` builds the model with ``AutoModelForCausalLM.from_config`` and
``_pretrained`` with ``from_pretrained`` of a checkpoint rank 0 saves first, both after the
``TrainingArguments`` (so under Transformers' ZeRO-3 model building at stage 3). ``_frozen``
trains the transformer blocks alone (embeddings and the final norm frozen, as adapters leave a
model); ``_gc`` turns on ``activation_checkpointing`` (Transformers' default, non-reentrant, with
the input embeddings made to require grad), ``_gcr`` the same with ``use_reentrant=True``: with
``_frozen``, every trained parameter is inside a reentrant segment.

``--reference`` applies the one accommodation DeepSpeed needs on a CPU machine under Accelerate
1.15 (with DeepSpeed on and no GPU, ``PartialState`` finds no backend and sets one process): it
gives such a run gloo, as ``zfunc.as_deepspeed`` does.
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
    m = re.fullmatch(r"z([123])_(fp32|bf16)_gas(\d)((?:_sgd|_resume)*)(_fromconfig|_pretrained)?(_frozen)?(_gcr?)?", name)
    if m is None:
        raise SystemExit(f"bad case name {name!r}")
    return {"stage": int(m[1]), "precision": m[2], "gas": int(m[3]), "sgd": "_sgd" in m[4],
            "resume": "_resume" in m[4], "build": (m[5] or "")[1:], "frozen": bool(m[6]),
            "checkpointing": (m[7] or "")[1:]}


def ds_config(case: dict) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_optimization": {"stage": case["stage"]},
        "bf16": {"enabled": "auto"},
    }
    if case["stage"] == 3:
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if not case["sgd"]:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto"}}
    return cfg


def trainer(case: dict, out: str, steps: int):
    import transformers.training_args
    from transformers import Trainer, TrainingArguments

    # TrainingArguments refuses bf16 on a machine without a GPU (it asks for use_cpu, which turns
    # DeepSpeed off); this CPU run answers its probe as a bf16 GPU machine would.
    transformers.training_args.is_torch_bf16_gpu_available = lambda: True
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=case["gas"],
        max_steps=steps, learning_rate=3e-3, weight_decay=0.01, warmup_steps=2, max_grad_norm=1.0,
        logging_steps=1, save_strategy="steps" if case["resume"] else "no", save_steps=STEPS // 2,
        report_to=[], seed=42, data_seed=42, dataloader_num_workers=0, disable_tqdm=True,
        bf16=case["precision"] == "bf16", deepspeed=ds_config(case),
        activation_checkpointing=bool(case["checkpointing"]),
        activation_checkpointing_kwargs={"use_reentrant": True} if case["checkpointing"] == "gcr" else None)
    m = model(case["build"], out)
    if case["frozen"]:
        for name, p in m.named_parameters():
            p.requires_grad_(name.startswith("transformer.h."))
    kwargs = {}
    if case["sgd"]:
        opt = torch.optim.SGD(m.parameters(), lr=3e-2)
        kwargs["optimizers"] = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
        args.max_grad_norm = 0.0
    return Trainer(model=m, args=args, train_dataset=dataset(), **kwargs)


def logs(tr) -> list[dict]:
    keep = ("step", "loss", "grad_norm", "learning_rate")
    return [{k: e[k] for k in keep if k in e} for e in tr.state.log_history if "loss" in e]


def saved_weights(path: str) -> dict[str, list]:
    from safetensors.torch import load_file

    f = os.path.join(path, "model.safetensors")
    sd = load_file(f) if os.path.exists(f) else torch.load(os.path.join(path, "pytorch_model.bin"))
    return {k: saved_tensor(v) for k, v in sorted(sd.items())}


def run_case(name: str, work: str) -> dict:
    from accelerate.state import AcceleratorState

    case = parse_case(name)
    out = os.path.join(work, name)
    if int(os.environ.get("RANK", 0)) == 0:
        shutil.rmtree(out, ignore_errors=True)
    torch.distributed.barrier()
    if case["resume"]:
        first = trainer(case, out, STEPS)
        first.add_callback(stop_at(STEPS // 2))  # the whole run's schedule, stopped after the checkpoint
        first.train()
        del first
        AcceleratorState._reset_state(reset_partial_state=False)
        tr = trainer(case, out, STEPS)
        tr.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{STEPS // 2}"))
    else:
        tr = trainer(case, out, STEPS)
        tr.train()
    tr.save_model(os.path.join(out, "final"))
    torch.distributed.barrier()
    result = {"logs": logs(tr)}
    if int(os.environ.get("RANK", 0)) == 0:
        result["weights"] = saved_weights(os.path.join(out, "final"))
    AcceleratorState._reset_state(reset_partial_state=False)
    return result


def stop_at(step: int):
    """A Trainer callback that ends training after ``step`` (the checkpoint written there)."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= step
            return control

    return StopAt()


if __name__ == "__main__":
    drive(run_case)
