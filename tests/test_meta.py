"""A model built on the meta device: materialized unit by unit, equal to the eager build."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zfunc
from tests.helpers import ZooNet, bitwise_equal, run_ranks, snapshot, zoo_batch, zoo_loss
from zfunc.core import materialize as materialize_module
from zfunc.models import GPT, GPTConfig, lm_loss
from zfunc.models.gpt import Block

SMALL = GPTConfig(vocab_size=11, block_size=6, n_layer=3, n_head=2, d_model=6)


class TiedNormed(nn.Module):
    """Modules initialised by their own reset_parameters: a BatchNorm (buffers), a frozen
    layer, and a weight shared by two layers (the first one's value is kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.bn = nn.BatchNorm1d(7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(7, 7)
        self.c = nn.Linear(7, 7)
        self.c.weight = self.b.weight
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.a(x)))
        h = h + self.frozen(h)
        return self.out(torch.tanh(self.b(h)) + torch.tanh(self.c(h * 0.5)))


def _tied_loss(model, x):
    return model(x).square().mean()


CASES = {  # build, init_fn, loss, batch, units
    "gpt": (lambda: GPT(SMALL), GPT._init, lm_loss,
            lambda rank, i: (lambda t: {"x": t[:, :-1], "y": t[:, 1:]})(
                torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(10 * i + rank))),
            [Block]),
    "tied": (TiedNormed, None, _tied_loss,
             lambda rank, i: torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * i + rank)), ["a", "out"]),
}


def _meta_vs_eager(rank: int, name: str, stage: int) -> dict[str, bool]:
    build, init_fn, loss_fn, batch, units = CASES[name]
    cfg = zfunc.Config(stage=stage, grad_accum=2, units=units if stage else None, persist_threshold=0,
                       optimizer=zfunc.adamw(lr=1e-2))
    torch.manual_seed(7)
    eager = build()
    after_eager = torch.rand(3)
    with torch.device("meta"):
        lazy = build()
    torch.manual_seed(7)
    a = zfunc.init(eager, cfg)
    b = zfunc.init(lazy, cfg, init_fn=init_fn)
    out = {"generator": torch.equal(after_eager, torch.rand(3)),  # construction's draws replayed exactly
           "init": bitwise_equal(snapshot(a), snapshot(b)),
           "module empty": all(p.is_meta for n, p in lazy.named_parameters() if n in a.layout.names)}
    step = zfunc.train_step(loss_fn)
    for i in range(2):
        a, b = step(a, batch(rank, i)), step(b, batch(rank, i))
    out["trained"] = bitwise_equal(snapshot(zfunc.settle(a)), snapshot(zfunc.settle(b)))
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_meta_built_model_equals_the_eager_build_bit_for_bit(world):
    for name in CASES:
        for stage in (0, 1, 2, 3):
            for rank, checks in enumerate(run_ranks(_meta_vs_eager, world, name, stage)):
                assert all(checks.values()), f"{name} stage {stage} world {world} rank {rank}: {checks}"


def test_stage_3_materializes_one_unit_at_a_time():
    cfg = GPTConfig(vocab_size=11, block_size=6, n_layer=8, n_head=2, d_model=16)
    with torch.device("meta"):
        model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    live = {"now": 0, "peak": 0}
    make, put = materialize_module._Tensors.make, materialize_module._Tensors.put

    def counted_make(self, name, device):
        new = make(self, name, device)
        live["now"] += new.numel()
        live["peak"] = max(live["peak"], live["now"])
        return new

    def counted_put(self, name, t):
        if t.is_meta and not self.get(name).is_meta:
            live["now"] -= t.numel()
        put(self, name, t)

    materialize_module._Tensors.make, materialize_module._Tensors.put = counted_make, counted_put
    try:
        state = zfunc.init(model, zfunc.Config(stage=3, units=[Block], persist_threshold=0), init_fn=GPT._init)
    finally:
        materialize_module._Tensors.make, materialize_module._Tensors.put = make, put
    root = total - 8 * block
    assert live["now"] == 0  # every trainable parameter went back to meta
    assert block <= live["peak"] <= root + 2 * block < total / 2, (live, root, block, total)
    assert len(state.layout.units) == 9


