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


# -- kernels ------------------------------------------------------------------------------------

def _muon64(p, g, b, lr, h_mom, h_apply, o=None):
    """float64: torch.optim.Muon's element rule around an orthogonalized update ``o``."""
    b = b + (1 - h_mom.momentum) * (g - b)
    u = g + h_mom.momentum * (b - g) if h_mom.nesterov else b
    if o is None:
        return u, b
    return p * (1 - lr * h_apply.weight_decay) - lr * o, b


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_kernels_match_float64(backend, nesterov):
    gen = torch.Generator().manual_seed(0)
    n = 1001
    hm = zfunc_kernels.MuonMomentumHyper(momentum=0.95, nesterov=nesterov)
    ha = zfunc_kernels.MuonApplyHyper(weight_decay=0.1)
    p, b = torch.randn(n, generator=gen), torch.zeros(n)
    p64, b64 = p.double(), b.double()
    compute = torch.empty(n, dtype=BF16)
    count = torch.tensor(0)
    for _ in range(3):
        g = torch.randn(n, generator=gen)
        o = torch.randn(n, generator=gen)
        u = torch.zeros(n)
        s = zfunc_kernels.StepScalars(count.clone(), torch.tensor(0.02), torch.tensor(0.5), torch.tensor(0.8),
                                      torch.tensor(0.0))
        zfunc_kernels.fused_muon_momentum(u, g, b, s, hm, backend=backend)
        one = torch.tensor(1.0)
        zfunc_kernels.fused_muon_apply(p, o, s._replace(step=count, inv_scale=one, clip_coef=one), ha,
                                       compute=compute, backend=backend)
        u64, _ = _muon64(p64, g.double() * 0.5 * 0.8, b64, 0.02, hm, ha)
        p64, b64 = _muon64(p64, g.double() * 0.5 * 0.8, b64, 0.02, hm, ha, o.double())
        assert (u.double() - u64).abs().max() < 1e-6
    assert int(count) == 3 and torch.equal(compute, p.to(BF16))
    assert (p.double() - p64).abs().max() < 1e-6 and (b.double() - b64).abs().max() < 1e-6


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_muon_kernels_skip_on_overflow(backend):
    p, g, b, u = torch.ones(8), torch.full((8,), 2.0), torch.full((8,), 0.5), torch.zeros(8)
    s = zfunc_kernels.StepScalars(torch.tensor(0), torch.tensor(0.1), torch.tensor(1.0), torch.tensor(1.0),
                                  torch.tensor(1.0))
    zfunc_kernels.fused_muon_momentum(u, g, b, s, zfunc_kernels.MuonMomentumHyper(), backend=backend)
    zfunc_kernels.fused_muon_apply(p, g, s, zfunc_kernels.MuonApplyHyper(), backend=backend)
    assert torch.equal(b, torch.full((8,), 0.5)) and torch.equal(u, torch.zeros(8)) and torch.equal(p, torch.ones(8))
    assert int(s.step) == 0


