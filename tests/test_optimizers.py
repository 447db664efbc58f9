"""SGD, Lion and Adagrad: kernels against float64, training against torch.optim (Lion: a float64
reference of the paper's rule), through the functional API and the shim, at every stage."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import zfunc
import zfunc_kernels
from tests.helpers import MODELS, bitwise_equal, run_ranks, snapshot, split

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HYPERS = {
    "sgd": zfunc_kernels.SGDHyper(momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd_nesterov": zfunc_kernels.SGDHyper(momentum=0.9, weight_decay=0.01, nesterov=True),
    "lion": zfunc_kernels.LionHyper(beta1=0.9, beta2=0.99, weight_decay=0.1),
    "adagrad": zfunc_kernels.AdagradHyper(lr_decay=0.01, weight_decay=0.01, eps=1e-10),
}
KERNELS = {"sgd": zfunc_kernels.fused_sgd, "lion": zfunc_kernels.fused_lion, "adagrad": zfunc_kernels.fused_adagrad}


def _step64(kind: str, p, g, s, step: int, lr: float, h) -> tuple:
    """The float64 rule of each optimizer (torch's SGD and Adagrad, the Lion paper)."""
    if kind.startswith("sgd"):
        d = g + h.weight_decay * p
        s = d.clone() if step == 0 else s * h.momentum + (1 - h.dampening) * d
        d = d + h.momentum * s if h.nesterov else s
        return p - lr * d, s
    if kind == "lion":
        u = torch.sign(h.beta1 * s + (1 - h.beta1) * g)
        return p * (1 - lr * h.weight_decay) - lr * u, h.beta2 * s + (1 - h.beta2) * g
    d = g + h.weight_decay * p
    s = s + d * d
    return p - lr / (1 + step * h.lr_decay) * d / (s.sqrt() + h.eps), s


def _kernel_run(kind: str, backend: str, master_dtype: torch.dtype, n: int = 37, steps: int = 3) -> float:
    gen = torch.Generator().manual_seed(0)
    p64 = torch.randn(n, generator=gen, dtype=torch.float64)
    grads = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(steps)]
    p, s = p64.to(master_dtype), torch.zeros(n)
    compute = torch.empty(n, dtype=BF16)
    step = torch.tensor(0)
    ref_p, ref_s = p.double(), torch.zeros(n, dtype=torch.float64)
    for i, g in enumerate(grads):
        scalars = zfunc_kernels.StepScalars(step, torch.tensor(0.01), torch.tensor(0.5), torch.tensor(0.8),
                                            torch.tensor(0.0))
        KERNELS[kind.split("_")[0]](p, (g * 2).to(F32), s, scalars, HYPERS[kind], compute=compute, backend=backend)
        ref_p, ref_s = _step64(kind, ref_p, (g * 2).to(F32).double() * 0.5 * 0.8, ref_s, i, 0.01, HYPERS[kind])
        ref_p = ref_p.to(master_dtype).double()  # the master's own rounding each step
    assert int(step) == steps and torch.equal(compute, p.to(BF16))
    tol = {F32: 2e-6, BF16: 1e-2, F16: 2e-3}[master_dtype]
    err = ((p.double() - ref_p).abs() / (ref_p.abs() + 1)).max().item()
    return err / tol


@pytest.mark.parametrize("kind", list(HYPERS))
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("master", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
def test_kernels_match_float64(kind, backend, master):
    assert _kernel_run(kind, backend, master) < 1.0


@pytest.mark.parametrize("kind", ["sgd", "lion", "adagrad"])
def test_found_inf_skips_and_backends_agree(kind):
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(64, generator=gen) for _ in range(2)]
    outs = {}
    for backend in ("cpu", "torch"):
        p, g, s, step = base[0].clone(), base[1].clone(), torch.zeros(64), torch.tensor(0)
        ok = zfunc_kernels.StepScalars(step, torch.tensor(0.1), torch.tensor(1.0), torch.tensor(1.0), torch.tensor(0.0))
        KERNELS[kind](p, g, s, ok, HYPERS[kind], backend=backend)
        kept = (p.clone(), s.clone())
        KERNELS[kind](p, g, s, ok._replace(found_inf=torch.tensor(1.0)), HYPERS[kind], backend=backend)
        assert torch.equal(p, kept[0]) and torch.equal(s, kept[1]) and int(step) == 1
        outs[backend] = p
    assert torch.allclose(outs["cpu"], outs["torch"], rtol=1e-6, atol=1e-7)


