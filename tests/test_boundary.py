"""Stages 0-1: the step's last micro-batch reduces the accumulated gradient in its backward.

Tiny ``bucket_mb`` cuts the fixtures into many buckets (`zfunc.autograd.buckets.Fold`). Checked: parity
with single-process torch AdamW at worlds 2 and 3 (the zoo has a tied weight, a frozen and an
unused parameter, odd sizes), the same bits as the one-piece reduce at the step (world 2), a
model called twice in the boundary micro-batch (one backward, and one backward per call in the
engine), a pullback run twice, the engine's plain ``loss.backward()`` and its boundary override.
"""

from __future__ import annotations

import pytest
import torch

import zfunc
import zfunc.core.backward
import zfunc.distributed.widen
from tests.helpers import MODELS, bitwise_equal, max_param_diff, reference_run, run_ranks, split
from zfunc.core.backward import record_micro
from zfunc.autograd.buckets import Fold

TOL = 2e-6
SMALL = 0.0002  # MiB: about 50 fp32 elements per bucket
_ENDS_STEP = zfunc.core.backward._ends_step
_WIDEN_MIN = zfunc.distributed.widen._MIN


def _cfg(stage: int, grad_accum: int, bucket_mb: float = SMALL) -> zfunc.Config:
    return zfunc.Config(stage=stage, grad_accum=grad_accum, clip=1.0, bucket_mb=bucket_mb,
                        optimizer=zfunc.adamw(lr=1e-2, weight_decay=0.01))


def _reduce_at(fold: bool) -> None:
    """Whether this rank's process reduces in the boundary's backward, or at the step as before
    the boundary reduce (the comparison run; the worlds' processes outlive a test, so both set it)."""
    zfunc.core.backward._ends_step = _ENDS_STEP if fold else (lambda state: None)


def _train(rank: int, name: str, stage: int, grad_accum: int, fold: bool = True, steps: int = 4,
           precision: str = "fp32") -> tuple[zfunc.TrainState, list[float], list[list[bool]]]:
    """``steps`` steps of backward_step + apply_step; each step's grad norm, and ``reduced``
    after each micro-batch."""
    _reduce_at(fold)
    make, loss_fn, batch_fn = MODELS[name]
    torch.manual_seed(0)
    state = zfunc.init(make(), _cfg(stage, grad_accum).replace(precision=precision))
    norms, reduced = [], []
    for i in range(steps):
        flags = []
        for mb in split(batch_fn(i, rank, 2 * grad_accum), grad_accum):
            state, _ = zfunc.backward_step(state, loss_fn, mb, donate=True)
            flags.append(state.reduced)
        state = zfunc.apply_step(state, donate=True)
        norms.append(state.metrics.grad_norm.item())
        reduced.append(flags)
    return state, norms, reduced


def _parity(rank: int, name: str, stage: int, grad_accum: int) -> tuple[float, list, list, list, int]:
    world = zfunc.comm.world().size
    state, norms, reduced = _train(rank, name, stage, grad_accum)
    ref, ref_norms = reference_run(name, world, 4, grad_accum=grad_accum, clip=1.0)
    return max_param_diff(state, ref), norms, ref_norms, reduced, len(state.binding.buckets(state))


@pytest.mark.parametrize("stage,grad_accum", [(0, 1), (0, 4), (1, 4)])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["zoo", "gpt"])
def test_boundary_reduce_matches_single_process_adamw(name, world, stage, grad_accum):
    for diff, norms, ref_norms, reduced, buckets in run_ranks(_parity, world, name, stage, grad_accum):
        assert buckets >= 5, buckets  # many buckets, so the bucketed path is the one tested
        # the last micro-batch of every step reduced in its backward, the others did not
        assert reduced == [[False] * (grad_accum - 1) + [True]] * 4, reduced
        assert diff <= TOL, diff
        assert norms == pytest.approx(ref_norms, rel=1e-5)


def _bits(rank: int, stage: int, fold: bool, precision: str) -> list[torch.Tensor]:
    import zfunc.distributed.widen

    zfunc.distributed.widen._MIN = 1  # bf16 gradients reach the accumulator through zfunc_kernels.accumulate
    try:
        state, _, reduced = _train(rank, "zoo", stage, 3, fold=fold, steps=3, precision=precision)
    finally:
        zfunc.distributed.widen._MIN = _WIDEN_MIN
    assert reduced[-1][-1] == fold
    return [state.params, *zfunc.tree.leaves(state.opt)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1])
def test_boundary_reduce_gives_the_bits_of_the_reduce_at_the_step(stage, precision):
    # Two ranks: a sum of two is the same in any order, so the bits must agree exactly.
    folded = run_ranks(_bits, 2, stage, True, precision)
    at_step = run_ranks(_bits, 2, stage, False, precision)
    for a, b in zip(folded, at_step):
        assert bitwise_equal(a, b)


