"""Floating buffers' dtype: the compute dtype by default (as ``model.bfloat16()``), their own
under a DeepSpeed config (DeepSpeed 0.19's default, FSDP2's), or ``data_types.buffer_dtype``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zfunc


class Rotary(nn.Module):
    """A fixed fp32 table used in the input's dtype, as rotary embeddings keep ``inv_freq``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(4) / 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cos(self.inv_freq).to(x.dtype)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), Rotary(), nn.Linear(4, 2))


def _dtypes(state: zfunc.TrainState) -> dict[str, torch.dtype]:
    return {n: b.dtype for n, b in state.buffers.items()}


def test_functional_default_casts_floating_buffers_to_the_compute_dtype():
    state = zfunc.init(_model(), zfunc.Config(precision="bf16"))
    assert _dtypes(state) == {"1.running_mean": torch.bfloat16, "1.running_var": torch.bfloat16,
                              "1.num_batches_tracked": torch.int64, "2.inv_freq": torch.bfloat16}
    assert state.buffers["2.inv_freq"].dtype == torch.bfloat16
    model = _model()
    del model[1]  # BatchNorm's kernel wants its statistics in its weights' dtype
    kept = zfunc.init(model, zfunc.Config(precision="bf16", buffer_dtype=None))
    assert kept.buffers["1.inv_freq"].dtype == torch.float32
    assert torch.equal(kept.buffers["1.inv_freq"], model[1].inv_freq)  # not rounded through bf16
    step = zfunc.train_step(lambda m, x: m(x).float().pow(2).mean())
    after = step(kept, torch.randn(8, 4))
    assert after.step.item() == 1 and torch.equal(after.buffers["1.inv_freq"], model[1].inv_freq)


def test_deepspeed_config_keeps_buffers_unless_buffer_dtype_says():
    base = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}}
    engine, *_ = zfunc.initialize(model=_model(), config=base)
    assert engine.state.buffers["1.running_mean"].dtype == torch.float32  # DeepSpeed 0.19: the loaded dtype
    engine, *_ = zfunc.initialize(model=_model(), config={
        **base, "data_types": {"buffer_dtype": "bf16", "keep_in_fp32_modules": [], "param_dtype": "bf16"}})
    assert engine.state.buffers["1.running_mean"].dtype == torch.bfloat16
    assert zfunc.Config.from_deepspeed(base).buffer_dtype is None


@pytest.mark.parametrize("types,match", [
    ({"param_dtype": "fp16"}, r"data_types.param_dtype: expected the enabled precision's dtype \(bfloat16"),
    ({"buffer_dtype": "bf16"}, r"data_types.keep_in_fp32_modules: expected \[\] with data_types.buffer_dtype"),
    ({"keep_in_fp32_modules": ["norm"]}, r"data_types.keep_in_fp32_modules: expected \"auto\" or \[\]"),
    ({"buffer_dtype": "fp64"}, r"data_types.buffer_dtype: expected \"fp32\", \"fp16\" or \"bf16\""),
])
def test_deepspeed_data_types_errors(types, match):
    with pytest.raises(zfunc.ConfigError, match=match):
        zfunc.Config.from_deepspeed({"train_batch_size": 8, "bf16": {"enabled": True}, "data_types": types})


def test_buffer_dtype_is_checked():
    with pytest.raises(zfunc.ConfigError, match="buffer_dtype: expected"):
        zfunc.Config(buffer_dtype="fp32")
