"""ZeRO-Offload (``Config.offload_optimizer="cpu"``): the master weights and optimizer state on a
host arena, stepped by the CPU kernel. On a CPU compute device the same code path runs with a
separate host arena and real copies, so it is tested here against the run without offload:
bitwise equal, stages 1-3, worlds 1-3, fp32/bf16/fp16, and checkpoints cross between the two.
"""

from __future__ import annotations

import pytest
import torch

import zfunc
from tests.helpers import MODELS, between_steps, bitwise_equal, run_ranks, snapshot, zfunc_run

PRECISIONS = ("fp32", "bf16", "fp16")


def _cfg(stage: int, precision: str, offload: str | None, **kw) -> zfunc.Config:
    ls = zfunc.DynamicLossScale(init=2.0**12, window=3) if precision == "fp16" else None
    return zfunc.Config(stage=stage, precision=precision, grad_accum=2, clip=1.0, loss_scale=ls,
                        offload_optimizer=offload, optimizer=zfunc.adamw(lr=1e-2, weight_decay=0.01), **kw)


def _everything(state: zfunc.TrainState) -> list[torch.Tensor]:
    return snapshot((state.compute, state.params, state.opt, state.scaler, state.metrics, state.buffers))


def _offload_vs_device(rank: int, cases: list[tuple[int, str]]) -> list[tuple]:
    out = []
    for stage, precision in cases:
        plain, _ = zfunc_run(rank, "zoo", 4, _cfg(stage, precision, None))
        off, _ = zfunc_run(rank, "zoo", 4, _cfg(stage, precision, "cpu"))
        separate = off.params.untyped_storage().data_ptr() != off.compute.untyped_storage().data_ptr()
        rep = zfunc.memory_report(off)
        out.append((stage, precision, bitwise_equal(_everything(plain), _everything(off)), separate,
                    off.params.device.type, rep["host"], rep["device"],
                    rep == between_steps(zfunc.memory_plan(MODELS["zoo"][0](), off.cfg, zfunc.comm.world().size))))
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_equals_the_device_run_bitwise(world):
    cases = [(stage, precision) for stage in (1, 2, 3) for precision in PRECISIONS]
    for rank, rows in enumerate(run_ranks(_offload_vs_device, world, cases)):
        for stage, precision, equal, separate, where, host, device, planned in rows:
            case = f"rank {rank} stage {stage} {precision}"
            assert equal, f"{case}: offloaded training differs from training on the device"
            assert separate and where == "cpu", f"{case}: the master must be its own host arena"
            assert host > 0 and device > 0 and planned, case


def _save_one_load_other(rank: int, stage: int, first: str | None, second: str | None, path: str) -> tuple:
    """Train 2 steps with ``first``, save, load with ``second``, train 2 more; and straight 4."""
    make, loss_fn, batch_fn = MODELS["zoo"]
    straight, _ = zfunc_run(rank, "zoo", 4, _cfg(stage, "bf16", first))
    half, _ = zfunc_run(rank, "zoo", 2, _cfg(stage, "bf16", first))
    zfunc.save(half, path)
    resumed = zfunc.load(path, like=zfunc.init(make(), _cfg(stage, "bf16", second)))
    where = resumed.opt.mu.device.type, resumed.cfg.offload_optimizer
    step = zfunc.train_step(loss_fn)
    for i in range(2, 4):
        resumed = step(resumed, batch_fn(i, rank, 4))
    return bitwise_equal(_everything(straight), _everything(resumed)), where


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoints_move_between_offloaded_and_device_runs(tmp_path, stage):
    for i, (first, second) in enumerate((("cpu", None), (None, "cpu"))):
        path = str(tmp_path / f"ckpt{i}")
        for equal, where in run_ranks(_save_one_load_other, 2, stage, first, second, path):
            assert equal, (first, second)
            assert where == ("cpu", second)


def _engine(rank: int, offload: dict | None) -> tuple[list[torch.Tensor], list[str]]:
    import warnings

    make, loss_fn, batch_fn = MODELS["gpt"]
    torch.manual_seed(0)
    zero = {"stage": 2, **({"offload_optimizer": offload} if offload else {})}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zfunc.initialize(model=make(), config={
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero})
    assert engine.state.cfg.offload_optimizer == ("cpu" if offload else None)
    for i in range(3):
        loss = loss_fn(engine, batch_fn(i, rank, 2))
        engine.backward(loss)
        engine.step()
    return _everything(engine.state), [str(w.message) for w in caught]