def _twice(rank: int, stage: int, fold: bool) -> list[float]:
    """A boundary micro-batch whose loss calls the model twice (two reducers, one accumulator)."""
    _reduce_at(fold)
    make, loss_fn, batch_fn = MODELS["gpt"]
    torch.manual_seed(0)
    state = zfunc.init(make(), _cfg(stage, 2))
    for i in range(3):
        first, last = split(batch_fn(i, rank, 8), 2)
        state, _ = zfunc.backward_step(state, loss_fn, first)
        a, b = split(last, 2)
        state, _ = zfunc.backward_step(state, lambda m, _: loss_fn(m, a) + loss_fn(m, b), None)
        assert state.reduced == fold
        state = zfunc.apply_step(state)
    return torch.cat([p.flatten() for p in zfunc.full_params(state).values()]).tolist()


@pytest.mark.parametrize("stage", [0, 1])
def test_model_called_twice_in_the_boundary_micro_batch(stage):
    folded = run_ranks(_twice, 3, stage, True)
    at_step = run_ranks(_twice, 3, stage, False)
    for a, b in zip(folded, at_step):
        assert a == pytest.approx(b, abs=1e-6)


def _pullback_twice(rank: int, stage: int) -> tuple[list, torch.Tensor, list[bool]]:
    _reduce_at(True)
    make, loss_fn, batch_fn = MODELS["gpt"]
    torch.manual_seed(0)
    state = zfunc.init(make(), _cfg(stage, 2))
    state, _ = zfunc.backward_step(state, loss_fn, batch_fn(0, rank, 2))
    batch = batch_fn(1, rank, 2)
    _, pullback = zfunc.vjp(state, lambda m: loss_fn(m, batch))
    first = pullback(torch.ones(()), retain_graph=True)
    second = pullback(torch.ones(()))
    once, _ = zfunc.backward_step(state, loss_fn, batch)
    return [first.grads, second.grads], once.grads, [first.reduced, second.reduced, once.reduced]


@pytest.mark.parametrize("stage", [0, 1])
def test_a_pullback_run_twice_at_the_boundary(stage):
    for (first, second), once, reduced in run_ranks(_pullback_twice, 2, stage):
        assert reduced == [True, True, True]
        assert torch.equal(first, once) and torch.equal(second, once)


def _engine(rank: int, stage: int, per_call: bool, fold: bool) -> list[float]:
    """The engine at grad_accum 2, plain ``loss.backward()``; with ``per_call`` the boundary
    micro-step runs the model twice, one backward each (the accumulator folds in the first)."""
    _reduce_at(fold)
    make, loss_fn, batch_fn = MODELS["gpt"]
    torch.manual_seed(0)
    cfg = zfunc.Config.from_deepspeed({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}})
    engine, *_ = zfunc.initialize(model=make(), config=cfg.replace(bucket_mb=SMALL))
    for i in range(6):
        batch = batch_fn(i, rank, 2)
        if per_call and engine.is_gradient_accumulation_boundary():
            for half in split(batch, 2):
                (loss_fn(engine.module, half) / 2).backward()
        else:
            loss_fn(engine, batch).backward()
        engine.step()
    return torch.cat([p.flatten() for p in zfunc.full_params(engine.state).values()]).tolist()


@pytest.mark.parametrize("stage", [0, 1])
def test_engine_plain_backward_reduces_at_the_boundary(stage):
    for per_call in (False, True):
        folded = run_ranks(_engine, 2, stage, per_call, True)
        at_step = run_ranks(_engine, 2, stage, per_call, False)
        for a, b in zip(folded, at_step):
            assert a == pytest.approx(b, abs=1e-6)


def _override(rank: int) -> str:
    _reduce_at(True)
    make, loss_fn, batch_fn = MODELS["gpt"]
    torch.manual_seed(0)
    engine, *_ = zfunc.initialize(model=make(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}})
    engine.set_gradient_accumulation_boundary(True)
    loss_fn(engine, batch_fn(0, rank, 2)).backward()  # reduced in backward: this is the boundary
    engine.set_gradient_accumulation_boundary(False)
    before = engine.state.params.clone()
    try:
        engine.step()
    except RuntimeError as e:
        assert torch.equal(engine.state.params, before) and engine.micro_steps == 0
        engine.set_gradient_accumulation_boundary(True)
        engine.step()  # the reduced gradient is still there for the step
        assert engine.global_steps == 1 and not torch.equal(engine.state.params, before)
        return str(e)
    return "no error"


def test_engine_refuses_a_boundary_changed_after_the_backward():
    for message in run_ranks(_override, 2):
        assert message.startswith("engine.step(): this micro-step's backward ran at the accumulation boundary"), \
            message