def test_zero_init_builds_on_meta_and_the_engine_trains_it():
    def build():
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))

    for stage in (0, 1, 2, 3):
        ds = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}}
        runs = []
        for lazy in (False, True):
            torch.manual_seed(0)
            with zfunc.zero.Init(enabled=lazy, config_dict_or_path=ds):
                model = build()
            assert model[0].weight.is_meta == lazy
            engine, *_ = zfunc.initialize(model=model, config=ds)
            for i in range(2):
                x = torch.randn(4, 4, generator=torch.Generator().manual_seed(i))
                engine.backward(engine(x).square().mean())
                engine.step()
            runs.append(snapshot(zfunc.full_params(engine.state)) + snapshot(engine.state.buffers))
        assert bitwise_equal(*runs), stage


class _Drawn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.w


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("mask", torch.tril(torch.ones(3, 3)))

    def forward(self, x):
        return self.lin(x) @ self.mask


def test_what_a_meta_build_cannot_recover_is_an_error_naming_it():
    with torch.device("meta"):
        zoo, drawn, masked = ZooNet(), _Drawn(), _Masked()
    with pytest.raises(zfunc.ConfigError, match=r"\['ZooNet'\] hold parameters or buffers but have no reset_param"):
        zfunc.init(zoo, zfunc.Config(stage=2))
    with pytest.raises(zfunc.ConfigError, match=r"\['_Masked'\] hold parameters or buffers but have no reset_param"):
        zfunc.init(masked, zfunc.Config(stage=1))
    with pytest.raises(zfunc.ConfigError, match="'mask' was not set by its module's reset_parameters"):
        zfunc.init(masked, zfunc.Config(stage=1), init_fn=lambda m: None)  # a buffer made in __init__ is lost
    with pytest.raises(zfunc.ConfigError, match="'w' was not set"):  # init_fn given, but it sets nothing of _Drawn
        zfunc.init(drawn, zfunc.Config(stage=0), init_fn=lambda m: None)
    with pytest.raises(zfunc.ConfigError, match="init_fn: the model's parameters are already initialised"):
        zfunc.init(nn.Linear(2, 2), zfunc.Config(), init_fn=lambda m: None)
    with pytest.raises(zfunc.ConfigError, match="device: 'cpu' is for a model built on the meta device"):
        zfunc.init(nn.Linear(2, 2), zfunc.Config(), device="cpu")
    with pytest.raises(zfunc.ConfigError, match="zero.Init: dtype=torch.float16 is not supported"):
        zfunc.zero.Init(dtype=torch.float16)
    with pytest.raises(zfunc.ConfigError, match="zero.Init: 'remote_devices' is not a keyword"):
        zfunc.zero.Init(remote_devices="cpu")


def _zoo_with_init_fn(rank: int) -> list[torch.Tensor]:
    def init_fn(m: nn.Module) -> None:
        if isinstance(m, ZooNet):
            nn.init.normal_(m.odd, std=0.1)

    torch.manual_seed(0)
    with torch.device("meta"):
        model = ZooNet()
    state = zfunc.init(model, zfunc.Config(stage=2, optimizer=zfunc.adamw(lr=1e-2)), init_fn=init_fn)
    step = zfunc.train_step(zoo_loss)
    for i in range(2):
        state = step(state, zoo_batch(i, rank, 4))
    return snapshot(zfunc.full_params(state))


def test_an_init_fn_sets_what_reset_parameters_does_not_and_every_rank_agrees():
    a, b, c = run_ranks(_zoo_with_init_fn, 3)
    assert bitwise_equal(a, b) and bitwise_equal(a, c)
    assert all(torch.isfinite(t).all() for t in a)
