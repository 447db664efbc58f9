"""The imperative shim against a single-process reference (mean of per-rank grads, torch AdamW)."""

from __future__ import annotations

import math
from typing import Any
import warnings

import pytest
import torch
from torch import nn

import zfunc

from tests.helpers import run_ranks, side_by_side


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3))


def _data(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(97 * i + rank)
    return torch.randn(2, 4, generator=g), torch.randint(0, 3, (2,), generator=g)


def _ds(stage: int, gas: int = 1, world: int = 2, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage}, **extra}


def _reference(steps: int, gas: int, world: int, *, scale: float = 1.0):
    """Params after each boundary of torch AdamW on the mean loss over ranks and micro-batches."""
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    out = []
    for s in range(steps):
        opt.zero_grad()
        for m in range(gas):
            for r in range(world):
                x, y = _data(s * gas + m, r)
                (nn.functional.cross_entropy(ref(x), y) * scale / (gas * world)).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    return out


def _diff(engine, ref_params) -> float:
    full = zfunc.full_params(engine.state)
    return max((full[n] - p).abs().max().item() for n, p in ref_params.items())


def _backward_styles(rank: int, stage: int, style: str, gas: int) -> tuple[list, list]:
    world = zfunc.comm.world().size
    engine, *_ = zfunc.initialize(model=_model(), config=_ds(stage, gas))
    refs = _reference(2, gas, world)
    diffs, applied = [], []
    for i in range(2 * gas):
        x, y = _data(i, rank)
        out = engine.module(x) if style == "module" else engine(x)  # engine.module(x) is engine(x)
        if style in ("engine", "module"):
            engine.backward(nn.functional.cross_entropy(out, y))
        elif style == "tensor":
            nn.functional.cross_entropy(out, y).backward()
        else:  # non-scalar: the gradient of the loss with respect to the output, passed by hand
            out_leaf = out.detach().requires_grad_()
            nn.functional.cross_entropy(out_leaf, y).backward()
            out.backward(out_leaf.grad)
        before = zfunc.full_params(engine.state)
        engine.step()
        applied.append(engine.was_step_applied())
        if (i + 1) % gas == 0:
            diffs.append(_diff(engine, refs[i // gas]))
        else:  # params move only at boundaries
            after = zfunc.full_params(engine.state)
            diffs.append(max((after[n] - before[n]).abs().max().item() for n in after))
    return diffs, applied


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("style", ["engine", "module", "tensor", "nonscalar"])
@pytest.mark.parametrize("gas", [1, 4])
def test_every_backward_style_matches_the_reference(stage, style, gas):
    for diffs, applied in run_ranks(_backward_styles, 2, stage, style, gas):
        assert max(diffs) < 2e-6, diffs
        assert applied == ([True, True] if gas == 1 else [False, False, False, True] * 2)


def _gradient_lifetimes(rank: int, stage: int) -> tuple[list[int], int]:
    import gc
    import weakref

    engine, *_ = zfunc.initialize(model=_model(), config=_ds(stage))
    held, accumulators = [], []
    for i in range(6):
        x, y = _data(i, rank)
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        accumulators.append(weakref.ref(engine.state.grads))
        engine.step()
        held.append(zfunc.memory_report(engine.state)["grads"])
    gc.collect()
    return held, sum(r() is not None for r in accumulators)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engine_holds_no_gradient_between_steps(stage):
    """Each step's accumulator is freed after the step (nothing keeps it: not the sinks, not the
    hooks of stage 3's gatherers), and the state between steps holds no gradient memory."""
    for held, alive in run_ranks(_gradient_lifetimes, 2, stage):
        assert held == [0] * 6 and alive == 0, (held, alive)


def _unscaled(rank: int, stage: int) -> float:
    engine, *_ = zfunc.initialize(model=_model(), config=_ds(stage, gas=2))
    for i in range(2):
        x, y = _data(i, rank)
        engine.backward(nn.functional.cross_entropy(engine(x), y), scale_wrt_gas=False)
        engine.step()
    return _diff(engine, _reference(1, 2, 2, scale=2.0)[0])


def test_scale_wrt_gas_false_is_the_unscaled_sum():
    for stage in (0, 2):
        assert max(run_ranks(_unscaled, 2, stage)) < 2e-6


def _three_engines(rank: int, stage: int) -> float:
    engines = [zfunc.initialize(model=_model(), config=_ds(stage))[0] for _ in range(3)]
    refs = [_model() for _ in range(3)]
    opts = [torch.optim.AdamW(r.parameters(), lr=1e-2, weight_decay=0.0) for r in refs]
    for it in range(2):
        x, y = _data(it, rank)
        loss = sum(nn.functional.cross_entropy(e(x), y) / (i + 1) for i, e in enumerate(engines))
        loss.backward()
        for e in engines:
            e.step()
        for o in opts:
            o.zero_grad()
        for r in range(2):
            xr, yr = _data(it, r)
            (sum(nn.functional.cross_entropy(m(xr), yr) / (i + 1) for i, m in enumerate(refs)) / 2).backward()
        for o in opts:
            o.step()
    return max(_diff(e, dict(m.named_parameters())) for e, m in zip(engines, refs))


def test_one_loss_over_three_engines():
    for stage in (1, 2, 3):
        assert max(run_ranks(_three_engines, 2, stage)) < 2e-6


def _manual(rank: int, stage: int) -> float:
    counts = [2, 5, 3]
    manual, *_ = zfunc.initialize(model=_model(), config=_ds(stage))
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    i = 0
    for n in counts:
        manual.set_gradient_accumulation_boundary(False)
        opt.zero_grad()
        for k in range(n):
            if k == n - 1:
                manual.set_gradient_accumulation_boundary(True)
            x, y = _data(i + k, rank)
            manual.backward(nn.functional.cross_entropy(manual(x), y) / n, scale_wrt_gas=False)
            for r in range(2):
                xr, yr = _data(i + k, r)
                (nn.functional.cross_entropy(ref(xr), yr) / (n * 2)).backward()
        manual.step()
        opt.step()
        i += n
    return _diff(manual, dict(ref.named_parameters()))


def test_n_backwards_between_steps_all_accumulate():
    for stage in (0, 1, 2):
        assert max(run_ranks(_manual, 2, stage)) < 2e-6


def _fp16_nonscalar(rank: int, stage: int) -> str:
    cfg = _ds(stage, fp16={"enabled": True, "initial_scale_power": 8})
    engine, *_ = zfunc.initialize(model=_model(), config=cfg)
    x, _ = _data(0, rank)
    out = engine(x)
    try:
        out.backward(torch.ones_like(out) / out.numel())
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_nonscalar_backward_under_fp16_dynamic_scaling_is_refused_as_deepspeed_does():
    # DeepSpeed 0.19.8 scales a backward only through engine.backward/engine.scale (scalars); an
    # out.backward(grad) under fp16 loss scaling ends in its "Loss scaling is required" error
    for said in run_ranks(_fp16_nonscalar, 2, 2):
        assert "Loss scaling is required" in said, said


def test_engine_state_round_trips_through_functional_code():
    engine, *_ = zfunc.initialize(model=_model(), config=_ds(2, world=1))
    state = engine.state
    state, _ = zfunc.backward_step(state, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), _data(0, 0))
    engine.state = zfunc.apply_step(state)
    assert engine.global_steps == 1
    w = dict(engine.module.named_parameters())["0.weight"]
    assert torch.equal(w, zfunc.full_params(engine.state)["0.weight"])  # the module shows current weights


@pytest.mark.parametrize("tbs,mbs,gas,ok", [(32, 16, 1, True), (32, 8, 2, True), (33, 17, 2, False),
                                            (32, 18, 1, False)])
def test_deepspeed_batch_table_at_world_two(tbs, mbs, gas, ok):
    ds = {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": gas}
    if ok:
        assert zfunc.Config.from_deepspeed(ds, world_size=2).grad_accum == gas
    else:
        with pytest.raises(zfunc.ConfigError, match="make the three batch keys consistent"):
            zfunc.Config.from_deepspeed(ds, world_size=2)


@pytest.mark.parametrize("ds,match", [
    ({}, "set at least one of them"),
    ({"train_batch_size": 0}, r"train_batch_size: expected a positive integer"),
    ({"train_batch_size": 8, "gradient_clipping": -1}, r"gradient_clipping: expected a finite number >= 0"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 4}}, r"zero_optimization.stage: expected one of"),
    ({"train_batch_size": 8, "optimizer": {"type": "Lamb"}}, r'optimizer.type: expected "Adam", "AdamW", "SGD", "Lion", "Adagrad" or "Muon"'),
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "max_grad_norm"),
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": -1}}}, r"^optimizer\.params\.lr: "),
    ({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable one of them"),
    ({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": -1}}, r"fp16.loss_scale: expected a finite"),
    ({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": True}}, r"fp16.loss_scale"),
    ({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale_window": 0}}, r"fp16.loss_scale_window"),
    ({"train_batch_size": 8, "fp16": {"enabled": True, "min_loss_scale": float("nan")}}, r"fp16.min_loss_scale"),
    ({"train_batch_size": 8, "bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16_master_weights"),
    ({"train_batch_size": 8, "torch_autocast": {"enabled": True, "dtype": "fp8"}}, r"torch_autocast.dtype"),
    ({"train_batch_size": 8, "scheduler": {"type": "OneCyclic"}}, r"scheduler.type: expected one of"),
    ({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
     r"scheduler.params.warmup_num_steps"),
])
def test_deepspeed_config_errors_name_the_key(ds, match):
    with pytest.raises(zfunc.ConfigError, match=match):
        zfunc.Config.from_deepspeed(ds, world_size=2)


def test_deepspeed_precision_and_optimizer_mapping():
    cfg = zfunc.Config.from_deepspeed({"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {
        "lr": 3e-4, "adam_w_mode": False}}, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True}, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    assert (cfg.precision, cfg.master_dtype, cfg.moment_dtype, cfg.autocast) == (
        "bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert cfg.optimizer.decoupled is False and cfg.clip == 1.0  # "Adam" + adam_w_mode false; clip default 1.0
    fp16 = zfunc.Config.from_deepspeed({"train_batch_size": 4, "fp16": {
        "enabled": True, "initial_scale_power": 8, "hysteresis": 3, "loss_scale_window": 10}})
    assert fp16.loss_scale == zfunc.DynamicLossScale(init=256.0, window=10, hysteresis=3)
    assert zfunc.Config.from_deepspeed({"train_batch_size": 4, "fp16": {"enabled": True, "loss_scale": "3"}}
                                       ).loss_scale == 3.0


def test_harmless_keys_give_one_warning_and_the_rest_are_refused():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zfunc.Config.from_deepspeed({"train_batch_size": 4, "activation_checkpointing": {}, "flops_profiler": {},
                                     "gradient_predivide_factor": 1.0, "gradient_allreduce_op": "mean",
                                     "zero_optimization": {"stage": 1, "overlap_comm": True,
                                                           "offload_optimizer": {"device": "none"}}})
    assert len(caught) == 1
    assert "activation_checkpointing, flops_profiler, gradient_predivide_factor, zero_optimization.overlap_comm" in str(caught[0].message)
    refused = [
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
         "zero_optimization.offload_optimizer.device"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
         "zero_optimization.offload_optimizer.ratio"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memry": True}}},
         "zero_optimization.offload_optimizer.pin_memry"),
        ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, "zero_optimization.offload_param.device"),
        ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, "zero_optimization.offload_param.device"),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer: needs stage"),
        ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor: expected a number > 0"),
        ({"prescale_gradients": 1}, "prescale_gradients: expected true or false"),
        ({"gradient_allreduce_op": "max"}, "gradient_allreduce_op"),
        ({"managed_gradient_accumulation": "no"}, "managed_gradient_accumulation"),
        ({"bf16": {"enabled": True, "check_grad_overflow": False}}, "bf16.check_grad_overflow"),
        ({"bf16": {"enabled": True, "check_grad_overflow": "yes"}}, "bf16.check_grad_overflow"),
        ({"fp16": {"enabled": True, "consecutive_hysteresis": 1}}, "fp16.consecutive_hysteresis"),
        ({"train_batch_szie": 4}, "train_batch_szie"),
        ({"zero_optimization": {"stagee": 2}}, "zero_optimization.stagee"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "wieght_decay": 0.1}}}, "optimizer.params"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 3}}}, "scheduler.params.warmup_num_step"),
        ({"amp": {"enabled": True}}, "amp"),
        ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1, "load_from_fp32_weights": False}},
         "zero_optimization.load_from_fp32_weights: expected true"),  # (it changes the loaded masters)
        ({"zero_optimization": {"stage": 1, "load_from_fp32_weights": "no"}}, "zero_optimization.load_from_fp32_weights"),
    ]
    for extra, path in refused:
        with pytest.raises(zfunc.ConfigError, match="^" + path.replace(".", r"\.")):
            zfunc.Config.from_deepspeed({"train_batch_size": 4, **extra})


