"""Pretrained weights straight into the shards: safetensors (one file, a sharded index) and torch files."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import zfunc
from tests.helpers import bitwise_equal, run_ranks, snapshot
from zfunc.core import weights as weights_module
from zfunc.models import GPT, GPTConfig
from zfunc.models.gpt import Block

SMALL = GPTConfig(vocab_size=11, block_size=6, n_layer=3, n_head=2, d_model=6)


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(SMALL)
        self.bn = nn.BatchNorm1d(11)
        self.frozen = nn.Linear(11, 11)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.bn(self.gpt(x).mean(1)))


def _trained_values(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = Normed()
    model.bn.running_mean.uniform_()  # buffers with values of their own
    model.bn.num_batches_tracked.fill_(5)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _write(where: str, kind: str, values: dict[str, torch.Tensor], prefix: str = "") -> str:
    values = {prefix + n: t.contiguous() for n, t in values.items() if n != "gpt.head.weight"}  # tied: stored once
    if kind == "safetensors":
        save_file(values, f"{where}/model.safetensors")
    elif kind == "sharded":
        names = sorted(values)
        half = {n: ("a.safetensors" if k % 2 else "b.safetensors") for k, n in enumerate(names)}
        for f in ("a.safetensors", "b.safetensors"):
            save_file({n: values[n] for n in names if half[n] == f}, f"{where}/{f}")
        with open(f"{where}/model.safetensors.index.json", "w") as fh:
            json.dump({"metadata": {}, "weight_map": half}, fh)
    else:
        torch.save(values, f"{where}/pytorch_model.bin")
    return where


def _loaded(rank: int, where: str, stage: int, meta: bool) -> tuple[list, list, int, int, int]:
    torch.manual_seed(1)  # other values than the files'
    if meta:
        with torch.device("meta"):
            model = Normed()
    else:
        model = Normed()
    read = {"n": 0}
    original = weights_module.Weights.read_range

    def counted(self, name, start, stop):
        out = original(self, name, start, stop)
        read["n"] += out.numel()
        return out

    weights_module.Weights.read_range = counted
    try:
        cfg = zfunc.Config(stage=stage, units=[Block] if stage else None, persist_threshold=0)
        state = zfunc.init(model, cfg, weights=where, init_fn=GPT._init if meta else None)
    finally:
        weights_module.Weights.read_range = original
    values = _trained_values(0)
    full = zfunc.full_params(state)
    trained = sum(t.numel() for t in full.values())
    got = snapshot(full) + snapshot({**state.frozen, **state.buffers})
    want = snapshot({n: values[n] for n in full}) + snapshot({n: values[n] for n in {**state.frozen, **state.buffers}})
    replicated = sum(t.numel() for t in {**state.frozen, **state.buffers}.values())  # every rank reads these whole
    return got, want, read["n"], trained, replicated


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "torch"])
def test_weights_load_into_the_shards_at_every_stage_and_world(kind, tmp_path):
    where = _write(str(tmp_path), kind, _trained_values(0))
    for world in (1, 2, 3) if kind == "safetensors" else (2,):
        for stage in (0, 1, 2, 3):
            for meta in (False, True) if stage == 3 else (False,):
                for rank, (got, want, read, trained, replicated) in enumerate(
                        run_ranks(_loaded, world, where, stage, meta)):
                    where_ = f"{kind} world {world} stage {stage} meta {meta} rank {rank}"
                    assert len(got) == len(want) and bitwise_equal(got, want), where_
                    if stage > 0:  # each rank reads only what it keeps: about 1/world of the trained elements
                        assert read - replicated <= math.ceil(trained / world) + 64, (where_, read, trained)
                    else:
                        assert read - replicated == trained, where_


def test_weights_map_missing_names_and_shape_errors(tmp_path):
    values = _trained_values(0)
    where = _write(str(tmp_path), "safetensors", values, prefix="model.")
    torch.manual_seed(1)
    state = zfunc.init(Normed(), zfunc.Config(stage=2), weights=where, weights_map=lambda n: "model." + n)
    assert torch.equal(zfunc.full_params(state)["gpt.tok.weight"], values["gpt.tok.weight"])

    partial = tmp_path / "partial"
    partial.mkdir()
    save_file({"gpt.tok.weight": values["gpt.tok.weight"]}, str(partial / "model.safetensors"))
    torch.manual_seed(1)
    model = Normed()
    before = model.gpt.pos.weight.detach().clone()
    with pytest.warns(UserWarning, match=r"weights: \d+ parameters and buffers of the model are not in the files"):
        state = zfunc.init(model, zfunc.Config(stage=1), weights=str(partial))
    full = zfunc.full_params(state)
    assert torch.equal(full["gpt.tok.weight"], values["gpt.tok.weight"]) and torch.equal(full["gpt.pos.weight"], before)

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    save_file({**{n: t.contiguous() for n, t in values.items() if n != "gpt.head.weight"},
               "gpt.pos.weight": torch.zeros(7, 6)}, str(wrong / "model.safetensors"))
    with pytest.raises(zfunc.ConfigError, match=r"weights: 'gpt.pos.weight' has shape \[7, 6\] in the files, the "
                                                r"model's is \[6, 6\]"):
        zfunc.init(Normed(), zfunc.Config(stage=3), weights=str(wrong))
    (tmp_path / "empty").mkdir()
    with pytest.raises(zfunc.ConfigError, match="holds none of"):
        zfunc.init(Normed(), zfunc.Config(), weights=str(tmp_path / "empty"))


def test_a_truncated_or_missing_shard_is_an_error_naming_the_file(tmp_path):
    where = _write(str(tmp_path), "sharded", _trained_values(0))
    with open(tmp_path / "a.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(zfunc.ConfigError, match=r"a.safetensors' is unreadable .* damaged or truncated"):
        zfunc.init(Normed(), zfunc.Config(stage=2), weights=where)
    os.remove(tmp_path / "a.safetensors")
    with pytest.raises(zfunc.ConfigError, match=r"a.safetensors', a shard model.safetensors.index.json names, does "
                                                r"not exist"):
        zfunc.init(Normed(), zfunc.Config(stage=2), weights=where)
