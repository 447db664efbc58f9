"""Mixed precision: overflow skips on every rank, autocast parity with GradScaler, low-precision
masters and moments, and an fp32 accumulator that keeps tiny gradients."""

from __future__ import annotations

import copy

import pytest
import torch

import zfunc
from tests.helpers import MODELS, autocast_losses, bitwise_equal, run_ranks, snapshot, split


def _inject(rank: int, stage: int, precision: str, bad: float, shard_size: int | None = None) -> dict:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    make, loss_fn, batch_fn = MODELS["zoo"]
    torch.manual_seed(0)
    ls = zfunc.DynamicLossScale(init=2.0**8, hysteresis=1) if precision == "fp16" else None
    state = zfunc.init(make(), zfunc.Config(stage=stage, precision=precision, loss_scale=ls, clip=1.0,
                                            shard_size=shard_size, grad_accum=2))
    for mb in split(batch_fn(0, rank, 4), 2):
        state, _ = zfunc.backward_step(state, loss_fn, mb)
    state = zfunc.apply_step(state)  # moments are non-zero from here on
    first, last = split(batch_fn(1, rank, 4), 2)
    state, _ = zfunc.backward_step(state, loss_fn, first)
    if rank == world - 1:  # only the last rank's accumulated gradient overflows (before the last
        grads = state.grads.clone()  # micro-batch, whose backward reduces it at stages 0-1)
        grads[grads.numel() // 2] = bad
        state = state.replace(grads=grads)
    state, _ = zfunc.backward_step(state, loss_fn, last)
    kept = snapshot((state.params, state.compute, state.opt))
    after = zfunc.apply_step(state)
    return {"unchanged": bitwise_equal(kept, snapshot((after.params, after.compute, after.opt))),
            "skipped": after.metrics.skipped.item(), "count": after.opt.count.item(),
            "step": after.step.item(), "scale": after.scaler.scale.item(),
            "skips": after.scaler.skipped.item(), "grads_zero": after.grads.abs().sum().item() == 0}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision,bad", [("fp16", float("inf")), ("fp16", float("nan")), ("bf16", float("-inf"))])
def test_overflow_on_one_rank_skips_everywhere(world, stage, precision, bad):
    for rank, r in enumerate(run_ranks(_inject, world, stage, precision, bad)):
        assert r["unchanged"], f"rank {rank}: params, compute copy or moments changed on a skipped step"
        assert r["skipped"] == 1 and r["skips"] == 1 and r["count"] == 1 and r["step"] == 2, r
        assert r["grads_zero"], r
        assert r["scale"] == (128.0 if precision == "fp16" else 1.0), r  # bf16: exactly 1


def _autocast(rank: int, stage: int, dtype: torch.dtype) -> tuple[list[float], list[float]]:
    fp16 = dtype == torch.float16
    return autocast_losses(rank, zfunc.Config(
        stage=stage, autocast=dtype, grad_accum=2, optimizer=zfunc.adamw(lr=1e-2),
        loss_scale=zfunc.DynamicLossScale(init=2.0**16, window=2000) if fp16 else None))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_autocast_matches_gradscaler_adamw(stage, dtype):
    for ours, theirs in run_ranks(_autocast, 2, stage, dtype):
        assert ours == pytest.approx(theirs, rel=1e-2), (ours, theirs)


def _low_precision(rank: int, master: torch.dtype, moments: torch.dtype, precision: str) -> dict:
    make, loss_fn, batch_fn = MODELS["gpt"]
    torch.manual_seed(0)
    ls = zfunc.DynamicLossScale(init=2.0**10) if precision == "fp16" else None
    cfg = zfunc.Config(stage=2, precision=precision, master_dtype=master, moment_dtype=moments,
                       grad_accum_dtype=master, loss_scale=ls, optimizer=zfunc.adamw(lr=3e-2))
    state = zfunc.init(make(), cfg)
    step = zfunc.train_step(loss_fn)
    losses = []
    for i in range(30):
        state = step(state, batch_fn(0, rank, 8))  # one fixed batch: the loss must fall
        losses.append(state.metrics.loss.item())
    # Memory during a step (after a micro-batch: the gradient accumulator is held).
    fp32, _ = zfunc.backward_step(zfunc.init(make(), zfunc.Config(stage=2)), loss_fn, batch_fn(0, rank, 8))
    state, _ = zfunc.backward_step(state, loss_fn, batch_fn(0, rank, 8))
    return {"first": losses[0], "last": losses[-1], "dtypes": (state.params.dtype, state.grads.dtype,
            state.opt.mu.dtype, state.opt.nu.dtype, state.compute.dtype),
            "mem": zfunc.memory_report(state), "fp32": zfunc.memory_report(fp32)}


@pytest.mark.parametrize("master,moments,precision", [
    (torch.bfloat16, torch.bfloat16, "bf16"),
    (torch.bfloat16, torch.float32, "bf16"),
    (torch.float16, torch.float32, "fp16"),
])
def test_low_precision_masters_and_moments_train(master, moments, precision):
    for r in run_ranks(_low_precision, 2, master, moments, precision):
        assert r["last"] < 0.8 * r["first"], r
        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        assert r["dtypes"] == (master, master, moments, moments, compute), r["dtypes"]
        assert r["mem"]["grads"] * 2 == r["fp32"]["grads"] > 0
        assert r["mem"]["optimizer"] < r["fp32"]["optimizer"] or moments == torch.float32
        assert r["mem"]["total"] < r["fp32"]["total"]


def test_fp32_accumulator_keeps_64_tiny_micro_gradients():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 16)
    g = torch.Generator().manual_seed(1)
    micro = [{"weight": torch.randn(16, 64, generator=g) * 10.0 ** float(torch.randint(-8, -2, (1,), generator=g)),
              "bias": torch.randn(16, generator=g) * 1e-6} for _ in range(64)]
    exact = {k: sum(m[k].double() for m in micro) / 64 for k in ("weight", "bias")}
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        state = zfunc.init(model, zfunc.Config(stage=0, precision="bf16", grad_accum=64, grad_accum_dtype=dtype))
        for m in micro:
            state = zfunc.accumulate(state, m, donate=True)
        views = state.layout.views(state.layout.units[0], state.grads)
        errors[dtype] = max(((views[k].double() - exact[k]).abs().max() / exact[k].abs().max()).item()
                            for k in exact)
    assert errors[torch.float32] < 1e-6, errors
    assert errors[torch.bfloat16] > 100 * errors[torch.float32], errors  # bf16 accumulation is lossy