def test_deepspeed_schedule_lags_one_update():
    cfg = zfunc.Config.from_deepspeed({"train_batch_size": 4, "optimizer": {"params": {"lr": 1.0}}, "scheduler": {
        "type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_num_steps": 4, "warmup_type": "linear"}}})
    assert [round(cfg.lr_schedule(u).item(), 3) for u in range(6)] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0]


def _second_order(rank: int, stage: int) -> tuple[str, str, float]:
    """create_graph=True through the parameters is refused; a gradient penalty on the inputs is
    torch's at any grad_accum and world (nothing scales the model's outputs); on one rank it
    trains like torch."""
    world = zfunc.comm.world().size
    engine, *_ = zfunc.initialize(model=_model(), config=_ds(stage, 2))
    x, y = _data(0, rank)

    def penalised(model, x, y):
        x = x.clone().requires_grad_()
        loss = nn.functional.cross_entropy(model(x), y)
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        return loss + gx.pow(2).sum()

    said = []
    for attempt in (lambda: nn.functional.cross_entropy(engine(x), y).backward(create_graph=True),
                    lambda: penalised(engine, x, y)):
        try:
            attempt()
            said.append("no error")
        except RuntimeError as e:
            said.append(str(e))
        engine.zero_grad()
    if world > 1:
        return (*said, 0.0)
    engine, *_ = zfunc.initialize(model=_model(), config=_ds(stage, 1))
    try:  # the factor is 1 here, so the model's boundary lets it through; the parameters do not
        nn.functional.cross_entropy(engine(x), y).backward(create_graph=True)
    except RuntimeError as e:
        said[0] += " | " + str(e)
    engine, *_ = zfunc.initialize(model=_model(), config=_ds(stage, 1))  # (nothing of the refused backward)
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for m in range(2):
        engine.backward(penalised(engine, *_data(m, rank)))
        engine.step()
        opt.zero_grad()
        penalised(ref, *_data(m, rank)).backward()
        opt.step()
    full = zfunc.full_params(engine.state)
    return (*said, max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_second_order_terms_are_exact_through_inputs_and_refused_through_parameters(stage):
    for world in (1, 2):
        for through_params, penalty, diff in run_ranks(_second_order, world, stage):
            assert "create_graph=True" in through_params and "no error" not in through_params, through_params
            assert penalty == "no error", penalty
            assert world > 1 or "through a zfunc model's parameters" in through_params, through_params
            assert diff <= 2e-6, diff  # grad_accum 1 on one rank: the penalty trains as in torch


def _stray(rank: int, stage: int, how: str) -> tuple[str, float]:
    """A gradient that reaches engine.module's own parameters outside the engine's forward (an L2
    penalty over ``engine.module.parameters()``, also over gradients a backward left on the model
    before initialize; or the last layer called directly on a hidden output): step() refuses it
    and drops the step's gradients; the next plain step trains as the reference does. A penalty
    on parameters the client's optimizer leaves out (frozen in the state) is not refused."""
    model, x, y = _model(), *_data(0, rank)
    if how == "leftover":  # gradients from a backward before initialize: autograd adds into them in place
        nn.functional.cross_entropy(model(x), y).backward()
    if how == "untrained":  # the first layer is not in the client's optimizer: neither trains it
        client = torch.optim.AdamW(model[2].parameters(), lr=1e-2, weight_decay=0.0)
        engine, *_ = zfunc.initialize(model=model, optimizer=client, config={**_ds(stage), "optimizer": None})
    else:
        engine, *_ = zfunc.initialize(model=model, config=_ds(stage))
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    loss = nn.functional.cross_entropy(engine(x), y)
    if how == "submodule":
        loss = loss + engine.module[2](torch.tanh(torch.ones(2, 7))).sum()
    else:
        loss = loss + 1e-2 * sum(p.square().sum() for p in engine.module[:1 if how == "untrained" else 3].parameters())
    engine.backward(loss)
    try:
        engine.step()
        said = "accepted"
    except RuntimeError as e:
        said = str(e)
    if how == "untrained":
        return said, 0.0
    assert all(p.grad is None for p in engine.module.parameters())
    x, y = _data(1, rank)
    engine.backward(nn.functional.cross_entropy(engine(x), y))
    engine.step()
    xs, ys = zip(*(_data(1, r) for r in range(zfunc.comm.world().size)))
    nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
    opt.step()
    full = zfunc.full_params(engine.state)
    return said, max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_gradient_outside_the_engines_forward_is_refused(stage):
    """(At stage 3 the module's parameters are empty between forwards, as DeepSpeed's partitioned
    ones: a submodule called directly fails in torch already; the penalty reads empty tensors.)"""
    for how in ("penalty", "leftover", "submodule", "untrained") if stage < 3 else ("penalty", "untrained"):
        for said, diff in run_ranks(_stray, 2, stage, how):
            if how == "untrained":  # a parameter the state does not train: nothing is dropped
                assert said == "accepted", said
                continue
            assert "reached engine.module's own parameter(s)" in said and "weight_decay" in said, said
            assert diff < 2e-6, (how, diff)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engine_is_a_module_wrapping_the_users_and_destroy_gives_it_back(stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    hooks_before = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    engine, *_ = zfunc.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    assert isinstance(engine, nn.Module) and engine.module is model
    names = [n for n, _ in engine.named_parameters()]
    assert names == [f"module.{n}" for n, _ in model.named_parameters()]
    loss = engine(torch.randn(4, 3)).square().mean()  # kept past destroy(), as a loop's last loss is
    engine.backward(loss)
    engine.step()
    if stage < 3:  # the module's parameters are the current weights
        full = zfunc.full_params(engine.state)
        assert all(torch.equal(p, full[n[len("module."):]]) for n, p in engine.named_parameters())
    else:  # partitioned: empty, as DeepSpeed's
        assert all(p.numel() == 0 for p in engine.parameters())
    assert engine.eval() is engine and not model.training and not model[1].training
    assert engine.train() is engine and model[1].training
    trained = engine.module_state_dict()
    engine.destroy()
    from torch.nn.modules import module as torch_module
    hooks_after = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) + \
        len(torch_module._global_forward_pre_hooks) + len(torch_module._global_forward_hooks)
    assert hooks_before == 0 and hooks_after == 0  # none of zfunc's hooks stay, at every stage, the loss alive
    del loss
    # the weights (and BatchNorm's statistics) are back in the module, which runs on its own again
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    model.eval()(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match=r"destroy\(\) was called"):
        engine(torch.randn(4, 3))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_engine_dropped_without_destroy_goes_with_its_hooks(stage):
    """Reference counting alone frees a dropped engine (no cycle through its optimizer, its
    scheduler, the module's hooks or the state's sinks), and the hooks leave the module with it;
    at stage 3 the module was donated (its weights lived in the engine), so it stays refusing
    direct calls. The optimizer kept past its engine says what happened."""
    import gc
    import weakref

    def hooks(m: nn.Module) -> int:
        return sum(len(getattr(x, d)) for x in m.modules() for d in
                   ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks"))

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    import torch._dynamo  # noqa: F401 - torch's first optimizer imports it, leaving a frame cycle behind

    gc.collect()
    gc.disable()
    try:
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        engine, optimizer, _, scheduler = zfunc.initialize(model=model, config=cfg)
        engine.backward(engine(torch.randn(2, 3)).square().mean())
        engine.step()
        assert hooks(model) > 0
        gone = weakref.ref(engine)
        del engine, _
        assert gone() is None, "a dropped engine stayed alive"
        # stage 3: the donated module's refusing hooks (the top module and the 3 holding parameters)
        assert hooks(model) == (4 if stage == 3 else 0)
        with pytest.raises(RuntimeError, match="the engine it belongs to was dropped"):
            optimizer.zero_grad()
        with pytest.raises(RuntimeError, match="the engine it belongs to was dropped"):
            scheduler.get_lr()
    finally:
        gc.enable()
    if stage < 3:
        zfunc.initialize(model=model, config=cfg)  # the module is the user's again
    else:
        with pytest.raises(RuntimeError, match="live in a zfunc state"):
            model(torch.randn(2, 3))


def _sgd_engine_run(rank: int, extra: dict, backwards: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    engine, *_ = zfunc.initialize(model=nn.Linear(3, 2), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        **extra})
    for step in range(2):
        for micro in range(backwards):
            x = torch.randn(2, 3, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
            engine.backward(engine(x).square().mean())
        engine.step()
    return [t.clone() for t in zfunc.full_params(engine.state).values()], engine.global_steps, engine.global_samples


def _sgd_reference(world: int, backwards: int, rank_reduce: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        for rank in range(world):
            for micro in range(backwards):
                x = torch.randn(2, 3, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
                (model(x).square().mean() / (world if rank_reduce == "mean" else 1)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_unmanaged_accumulation_and_a_summing_reduce_are_deepspeeds():
    """managed_gradient_accumulation false: each step() applies the sum of the backwards since the
    last (each scaled by 1/gradient_accumulation_steps, here 1), however many; gradient_allreduce_op
    "sum": summed over ranks instead of averaged (DeepSpeed's documented semantics)."""
    for world in (1, 2, 3):
        for stage in (0, 1, 2, 3):
            for op in ("mean", "sum"):
                extra = {"managed_gradient_accumulation": False, "gradient_allreduce_op": op,
                         "zero_optimization": {"stage": stage}}
                want = _sgd_reference(world, 3, op)
                for got, steps, samples in run_ranks(_sgd_engine_run, world, extra, 3):
                    assert max((a - b).abs().max().item() for a, b in zip(got, want)) <= 1e-6, (world, stage, op)
                    assert steps == 2 and samples == 2 * 3 * 2 * world
    engine, *_ = zfunc.initialize(model=nn.Linear(3, 2), config={"train_batch_size": 2,
                                                                  "managed_gradient_accumulation": False})
    with pytest.raises(zfunc.ConfigError, match="every step\\(\\) is the boundary"):
        engine.set_gradient_accumulation_boundary(True)


def _coalesced_run(rank: int, stage: int, coalesce: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    engine, *_ = zfunc.initialize(model=nn.Linear(3, 2), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for step in range(2):
        xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(100 * step + 10 * m + rank)) for m in range(2)]
        if coalesce:  # one step over the block's backwards
            with engine.coalesce_grad_reduction():
                for x in xs:
                    engine.backward(engine(x).square().mean())
                with pytest.raises(RuntimeError, match="inside coalesce_grad_reduction"):
                    engine.step()
            engine.step()
        else:  # DeepSpeed's usual loop: step() after each backward, applied at the boundary
            for x in xs:
                engine.backward(engine(x).square().mean())
                engine.step()
    return [t.clone() for t in zfunc.full_params(engine.state).values()] + [torch.tensor(engine.global_steps)]


def test_coalesce_grad_reduction_is_one_step_over_the_blocks_backwards():
    for world in (1, 2):
        for stage in (0, 1, 2, 3):
            plain = run_ranks(_coalesced_run, world, stage, False)
            for a, b in zip(plain, run_ranks(_coalesced_run, world, stage, True)):
                assert all(torch.allclose(x, y, atol=1e-7) for x, y in zip(a, b)), (world, stage)
    engine, *_ = zfunc.initialize(model=nn.Linear(3, 2), config={"train_batch_size": 2,
                                                                  "managed_gradient_accumulation": False})
    with pytest.raises(zfunc.ConfigError, match="coalesce_grad_reduction: with managed_gradient_accumulation false"):
        with engine.coalesce_grad_reduction():
            pass


def test_the_optimizer_answers_overflow_and_scale_as_deepspeeds():
    """Hugging Face Accelerate reads ``optimizer.overflow`` for ``step_was_skipped``."""
    engine, optimizer, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={
        "train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1}})
    engine.backward(engine(torch.ones(1, 2, dtype=torch.float16)).float().sum())
    engine.step()
    assert optimizer.overflow is False and optimizer.loss_scale == engine.loss_scale == 16.0
    engine.backward(engine(torch.full((1, 2), float("inf"), dtype=torch.float16)).float().sum())
    engine.step()
    assert optimizer.overflow is True and optimizer.cur_scale == engine.loss_scale == 8.0


def _saved_by_lightning(rank: int, stage: int) -> dict:
    """What a Lightning checkpoint asks of a DeepSpeed strategy and drops: the module's and the
    optimizer's ``state_dict()``; and ``save_checkpoint(..., exclude_frozen_parameters=False)``."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    engine, optimizer, *_ = zfunc.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    engine.backward(engine(torch.randn(2, 3)).square().mean())
    engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = model.state_dict()
    sd = optimizer.state_dict()
    local = optimizer.state
    same = all(torch.equal(sd["state"][i]["exp_avg"], local[p]["exp_avg"])
               for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"]))
    try:
        optimizer.load_state_dict(sd)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return {"said": [str(w.message) for w in caught], "sizes": [t.numel() for t in module.values()],
            "groups": [g["lr"] for g in sd["param_groups"]], "same": same, "refused": refused,
            "held": sum(v["exp_avg"].numel() for v in sd["state"].values())}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_what_a_lightning_checkpoint_asks_of_the_module_and_the_optimizer(stage):
    """The optimizer's ``state_dict()`` is what this rank holds (its part of each moment, as
    DeepSpeed's ZeRO optimizer gives its partition; the groups), and loading one back refuses and
    names ``engine.load_checkpoint``; at stage 3 the module's ``state_dict()`` holds empty
    placeholders, as DeepSpeed's, and says so with a warning naming where the weights are."""
    results = run_ranks(_saved_by_lightning, 2, stage)
    elements = 4 * 3 + 4 + 2 * 4 + 2
    for r in results:
        assert r["same"] and r["groups"] == [0.1] and "engine.load_checkpoint(dir)" in r["refused"]
        if stage == 3:
            assert r["sizes"] == [0, 0, 0, 0] and len(r["said"]) == 1 and "module_state_dict()" in r["said"][0]
        else:
            assert r["sizes"] == [12, 4, 8, 2] and r["said"] == []
    held = [r["held"] for r in results]
    assert sum(held) == (elements if stage else 2 * elements), held  # each rank its own part from stage 1


def test_the_optimizer_view_state_holds_the_moments_as_torchs_adamw_does():
    torch.manual_seed(0)
    model, ref = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ref.load_state_dict(model.state_dict())
    model[0].bias.requires_grad_(False)
    ref[0].bias.requires_grad_(False)
    adamw = {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.01}}
    engine, optimizer, *_ = zfunc.initialize(model=model, config={
        "train_batch_size": 1, "gradient_clipping": 0.0, "optimizer": adamw})
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=0.1, weight_decay=0.01)
    side_by_side(engine, ref, opt, 2)
    assert len(optimizer.state) == 3 and id(engine.module[0].bias) not in {id(p) for p in optimizer.state}
    for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        if p.requires_grad:
            ours, theirs = optimizer.state[p], opt.state[q]
            assert sorted(ours) == ["exp_avg", "exp_avg_sq"], name
            assert all(torch.allclose(ours[k], theirs[k].flatten(), atol=1e-7) for k in ours), name
    with pytest.raises(KeyError, match="not a parameter this engine trains"):
        optimizer.state[engine.module[0].bias]


def test_refusals_where_deepspeed_asserts_are_assertion_errors_too():
    """Code written against DeepSpeed catches AssertionError; zfunc's refusals there are both."""
    engine, *_ = zfunc.initialize(model=nn.Linear(3, 2), config={"train_batch_size": 1,
                                                                  "managed_gradient_accumulation": False})
    with pytest.raises(AssertionError, match="scalar tensor"):
        engine.scale(engine(torch.ones(1, 3)))
    with pytest.raises(zfunc.ConfigError, match="set_gradient_accumulation_boundary"):
        engine.set_gradient_accumulation_boundary(True)
    with pytest.raises(AssertionError, match="coalesce_grad_reduction"):
        with engine.coalesce_grad_reduction():
            pass
    with pytest.raises(AssertionError, match="zfunc maps torch.optim.Adam"):
        zfunc.initialize(model=nn.Linear(3, 2), optimizer=torch.optim.RMSprop(nn.Linear(3, 2).parameters()),
                         config={"train_batch_size": 1})


def _divided(rank: int, op: str, extra: dict) -> list[float]:
    model = nn.Linear(2, 1, bias=False)
    nn.init.zeros_(model.weight)
    engine, *_ = zfunc.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "gradient_allreduce_op": op,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}}, **extra})
    engine.backward(engine(torch.tensor([1.0, 2.0])).sum())
    engine.step()
    return zfunc.full_params(engine.state)["weight"].flatten().tolist()


@pytest.mark.parametrize("extra", [{"prescale_gradients": True}, {"gradient_predivide_factor": 2.0},
                                   {"prescale_gradients": False, "gradient_predivide_factor": 1.0}])
def test_prescaling_and_a_predivide_factor_give_deepspeeds_average(extra):
    """DeepSpeed divides before and/or after the reduce as these say; the result is the mean (or
    the sum with gradient_allreduce_op "sum") either way, as zfunc's (it divides in the graph)."""
    for op, scale in (("mean", 1.0), ("sum", 2.0)):
        for weight in run_ranks(_divided, 2, op, extra):
            assert weight == [-1.0 * scale, -2.0 * scale], (op, extra)
    with pytest.warns(UserWarning, match="accepts and does not use these DeepSpeed config keys.*"
                                         "(prescale_gradients|gradient_predivide_factor)"):
        zfunc.Config.from_deepspeed({"train_batch_size": 1, **extra})


def test_empty_partition_cache_has_nothing_to_release_at_stage_3():
    """zfunc frees each gathered unit after use: after a forward, and after a step, the module's
    parameters at stage 3 hold no elements, so DeepSpeed's empty_partition_cache() has no work."""
    engine, *_ = zfunc.initialize(model=nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), config={
        "train_batch_size": 1, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    with torch.no_grad():
        engine(torch.ones(1, 3))
    assert all(p.numel() == 0 for p in engine.module.parameters())
    engine.backward(engine(torch.ones(1, 3)).sum())
    engine.step()
    engine.empty_partition_cache()
    assert all(p.numel() == 0 for p in engine.module.parameters())
    assert engine(torch.ones(1, 3)).shape == (1, 2)


def test_a_meta_built_model_at_stage_3_shows_empty_tensors_as_deepspeeds_partitioned_ones():
    """Built under zfunc.zero.Init, the module's parameters at stage 3 are empty tensors on the
    state's device (code comparing them with torch.allclose, as DeepSpeed's tests do, works)."""
    with zfunc.zero.Init():
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    engine, *_ = zfunc.initialize(model=model, config={"train_batch_size": 1, "zero_optimization": {"stage": 3}})
    params = list(engine.module.parameters())
    assert all(p.device.type == "cpu" and p.numel() == 0 for p in params)
    assert all(torch.allclose(p, p) for p in params)
    engine.backward(engine(torch.ones(1, 3)).sum())
    engine.step()
    assert zfunc.utils.safe_get_full_fp32_param(params[0]).shape == (4, 3)


def test_a_copy_of_the_engine_state_outlives_the_engine():
    """``copy.deepcopy(engine.state)`` shares the module: the engine's ``destroy()`` takes only
    the engine's hooks off, so the copy trains on (stage 3 with units: its unit hooks still go
    on per call), exactly as a pickled copy does; a state kept past a dropped engine leaves the
    module's own calls plain; the pickled module is code, without the engine's state_dict guard."""
    import copy
    import pickle

    for stage in (1, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
        engine, *_ = zfunc.initialize(model=model, config=cfg)
        engine.backward(engine(torch.randn(2, 3)).square().mean())
        engine.step()
        best = copy.deepcopy(engine.state)
        twin = pickle.loads(pickle.dumps(best))
        twin.module.state_dict()  # code only: no engine guard came with it
        engine.backward(engine(torch.randn(2, 3)).square().mean())
        engine.step()
        engine.destroy()
        x = torch.randn(2, 3)
        a, _ = zfunc.backward_step(best, lambda m, x: m(x).square().mean(), x)
        b, _ = zfunc.backward_step(twin, lambda m, x: m(x).square().mean(), x)
        assert torch.equal(a.grads, b.grads) and a.grads.abs().sum() > 0, stage
    engine, *_ = zfunc.initialize(model=nn.Linear(3, 2), config=cfg | {"zero_optimization": {"stage": 1}})
    kept, module = engine.state, engine.module
    del engine, _
    assert module(torch.ones(1, 3)).shape == (1, 2) and kept.step.item() == 0


@pytest.mark.parametrize("stage, units", [(0, None), (1, None), (2, None), (2, ["0", "2"])])
def test_a_state_made_from_the_engines_module_trains_on_its_own(stage, units):
    """``zfunc.init(engine.module, ...)`` (``init`` may take a module again): that state's calls
    run on its own tensors and gradients, not routed to the engine's state (whose next ``step()``
    finds no backward); the engine trains on as plain torch."""
    engine, *_ = zfunc.initialize(model=_model(), config=_ds(stage, world=1))
    state = zfunc.init(engine.module, zfunc.Config(stage=stage, units=units, optimizer=zfunc.sgd(lr=1.0)))
    ref = _model()
    x, y = _data(0, 0)
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    loss_fn(ref, (x, y)).backward()
    new, loss = zfunc.backward_step(state, loss_fn, (x, y))
    before, after = zfunc.full_params(state), zfunc.full_params(zfunc.apply_step(new))
    for n, p in ref.named_parameters():  # one SGD step of lr 1: torch's gradient
        assert torch.allclose(before[n] - after[n], p.grad, atol=1e-6), (stage, n)
    with pytest.raises(RuntimeError, match="no backward reached the model since the last step"):
        engine.step()  # nothing of the state's backward reached the engine
    expected = _reference(1, 1, 1)[0]
    engine.backward(nn.functional.cross_entropy(engine(x), y))
    engine.step()
    assert _diff(engine, expected) <= 1e-6


class _Paused(nn.Module):
    """``_model()``'s layers, whose forward waits at ``self.pause`` when one is set."""

    def __init__(self):
        super().__init__()
        self.net = _model()
        self.pause = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[0](x)
        if self.pause is not None:
            self.pause()
        return self.net[2](self.net[1](h))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_step_or_forward_while_another_thread_runs_the_engine_is_refused_cleanly(stage):
    """While another thread's forward runs through ``engine.module``: a forward here, and
    ``engine.step()`` here (which replaces the state that forward runs on), raise the clear
    "another thread" error and change nothing; that thread's call (its entries put back by its
    own routing record, kept per thread) and the step after it train as plain torch."""
    from tests.helpers import paused_in_thread

    model = _Paused()
    engine, *_ = zfunc.initialize(model=model, config=_ds(stage, world=1))
    x, y = _data(0, 0)
    engine.backward(nn.functional.cross_entropy(engine(x), y))
    before = zfunc.full_params(engine.state)
    outs = []

    def other(pause) -> None:
        model.pause = pause
        outs.append(engine(x))
        model.pause = None

    with paused_in_thread(other):
        with pytest.raises(RuntimeError, match="in another thread now"):
            engine(x)
        with pytest.raises(RuntimeError, match="in another thread now"):
            engine.step()
        assert all(torch.equal(before[n], t) for n, t in zfunc.full_params(engine.state).items())
    assert all(type(p) is nn.Parameter for p in model.parameters())  # that call put its entries back
    engine.step()
    full = zfunc.full_params(engine.state)
    for n, p in _reference(1, 1, 1)[0].items():
        assert torch.allclose(full["net." + n], p, atol=1e-6), (stage, n)
    assert torch.allclose(outs[0], _model()(x), atol=1e-6)  # that forward ran on the weights of its time


def _ds_lrs(scheduler: dict, updates: int, group_lrs: tuple[float, ...] = (0.1,)) -> list[list[float]]:
    """Each group's lr at applied updates 0..updates-1 under ``scheduler`` (a DeepSpeed config
    section), an SGD of lr 0.1 with a group per entry of ``group_lrs`` (the first the optimizer's)."""
    groups = [zfunc.ParamGroup([f"{i}.weight", f"{i}.bias"], lr=lr) for i, lr in enumerate(group_lrs) if i]
    cfg = zfunc.Config.from_deepspeed({"train_batch_size": 4, "scheduler": scheduler,
                                       "optimizer": {"type": "SGD", "params": {"lr": group_lrs[0]}}})
    state = zfunc.init(nn.Sequential(*(nn.Linear(2, 2) for _ in group_lrs)), cfg.replace(param_groups=groups))
    import dataclasses

    return [[round(x, 6) for x in zfunc.learning_rates(state.replace(
        opt=dataclasses.replace(state.opt, count=torch.tensor(u)))).tolist()] for u in range(updates)]


def test_deepspeed_schedulers_follow_deepspeeds_objects():
    """The lr each update gets, as DeepSpeed 0.19's scheduler objects set it (made before the
    first update, stepped after each): ``WarmupDecayLR``'s ``warmup_max_lr`` is 0.001 unless
    given; ``WarmupLR``'s each group's own lr unless given, a given one every group's, with
    ``warmup_min_lr`` every group's start; ``WarmupCosineLR`` starts at 0 whatever
    ``warmup_min_ratio``, takes at least 2 warmup steps, and scales each group's lr;
    ``last_batch_iteration`` resumes the formula there, the first update at the group's own lr."""
    decay = {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2, "warmup_type": "linear"}}
    assert _ds_lrs(decay, 6) == [[0.0], [0.0], [0.0005], [0.001], [0.00075], [0.0005]]
    warm = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}}
    assert _ds_lrs(warm, 6, (0.1, 0.3)) == [[0.01, 0.01], [0.01, 0.01], [0.0325, 0.0825], [0.055, 0.155],
                                            [0.0775, 0.2275], [0.1, 0.3]]
    warm["params"]["warmup_max_lr"] = 0.2
    assert _ds_lrs(warm, 6, (0.1, 0.3))[-1] == [0.2, 0.2]
    cosine = {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 1, "warmup_min_ratio": 0.1,
                                                   "cos_min_ratio": 0.0, "warmup_type": "linear"}}
    lrs = _ds_lrs(cosine, 6, (0.1, 0.3))
    cos = [round(0.1 * (1 + math.cos(math.pi * k / 4)) / 2, 6) for k in (1, 2, 3)]  # over 6 - N = 4 updates
    assert [g[0] for g in lrs] == [0.0, 0.01, 0.055, *cos]  # 0, then r0 + (1 - r0) i / N for i < N = 2
    assert all(abs(b - 3 * a) < 1e-5 for a, b in lrs)  # each group its own lr times the ratio
    resumed = {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear",
                                              "last_batch_iteration": 4}}
    assert _ds_lrs(resumed, 4) == [[0.1], [0.05], [0.06], [0.07]]