def test_deepspeed_offload_config_runs_offloaded_without_a_warning():
    off = run_ranks(_engine, 2, {"device": "cpu", "pin_memory": True})
    plain = run_ranks(_engine, 2, None)
    for (a, caught), (b, _) in zip(off, plain):
        assert caught == [], caught  # the offload keys are honoured: nothing to warn about
        assert bitwise_equal(a, b)
    # the check can fail: a key zfunc accepts without using it is warned about
    _, caught = run_ranks(_engine, 1, {"device": "cpu", "buffer_count": 4})[0]
    assert any("offload_optimizer.buffer_count" in w for w in caught), caught


def test_offload_plan_moves_master_and_moments_to_the_host():
    model = torch.nn.Linear(1000, 1000)
    base = zfunc.memory_plan(model, zfunc.Config(stage=2, precision="bf16"), world_size=4)
    off = zfunc.memory_plan(model, zfunc.Config(stage=2, precision="bf16", offload_optimizer="cpu"), world_size=4)
    assert base["host"] == 0 and base["device"] == base["total"]
    assert off["total"] == base["total"]  # the same bytes, moved
    full, shard = 1001008, 250252  # 1,001,000 parameters padded to a multiple of 4 ranks x 4
    assert off["host"] == 4 * shard + 8 * shard  # fp32 master and moments of this rank's shard
    assert off["device"] == 2 * full + 4 * shard  # the bf16 compute copy and the fp32 gradient shard


def test_offload_bad_values():
    with pytest.raises(zfunc.ConfigError, match="offload_optimizer: expected None or \"cpu\""):
        zfunc.Config(offload_optimizer="nvme")
    with pytest.raises(zfunc.ConfigError, match="offload_optimizer: needs stage 1, 2 or 3"):
        zfunc.Config(stage=0, offload_optimizer="cpu")


def _with_a_skipped_step(rank: int, stage: int, precision: str, offload: str | None) -> tuple:
    """Two steps, a step skipped by a non-finite gradient on the last rank, two more steps; the
    state's tensors after the first two, after the skip and at the end, and the skip flag."""
    world = zfunc.comm.world().size
    make, loss_fn, batch_fn = MODELS["zoo"]
    torch.manual_seed(0)
    state = zfunc.init(make(), _cfg(stage, precision, offload))
    step = zfunc.train_step(loss_fn)
    for i in range(2):
        state = step(state, batch_fn(i, rank, 4))
    before = _everything(state)
    for k, mb in enumerate(zfunc.core.train.split_micro_batches(batch_fn(2, rank, 4), 2)):
        if k == 1 and rank == world - 1:  # before the last micro-batch (whose backward reduces at stages 0-1)
            grads = state.grads.clone()
            grads[grads.numel() // 2] = float("nan")
            state = state.replace(grads=grads)
        state, _ = zfunc.backward_step(state, loss_fn, mb)
    state = zfunc.apply_step(state)
    skipped = _everything(state)
    compute_kept = state.metrics.skipped.item() == 1 and bitwise_equal([before[0]], [skipped[0]])
    for i in range(3, 5):
        state = step(state, batch_fn(i, rank, 4))
    return before, skipped, _everything(state), state.metrics.skipped.item(), compute_kept


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_skipped_step_under_offload_keeps_the_forward_weights(world):
    # The offloaded pass writes the new compute copy into a fresh host buffer; a skipped pass
    # writes nothing there, and nothing of it may reach the weights the forward uses.
    for stage in (1, 2, 3):
        for precision in PRECISIONS:
            plain = run_ranks(_with_a_skipped_step, world, stage, precision, None)
            off = run_ranks(_with_a_skipped_step, world, stage, precision, "cpu")
            for rank, (p, o) in enumerate(zip(plain, off)):
                case = f"rank {rank} stage {stage} {precision}"
                assert o[4] and p[4], f"{case}: the step was not skipped, or it changed the compute copy"
                for k, what in enumerate(("before the skip", "after the skip", "two steps later")):
                    assert bitwise_equal(p[k], o[k]), f"{case}: offloaded training differs {what}"
                assert p[3] == o[3] == 0.0, case  # the later steps were applied (finite weights)
