"""The engine counts micro-batches as DeepSpeed does: each backward that reaches the model is
``1 / gradient_accumulation_steps`` of a step, whatever loop drives it.

Every loop shape a DeepSpeed client uses (DeepSpeed's own ``backward``/``step`` per micro-batch,
Accelerate's boundary flag with one ``step()`` at the boundary, Hugging Face Trainer's
``loss / GAS`` with ``scale_wrt_gas=False``, plain ``loss.backward()``) gives the weights and the
logged grad norm plain torch gives with SGD and no clipping, at stages 0-3, worlds 1-3 and GAS 1
and 3; a step forced early applies what ran, each backward ``1 / GAS`` of a step (DeepSpeed's rule).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc
from tests.helpers import paused_in_thread, run_ranks

LR, STEPS = 0.5, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _micro(step: int, k: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * k + rank)
    return torch.randn(2, 5, generator=g), torch.randn(2, 3, generator=g)


def _config(stage: int, ga: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage}}


def _reference(world: int, ga: int, run: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """SGD on one process: ``run`` micro-batches a step on every rank, each loss divided by
    ``world * ga`` (DeepSpeed's rule: a backward is 1/GAS of a step; the mean over ranks)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for i in range(STEPS):
        for r in range(world):
            for k in range(run):
                x, y = _micro(i, k, r)
                (F.mse_loss(model(x), y) / (world * ga)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}, norms


def _loop(rank: int, stage: int, ga: int, shape: str, run: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    engine, *_ = zfunc.initialize(model=_model(), config=_config(stage, ga))
    norms = []
    for i in range(STEPS):
        for k in range(run):
            last = k == run - 1
            x, y = _micro(i, k, rank)
            loss = F.mse_loss(engine(x), y)
            if shape == "deepspeed":  # a step() per micro-batch; the boundary by count, or forced
                if run != ga:  # (the override is sticky, as DeepSpeed's)
                    engine.set_gradient_accumulation_boundary(last)
                engine.backward(loss)
                engine.step()
            elif shape == "accelerate":  # the boundary flag before each backward, one step()
                engine.set_gradient_accumulation_boundary(last)
                engine.backward(loss)
                if last:
                    engine.step()
            elif shape == "trainer":  # HF Trainer: loss / GAS, scale_wrt_gas=False, in-place ops
                loss = loss / ga
                loss *= 1.0
                engine.set_gradient_accumulation_boundary(last)
                engine.backward(loss, scale_wrt_gas=False)
                if last:
                    engine.step()
            else:  # plain loss.backward(), a step() per micro-batch
                loss.backward()
                engine.step()
        norms.append(engine.get_global_grad_norm())
    return zfunc.full_params(engine.state), norms


@pytest.mark.parametrize("ga", [1, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_loop_shape_gives_deepspeeds_mean(world, stage, ga):
    ref, ref_norms = _reference(world, ga, ga)
    for shape in ("deepspeed", "accelerate", "trainer", "plain"):
        for ours, norms in run_ranks(_loop, world, stage, ga, shape, ga):
            worst = max((ours[n] - ref[n]).abs().max().item() for n in ref)
            assert worst < 1e-6, (shape, worst)
            assert norms == pytest.approx(ref_norms, rel=1e-5), shape


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_boundary_forced_early_applies_what_ran(stage):
    """Two backwards of a configured three, then the boundary: DeepSpeed applies their sum over
    three (each backward is a third of a step), and so does the engine."""
    ref, _ = _reference(2, 3, 2)
    for shape in ("deepspeed", "accelerate"):
        for ours, _ in run_ranks(_loop, 2, stage, 3, shape, 2):
            assert max((ours[n] - ref[n]).abs().max().item() for n in ref) < 1e-6, shape


def test_the_loss_metric_is_the_mean_of_the_backwards():
    engine, *_ = zfunc.initialize(model=_model(), config=_config(1, 2))
    losses = []
    for k in range(2):
        x, y = _micro(0, k, 0)
        loss = F.mse_loss(engine(x), y)
        losses.append(loss.item())
        engine.set_gradient_accumulation_boundary(k == 1)
        engine.backward(loss)
    engine.step()
    assert engine.state.metrics.loss.item() == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert engine.global_steps == 1 and engine.micro_steps == 1


def test_an_output_is_what_the_module_returned():
    """The engine's output is the module's own tensor: in-place ops work, its grad_fn is the
    module's last op, and an input gradient through it is torch's (no factor on it)."""
    engine, *_ = zfunc.initialize(model=_model(), config=_config(2, 4))
    ref = _model()
    x = torch.randn(2, 5, requires_grad=True)
    out = engine(x)
    assert type(out.grad_fn).__name__ == "AddmmBackward0"
    out.mul_(2.0)
    (dx,) = torch.autograd.grad(out.sum(), x)
    xr = x.detach().requires_grad_()
    (dxr,) = torch.autograd.grad((ref(xr) * 2.0).sum(), xr)
    assert torch.allclose(dx, dxr, atol=1e-7, rtol=0)


def _fp16_engine() -> tuple[object, torch.Tensor]:
    engine, *_ = zfunc.initialize(model=_model(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "fp16": {"enabled": True,
                                                                             "initial_scale_power": 8},
        "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": 1}})
    x, y = _micro(0, 0, 0)
    return engine, F.mse_loss(engine(x).float(), y)


def test_a_plain_backward_under_fp16_loss_scaling_is_refused_as_deepspeed_does():
    engine, loss = _fp16_engine()
    with pytest.raises(RuntimeError, match="Loss scaling is required"):
        loss.backward()
    with pytest.raises(RuntimeError, match="no backward reached the model"):
        engine.step()  # the refused backward's gradients were dropped: nothing to apply


def test_engine_scale_then_backward_equals_engine_backward():
    a, loss_a = _fp16_engine()
    a.scale(loss_a).backward()
    a.step()
    b, loss_b = _fp16_engine()
    b.backward(loss_b)
    b.step()
    assert a.state.metrics.skipped.item() == 0
    assert torch.equal(a.state.params, b.state.params)
    assert a.get_global_grad_norm() == b.get_global_grad_norm() > 0


# -- every documented form of initialize's arguments -----------------------------------------------

_DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
       "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}


def _forms(tmp: pathlib.Path) -> dict[str, dict]:
    path = tmp / "ds.json"
    path.write_text(json.dumps(_DS))
    model = _model()
    return {
        "dict": {"config": _DS},
        "json path (str)": {"config": str(path)},
        "json path (PathLike)": {"config": path},
        "config_params": {"config_params": _DS},
        "zfunc.Config": {"config": zfunc.Config(grad_accum=2, optimizer=zfunc.adamw(lr=0.01))},
        "zfunc.Config and a torch scheduler": {
            "config": zfunc.Config(grad_accum=2, optimizer=zfunc.adamw(lr=0.01)),
            "lr_scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1)},
        "model_parameters (params)": {"config": _DS, "model_parameters": model.parameters()},
        "model_parameters (groups)": {"config": _DS, "model_parameters": [
            {"params": [p for p in model.parameters() if p.ndim == 2]},
            {"params": [p for p in model.parameters() if p.ndim == 1], "weight_decay": 0.0}]},
        "a zfunc optimizer": {"config": _DS, "optimizer": zfunc.adamw(lr=0.01)},
        "a torch optimizer": {"config": {k: v for k, v in _DS.items() if k != "optimizer"},
                              "optimizer": torch.optim.AdamW(model.parameters(), lr=0.01)},
        "a torch scheduler": {"config": _DS, "lr_scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1)},
        "no config": {},
    }, model


@pytest.mark.parametrize("form", ["dict", "json path (str)", "json path (PathLike)", "config_params", "zfunc.Config",
                                  "zfunc.Config and a torch scheduler", "model_parameters (params)",
                                  "model_parameters (groups)", "a zfunc optimizer", "a torch optimizer",
                                  "a torch scheduler", "no config"])
def test_every_documented_form_of_initialize(form, tmp_path):
    forms, model = _forms(tmp_path)
    engine, optimizer, none, scheduler = zfunc.initialize(model=model, **forms[form])
    assert none is None and optimizer is engine.optimizer
    before = zfunc.full_params(engine.state)
    for k in range(engine.cfg.grad_accum):
        x, y = _micro(0, k, 0)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    assert engine.global_steps == 1
    after = zfunc.full_params(engine.state)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    if "scheduler" in form:
        assert scheduler is not None and hasattr(scheduler, "step")
    assert os.fspath(tmp_path)  # the JSON forms read their file from here


# -- backwards the engine must count once, and seeds several engines share -------------------------

@pytest.mark.parametrize("fp16", [False, True])
def test_reentrant_checkpointing_at_stage_3_is_one_backward(fp16):
    """Reentrant checkpointing differentiates each segment in a graph task of its own, inside the
    backward: the engine counts the outer backward once (and under fp16 its seed is scaled)."""
    from tests.test_stage3 import Stack

    torch.manual_seed(0)
    model = Stack(3)
    model.ckpt = "reentrant"
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if fp16:
        ds["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, *_ = zfunc.initialize(model=model, config=ds)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    loss = ((engine(x) - y.to(engine.state.cfg.compute_dtype)) ** 2).mean()
    engine.backward(loss)
    engine.step()
    assert engine.state.micro_step.item() == 1
    assert engine.state.loss_sum.item() == pytest.approx(loss.item(), rel=1e-6)


def _two_engines(style: str) -> tuple[float, float]:
    torch.manual_seed(0)
    cfg = _config(0, 2)
    enc = zfunc.initialize(model=nn.Linear(8, 16), config=cfg)[0]
    head = zfunc.initialize(model=nn.Linear(16, 4), config=cfg)[0]
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = F.cross_entropy(head(torch.tanh(enc(x))), y)
        if style == "plain":
            loss.backward()
        else:
            (head if style == "head" else enc).backward(loss)
        enc.step()
        head.step()
    return enc.get_global_grad_norm(), head.get_global_grad_norm()


def test_one_loss_over_two_engines_is_seeded_once_whichever_engine_runs_it():
    plain = _two_engines("plain")
    assert _two_engines("head") == pytest.approx(plain, rel=1e-6)
    assert _two_engines("enc") == pytest.approx(plain, rel=1e-6)


def _fp16_sum(rank: int, stage: int) -> tuple[float, float]:
    """Gradients near fp16's limit reduced in fp16 over 2 ranks with GAS 4: the mean is taken
    before the 16-bit sum at every stage, so none overflows."""
    torch.manual_seed(0)
    engine, *_ = zfunc.initialize(model=nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "gradient_clipping": 0.0,
        "fp16": {"enabled": True, "loss_scale": 1.0}, "communication_data_type": "fp16",
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    for _ in range(4):
        out = engine(torch.full((1, 4), 100.0))
        engine.backward(out.float().sum() * 100.0)
        engine.step()
    return engine.state.metrics.skipped.item(), engine.get_global_grad_norm()


def test_a_16_bit_reduce_takes_the_mean_first_at_every_stage():
    results = {stage: run_ranks(_fp16_sum, 2, stage) for stage in (2, 3)}
    assert results[2] == results[3]
    assert all(skipped == 0 for skipped, _ in results[3])


@pytest.mark.parametrize("stage", [0, 3])
def test_an_engine_backward_in_another_thread_leaves_other_backwards_alone(stage):
    """The engine's ``backward(loss)`` seeds ``1 / GAS`` itself, so the gradients of that backward
    enter without it; a pure ``backward_step`` another thread runs meanwhile (a state of its own
    over another module) keeps its own ``1 / GAS``, bit for bit, and the engine's gradients are
    those of the same backward alone."""
    engine, *_ = zfunc.initialize(model=_model(), config=_config(stage, 4))
    state = zfunc.init(_model(), zfunc.Config(stage=stage, grad_accum=4))
    x, y = _micro(0, 0, 0)

    def loss_fn(model, batch):
        return F.mse_loss(model(batch[0]), batch[1])

    def grads(st):
        return st.grads.clone()  # world 1: the whole flat gradient

    alone = grads(zfunc.backward_step(state, loss_fn, (x, y))[0])
    engine.backward(loss_fn(engine, (x, y)))
    engine_alone = zfunc.utils.safe_get_full_grad(next(engine.module.parameters())).clone()
    engine.optimizer.zero_grad()  # (DeepSpeed's drops the window at stages 0 and 3)

    def run_engine(pause) -> None:
        out = engine(x)
        out.register_hook(lambda g: (pause(), g)[1])  # the engine's backward waits here, in flight
        engine.backward(F.mse_loss(out, y))

    with paused_in_thread(run_engine):
        during = grads(zfunc.backward_step(state, loss_fn, (x, y))[0])
    assert torch.equal(during, alone), (during / alone)[:3]
    assert torch.equal(zfunc.utils.safe_get_full_grad(next(engine.module.parameters())), engine_alone)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("fp16", [False, True])
def test_the_engine_called_inside_a_reentrant_checkpoint(stage, fp16):
    """``engine.backward(loss)`` where the engine's own call sits inside a reentrant checkpoint:
    the recomputed call's gradients come in a backward nested in the engine's, whose seed carries
    ``1 / GAS`` (and the loss scale): the gradient is the plain call's, and fp16's scale check
    passes."""
    from torch.utils.checkpoint import checkpoint

    cfg = _config(stage, 4)
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    x, y = _micro(0, 0, 0)
    got = {}
    for how in ("plain", "checkpointed"):
        engine, *_ = zfunc.initialize(model=_model(), config=cfg)
        pred = engine(x) if how == "plain" else checkpoint(engine, x.clone().requires_grad_(), use_reentrant=True)
        engine.backward(F.mse_loss(pred.float(), y))
        got[how] = zfunc.utils.safe_get_full_grad(next(engine.module.parameters())).clone()
    assert torch.equal(got["checkpointed"], got["plain"]), (got["checkpointed"] / got["plain"]).flatten()[:3]



class _BlockInside(nn.Module):
    """`_model`'s shape with its middle layer checkpointed on its own (``reentrant`` or not)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 3)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: torch.tanh(self.b(t)), self.a(x), use_reentrant=self.reentrant)
        return self.c(h)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch's, in the outer no_grad forward
def test_the_engine_called_inside_a_reentrant_checkpoint_with_a_checkpointed_block(stage, reentrant):
    """The engine's call inside a reentrant checkpoint, its model checkpointing a block of its
    own: the block is recomputed in the backward the outer checkpoint runs through the
    recomputed call's outputs, on that call's tensors, and that backward is the engine's own
    (its seed carries ``1 / GAS``): every gradient is the plain call's."""
    from torch.utils.checkpoint import checkpoint

    x, y = _micro(0, 0, 0)
    got = {}
    for how in ("plain", "checkpointed"):
        engine, *_ = zfunc.initialize(model=_BlockInside(reentrant), config=_config(stage, 4))
        pred = engine(x) if how == "plain" else checkpoint(engine, x.clone().requires_grad_(), use_reentrant=True)
        engine.backward(F.mse_loss(pred, y))
        got[how] = [zfunc.utils.safe_get_full_grad(p).clone() for p in engine.module.parameters()]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(got["checkpointed"], got["plain"]))


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("whole", ["no", "alone", "beside_plain"])
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch's, in the outer no_grad forward
def test_a_step_a_gradient_hook_of_the_engines_backward_makes_keeps_its_factor(stage, whole):
    """A gradient hook of ``engine.backward(loss)`` (whose seed carries ``1 / GAS``) makes a
    ``backward_step`` of another state, whose model checkpoints a block (reentrant), its loss
    the model's call, or that call under a reentrant checkpoint (``whole``; alone, or beside a
    plain call): the blocks' and the checkpoint's backwards run inside the step's own backward
    (`InFlight.running`), and the gradients enter at the step's factor, ``1 / grad_accum``, as
    without the engine around it."""
    from torch.utils.checkpoint import checkpoint

    state = zfunc.init(_BlockInside(True), zfunc.Config(stage=stage, grad_accum=2))
    x, y = _micro(0, 0, 0)

    def loss_fn(model, batch):
        if whole == "no":
            return F.mse_loss(model(batch[0]), batch[1])
        pred = checkpoint(model, batch[0].clone().requires_grad_(), use_reentrant=True)
        if whole != "alone":
            pred = pred + model(2 * batch[0])
        return F.mse_loss(pred, batch[1])

    alone = zfunc.backward_step(state, loss_fn, (x, y))[0].grads.clone()
    engine, *_ = zfunc.initialize(model=_model(), config=_config(stage, 4))
    inside = {}

    def hook(grad):
        if not inside:
            with torch.enable_grad():  # (a gradient hook runs under no_grad)
                inside["grads"] = zfunc.backward_step(state, loss_fn, (x, y))[0].grads.clone()
        return grad

    out = engine(x)
    out.register_hook(hook)
    engine.backward(F.mse_loss(out, y))
    assert torch.allclose(inside["grads"], alone, rtol=0, atol=1e-7), (inside["grads"] / alone)[:3]


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("plain_too", [True, False])
def test_a_scaled_loss_over_a_checkpointed_engine_call(stage, plain_too):
    """Under fp16 loss scaling, ``engine.scale(loss).backward()`` of a loss over an engine call
    inside a reentrant checkpoint (and a plain one, ``plain_too``): the checkpoint's backward
    through the recomputed call is part of the scaled backward (not refused as an unscaled one),
    and the gradients equal ``engine.backward(loss)``'s."""
    from torch.utils.checkpoint import checkpoint

    cfg = _config(stage, 2)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    x, y = _micro(0, 0, 0)
    got = {}
    for how in ("backward", "scale"):
        engine, *_ = zfunc.initialize(model=_model(), config=cfg)
        pred = checkpoint(engine, x.clone().requires_grad_(), use_reentrant=True)
        if plain_too:
            pred = pred + engine(2 * x)
        loss = F.mse_loss(pred.float(), y)
        if how == "backward":
            engine.backward(loss)
        else:
            engine.scale(loss).backward()
        got[how] = [zfunc.utils.safe_get_full_grad(p).clone() for p in engine.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got["scale"], got["backward"]))


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch's, in the outer no_grad forward
def test_steps_and_engine_backwards_nested_in_each_others_hooks_keep_their_factors(stage):
    """One thread, one binding: ``engine.backward(loss)`` over the engine's call under a reentrant
    checkpoint, made by a gradient hook of a ``backward_step`` on the engine's own state; and a
    ``backward_step`` on the engine's own state whose loss checkpoints the whole call, made by a
    gradient hook of ``engine.backward``. Each backward inside the other is seeded as the
    innermost one around it (`InFlight.around`): the engine's gradient is its loss's over GAS,
    the step's is its own micro-batch's, as each run alone."""
    from torch.utils.checkpoint import checkpoint

    x, y = _micro(0, 0, 0)

    def whole(model, x):
        return F.mse_loss(checkpoint(model, x.clone().requires_grad_(), use_reentrant=True), y)

    def engine_grads(engine):
        return [zfunc.utils.safe_get_full_grad(p).clone() for p in engine.module.parameters()]

    alone, *_ = zfunc.initialize(model=_model(), config=_config(stage, 2))
    alone.backward(whole(alone, x))
    want = engine_grads(alone)
    engine, *_ = zfunc.initialize(model=_model(), config=_config(stage, 2))
    done = []

    def engine_in_hook(grad):
        if not done:
            done.append(True)
            with torch.enable_grad():  # (a gradient hook runs under no_grad)
                engine.backward(whole(engine, x))
        return grad

    def hooked(model, x):
        out = model(x)
        out.register_hook(engine_in_hook)
        return F.mse_loss(out, y)

    zfunc.backward_step(engine.state, hooked, x)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(engine_grads(engine), want))

    state_alone = zfunc.backward_step(engine.state, whole, x)[0].grads.clone()
    inside = {}

    def step_in_hook(grad):
        if not inside:
            with torch.enable_grad():
                inside["grads"] = zfunc.backward_step(engine.state, whole, x)[0].grads.clone()
        return grad

    out = engine(x)
    out.register_hook(step_in_hook)
    engine.backward(F.mse_loss(out, y))
    assert torch.allclose(inside["grads"], state_alone, rtol=0, atol=1e-7), (inside["grads"] / state_alone)[:3]

def test_an_engine_and_its_bound_model_deep_copy():
    """``copy.deepcopy`` of an engine and of the bound model a loss function receives works (the
    binding, and its record of calls in flight, shared as a state's copies share them)."""
    import copy

    engine, *_ = zfunc.initialize(model=_model(), config=_config(3, 1))
    twin = copy.deepcopy(engine)
    assert twin.state.binding is engine.state.binding
    assert twin.state.binding.flight is engine.state.binding.flight
    seen = []

    def loss_fn(model, batch):
        seen.append(copy.deepcopy(model))
        return F.mse_loss(model(batch[0]), batch[1])

    state = zfunc.init(_model(), zfunc.Config(stage=3))
    zfunc.backward_step(state, loss_fn, _micro(0, 0, 0))
    assert seen and seen[0].state.binding.flight is state.binding.flight


def test_zero_grad_inside_a_window_keeps_or_drops_it_as_deepspeeds_stages_do():
    """A ``zero_grad()`` between two micro-batches of one window: DeepSpeed's engine drops the
    module's ``.grad`` only, which at stages 0-1 is the window so far and at stages 2-3 nothing
    (each backward reduced it into the shards already); its ZeRO optimizer's drops the window at
    stages 0, 1 and 3 (at 3 the next backward overwrites the shards) and keeps it at stage 2 (a
    Lightning epoch whose length ``accumulate_grad_batches`` does not divide calls it there).
    Against plain SGD on the micro-batches the step keeps."""
    def loss_fn(model, k):
        x, y = _micro(0, k, 0)
        return F.mse_loss(model(x), y)

    grads = []
    for k in (0, 1):
        ref = _model()
        loss_fn(ref, k).backward()
        grads.append({n: p.grad / 2 for n, p in ref.named_parameters()})  # each backward 1/GAS of the step
    start = dict(_model().named_parameters())
    for stage in (0, 1, 2, 3):
        for which in ("engine", "optimizer"):
            engine, optimizer, *_ = zfunc.initialize(model=_model(), config=_config(stage, 2))
            engine.backward(loss_fn(engine, 0))
            engine.step()
            (engine if which == "engine" else optimizer).zero_grad()
            engine.backward(loss_fn(engine, 1))
            engine.step()
            kept = stage >= 2 if which == "engine" else stage == 2
            full = zfunc.full_params(engine.state)
            for n, p in start.items():
                expected = p.detach() - LR * (grads[1][n] + (grads[0][n] if kept else 0))
                assert torch.allclose(full[n], expected, atol=1e-6), (stage, which, n)