def test_slot_kernels_in_the_cuda_simulator():
    code = (
        "import torch, zfunc_kernels as k\n"
        "h = {'sgd': k.SGDHyper(momentum=0.9), 'lion': k.LionHyper(), 'adagrad': k.AdagradHyper()}\n"
        "for kind, f in (('sgd', k.fused_sgd), ('lion', k.fused_lion), ('adagrad', k.fused_adagrad)):\n"
        "    out = []\n"
        "    for backend in ('sim', 'torch'):\n"
        "        g = torch.Generator().manual_seed(0)\n"
        "        p, gr, s = torch.randn(20, generator=g), torch.randn(20, generator=g), torch.zeros(20)\n"
        "        sc = k.StepScalars(torch.tensor(0), torch.tensor(0.1), torch.tensor(1.0), torch.tensor(1.0), torch.tensor(0.0))\n"
        "        for _ in range(2):\n"
        "            f(p, gr, s, sc, h[kind], compute=torch.empty(20, dtype=torch.bfloat16), backend=backend)\n"
        "        out.append(p)\n"
        "    assert torch.allclose(out[0], out[1], rtol=1e-6, atol=1e-7), kind\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NUMBA_ENABLE_CUDASIM": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# -- training parity ------------------------------------------------------------------------

def _torch_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)
    if kind == "sgd_nesterov":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)
    raise ValueError(kind)


