"""What the client scripts share: the data, the tiny GPT-2, what a comparison keeps of a saved
tensor, the CPU accommodation DeepSpeed needs under Accelerate, and the loop over cases."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

MICRO, SEQ, VOCAB = 4, 16, 64


def dataset() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(4 * MICRO * 2 * 2 * 2):  # enough for 4 steps of gas 2 at world 2, twice over
        motif = torch.randint(0, VOCAB, (4,), generator=g)
        ids = motif.repeat(SEQ // 4)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def model(build: str = "", out: str = ""):
    """The tiny GPT-2: built directly, or by ``from_config``, or ``from_pretrained`` of a
    checkpoint of another seed's model saved by rank 0 under ``out``."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if build == "pretrained":
        path = os.path.join(out, "pretrained")
        if int(os.environ.get("RANK", 0)) == 0:
            torch.manual_seed(7)
            GPT2LMHeadModel(cfg).save_pretrained(path)
        torch.distributed.barrier()
        return AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg) if build == "fromconfig" else GPT2LMHeadModel(cfg)


def saved_tensor(v: torch.Tensor) -> list[float]:
    """What the comparison keeps of a saved tensor: its first 64 elements and its sum."""
    return v.float().flatten()[:64].tolist() + [float(v.float().sum())]


def accommodate_cpu_backend() -> None:
    """DeepSpeed's run on a CPU machine under Accelerate: a gloo backend (see the docstring)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    prepare = PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        found = prepare(self, cpu, sagemaker_dp, backend)
        if found[0] is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" \
                and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return found

    PartialState._prepare_backend = _prepare_backend


def drive(run_case: Callable[[str, str], dict], argv: list[str] | None = None, init_group: bool = True) -> None:
    """Run the cases named on the command line in one world; rank 0 writes ``<out>/<case>.json``.
    ``init_group``: start the default process group first (the scripts' own barriers need it;
    Lightning's strategy starts it itself)."""
    p = argparse.ArgumentParser()
    p.add_argument("cases", nargs="+")
    p.add_argument("--out", required=True, help="directory for <case>.json")
    p.add_argument("--work", help="directory for the runs' files (checkpoints, saved models); default <out>/runs")
    p.add_argument("--reference", action="store_true", help="DeepSpeed itself: accommodate its CPU run")
    a = p.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if a.reference:
        accommodate_cpu_backend()
    torch.set_num_threads(1)
    if init_group and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    for name in a.cases:
        result = run_case(name, a.work or os.path.join(a.out, "runs"))
        if int(os.environ.get("RANK", 0)) == 0:
            with open(os.path.join(a.out, f"{name}.json"), "w") as f:
                json.dump(result, f)
            print(f"{name}: {[round(e['loss'], 5) for e in result['logs']]}", file=sys.stderr)
