"""Stages 1-2 with Config.units: the next forward gathers the step's parameters unit by unit (zfunc.autograd.forward_gather)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zfunc
from tests.helpers import (MODELS, bitwise_equal, max_param_diff, reference_run, run_ranks, snapshot, zfunc_run)
from zfunc.autograd import forward_gather as regather
from zfunc.models import GPT, GPTConfig, lm_loss
from zfunc.models.gpt import Block

UNITS = {"zoo": ["inp", "a", "side", "out"], "gpt": [Block]}  # zoo: "a" shares its weight (root)


def _final(rank: int, name: str, stage: int, grad_accum: int, units: list | None) -> tuple[list, list[float]]:
    cfg = zfunc.Config(stage=stage, grad_accum=grad_accum, clip=1.0, units=units,
                       optimizer=zfunc.adamw(lr=1e-2, weight_decay=0.01))
    state, norms = zfunc_run(rank, name, 3, cfg)
    return snapshot(zfunc.settle(state)), norms  # settled: the others' slices as the step made them


@pytest.mark.parametrize("world", [1, 2, 3])
def test_overlapped_gather_trains_bitwise_as_the_gather_at_the_step(world):
    for name in ("zoo", "gpt"):
        for stage in (1, 2):
            for grad_accum in (1, 2):
                plain = run_ranks(_final, world, name, stage, grad_accum, None)
                overlapped = run_ranks(_final, world, name, stage, grad_accum, UNITS[name])
                for rank, ((a, na), (b, nb)) in enumerate(zip(plain, overlapped)):
                    assert na == nb, f"{name} stage {stage} ga {grad_accum} world {world} rank {rank}"
                    assert bitwise_equal(a, b), f"{name} stage {stage} ga {grad_accum} world {world} rank {rank}"


def _against_torch(rank: int, stage: int) -> float:
    cfg = zfunc.Config(stage=stage, grad_accum=2, clip=1.0, units=[Block],
                       optimizer=zfunc.adamw(lr=1e-2, weight_decay=0.01))
    state, _ = zfunc_run(rank, "gpt", 3, cfg)
    model, _ = reference_run("gpt", 3, 3, grad_accum=2, clip=1.0)
    return max_param_diff(state, model)


def test_overlapped_gather_matches_torch_adamw():
    for stage in (1, 2):
        assert max(run_ranks(_against_torch, 3, stage)) < 1e-5


def _events(rank: int, stage: int) -> tuple[bool, list[tuple[str, int]]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=3, n_head=2, d_model=6))
    state = zfunc.init(model, zfunc.Config(stage=stage, units=[Block]))
    events: list[tuple[str, int]] = []
    for i, block in enumerate(model.blocks):  # after zfunc's own hook, which waits for the unit
        block.register_forward_pre_hook(lambda m, a, i=i: events.append(("run", i)))
    wait = regather.Gathering.wait

    def logged(self: regather.Gathering, key: int) -> None:
        if self.works.get(key):
            events.append(("wait", key))
        wait(self, key)

    regather.Gathering.wait = logged
    try:
        batch = MODELS["gpt"][2](0, rank, 2)
        state, _ = zfunc.backward_step(state, lm_loss, batch, donate=True)
        state = zfunc.apply_step(state, donate=True)
        pending = not bool(state.gathered)
        events.clear()
        state, _ = zfunc.backward_step(state, lm_loss, batch, donate=True)
        after = bool(state.gathered)
        seen = list(events)
        state = zfunc.settle(zfunc.apply_step(state, donate=True))
        events.clear()
        state, _ = zfunc.backward_step(state, lm_loss, batch, donate=True)  # a settled state: nothing to wait for
    finally:
        regather.Gathering.wait = wait
    return pending and after and all(kind == "run" for kind, _ in events), seen


def test_the_next_forward_waits_for_each_unit_when_it_starts():
    expected = [("wait", regather.ROOT)] + [e for i in range(3) for e in (("wait", i), ("run", i))]
    for stage in (1, 2):
        for pending, events in run_ranks(_events, 2, stage):
            assert pending  # apply_step left the gathers to the next forward, which hands on a gathered state
            assert events == expected  # unit i's gather waited for only as unit i starts


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.bn = nn.BatchNorm1d(7)
        self.b = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.bn(self.a(x))))


def _pending_reads(rank: int, stage: int, where: str) -> dict[str, bool]:
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    out = {}
    results = []
    for units in (None, ["a", "b"]):
        torch.manual_seed(0)
        state = zfunc.init(_Normed(), zfunc.Config(stage=stage, units=units, optimizer=zfunc.adamw(lr=0.1)))
        s1, _ = zfunc.backward_step(state, loss_fn, x)
        before = snapshot(s1)
        s2 = zfunc.apply_step(s1)  # not donated: s1 must stay as it was
        out[f"pending {units}"] = units is None or not bool(s2.gathered)
        flat = snapshot(zfunc.settle(s2))
        out[f"pure {units}"] = bitwise_equal(before, snapshot(s1))
        s3, _ = zfunc.backward_step(zfunc.apply_step(s1), loss_fn, x)  # a pending state read by forward
        path = zfunc.save(zfunc.apply_step(s3), f"{where}/ckpt-{stage}-{units is None}")  # every rank's dir
        loaded = zfunc.load(path, like=state)
        results.append((flat, snapshot(s3), zfunc.full_params(loaded)))
    (a2, a3, af), (b2, b3, bf) = results
    out["same states"] = bitwise_equal(a2, b2) and bitwise_equal(a3, b3)
    out["same checkpoint"] = bitwise_equal(list(af.values()), list(bf.values()))
    return out


def test_a_pending_state_reads_as_the_gathered_one_and_its_input_is_untouched(tmp_path):
    for world in (2, 3):
        for stage in (1, 2):
            for rank, checks in enumerate(run_ranks(_pending_reads, world, stage, str(tmp_path / f"w{world}"))):
                assert all(checks.values()), f"stage {stage} world {world} rank {rank}: {checks}"


class _Peek(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x + self.a.bias))  # a's bias read before a's forward


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_unit_parameter_used_outside_its_module_fails_loudly(stage):
    state = zfunc.init(_Peek(), zfunc.Config(stage=stage, units=["a"], persist_threshold=0))
    with pytest.raises(RuntimeError, match=r"parameter 'a.bias' of unit 'a' was used outside the unit"):
        zfunc.backward_step(state, lambda m, x: m(x).sum(), torch.ones(2, 3))
    fine = zfunc.init(_Peek(), zfunc.Config(stage=stage, units=["b"], persist_threshold=0))
    fine, _ = zfunc.backward_step(fine, lambda m, x: m(x).sum(), torch.ones(2, 3))
    assert int(fine.micro_step) == 1


def test_units_at_stage_0_are_refused():
    with pytest.raises(zfunc.ConfigError, match="units: stage 0 gathers nothing"):
        zfunc.Config(stage=0, units=["a"])


class _Tied(nn.Module):
    """A unit holding a weight under two names, and a root that reads a unit's metadata (never its
    values) before the unit runs."""

    def __init__(self) -> None:
        super().__init__()
        self.u = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.u[2].weight = self.u[0].weight
        self.v = nn.Linear(4, 3)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.u[0].weight
        self.seen.append(f"{tuple(w.shape)} {w.dtype} {w.numel()} {w.is_floating_point()} {w.requires_grad}")
        return self.v(self.u(x.type_as(w)))


def _tied(rank: int, stage: int, units: list[str] | None, remove: bool) -> tuple[list, list[str], list[float]]:
    torch.manual_seed(0)
    model = _Tied()
    read: list[float] = []
    # A hook of the user's registered before init, and one after: both read a unit's values.
    model.v.register_forward_pre_hook(lambda m, a: read.append(float(m.weight.sum())))
    state = zfunc.init(model, zfunc.Config(stage=stage, units=units, persist_threshold=0,
                                           optimizer=zfunc.adamw(lr=0.1)))
    if stage < 3:  # at stage 3 a unit is released when its module returns
        model.u.register_forward_hook(lambda m, a, out: read.append(float(m[0].weight.sum())))
    if remove:
        state.binding.remove()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        state, _ = zfunc.backward_step(state, lambda m, x: m(x).square().mean(), x, donate=True)
        state = zfunc.apply_step(state, donate=True)
        zfunc.tree.map(torch.add, state, zfunc.settle(state))  # gathered or not: one structure
    return snapshot(zfunc.settle(state)), model.seen[:1], read


def test_tied_weights_hooks_metadata_and_remove_with_units():
    for world in (2, 3):
        for stage in (1, 2, 3):
            units = ["u", "v"]
            plain = run_ranks(_tied, world, stage, None if stage < 3 else units, False)
            for remove in (False, True) if stage < 3 else (False,):  # stage 3 needs its hooks
                for rank, ((a, seen_a, read_a), (b, seen_b, read_b)) in enumerate(
                        zip(plain, run_ranks(_tied, world, stage, units, remove))):
                    where = f"stage {stage} world {world} rank {rank} remove {remove}"
                    assert seen_b == seen_a == ["(4, 4) torch.float32 16 True True"], where
                    assert len(read_b) == (3 if stage == 3 else 6), where
                    assert bitwise_equal(a, b) and read_a == read_b, where  # as without units (stage 3: with)
