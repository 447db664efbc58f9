"""Bad input gets a clear error naming the problem and the fix; nothing is half applied."""

from __future__ import annotations

import pytest
import torch

import zfunc
from tests.helpers import run_ranks


@pytest.mark.parametrize("kwargs,match", [
    (dict(stage=4), r"stage: expected one of 0, 1, 2, 3, got 4"),
    (dict(stage="2"), r"stage: expected one of 0, 1, 2, 3, got '2'"),
    (dict(grad_accum=0), r"grad_accum: expected a positive integer, got 0"),
    (dict(grad_accum=2.0), r"grad_accum: expected a positive integer, got 2.0"),
    (dict(clip=-1.0), r"clip: expected None or a finite number >= 0, got -1.0"),
    (dict(precision="fp8"), r'precision: expected "fp32", "fp16" or "bf16"'),
    (dict(optimizer="adam"), r"optimizer: expected zfunc.adam, adamw, sgd, lion, adagrad or muon"),
    (dict(moment_dtype=torch.float16), r"moment_dtype: expected torch.float32 or torch.bfloat16"),
    (dict(persist_threshold=True), r"persist_threshold: expected an integer >= 0, got True"),
    (dict(prefetch=-1), r"prefetch: expected an integer >= 0 \(units gathered ahead\), got -1"),
    (dict(bucket_mb=0), r"bucket_mb: expected a number > 0 \(MiB\), got 0"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(zfunc.ConfigError, match=match):
        zfunc.Config(**kwargs)


@pytest.mark.parametrize("lr", [-1e-3, float("nan"), float("inf")])
def test_negative_or_non_finite_lr(lr):
    with pytest.raises(zfunc.ConfigError, match=r"optimizer.lr: expected a finite number >= 0"):
        zfunc.adamw(lr=lr)
    assert zfunc.adamw(lr=0).lr == 0  # as torch.optim.AdamW: a frozen-by-lr group is allowed


def test_bad_betas_and_eps():
    with pytest.raises(zfunc.ConfigError, match=r"optimizer.betas"):
        zfunc.adam(betas=(0.9, 1.0))
    with pytest.raises(zfunc.ConfigError, match=r"optimizer.eps"):
        zfunc.adam(eps=-1.0)


def test_batch_that_does_not_split_into_micro_batches():
    state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config(grad_accum=4))
    step = zfunc.train_step(lambda m, b: m(b).sum(), donate=False)
    with pytest.raises(zfunc.ConfigError, match=r"shape \[6, 2\] cannot be split into grad_accum=4"):
        step(state, torch.ones(6, 2))
    assert state.micro_step.item() == 0  # nothing was accumulated


def test_loss_must_be_a_scalar():
    state = zfunc.init(torch.nn.Linear(2, 3), zfunc.Config())
    with pytest.raises(TypeError, match=r"loss_fn must return a scalar tensor; got Tensor of shape \[4, 3\]"):
        zfunc.backward_step(state, lambda m, b: m(b), torch.ones(4, 2))


def test_accumulate_rejects_unknown_names_and_shapes():
    state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config())
    with pytest.raises(KeyError, match=r"\['bogus'\] are not trainable parameters"):
        zfunc.accumulate(state, {"bogus": torch.ones(1)})
    with pytest.raises(ValueError, match=r"gradient of 'weight' has shape \[2\], expected \[1, 2\]"):
        zfunc.accumulate(state, {"weight": torch.ones(2)}, strict=False)


def test_model_without_trainable_parameters():
    model = torch.nn.Linear(2, 1).requires_grad_(False)
    with pytest.raises(zfunc.ConfigError, match=r"no parameter with requires_grad=True"):
        zfunc.init(model, zfunc.Config())


def _differing_model(rank: int) -> str:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, 4), torch.nn.Linear(4, 2 if rank != 1 else 5)]
    try:
        zfunc.init(torch.nn.Sequential(*layers), zfunc.Config(stage=2))
    except zfunc.ConfigError as e:
        return str(e)
    return "no error"


def test_parameters_differing_across_ranks_are_named_on_every_rank():
    messages = run_ranks(_differing_model, 3)
    for msg in messages:
        assert "the parameters differ across ranks at parameter #2" in msg, msg
        assert "rank 1: 1.weight [5, 4] torch.float32" in msg and "rank 0: 1.weight [2, 4]" in msg, msg