def _zfunc_optimizer(kind: str):
    return {"sgd": zfunc.sgd(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
            "sgd_nesterov": zfunc.sgd(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
            "adagrad": zfunc.adagrad(lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
            "lion": zfunc.lion(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)}[kind]


def _reference(kind: str, world: int, steps: int, ga: int) -> dict[str, torch.Tensor]:
    make, loss_fn, batch_fn = MODELS["zoo"]
    torch.manual_seed(0)
    model = make()
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "lion":
        model.double()
        moments = [torch.zeros_like(p) for p in params]
    else:
        opt = _torch_optimizer(kind, params)
    for i in range(steps):
        for p in params:
            p.grad = None
        for r in range(world):
            for mb in split(batch_fn(i, r, 2 * ga), ga):
                if kind == "lion":
                    mb = {k: v.double() if v.is_floating_point() else v for k, v in mb.items()}
                (loss_fn(model, mb) / (world * ga)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if kind == "lion":
            h = HYPERS["lion"]
            with torch.no_grad():
                for p, m in zip(params, moments):
                    new_p, new_m = _step64("lion", p, p.grad, m, i, 3e-3, h)
                    p.copy_(new_p)
                    m.copy_(new_m)
        else:
            opt.step()
    return {n: p.detach().float() for n, p in model.named_parameters()}


def _parity(rank: int, kind: str, stage: int, ga: int) -> float:
    make, loss_fn, batch_fn = MODELS["zoo"]
    world = zfunc.comm.world().size
    torch.manual_seed(0)
    cfg = zfunc.Config(stage=stage, grad_accum=ga, clip=1.0, persist_threshold=0, optimizer=_zfunc_optimizer(kind),
                       units=["inp", "a", "out"] if stage == 3 else None)
    state = zfunc.init(make(), cfg)
    step = zfunc.train_step(loss_fn)
    for i in range(4):
        state = step(state, batch_fn(i, rank, 2 * ga))
    ref = _reference(kind, world, 4, ga)
    full = zfunc.full_params(state)
    return max((full[n] - ref[n]).abs().max().item() for n in full)


@pytest.mark.parametrize("kind", ["sgd", "sgd_nesterov", "adagrad", "lion"])
def test_training_matches_the_reference(kind):
    for world, stage, ga in ((1, 0, 1), (3, 1, 2), (3, 2, 1), (3, 3, 2), (2, 0, 2)):
        tol = 2e-5 if kind == "lion" else 2e-6  # Lion: a sign of float32 vs float64 sums can flip near 0
        for d in run_ranks(_parity, world, kind, stage, ga):
            assert d < tol, (kind, world, stage, ga, d)


def _sgd_two_groups(model: nn.Module) -> torch.optim.SGD:
    """torch SGD with weight decay on three matrices only (a second group without it)."""
    decay = ("inp.weight", "a.weight", "out.weight")
    named = dict(model.named_parameters())
    rest = [p for n, p in named.items() if p.requires_grad and n not in decay]
    return torch.optim.SGD([{"params": [named[n] for n in decay]}, {"params": rest, "weight_decay": 0.0}],
                           lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)


def _shim(rank: int, stage: int) -> tuple[float, float]:
    make, loss_fn, batch_fn = MODELS["zoo"]
    world = zfunc.comm.world().size
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    out = []
    for how in ("torch", "config"):
        torch.manual_seed(0)
        model = make()
        if how == "torch":
            opt = _sgd_two_groups(model)
            engine, *_ = zfunc.initialize(model=model, optimizer=opt, config=ds)
        else:
            engine, *_ = zfunc.initialize(model=model, model_parameters=model.parameters(), config={
                **ds, "optimizer": {"type": "Adagrad", "params": {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.01,
                                                                  "initial_accumulator_value": 0.1}}})
        for i in range(3):
            engine.backward(loss_fn(engine, batch_fn(i, rank, 2)))
            engine.step()
        torch.manual_seed(0)
        ref = make()
        if how == "torch":
            ref_opt = _sgd_two_groups(ref)
        else:
            ref_opt = _torch_optimizer("adagrad", [p for p in ref.parameters() if p.requires_grad])
        for i in range(3):
            ref_opt.zero_grad()
            for r in range(world):
                (loss_fn(ref, batch_fn(i, r, 2)) / world).backward()
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 1.0)
            ref_opt.step()
        full, named = zfunc.full_params(engine.state), dict(ref.named_parameters())
        out.append(max((full[n] - named[n].detach()).abs().max().item() for n in full))
    return tuple(out)


def test_the_shim_maps_torch_sgd_groups_and_deepspeed_adagrad():
    for stage in (0, 1, 2, 3):
        for sgd_diff, adagrad_diff in run_ranks(_shim, 3, stage):
            assert sgd_diff < 2e-6 and adagrad_diff < 2e-6, (stage, sgd_diff, adagrad_diff)


def test_a_checkpoint_resumes_sgd_bitwise(tmp_path):
    make, loss_fn, batch_fn = MODELS["zoo"]

    def fresh(stage):
        torch.manual_seed(0)
        return zfunc.init(make(), zfunc.Config(stage=stage, optimizer=zfunc.sgd(lr=0.05, momentum=0.9)))

    step = zfunc.train_step(loss_fn)
    state = step(step(fresh(2), batch_fn(0, 0, 2)), batch_fn(1, 0, 2))
    zfunc.save(state, str(tmp_path / "c"))
    straight = step(state, batch_fn(2, 0, 2))
    resumed = step(zfunc.load(str(tmp_path / "c"), like=fresh(2)), batch_fn(2, 0, 2))
    assert bitwise_equal(snapshot(straight), snapshot(resumed))
    with pytest.raises(zfunc.CheckpointError, match="optimizer is sgd in the checkpoint but adam"):
        zfunc.load(str(tmp_path / "c"), like=zfunc.init(make(), zfunc.Config(stage=2)))


def test_optimizer_specific_mistakes_are_refused():
    with pytest.raises(zfunc.ConfigError, match=r"param_groups\[0\]: adam does not read \['momentum'\]"):
        zfunc.init(nn.Linear(2, 1), zfunc.Config(param_groups=[zfunc.ParamGroup("bias", momentum=0.9)]))
    with pytest.raises(zfunc.ConfigError, match="optimizer.nesterov: needs momentum > 0"):
        zfunc.sgd(nesterov=True)
    with pytest.raises(ValueError, match=r"sgd does not read \['betas'\]"):
        zfunc.set_hyperparams(zfunc.init(nn.Linear(2, 1), zfunc.Config(optimizer=zfunc.sgd())), betas=(0.9, 0.9))
    with pytest.raises(zfunc.ConfigError, match=r"^optimizer.params: expected keys of SGD"):
        zfunc.Config.from_deepspeed({"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}})
    assert math.isclose(zfunc.Config.from_deepspeed(
        {"train_batch_size": 1, "optimizer": {"type": "Lion", "params": {"lr": 1e-4}}}).optimizer.lr, 1e-4)
    memory = zfunc.memory_plan(nn.Linear(100, 10), zfunc.Config(stage=0, optimizer=zfunc.sgd(momentum=0.9)), 1)
    assert memory["optimizer"] == 1012 * 4  # one slot (padded to a multiple of 4), not Adam's two
