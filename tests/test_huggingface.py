"""Hugging Face Trainer on zfunc equals Trainer on DeepSpeed 0.19.8, on the same script.

`tests/hf/trainer_run.py` runs unchanged on both: here through ``zfunc.as_deepspeed`` (``torchrun
-m zfunc.compat.as_deepspeed``), a world of 2 gloo ranks; the reference numbers in
``tests/fixtures/hf/<case>.json`` are DeepSpeed's own run of it (the command is in the script's
docstring). Per logged step: loss, ``grad_norm`` and learning rate; then the weights
``trainer.save_model`` wrote (names, a leading slice of each tensor and its sum).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "hf")
FP32 = ["z1_fp32_gas1", "z1_fp32_gas2", "z2_fp32_gas1", "z2_fp32_gas2", "z3_fp32_gas1", "z3_fp32_gas2",
        "z2_fp32_gas2_sgd", "z2_fp32_gas2_resume", "z3_fp32_gas2_resume"]
BF16 = ["z1_bf16_gas2", "z2_bf16_gas2", "z3_bf16_gas1", "z3_bf16_gas2"]
# fp32: the bounds (loss 1e-4, grad_norm 1e-3 relative); weights after 4 AdamW steps of lr
# 3e-3 differ by fp32 rounding (measured <= 4e-6). bf16: the same forward in bf16 on both sides,
# weights within a bf16 step of each other (measured: loss 4e-6, grad_norm 3e-4, weights 2.1e-3).
# The sum of each tensor: measured 4e-6 (fp32) and 2e-3 (bf16) apart.
TOL = {"fp32": {"loss": 1e-4, "grad_norm": 1e-3, "weights": 2e-5, "sum": 1e-4},
       "bf16": {"loss": 1e-4, "grad_norm": 1e-3, "weights": 5e-3, "sum": 1e-2}}


def _launch(out: str, cases: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "zfunc.compat.as_deepspeed", os.path.join(HERE, "hf", "trainer_run.py"), "--out", out, *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=env)
    if done.returncode != 0:
        raise AssertionError(f"the Trainer run failed ({done.returncode}):\n{done.stderr[-6000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf"))
    _launch(out, FP32 + BF16)
    return out


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("case", FP32 + BF16)
def test_trainer_on_zfunc_equals_trainer_on_deepspeed(runs, case):
    ours, ref = _read(os.path.join(runs, f"{case}.json")), _read(os.path.join(FIXTURES, f"{case}.json"))
    tol = TOL["bf16" if "bf16" in case else "fp32"]
    assert [e["step"] for e in ours["logs"]] == [e["step"] for e in ref["logs"]] == [1, 2, 3, 4]
    for a, b in zip(ours["logs"], ref["logs"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=tol["loss"]), (a, b)
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-6, abs=1e-12), (a, b)
        assert ("grad_norm" in a) == ("grad_norm" in b)
        if "grad_norm" in b:
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=tol["grad_norm"]), (a, b)
    # the saved names (no "module." prefix; a tied weight as DeepSpeed saves it) and values
    assert sorted(ours["weights"]) == sorted(ref["weights"])
    for name, values in ref["weights"].items():
        got = ours["weights"][name]
        worst = max(abs(x - y) for x, y in zip(got[:-1], values[:-1]))
        assert worst <= tol["weights"], (name, worst)
        assert abs(got[-1] - values[-1]) <= tol["sum"], name


def test_resume_equals_the_uninterrupted_run(runs):
    """``save_steps`` checkpoint at step 2, a fresh Trainer resumed from it: the same numbers as
    training straight through (on zfunc; each also equals DeepSpeed's above)."""
    for stage in (2, 3):
        resumed = _read(os.path.join(runs, f"z{stage}_fp32_gas2_resume.json"))
        straight = _read(os.path.join(runs, f"z{stage}_fp32_gas2.json"))
        for a, b in zip(resumed["logs"], straight["logs"]):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        for name, values in straight["weights"].items():
            assert resumed["weights"][name] == pytest.approx(values, abs=1e-6), name