def test_muon_kernels_in_the_cuda_simulator():
    code = (
        "import torch, zfunc_kernels as k\n"
        "out = []\n"
        "for backend in ('sim', 'torch'):\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    p, gr, b, u = torch.randn(40, generator=g), torch.randn(40, generator=g), torch.zeros(40), torch.zeros(40)\n"
        "    one = torch.tensor(1.0)\n"
        "    sc = k.StepScalars(torch.tensor(0), torch.tensor(0.1), one, one, torch.tensor(0.0))\n"
        "    for _ in range(2):\n"
        "        k.fused_muon_momentum(u, gr, b, sc, k.MuonMomentumHyper(), backend=backend)\n"
        "        k.fused_muon_apply(p, u, sc, k.MuonApplyHyper(), compute=torch.empty(40, dtype=torch.bfloat16),\n"
        "                           backend=backend)\n"
        "    out.append(torch.cat([p, b, u]))\n"
        "assert torch.allclose(out[0], out[1], rtol=1e-6, atol=1e-7)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NUMBA_ENABLE_CUDASIM": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_newton_schulz_is_torchs():
    """Ours against torch.optim.Muon's own (bfloat16), on a tall and a wide matrix."""
    from torch.optim._muon import _zeropower_via_newtonschulz as theirs
    gen = torch.Generator().manual_seed(0)
    for shape in ((7, 3), (3, 7), (5, 5)):
        x = torch.randn(shape, generator=gen)
        ours = newton_schulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert torch.equal(ours, theirs(x, (3.4445, -4.7750, 2.0315), 5, 1e-7))


# -- the exchange, the state, checkpoints, memory -------------------------------------------------

def _exchange(rank: int, stage: int) -> tuple[int, int, int]:
    make, _, _ = MODELS["zoo"]
    torch.manual_seed(0)
    state = zfunc.init(make(), _config(stage, 1, "zoo"))
    runs = opt_state.runs(state.cfg, state.layout)
    muon_numel = sum(r.length for r in runs[1])
    return (exchanged_numel(state.layout, stage == 0, (1,), runs[1]), muon_numel,
            state.group_opts[0].momentum_buffer.numel())


def test_only_boundary_crossing_matrices_are_exchanged():
    assert run_ranks(_exchange, 2, 0) == [(0, 154, 154)] * 2  # stage 0: everything is local
    # Stage 2, world 2: zoo's 192 elements (vectors 0..38, matrices 38..192) in shards of 96;
    # a.weight (73..122) is the one matrix cut: 23 elements on rank 0, 26 on rank 1. Each rank
    # sends the longer piece's length, so each receives 2 * 26; the momentum stays packed.
    assert run_ranks(_exchange, 2, 2) == [(52, 58, 58), (52, 96, 96)]


def _resume(rank: int, path: str, stage_after: int) -> tuple[bool, float]:
    make, loss_fn, batch_fn = MODELS["zoo"]
    torch.manual_seed(0)
    state = zfunc.init(make(), _config(2, 1, "zoo"))
    step = zfunc.train_step(loss_fn)
    for i in range(2):
        state = step(state, batch_fn(i, rank, 2))
    zfunc.save(state, path)
    for i in range(2, 4):
        state = step(state, batch_fn(i, rank, 2))
    torch.manual_seed(1)
    like = zfunc.init(make(), _config(stage_after, 1, "zoo"))
    again = zfunc.load(path, like=like)
    for i in range(2, 4):
        again = step(again, batch_fn(i, rank, 2))
    a, b = zfunc.full_params(state), zfunc.full_params(again)
    same = all(torch.equal(a[n], b[n]) for n in a)
    return same, max((a[n] - b[n]).abs().max().item() for n in a)


def test_a_checkpoint_resumes_muon_and_adamw(tmp_path):
    assert all(same for same, _ in run_ranks(_resume, 2, str(tmp_path / "a"), 2))  # bitwise, same layout
    assert all(d < 1e-6 for _, d in run_ranks(_resume, 3, str(tmp_path / "b"), 3))  # stage 2 -> 3


def test_memory_counts_each_optimizers_moments():
    make, _, _ = MODELS["zoo"]
    cfg = _config(0, 1, "zoo")
    state = zfunc.init(make(), cfg)
    muon = state.group_opts[0].momentum_buffer.numel()
    adam = state.opt.mu.numel()
    assert muon + adam == state.params.numel() and adam == 38  # the 1-D parameters
    rep, plan = zfunc.memory_report(state), zfunc.memory_plan(make(), cfg, world_size=1)
    assert rep["optimizer"] == plan["optimizer"] == 4 * (2 * adam + muon)


def test_hyperparameters_per_group_optimizer():
    state = zfunc.init(MODELS["zoo"][0](), _config(0, 1, "zoo"))
    assert state.hyper.momentum.tolist() == [0.0, 0.95] and state.hyper.lr.tolist() == [ADAM_LR, MUON_LR]
    later = zfunc.set_hyperparams(state, 1, momentum=0.9, lr=0.01)
    assert later.hyper.momentum.tolist() == [0.0, 0.9]
    with pytest.raises(ValueError, match="muon does not read.*betas"):
        zfunc.set_hyperparams(state, 1, betas=(0.9, 0.9))


# -- bad input --------------------------------------------------------------------------------------

def test_muon_refuses_what_is_not_a_matrix():
    model = MODELS["zoo"][0]()
    with pytest.raises(zfunc.ConfigError, match=r"param_groups\[0\].optimizer: muon takes 2-D parameters only.*odd"):
        zfunc.init(model, zfunc.Config(param_groups=[zfunc.ParamGroup(lambda n, p: True, optimizer=zfunc.muon())]))
    with pytest.raises(zfunc.ConfigError, match="optimizer: muon takes 2-D parameters only"):
        zfunc.init(model, zfunc.Config(optimizer=zfunc.muon()))
    with pytest.raises(zfunc.ConfigError, match="offload_optimizer is not supported"):
        zfunc.init(model, zfunc.Config(stage=1, offload_optimizer="cpu", param_groups=[
            zfunc.ParamGroup(is_matrix, optimizer=zfunc.muon())]))
    with pytest.raises(zfunc.ConfigError, match=r"param_groups\[0\]: muon does not read \['beta1', 'beta2'\]"):
        zfunc.init(model, zfunc.Config(param_groups=[zfunc.ParamGroup(is_matrix, betas=(0.9, 0.9),
                                                                      optimizer=zfunc.muon())]))
    for bad in (dict(ns_steps=100), dict(adjust_lr_fn="other"), dict(ns_coefficients=(1.0, 2.0)),
                dict(ns_dtype=torch.float16)):
        with pytest.raises(zfunc.ConfigError, match="optimizer." + next(iter(bad))):
            zfunc.muon(**bad)


def test_deepspeed_muon_config_errors():
    base = {"train_micro_batch_size_per_gpu": 2}
    for params, match in (({"lr": 0.1, "nesterov": True}, r"optimizer.params: .*keys of Muon.*\['nesterov'\]"),
                          ({"ns_method": "gram"}, 'ns_method.*"standard"'),
                          ({"per_head_muon": True}, "per_head_muon")):
        with pytest.raises(zfunc.ConfigError, match=match):
            zfunc.initialize(model=MODELS["zoo"][0](), config={**base, "optimizer": {"type": "Muon", "params": params}})
    with pytest.raises(zfunc.ConfigError, match="scheduler.type.*WarmupCosineLR with Muon"):
        zfunc.initialize(model=MODELS["zoo"][0](), config={**base, "optimizer": {"type": "Muon"},
                                                            "scheduler": {"type": "WarmupLR"}})
    conv = nn.Sequential(nn.Conv2d(2, 2, 3), nn.Flatten(), nn.Linear(2, 1))
    with pytest.raises(zfunc.ConfigError, match=r"muon takes 2-D parameters only.*0.weight \[2, 2, 3, 3\]"):
        zfunc.initialize(model=conv, config={**base, "optimizer": {"type": "Muon"}})


# -- the shim: DeepSpeed's Muon config, torch's two optimizers -----------------------------------

def _shim(rank: int, how: str, stage: int) -> float:
    make, loss_fn, batch_fn = MODELS["gpt"]
    world = zfunc.comm.world().size
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}

    def rule(name, p):  # DeepSpeed's: matrices without "embed" or "lm_head" in their names
        return p.ndim >= 2 and "embed" not in name.lower() and "lm_head" not in name.lower()

    def torch_pair(model):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        mats, rest = [p for n, p in named if rule(n, p)], [p for n, p in named if not rule(n, p)]
        if how == "deepspeed":
            return [torch.optim.Muon(mats, lr=0.01, momentum=0.9, weight_decay=0.05),
                    torch.optim.AdamW(rest, lr=2e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.05)]
        return [torch.optim.Muon(mats, lr=0.01, weight_decay=0.05), torch.optim.AdamW(rest, lr=2e-3)]

    torch.manual_seed(0)
    model = make()
    if how == "deepspeed":
        config = {**ds, "optimizer": {"type": "Muon", "params": {"muon_lr": 0.01, "adam_lr": 2e-3, "momentum": 0.9,
                                                                 "weight_decay": 0.05}}}
        engine, optimizer, *_ = zfunc.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert [round(g["lr"], 6) for g in optimizer.param_groups] == [2e-3, 0.01]
    else:
        engine, optimizer, *_ = zfunc.initialize(model=model, optimizer=torch_pair(model), config=ds)
    for i in range(3):
        engine.backward(loss_fn(engine, batch_fn(i, rank, 2)))
        engine.step()
    torch.manual_seed(0)
    ref = make()
    opts = torch_pair(ref)
    for i in range(3):
        for o in opts:
            o.zero_grad()
        for r in range(world):
            (loss_fn(ref, batch_fn(i, r, 2)) / world).backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 1.0)
        for o in opts:
            o.step()
    full, named = zfunc.full_params(engine.state), dict(ref.named_parameters())
    return max((full[n] - named[n].detach()).abs().max().item() for n in full)


@pytest.mark.parametrize("how", ["deepspeed", "torch"])
def test_the_shim_trains_muon_as_deepspeed_and_torch_users_write_it(how):
    for stage in (0, 3):
        assert run_ranks(_shim, 1, how, stage) == [pytest.approx(0.0, abs=1e-5)], (how, stage)