def test_a_backward_that_stopped_part_way_through_the_reduce_is_refused():
    state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=1, grad_accum=2))
    fold = Fold(3)
    fold.folded[2] = True  # the last bucket's reduce ran, the first two never started
    with pytest.raises(RuntimeError, match="stopped part way through reducing the gradient"):
        record_micro(state, state.grads, fold=fold)
    done = Fold(1)
    done.folded[0] = True
    assert record_micro(state, torch.zeros(state.grads.numel()), fold=done).reduced


def _short(rank: int, name: str, stage: int, grad_accum: int, seen: int) -> tuple[float, list, list, list[float]]:
    """``grad_accum`` configured, ``seen`` micro-batches run before each `apply_step` (an epoch's
    short last accumulation), against torch AdamW whose steps see those ``seen`` alone."""
    world = zfunc.comm.world().size
    make, loss_fn, batch_fn = MODELS[name]
    torch.manual_seed(0)
    state = zfunc.init(make(), _cfg(stage, grad_accum, bucket_mb=25.0))
    norms, losses = [], []
    for i in range(3):
        for mb in split(batch_fn(i, rank, 2 * seen), seen):
            state, _ = zfunc.backward_step(state, loss_fn, mb)
        state = zfunc.apply_step(state)
        norms.append(state.metrics.grad_norm.item())
        losses.append(state.metrics.loss.item())
    ref, ref_norms = reference_run(name, world, 3, grad_accum=seen, clip=1.0)
    return max_param_diff(state, ref), norms, ref_norms, losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fewer_micro_batches_than_grad_accum_step_on_their_mean(world, stage):
    # grad_accum=3 with 1 and with 2 micro-batches per step: the mean over those seen, as torch
    # AdamW with those micro-batches alone; never their sum divided by grad_accum.
    for seen in (1, 2):
        for diff, norms, ref_norms, losses in run_ranks(_short, world, "zoo", stage, 3, seen):
            # 1/3 then 3 on a tied weight's two parts rounds apart by ~1e-7, which Adam's
            # normalisation of near-zero elements enlarges to ~4e-6 after three steps
            assert diff <= 1e-5, (seen, diff)
            # the norm sees the scale that Adam hides: the sum over grad_accum is 3/seen x smaller
            assert norms == pytest.approx(ref_norms, rel=1e-5), (seen, norms, ref_norms)
            assert all(loss == loss for loss in losses), losses  # the mean loss over those seen


def test_a_full_accumulation_is_unchanged_by_the_mean():
    # The factor is exactly 1 after grad_accum micro-batches: the bits of the configured step.
    make, loss_fn, batch_fn = MODELS["zoo"]
    torch.manual_seed(0)
    state = zfunc.init(make(), _cfg(2, 2))
    for mb in split(batch_fn(0, 0, 4), 2):
        state, _ = zfunc.backward_step(state, loss_fn, mb)
    after = zfunc.apply_step(state)
    by_hand = state.replace(micro_step=torch.zeros_like(state.micro_step) + 2)
    assert bitwise_equal([after.params], [zfunc.apply_step(by_hand).params])
    # and the check can fail: a count of 1 (a half accumulation) scales the same gradient by 2
    half = zfunc.apply_step(state.replace(micro_step=torch.ones_like(state.micro_step)))
    assert not bitwise_equal([after.params], [half.params])


def _engine_short_end(rank: int, stage: int, forced: bool) -> list[torch.Tensor]:
    make, loss_fn, batch_fn = MODELS["zoo"]
    torch.manual_seed(0)
    engine, *_ = zfunc.initialize(model=make(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3 if forced else 1,
        "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1 if forced else 0.1 / 3}}})
    if forced:  # an epoch's short end: one micro-batch, then a step forced by the boundary
        engine.set_gradient_accumulation_boundary(True)
    engine.backward(loss_fn(engine, batch_fn(0, rank, 2)))
    engine.step()
    assert engine.global_steps == 1
    return list(zfunc.full_params(engine.state).values())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_forced_boundary_after_fewer_micro_batches_applies_them_as_deepspeed_does(stage):
    # DeepSpeed's rule, which Hugging Face Trainer relies on (it divides a short accumulation's
    # losses itself): each backward is 1/GAS of a step, however many ran. SGD shows the
    # gradient's size: GAS=3 with the step forced after one micro-batch moves the weights as
    # GAS=1 on that micro-batch with a third of the learning rate.
    for short, third in zip(run_ranks(_engine_short_end, 2, stage, True), run_ranks(_engine_short_end, 2, stage, False)):
        assert max((a - b).abs().max().item() for a, b in zip(short, third)) <= 1e-7