def test_precision_errors():
    with pytest.raises(zfunc.ConfigError, match="bf16 needs no loss scaling"):
        zfunc.Config(precision="bf16", loss_scale=zfunc.DynamicLossScale())
    with pytest.raises(zfunc.ConfigError, match="bf16 needs no loss scaling"):
        zfunc.Config(autocast=torch.bfloat16, loss_scale=1024.0)
    for bad in (float("inf"), float("nan"), -1.0, 0.0, True):
        with pytest.raises(zfunc.ConfigError, match="loss_scale"):
            zfunc.Config(precision="fp16", loss_scale=bad)
    for field in ("window", "hysteresis"):
        for bad in (0, -1, 1.5, True, None, "3"):
            with pytest.raises(zfunc.ConfigError, match=f"loss_scale.{field}: expected a positive integer"):
                zfunc.DynamicLossScale(**{field: bad})
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(zfunc.ConfigError, match="loss_scale.min_scale"):
            zfunc.DynamicLossScale(min_scale=bad)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("stage", [0, 1])
def test_bf16_gradients_accumulate_into_the_fp32_accumulator(stage, kernel, monkeypatch):
    # Stages 0-1 add each micro-batch's bf16 gradient to the fp32 accumulator in place (no fp32
    # copy of the whole gradient first; on the CPU through zfunc_kernels.accumulate from
    # zfunc.distributed.widen._MIN elements on): torch's bf16 gradients summed in fp32, to the bit.
    import zfunc.distributed.widen

    monkeypatch.setattr(zfunc.distributed.widen, "_MIN", 1 if kernel else 1 << 62)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model).bfloat16()
    state = zfunc.init(model, zfunc.Config(stage=stage, precision="bf16", grad_accum=4))

    def loss_fn(m, x):
        return m(x).float().pow(2).mean()

    xs = [torch.randn(5, 8) for _ in range(3)]
    expected = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
    for x in xs:
        state, _ = zfunc.backward_step(state, loss_fn, x)
        ref.zero_grad()
        (loss_fn(ref, x.bfloat16()) / 4).backward()
        for n, p in ref.named_parameters():
            expected[n] += p.grad.float()
    assert state.grads.dtype == torch.float32 and not state.reduced
    got = state.layout.views(state.layout.units[0], state.grads)
    for n in expected:
        assert torch.equal(got[n], expected[n]), n


