"""Hugging Face Trainer, Accelerate and Lightning on zfunc equal them on DeepSpeed 0.19.8, on the
same scripts.

`tests/hf/trainer_run.py`, `tests/hf/accelerate_run.py` and `tests/hf/lightning_run.py` run
unchanged on both: here through ``zfunc.as_deepspeed`` (``torchrun
-m zfunc.compat.as_deepspeed``), a world of 2 gloo ranks; the reference numbers in
``tests/fixtures/hf/<case>.json`` are DeepSpeed's own runs of them (``tests/hf/cases.py`` makes
them). Per logged step: loss, ``grad_norm`` and learning rate; then the weights
``trainer.save_model`` wrote, or Accelerate's ``get_state_dict`` returned (names, a leading slice
of each tensor and its sum).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from tests.hf.cases import ACCELERATE, LIGHTNING, RUNS, TRAINER_BF16, TRAINER_FP32

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "hf")
# fp32: loss 1e-4 and grad_norm 1e-3 relative; weights after 4 AdamW steps of lr
# 3e-3 differ by fp32 rounding (measured <= 4e-6). bf16: the same forward in bf16 on both sides,
# weights within a bf16 step of each other (measured: loss 2e-5, grad_norm 3e-4, weights 4.9e-3).
# The sum of each tensor: measured 4e-6 (fp32) and 2e-3 (bf16) apart.
TOL = {"fp32": {"loss": 1e-4, "grad_norm": 1e-3, "weights": 2e-5, "sum": 1e-4},
       "bf16": {"loss": 1e-4, "grad_norm": 1e-3, "weights": 1e-2, "sum": 2e-2}}


def _launch(script: str, out: str, cases: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "zfunc.compat.as_deepspeed", os.path.join(HERE, "hf", script), "--out", out, *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=env)
    if done.returncode != 0:
        raise AssertionError(f"{script} failed ({done.returncode}):\n{done.stderr[-6000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf"))
    for script, cases in RUNS.items():
        _launch(script, out, cases)
    return out


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("case", TRAINER_FP32 + TRAINER_BF16)
def test_trainer_on_zfunc_equals_trainer_on_deepspeed(runs, case):
    ours, ref = _read(os.path.join(runs, f"{case}.json")), _read(os.path.join(FIXTURES, f"{case}.json"))
    tol = TOL["bf16" if "bf16" in case else "fp32"]
    _same_logs(ours["logs"], ref["logs"], tol, [1, 2, 3, 4])
    _same_weights(ours["weights"], ref["weights"], tol)


@pytest.mark.parametrize("case", ACCELERATE)
def test_an_accelerate_loop_on_zfunc_equals_it_on_deepspeed(runs, case):
    """Straight through, then ``load_state`` of the half-way ``save_state`` and the second half
    again: each equal to DeepSpeed's, and the resumed half equal to the straight one."""
    ours, ref = _read(os.path.join(runs, f"{case}.json")), _read(os.path.join(FIXTURES, f"{case}.json"))
    tol = TOL["bf16" if "bf16" in case else "fp32"]
    _same_logs(ours["logs"], ref["logs"], tol, [1, 2, 3, 4])
    _same_logs(ours["resumed"], ref["resumed"], tol, [3, 4])
    _same_logs(ours["resumed"], ours["logs"][2:], {**tol, "loss": 1e-6, "grad_norm": 1e-6}, [3, 4])
    _same_weights(ours["weights"], ref["weights"], tol)
    _same_weights(ours["resumed_weights"], ref["resumed_weights"], tol)
    assert ours["unwrapped_names"] == ref["unwrapped_names"]  # unwrap_model knows the engine
    assert not any(n.startswith("module.") for n in ours["weights"])


@pytest.mark.parametrize("case", LIGHTNING)
def test_lightning_deepspeed_strategy_on_zfunc_equals_it_on_deepspeed(runs, case):
    ours, ref = _read(os.path.join(runs, f"{case}.json")), _read(os.path.join(FIXTURES, f"{case}.json"))
    _same_logs(ours["logs"], ref["logs"], TOL["fp32"], [1, 2, 3, 4])
    _same_weights(ours["weights"], ref["weights"], TOL["fp32"])
    assert ours["checkpoints"] == ["epoch=0-step=4.ckpt"], ours["checkpoints"]  # its default checkpointing


def _same_logs(ours: list[dict], ref: list[dict], tol: dict, steps: list[int]) -> None:
    assert [e["step"] for e in ours] == [e["step"] for e in ref] == steps
    for a, b in zip(ours, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=tol["loss"]), (a, b)
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-6, abs=1e-12), (a, b)
        assert ("grad_norm" in a) == ("grad_norm" in b)
        if "grad_norm" in b:
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=tol["grad_norm"]), (a, b)


def _same_weights(ours: dict, ref: dict, tol: dict) -> None:
    """The saved names (no "module." prefix; a tied weight as DeepSpeed saves it) and values."""
    assert sorted(ours) == sorted(ref)
    for name, values in ref.items():
        got = ours[name]
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