def test_deepspeed_optimizer_defaults_are_deepspeeds():
    """Params left out take DeepSpeed's values: Lion's of its FusedLion (lr 1e-3, betas 0.9 and
    0.999), and ``torch_adam`` builds torch.optim.AdamW, whose weight decay is 0.01."""
    lion = zfunc.Config.from_deepspeed({"train_batch_size": 4, "optimizer": {"type": "Lion"}}).optimizer
    assert (lion.lr, lion.betas, lion.weight_decay) == (1e-3, (0.9, 0.999), 0.0)
    for kind in ("Adam", "AdamW"):
        adam = zfunc.Config.from_deepspeed({"train_batch_size": 4, "optimizer": {
            "type": kind, "params": {"torch_adam": True}}}).optimizer
        assert adam.weight_decay == 0.01 and adam.decoupled, kind
    fused = zfunc.Config.from_deepspeed({"train_batch_size": 4, "optimizer": {"type": "AdamW"}}).optimizer
    assert fused.weight_decay == 0.0
    ignored = zfunc.Config.from_deepspeed({"train_batch_size": 4, "optimizer": {  # DeepSpeed's AdamW ignores it
        "type": "AdamW", "params": {"adam_w_mode": False}}}).optimizer
    assert ignored.decoupled
    with pytest.raises(zfunc.ConfigError, match=r"scheduler\.params\.warmup_max_lr: expected a number"):
        zfunc.Config.from_deepspeed({"train_batch_size": 4, "scheduler": {
            "type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}}})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_backward_after_the_step_that_replaced_its_forwards_weights_is_refused(stage):
    """The next batch's forward before the boundary ``step()`` and its backward after it (invalid
    in plain torch too): the backward raises, saying the step replaced the weights its forward
    ran on (rather than autograd's in-place version errors); the engine trains on as plain torch
    does without that backward."""
    engine, *_ = zfunc.initialize(model=_model(), config=_ds(stage, world=1))
    x, y = _data(0, 0)
    engine.backward(nn.functional.cross_entropy(engine(x), y))
    ahead = engine(x)
    engine.step()
    with pytest.raises(RuntimeError, match="differentiates a forward whose weights a step has replaced since"):
        engine.backward(nn.functional.cross_entropy(ahead, y))
    expected = _reference(2, 1, 1)[1]  # two steps on batches 0 and 1
    x1, y1 = _data(1, 0)
    engine.backward(nn.functional.cross_entropy(engine(x1), y1))
    engine.step()
    assert _diff(engine, expected) <= 1e-6


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_save_checkpoint_inside_an_accumulation_window_saves_the_last_step(stage, tmp_path):
    """As DeepSpeed: a save inside an accumulation window keeps the weights and optimizer state of
    the last step (the window's gradients are not saved); the saving engine goes on with its window
    as if it had not saved, and an engine loading the checkpoint runs the window afresh to the
    same weights."""
    def micro(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _data(i, 0)

    def run(save: bool) -> tuple[dict, Any]:
        engine, *_ = zfunc.initialize(model=_model(), config=_ds(stage, gas=2, world=1))
        for i in range(3):
            x, y = micro(i)
            engine.backward(nn.functional.cross_entropy(engine(x), y))
            engine.step()
            if i == 2 and save:
                with pytest.raises(NotImplementedError, match="exclude_frozen_parameters=False"):
                    engine.save_checkpoint(tmp_path, tag="mid", exclude_frozen_parameters=True)
                engine.save_checkpoint(tmp_path, tag="mid", exclude_frozen_parameters=False)  # Lightning's call
        x, y = micro(3)
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
        return zfunc.full_params(engine.state), engine

    plain, _ = run(False)
    saved, first = run(True)
    assert all(torch.equal(plain[n], t) for n, t in saved.items())  # the save changed nothing
    loader, *_ = zfunc.initialize(model=_model(), config=_ds(stage, gas=2, world=1))
    loader.load_checkpoint(tmp_path, tag="mid")
    assert loader.global_steps == 1 and loader.micro_steps == 0  # DeepSpeed restores no micro_steps
    for i in (2, 3):
        x, y = micro(i)
        loader.backward(nn.functional.cross_entropy(loader(x), y))
        loader.step()
    assert all(torch.equal(plain[n], t) for n, t in zfunc.full_params(loader.state).items())


def test_the_global_grad_norm_is_none_until_the_engines_first_step(tmp_path):
    """As DeepSpeed's ``get_global_grad_norm()``: None before the engine's first step (a
    micro-step inside the first window included), the last step's norm after it, and a load
    leaves it as it was (a fresh engine that loads still answers None)."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zfunc.initialize(model=_model(), config=cfg)
    assert engine.get_global_grad_norm() is None
    norms = []
    for i in range(4):
        engine.backward(nn.functional.cross_entropy(engine(torch.randn(2, 4)), torch.tensor([0, 1])))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    assert norms[0] is None and norms[1] > 0 and norms[2] == norms[1] and norms[3] > 0 and norms[3] != norms[1]
    engine.save_checkpoint(tmp_path)
    fresh, *_ = zfunc.initialize(model=_model(), config=cfg)
    fresh.load_checkpoint(tmp_path)
    assert fresh.get_global_grad_norm() is None
    engine.load_checkpoint(tmp_path)
    assert engine.get_global_grad_norm() == norms[3]
