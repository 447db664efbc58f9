"""The runs `tests/test_huggingface.py` compares, by script; ``python tests/hf/cases.py`` (in
DeepSpeed's venv, see DEVELOPERS.md) makes their reference numbers with DeepSpeed 0.19.8:

    DS_ACCELERATOR=cpu .venv-ds/bin/python tests/hf/cases.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

TRAINER_FP32 = ["z1_fp32_gas1", "z1_fp32_gas2", "z2_fp32_gas1", "z2_fp32_gas2", "z3_fp32_gas1", "z3_fp32_gas2",
                "z2_fp32_gas2_sgd", "z2_fp32_gas2_resume", "z3_fp32_gas2_resume",
                # Transformers' stage-3 model building (zero.Init, then GatheredParameters before any engine)
                "z3_fp32_gas2_fromconfig", "z3_fp32_gas2_pretrained", "z2_fp32_gas2_fromconfig",
                # activation checkpointing, non-reentrant and reentrant; the blocks alone trained
                "z2_fp32_gas2_gc", "z2_fp32_gas2_gcr", "z3_fp32_gas2_gc", "z3_fp32_gas2_gcr",
                "z2_fp32_gas2_frozen_gcr", "z3_fp32_gas2_frozen_gcr"]
TRAINER_BF16 = ["z1_bf16_gas2", "z2_bf16_gas2", "z3_bf16_gas1", "z3_bf16_gas2", "z3_bf16_gas2_pretrained",
                "z3_bf16_gas2_frozen_gcr"]
ACCELERATE = ["acc_z1_fp32_gas2", "acc_z2_fp32_gas1", "acc_z2_fp32_gas2", "acc_z3_fp32_gas2", "acc_z2_bf16_gas2",
              "acc_z3_bf16_gas2", "acc_z3_fp32_gas2_frozen_gcr"]
LIGHTNING = ["pl_z1_fp32_gas2", "pl_z2_fp32_gas1", "pl_z2_fp32_gas2", "pl_z3_fp32_gas2"]
RUNS = {"trainer_run.py": TRAINER_FP32 + TRAINER_BF16, "accelerate_run.py": ACCELERATE,
        "lightning_run.py": LIGHTNING}

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(here, "..", "fixtures", "hf")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    with tempfile.TemporaryDirectory() as work:
        for script, cases in RUNS.items():
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            os.path.join(here, script), "--reference", "--out", out, "--work", work, *cases],
                           check=True, env=env)
