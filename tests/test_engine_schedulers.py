"""DeepSpeed's OneCycle and LRRangeTest schedulers under the engine, against DeepSpeed's documented
rule written out here in float64 and torch.optim.Adam driven by the same values each step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import zfunc
from tests.helpers import run_ranks


def _one_cycle_rule(u: int, lo: float, hi: float, first: int, second: int, stairs: int, decay_every: int,
                    decay_rate: float, mom_lo: float, mom_hi: float) -> tuple[float, tuple[float, float]]:
    """The lr and betas DeepSpeed's OneCycle gives update ``u``: the starting values for update 0,
    then the schedule at batch ``u`` (rise over ``first``, fall over ``second``, ending at batch
    ``first + second``; decay from the next)."""
    if u == 0:
        return lo, (mom_lo, 0.99)
    total = first + second
    if u > total:  # after the cycle: u - total updates into the decay
        return lo / (1 + decay_rate * (u - total) / decay_every), (mom_hi, 0.99)
    if u <= first:
        s = u / first if not stairs else math.floor(u * stairs / first) / stairs
    else:
        s = (total - u) / second if not stairs else math.floor((total - u) * stairs / second) / stairs
    return lo + (hi - lo) * s, (mom_hi - (mom_hi - mom_lo) * s, 0.99)


def _train(rank: int, stage: int, scheduler: dict, steps: int) -> tuple[float, list, list]:
    torch.manual_seed(0)
    model, ref = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)), None
    ref = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    ref.load_state_dict(model.state_dict())
    world = zfunc.comm.world().size
    engine, optimizer, _, sched = zfunc.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1.0}}, "scheduler": scheduler})
    opt = torch.optim.Adam(ref.parameters())
    seen_lr, seen_betas = [], []
    for u in range(steps):
        seen_lr.append(optimizer.param_groups[0]["lr"])
        seen_betas.append(tuple(optimizer.param_groups[0].get("betas", ())))
        for g in opt.param_groups:
            g["lr"] = seen_lr[-1]
            if seen_betas[-1]:
                g["betas"] = seen_betas[-1]
        xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(100 * u + r)) for r in range(world)]
        engine.backward(engine(xs[rank]).square().mean())
        engine.step()
        sum(ref(x).square().mean() for x in xs).div(world).backward()
        opt.step()
        opt.zero_grad()
    full = zfunc.full_params(engine.state)
    return max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()), seen_lr, seen_betas


ONE_CYCLE = {"type": "OneCycle", "params": {
    "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "cycle_second_step_size": 3,
    "cycle_first_stair_count": 2, "decay_step_size": 2, "decay_lr_rate": 0.5, "cycle_min_mom": 0.8,
    "cycle_max_mom": 0.95}}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_cycle_sets_lr_and_betas_by_deepspeeds_rule_and_trains_as_torch_adam(world):
    p = ONE_CYCLE["params"]
    want = [_one_cycle_rule(u, p["cycle_min_lr"], p["cycle_max_lr"], 4, 3, 2, 2, 0.5, 0.8, 0.95) for u in range(10)]
    for stage in (0, 1, 2, 3) if world == 2 else (1, 3):
        for diff, lrs, betas in run_ranks(_train, world, stage, ONE_CYCLE, 10):
            assert all(abs(a - b) < 1e-15 for a, b in zip(lrs, [w[0] for w in want])), (lrs, want)
            assert all(abs(a[0] - b[1][0]) < 1e-15 and a[1] == 0.99 for a, b in zip(betas, want)), betas
            assert diff < 1e-6, (world, stage, diff)


def test_lr_range_test_rises_by_deepspeeds_rule():
    sched = {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3,
                                               "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}}
    for diff, lrs, _ in run_ranks(_train, 2, 2, sched, 7):
        assert lrs == pytest.approx([0.01 * (1 + 2.0 * math.floor(u / 3)) for u in range(7)], abs=1e-15)
        assert diff < 1e-6


def test_the_scheduler_resumes_from_a_checkpoint(tmp_path):
    def engine():
        torch.manual_seed(0)
        return zfunc.initialize(model=nn.Linear(3, 2), config={"train_batch_size": 1, "scheduler": ONE_CYCLE,
                                                                "optimizer": {"type": "Adam", "params": {}}})
    first, optimizer, _, sched = engine()
    for _ in range(5):
        first.backward(first(torch.ones(1, 3)).sum())
        first.step()
    first.save_checkpoint(str(tmp_path))
    again, optimizer2, _, sched2 = engine()
    again.load_checkpoint(str(tmp_path))
    assert sched2.state_dict() == sched.state_dict() == {"last_batch_iteration": 4}
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])
    assert optimizer2.param_groups[0]["betas"] == pytest.approx(optimizer.param_groups[0]["betas"])


def test_one_cycle_is_refused_where_it_cannot_run():
    with pytest.raises(zfunc.ConfigError, match="OneCycle runs in the engine"):
        zfunc.Config.from_deepspeed({"train_batch_size": 1, "scheduler": ONE_CYCLE})
    with pytest.raises(zfunc.ConfigError, match="scheduler.params.cycle_max_lr: OneCycle needs it"):
        zfunc.initialize(model=nn.Linear(2, 1), config={"train_batch_size": 1, "scheduler": {
            "type": "OneCycle", "params": {"cycle_min_lr": 0.1}}})
    with pytest.raises(zfunc.ConfigError, match="scheduler.params.warmup_num_steps: not a parameter of OneCycle"):
        zfunc.initialize(model=nn.Linear(2, 1), config={"train_batch_size": 1, "scheduler": {
            "type": "OneCycle", "params": {**ONE_CYCLE["params"], "warmup_num_steps": 3}}})
    with pytest.raises(zfunc.ConfigError, match="cycle_first_step_size: must be positive"):
        zfunc.initialize(model=nn.Linear(2, 1), config={"train_batch_size": 1, "scheduler": {
            "type": "OneCycle", "params": {**ONE_CYCLE["params"], "cycle_first_step_size": 0}}})


def test_one_cycle_momentum_decaying_past_one_names_decay_mom_rate():
    """After the cycle, ``decay_mom_rate`` raises beta1 each decay step; once it reaches 1 the
    error names the scheduler's setting (DeepSpeed trains on with it), after the updates so far."""
    engine, *_ = zfunc.initialize(model=nn.Linear(3, 2), config={
        "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                                     "cycle_first_step_size": 2, "decay_step_size": 1,
                                                     "decay_mom_rate": 0.1}}})
    x = torch.randn(2, 3)
    with pytest.raises(zfunc.ConfigError, match=r"decay_mom_rate: OneCycle's momentum .* reached 1\.08"):
        for _ in range(10):
            engine.backward(engine(x).square().mean())
            engine.step()
    assert engine.global_steps == 6


def test_a_torch_scheduler_the_client_steps_itself_sees_the_optimizer_stepped():
    """Lightning takes the scheduler back from the engine (``engine.lr_scheduler = None``) and
    steps it after each optimizer step itself; the client optimizer it was built on never steps
    (zfunc's does), so each applied step marks it stepped, as torch's step wrapper would: no
    "lr_scheduler.step() before optimizer.step()" warning (the suite turns warnings into errors),
    and the learning rates follow the scheduler."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    client = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(client, lambda s: 1.0 / (1 + s))
    engine, optimizer, _, _ = zfunc.initialize(model=model, optimizer=client, lr_scheduler=sched,
                                               config={"train_batch_size": 1})
    engine.lr_scheduler = None
    lrs = []
    for _ in range(3):
        engine.backward(engine(torch.randn(1, 3)).square().sum())
        engine.step()
        sched.step()
        lrs.append(round(optimizer.param_groups[0]["lr"], 6))
    assert lrs == [0.05, 0.033333, 0.025], lrs