def test_accumulate_scales_in_float32_and_rounds_to_the_reduce_dtype_once():
    """``accumulate`` multiplies by ``scale / (grad_accum * world)`` as ``backward_step`` does: a
    2**16 scale with fp16 reduces does not overflow (2**16 is past fp16's range), and bf16 reduces
    with grad_accum 3 keep the mean (no rounded 1/3)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 1)
    cfg = zfunc.Config(stage=0, precision="fp16", loss_scale=2.0**16, comm_dtype=torch.float16,
                       optimizer=zfunc.sgd(lr=0.1))
    state = zfunc.accumulate(zfunc.init(model, cfg), {"weight": torch.full((1, 7), 1e-3), "bias": torch.zeros(1)})
    state = zfunc.apply_step(state)
    assert state.metrics.skipped.item() == 0
    moved = zfunc.full_params(state)["weight"].double() - model.weight.detach().double()
    assert torch.allclose(moved, torch.full_like(moved, -1e-4), rtol=1e-3), moved
    g = torch.Generator().manual_seed(1)
    wide = torch.nn.Linear(1024, 4)
    micro = [{"weight": torch.randn(4, 1024, generator=g), "bias": torch.randn(4, generator=g)} for _ in range(3)]
    state = zfunc.init(wide, zfunc.Config(stage=0, grad_accum=3, comm_dtype=torch.bfloat16))
    for m in micro:
        state = zfunc.accumulate(state, m)
    got = state.layout.views(state.layout.units[0], state.grads)["weight"].double()
    exact = sum(m["weight"].double() for m in micro) / 3
    # each micro-batch's contribution rounded to bf16 once (2**-9 relative), and no bias: a
    # factor rounded to bf16 (1/3 -> 0.33398) made every gradient 0.2% larger
    assert ((got - exact).abs() <= 3 * 2.0**-9 * sum(m["weight"].double().abs() for m in micro) / 3).all()
    assert abs(got.abs().sum().item() / exact.abs().sum().item() - 1) < 2e-4


def test_fp16_weights_under_bf16_autocast_take_a_loss_scale():
    """fp16 weights have fp16 gradients whatever autocast computes in: a loss scale is theirs
    (DeepSpeed: ``fp16`` with ``torch_autocast`` bf16); DeepSpeed's fp16 ``torch_autocast`` alone
    scales with torch's ``GradScaler()``."""
    cfg = zfunc.Config(precision="fp16", autocast=torch.bfloat16, loss_scale=zfunc.DynamicLossScale())
    assert cfg.loss_scale.rule == "deepspeed"
    ds = zfunc.Config.from_deepspeed({"train_batch_size": 1, "fp16": {"enabled": True},
                                      "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    assert ds.precision == "fp16" and ds.autocast == torch.bfloat16 and ds.loss_scale.hysteresis == 2
    ds = zfunc.Config.from_deepspeed({"train_batch_size": 1, "torch_autocast": {"enabled": True, "dtype": "fp16"}})
    assert ds.loss_scale == zfunc.DynamicLossScale.grad_scaler()
    assert (ds.loss_scale.rule, ds.loss_scale.init, ds.loss_scale.window, ds.loss_scale.hysteresis) == \
        ("grad_scaler", 2.0**16, 2000, 1)
    with pytest.raises(zfunc.ConfigError, match="torch_autocast.dtype: expected bf16 with bf16.enabled"):
        zfunc.Config.from_deepspeed({"train_batch_size": 1, "bf16": {"enabled": True},
                                     "torch_autocast": {"enabled": True, "dtype": "fp16"}})
