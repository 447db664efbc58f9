"""Muon and an optimizer per parameter group: kernels against float64, training against
single-process ``torch.optim.Muon`` + ``torch.optim.AdamW`` at worlds 1-3 and stages 0-3, the
whole-matrix exchange, checkpoints, DeepSpeed's Muon config, and the errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import zfunc
import zfunc_kernels
from tests.helpers import MODELS, run_ranks, split
from zfunc.core import opt_state
from zfunc.core.muon import exchanged_numel, newton_schulz

F32, BF16 = torch.float32, torch.bfloat16
MUON_LR, ADAM_LR = 0.02, 1e-2


def is_matrix(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2


def _config(stage: int, ga: int, name: str, ns_dtype: torch.dtype = F32) -> zfunc.Config:
    units = {"zoo": ["inp", "a", "out"], "gpt": None}[name] if stage == 3 else None
    group = zfunc.ParamGroup(is_matrix, optimizer=zfunc.muon(lr=MUON_LR, weight_decay=0.1, ns_dtype=ns_dtype))
    return zfunc.Config(stage=stage, grad_accum=ga, clip=1.0, persist_threshold=0, units=units,
                        optimizer=zfunc.adamw(lr=ADAM_LR, weight_decay=0.01), param_groups=[group])


def _ns_float32(grad, ns_coefficients, ns_steps, eps):
    """Newton-Schulz as torch.optim.Muon's, in float32 (written out: X = aX + (bA + cA^2)X)."""
    a, b, c = ns_coefficients
    x = grad.float()
    wide = x if x.size(0) <= x.size(1) else x.T
    wide = wide / max(wide.norm().item(), eps)
    for _ in range(ns_steps):
        gram = wide @ wide.T
        wide = a * wide + (b * gram + c * gram @ gram) @ wide
    return wide if x.size(0) <= x.size(1) else wide.T


def _reference(name: str, world: int, steps: int, ga: int, ns_dtype: torch.dtype = F32) -> dict[str, torch.Tensor]:
    """Single process: torch.optim.Muon on the matrices (its Newton-Schulz in float32 unless
    ``ns_dtype`` is bfloat16, torch's own), torch.optim.AdamW on the rest."""
    if ns_dtype == F32:
        from unittest import mock
        with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", _ns_float32):
            return _reference(name, world, steps, ga, BF16)
    make, loss_fn, batch_fn = MODELS[name]
    torch.manual_seed(0)
    model = make()
    params = [p for p in model.parameters() if p.requires_grad]
    muon = torch.optim.Muon([p for p in params if p.ndim == 2], lr=MUON_LR, weight_decay=0.1)
    adamw = torch.optim.AdamW([p for p in params if p.ndim != 2], lr=ADAM_LR, weight_decay=0.01)
    for i in range(steps):
        for p in params:
            p.grad = None
        for r in range(world):
            for mb in split(batch_fn(i, r, 2 * ga), ga):
                (loss_fn(model, mb) / (world * ga)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        muon.step()
        adamw.step()
    return {n: p.detach().float() for n, p in model.named_parameters()}


def _parity(rank: int, name: str, stage: int, ga: int, steps: int = 3, ns_dtype: torch.dtype = F32
            ) -> tuple[float, float]:
    make, loss_fn, batch_fn = MODELS[name]
    world = zfunc.comm.world().size
    torch.manual_seed(0)
    state = zfunc.init(make(), _config(stage, ga, name, ns_dtype))
    step = zfunc.train_step(loss_fn)
    for i in range(steps):
        state = step(state, batch_fn(i, rank, 2 * ga))
    ref = _reference(name, world, steps, ga, ns_dtype)
    full = zfunc.full_params(state)
    diff = {n: (full[n] - ref[n]).abs().max().item() for n in full}
    mats = [d for n, d in diff.items() if full[n].ndim == 2]
    rest = [d for n, d in diff.items() if full[n].ndim != 2]
    return max(mats), max(rest)


@pytest.mark.parametrize("name", ["zoo", "gpt"])
def test_one_rank_matches_torch_muon_in_bfloat16(name):
    """The default (Newton-Schulz in bfloat16, as torch) against stock torch.optim.Muon."""
    for ga in (1, 2):
        for stage in (0, 2):
            (muon_diff, adam_diff), = run_ranks(_parity, 1, name, stage, ga, 3, BF16)
            assert muon_diff < 1e-5 and adam_diff < 1e-6, (name, stage, ga, muon_diff, adam_diff)


@pytest.mark.parametrize("name", ["zoo", "gpt"])
def test_training_matches_torch_muon_and_adamw(name):
    """Sharded: the summed gradients differ from one process's by rounding (~1e-8), which bfloat16
    Newton-Schulz can turn into a different rounding of the update (a bfloat16 ulp, ~1e-4 here);
    in float32 the comparison is tight. Matrices cross shard boundaries at every world size."""
    for world, stage, ga in ((1, 0, 1), (2, 0, 2), (2, 1, 1), (3, 1, 2), (3, 2, 1), (2, 2, 2), (3, 3, 2),
                             (2, 3, 1)):
        for muon_diff, adam_diff in run_ranks(_parity, world, name, stage, ga):
            assert muon_diff < 1e-5 and adam_diff < 1e-6, (name, world, stage, ga, muon_diff, adam_diff)
