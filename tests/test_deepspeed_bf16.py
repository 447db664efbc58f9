"""Under a DeepSpeed bf16 config the engine starts from DeepSpeed's masters: the model's weights
cast to bf16, widened (DeepSpeed casts the module before it builds its fp32 masters); the
functional API keeps the model's own fp32 values. Checked against DeepSpeed 0.19.8's own run
(tests/fixtures/deepspeed/make.py)."""

from __future__ import annotations

import os

import pytest
import torch

import zfunc
from tests.fixtures.deepspeed.make import HERE, Small, batch, config
from tests.helpers import run_ranks
from zfunc.io.deepspeed_checkpoint import read_deepspeed


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_bf16_masters_are_the_cast_weights(stage):
    torch.manual_seed(0)
    model = Small()
    original = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ds = {**config(stage, "bf16"), "zero_optimization": {"stage": stage}}
    engine, *_ = zfunc.initialize(model=model, config=ds)
    masters = zfunc.full_params(engine.state)
    assert all(torch.equal(masters[n], original[n].bfloat16().float()) for n in masters)
    torch.manual_seed(0)
    functional = zfunc.full_params(zfunc.init(Small(), zfunc.Config(stage=stage, precision="bf16")))
    assert all(torch.equal(functional[n], original[n]) for n in functional)


def _fresh(rank: int, stage: int) -> tuple[bool, float, float]:
    """Five steps under DeepSpeed's bf16 config: whether every step's full reduced gradient equals
    DeepSpeed's bit for bit, and the largest master difference at step 3 and after step 5."""
    torch.manual_seed(0)
    model = Small()
    engine, *_ = zfunc.initialize(model=model, config=config(stage, "bf16"))
    case = os.path.join(HERE, f"zero{stage}_bf16")
    theirs = torch.load(os.path.join(case, "grads.pt"))
    same, at3 = True, None
    for step in range(5):
        if step == 3:
            full, ck = zfunc.full_params(engine.state), read_deepspeed(case)
            at3 = max((full[n] - ck.master[n]).abs().max().item() for n in ck.master)
        engine.backward(engine(batch(step, rank)))
        ours = {n: zfunc.utils.safe_get_full_grad(p) for n, p in engine.module.named_parameters() if p.requires_grad}
        same &= sorted(ours) == sorted(theirs[step]) and all(torch.equal(ours[n], theirs[step][n]) for n in ours)
        engine.step()
    after, full = torch.load(os.path.join(case, "after.pt")), zfunc.full_params(engine.state)
    return same, at3, max((full[n] - after[n]).abs().max().item() for n in after)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_deepspeed_bf16_run_reduces_deepspeeds_gradients_bit_for_bit(stage):
    """Same seed, 2 ranks, 5 steps: every reduced gradient equals DeepSpeed 0.19.8's (summed in
    bf16, its default communication dtype); the fp32 masters differ only by the order of Adam's
    float32 operations (torch's fused CPU Adam against the single-tensor AdamW DeepSpeed runs)."""
    for same, at3, after in run_ranks(_fresh, 2, stage):
        assert same
        assert at3 < 1e-7 and after < 1e-7, (at3, after)


def _accumulated(rank: int, stage: int) -> list[float]:
    """Three steps of three micro-batches under DeepSpeed's bf16 config: per step, the largest
    difference from DeepSpeed's full reduced gradient (in bf16 spacings of the parameter's largest
    gradient element)."""
    torch.manual_seed(0)
    engine, *_ = zfunc.initialize(model=Small(), config={**config(stage, "bf16"), "gradient_accumulation_steps": 3})
    theirs = torch.load(os.path.join(HERE, f"zero{stage}_bf16", "grads_accum3.pt"))
    worst = []
    for step in range(3):
        for micro in range(3):
            engine.backward(engine(batch(3 * step + micro, rank)))
            if micro == 2:
                ours = {n: zfunc.utils.safe_get_full_grad(p) for n, p in engine.module.named_parameters()
                        if p.requires_grad}
                assert sorted(ours) == sorted(theirs[step])
                worst.append(max(((ours[n] - t).abs().max() / t.abs().max() * 128).item()
                                 for n, t in theirs[step].items()))
            engine.step()
    return worst


def test_deepspeeds_bf16_gradient_accumulation():
    """DeepSpeed adds micro-batch gradients in bf16 (its default grad_accum_dtype); so does the
    shim under its config, reducing each micro-batch's sum before adding it at stages 2-3 as
    DeepSpeed does: the same gradients bit for bit at every stage."""
    for stage in (1, 2, 3):
        assert all(w == 0 for out in run_ranks(_accumulated, 2, stage) for w in out), stage
