"""Activation checkpointing (torch.utils.checkpoint, reentrant or not) trains as without it (bitwise
when not reentrant), at every stage: the forward autograd recomputes in backward runs outside zfunc's call, on the
latest call's parameters (`zfunc.autograd.recompute.Recompute._cover_in`), never on the module's own."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import zfunc
from tests.helpers import run_ranks
from zfunc._probes import graph_task
from tests.test_stage3 import Stack, _stack_loss


def _model(ckpt: str | None) -> Stack:
    torch.manual_seed(0)
    model = Stack(3, reuse=1)  # block 1 runs twice: its gradient comes in two parts
    model.blocks[0][0].requires_grad_(False)  # a frozen parameter inside a checkpointed block
    model.ckpt = ckpt
    return model


def _train(rank: int, ckpt: str | None, stage: int, grad_accum: int, units: list | None,
           bucket_mb: float = 25.0) -> list[torch.Tensor]:
    cfg = zfunc.Config(stage=stage, grad_accum=grad_accum, clip=1.0, persist_threshold=0, units=units,
                       optimizer=zfunc.adamw(lr=1e-2), bucket_mb=bucket_mb)
    state = zfunc.init(_model(ckpt), cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        for _ in range(grad_accum):
            batch = (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))
            state, _ = zfunc.backward_step(state, _stack_loss, batch, donate=True)
        state = zfunc.apply_step(state, donate=True)
    return list(zfunc.full_params(state).values())


@pytest.mark.parametrize("world", [1, 2, 3])
def test_checkpointed_training_is_the_plain_one(world):
    for stage in (0, 1, 2, 3):
        for grad_accum in (1, 2):
            # Stage 3 with only block 0 a unit: the checkpointed blocks 1 and 2 are root parameters.
            unit_choices = {1: [None, ["blocks.0", "blocks.1", "blocks.2"]], 2: [None, ["blocks.0", "blocks.1",
                            "blocks.2"]], 3: [None, ["blocks.0"]]}.get(stage, [None])
            for units in unit_choices:
                plain = run_ranks(_train, world, None, stage, grad_accum, units)
                for ckpt in ("reentrant", "non_reentrant"):
                    for rank, (a, b) in enumerate(zip(plain, run_ranks(_train, world, ckpt, stage, grad_accum, units))):
                        where = f"stage {stage} ga {grad_accum} units {units} {ckpt} world {world} rank {rank}"
                        if ckpt == "non_reentrant":  # the same graph: bitwise
                            assert all(torch.equal(x, y) for x, y in zip(a, b)), where
                        else:  # block 1's two parts are added one after the other: rounding apart
                            assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-6, where


def test_small_buckets_under_reentrant_checkpointing():
    """Buckets of a parameter or two: on the local accumulator's path a recomputed segment's
    gradients are added a bucket's worth at a time (`zfunc.autograd.rebind.Rebind`), so here
    at nearly every recomputed module; at the boundary they are reduced bucket by bucket."""
    for world in (1, 2):
        for stage, grad_accum in ((0, 2), (1, 1), (2, 2)):
            plain = run_ranks(_train, world, None, stage, grad_accum, None, 1e-4)
            for a, b in zip(plain, run_ranks(_train, world, "reentrant", stage, grad_accum, None, 1e-4)):
                assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-6, (world, stage, grad_accum)


class _Shared(torch.nn.Module):
    """``shared`` runs outside a reentrant checkpoint and inside it: its gradient comes in two
    parts, one from the call's graph and one from the segment's own backward."""

    def __init__(self, ckpt: bool):
        super().__init__()
        self.a, self.shared, self.b = (torch.nn.Linear(8, 8) for _ in range(3))
        self.ckpt = ckpt

    def segment(self, h):
        return torch.tanh(self.shared(self.b(h)))

    def forward(self, x):
        h = self.shared(self.a(x))
        h = torch.utils.checkpoint.checkpoint(self.segment, h, use_reentrant=True) if self.ckpt else self.segment(h)
        return h.square().mean()


def _two_steps(rank: int, make: Any, cfg: zfunc.Config) -> list[torch.Tensor]:
    """Two steps of ``make()`` (a model returning its loss) on rank-seeded batches: its parameters."""
    torch.manual_seed(0)
    state = zfunc.init(make(), cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        state, _ = zfunc.backward_step(state, lambda m, x: m(x), torch.randn(4, 8, generator=g), donate=True)
        state = zfunc.apply_step(state, donate=True)
    return list(zfunc.full_params(state).values())


def _shared(rank: int, ckpt: bool, stage: int, bucket_mb: float) -> list[torch.Tensor]:
    cfg = zfunc.Config(stage=stage, bucket_mb=bucket_mb, optimizer=zfunc.adamw(lr=1e-2))
    return _two_steps(rank, lambda: _Shared(ckpt), cfg)


def test_a_parameter_inside_and_outside_a_reentrant_segment():
    """A segment's recomputed gradients join their bucket before it starts (`Rebind.collect` runs
    when a bucket completes): the part from the call's graph and the segment's part are both in
    the reduce, in one bucket for all and in a bucket per parameter."""
    for stage in (0, 2):
        for bucket_mb in (25.0, 1e-4):
            plain = run_ranks(_shared, 2, False, stage, bucket_mb)
            for a, b in zip(plain, run_ranks(_shared, 2, True, stage, bucket_mb)):
                assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-6, (stage, bucket_mb)


class _Adapters(torch.nn.Module):
    """Hugging Face's ``enable_input_require_grads`` with adapters: a frozen embedding whose output
    is made to require grad, and every trained parameter inside reentrant segments, so the call's
    graph holds none of the taps of its forward (the collector is not in it)."""

    def __init__(self, ckpt: bool | str, hidden: bool = False):
        super().__init__()
        self.emb = torch.nn.Linear(8, 8).requires_grad_(False)
        self.b1, self.b2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.ckpt, self.hidden = ckpt, hidden  # hidden: the first block's output returned beside the loss

    def forward(self, x):
        h = self.emb(x).requires_grad_()
        if self.ckpt == "nested":  # the blocks' checkpoints inside one around both
            h, first = torch.utils.checkpoint.checkpoint(self.blocks, h, True, use_reentrant=True)
        else:
            h, first = self.blocks(h, bool(self.ckpt))
        return (h.square().mean(), first) if self.hidden else h.square().mean()

    def blocks(self, h, ckpt):
        outs = []
        for b in (self.b1, self.b2):
            h = h + (torch.utils.checkpoint.checkpoint(b, h, use_reentrant=True) if ckpt else b(h)).tanh()
            outs.append(h)
        return h, outs[0]


def _adapters(rank: int, ckpt: bool | str, stage: int, grad_accum: int, bucket_mb: float,
              accum: torch.dtype = torch.float32) -> list[torch.Tensor]:
    cfg = zfunc.Config(stage=stage, grad_accum=grad_accum, bucket_mb=bucket_mb, grad_accum_dtype=accum,
                       optimizer=zfunc.adamw(lr=1e-2))
    return _two_steps(rank, lambda: _Adapters(ckpt), cfg)


def test_every_trained_parameter_inside_reentrant_segments():
    """The backward never reaches the call's collector: the reduces the segments' gradients started
    are finished, and their sum added, when it ends (`zfunc.autograd.rebind.Rebind.settle`). At
    stage 3 a nested segment's first run (under ``no_grad``) gathers the root for itself alone: its
    inner segments' recomputation gathers it again, differentiably."""
    for world in (2, 3):
        for stage, grad_accum, bucket_mb, accum in ((0, 1, 25.0, torch.float32), (1, 2, 25.0, torch.float32),
                                                     (2, 1, 25.0, torch.float32), (2, 2, 1e-4, torch.float32),
                                                     (2, 1, 25.0, torch.bfloat16),  # bf16: the sum added after
                                                     (3, 1, 25.0, torch.float32), (3, 2, 25.0, torch.float32)):
            plain = run_ranks(_adapters, world, False, stage, grad_accum, bucket_mb, accum)
            for ckpt in (True, "nested"):
                for a, b in zip(plain, run_ranks(_adapters, world, ckpt, stage, grad_accum, bucket_mb, accum)):
                    assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-6, (world, stage, grad_accum,
                                                                                          accum, ckpt)


class _Scaled(torch.nn.Module):
    """A block whose scale lives in an ``nn.ParameterList``: a module with no forward of its own,
    whose parameter the block's forward reads."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8))])

    def forward(self, h):
        return torch.tanh(self.lin(h) * self.scale[0])


class _ScaledStack(torch.nn.Module):
    def __init__(self, ckpt: str | None):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(_Scaled() for _ in range(2))
        self.ckpt = ckpt

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x) if self.ckpt is None else torch.utils.checkpoint.checkpoint(
                b, x, use_reentrant=self.ckpt == "reentrant")
        return x.square().mean()


def _scaled(rank: int, ckpt: str | None, stage: int) -> list[torch.Tensor]:
    return _two_steps(rank, lambda: _ScaledStack(ckpt), zfunc.Config(stage=stage, optimizer=zfunc.adamw(lr=1e-2)))


def test_a_parameter_a_parent_reads_is_recomputed_on_the_call():
    """A parameter held by a module that is never called (``nn.ParameterList``) is read by its
    parent's forward: the recomputation binds it there, and training is the plain one."""
    for stage in (0, 2):
        plain = run_ranks(_scaled, 2, None, stage)
        for ckpt in ("reentrant", "non_reentrant"):
            for a, b in zip(plain, run_ranks(_scaled, 2, ckpt, stage)):
                assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-6, (stage, ckpt)


def _engine(rank: int, ckpt: str | None, stage: int, adapters: bool = False, hidden: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _Adapters({"reentrant": True, "nested": "nested"}.get(ckpt, False), hidden) if adapters else _model(ckpt)
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
          "zero_optimization": {"stage": stage}}
    engine, *_ = zfunc.initialize(model=model, config=ds)
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = (engine(x)[0] if hidden else engine(x)) if adapters else ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
    return [p.detach().clone() for p in engine.module.parameters()] if stage < 3 else \
        list(zfunc.full_params(engine.state).values())


def test_checkpointing_through_the_engine():
    for stage in (0, 2, 3):
        plain = run_ranks(_engine, 2, None, stage)
        for ckpt in ("reentrant", "non_reentrant"):
            for a, b in zip(plain, run_ranks(_engine, 2, ckpt, stage)):
                diff = max((x - y).abs().max().item() for x, y in zip(a, b))
                assert diff == 0 if ckpt == "non_reentrant" else diff < 1e-6, f"stage {stage} {ckpt}: {diff}"


class _MetaBuilt(torch.nn.Module):
    def __init__(self, ckpt: str):
        super().__init__()
        self.a, self.c, self.ckpt = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2), ckpt
        self.b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())

    def forward(self, x):
        return self.c(torch.utils.checkpoint.checkpoint(self.b, self.a(x), use_reentrant=self.ckpt == "reentrant"))


def _meta_engine(ckpt: str, stage: int, meta: bool) -> list[torch.Tensor]:
    ds = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "zero_optimization": {"stage": stage}}
    torch.manual_seed(0)
    with zfunc.zero.Init(config_dict_or_path=ds, enabled=meta):
        model = _MetaBuilt(ckpt)
    engine, *_ = zfunc.initialize(model=model, config=ds)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 4, generator=g)).square().mean())
        engine.step()
    return list(zfunc.full_params(engine.state).values())


def test_checkpointing_through_the_engine_on_a_module_built_on_meta():
    """A module built under ``zfunc.zero.Init`` (on the meta device): the engine puts new
    parameter objects in its entries. A recomputation finds them there at rest (it refused them
    as another state's tensors), and trains as the module built eagerly, bitwise."""
    for ckpt in ("reentrant", "nonreentrant"):
        for stage in (0, 1, 2, 3):
            eager, meta = _meta_engine(ckpt, stage, False), _meta_engine(ckpt, stage, True)
            assert all(torch.equal(a, b) for a, b in zip(eager, meta)), (ckpt, stage)


def _fp16_engine(rank: int, ckpt: str | None, how: str, stage: int = 1) -> list[torch.Tensor]:
    """Three steps of an fp16 engine (loss scaling) over `_Adapters` (``ckpt``: None,
    ``"reentrant"`` or ``"nested"``), the loss through
    ``engine.backward`` or ``engine.scale(loss).backward()``."""
    torch.manual_seed(0)
    ds = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": stage}, "fp16": {"enabled": True, "initial_scale_power": 8}}
    engine, *_ = zfunc.initialize(model=_Adapters({"reentrant": True, "nested": "nested"}.get(ckpt, False)), config=ds)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        loss = engine(torch.randn(4, 8, generator=g))
        engine.backward(loss) if how == "backward" else engine.scale(loss).backward()
        engine.step()
    if stage == 3:
        return [p.float() for p in zfunc.full_params(engine.state).values()]
    return [p.detach().float().clone() for p in engine.module.parameters()]


def test_every_trained_parameter_inside_reentrant_segments_under_loss_scaling():
    """The collector run at such a backward's end acts for it: the engine sees the scaled seed
    (`engine.backward`) or the scaled loss (`engine.scale`) of the backward that ends."""
    for stage, how in ((1, "backward"), (1, "scale"), (3, "backward"), (3, "scale")):
        plain = run_ranks(_fp16_engine, 2, None, how, stage)
        for ckpt in ("reentrant", "nested") if stage == 3 else ("reentrant",):
            for a, b in zip(plain, run_ranks(_fp16_engine, 2, ckpt, how, stage)):
                assert max((x - y).abs().max().item() for x, y in zip(a, b)) == 0, (stage, how, ckpt)


def test_every_trained_parameter_inside_reentrant_segments_through_the_engine():
    """The engine counts such a backward (its sinks are reached by the collector run at the
    backward's end, once: a segment's nested backward does not run one) and trains as without
    checkpointing; also when the model returns the first block's output beside the loss, whose
    marker the backward reaches only after the second block's recomputation. At stage 3 the
    segments' own backwards reduce-scatter into the sinks: the engine counts them as the backward
    they run inside (`zfunc.autograd.calls.InFlight.enclosing`)."""
    for stage in (0, 2, 3):
        for hidden in (False, True):
            plain = run_ranks(_engine, 2, None, stage, True, hidden)
            for ckpt in ("reentrant", "nested"):
                for a, b in zip(plain, run_ranks(_engine, 2, ckpt, stage, True, hidden)):
                    assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-6, (stage, ckpt, hidden)


def _late_part(rank: int) -> str:
    """Every parameter's gradient handed to the bucket reducer, then one of them again: its bucket's
    reduce is under way, so the late part is refused (it could not be added any more)."""
    from zfunc.autograd.average import Average
    from zfunc.autograd.buckets import bucket_views

    torch.manual_seed(0)
    state = zfunc.init(Stack(2), zfunc.Config(stage=2))
    sink = torch.zeros((), requires_grad=True).expand(state.grads.numel())
    sink.grad = torch.zeros(state.grads.numel())
    views, rebind = bucket_views(state, sink, state.binding.buckets(state), state.binding.pool, Average(1, 2))
    reducer = rebind.take.__self__
    rebind.take(tuple(range(len(reducer.slots))), tuple(torch.ones(slot.shape) for _, slot in reducer.slots))
    try:
        rebind.take((0,), (torch.ones(reducer.slots[0][1].shape),))
    except RuntimeError as e:
        return str(e)
    finally:
        reducer.finish()
    return "accepted"


def test_a_gradient_part_after_its_bucket_started_is_refused():
    for message in run_ranks(_late_part, 2):
        assert "arrived after its bucket's reduce had started" in message and "use_reentrant=False" in message


def _twice(rank: int, stage: int, ckpt: str | None, chained: bool = False, units: bool = False) -> str | torch.Tensor:
    """The model called twice in one loss, with checkpointed blocks: the state's gradient, or
    the refusal. ``chained``: the second call on the first one's output, so backward recomputes
    the second call's blocks before it reaches the first call at all. ``units``: stage 3 with a
    unit per block (else these small blocks are all in the root unit)."""
    state = zfunc.init(_model(ckpt), zfunc.Config(stage=stage, persist_threshold=0 if units else 100_000))
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))

    def loss(m, b):
        if chained:
            return ((m(m(b[0]).expand(-1, 8)) - b[1]) ** 2).mean()
        return _stack_loss(m, b) + _stack_loss(m, b)

    try:
        return zfunc.backward_step(state, loss, batch)[0].grads.clone()
    except RuntimeError as e:
        return str(e)


def test_two_calls_of_one_bound_model_recompute_on_its_tensors_or_are_refused():
    """Without units (stages 0-2; stage 3 with every parameter in the root unit) the bound
    model's calls compute with the same parameter tensors, as a torch module's do: a
    recomputation of either runs on them, and the gradient is the one without checkpointing. At
    stage 3 with units each call gathers its units apart: two pending calls are refused when
    recomputing."""
    for chained in (False, True):
        for stage in (0, 1, 2, 3):
            plain = run_ranks(_twice, 2, stage, None, chained)
            for ckpt in ("reentrant", "non_reentrant"):
                for a, b in zip(plain, run_ranks(_twice, 2, stage, ckpt, chained)):
                    assert isinstance(b, torch.Tensor), b
                    assert (a - b).abs().max().item() < 1e-6, (stage, ckpt, chained)
        for ckpt in ("reentrant", "non_reentrant"):  # chained: the first recomputation finds one call
            for message in run_ranks(_twice, 2, 3, ckpt, chained, True):
                assert "2 forward calls of it through zfunc are differentiated by this backward" in message, message


def _pullbacks(rank: int, stage: int, ckpt: str, between: str) -> torch.Tensor:
    """A vjp whose pullback runs after ``between``: nothing, a forward without autograd of the
    same state, or a second vjp still pending; the recomputation finds its own call from the graph."""
    import gc

    warm = torch.ones(1, 1, requires_grad=True)  # torch's first checkpoint imports modules, leaving cycles
    torch.utils.checkpoint.checkpoint(torch.tanh, warm, use_reentrant=False).sum().backward()
    gc.collect()
    gc.disable()  # a call's parameters must live exactly as long as its graph, without the collector
    try:
        units = ["blocks.0", "blocks.1"] if stage == 3 else None  # stage 3: block 2 in the root unit
        state = zfunc.init(_model(ckpt), zfunc.Config(stage=stage, units=units, persist_threshold=0))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        out, pullback = zfunc.vjp(state, lambda m, x: m(x), x)
        kept = None
        if between == "no_grad":
            with torch.no_grad():
                zfunc.vjp(state, lambda m, x: m(x), x * 3)
        elif between == "second":
            kept = zfunc.vjp(state, lambda m, x: m(x), x * 3)
        done = pullback(torch.ones_like(out))
        del out, pullback, kept
        assert len(state.binding._watch) == 0  # freed with the graph
        return done.grads.clone()
    finally:
        gc.enable()


def test_a_pullback_recomputes_on_its_own_call():
    for stage in (0, 1, 2, 3):
        for ckpt in ("non_reentrant", "reentrant"):
            alone = run_ranks(_pullbacks, 2, stage, ckpt, "nothing")
            for between in ("no_grad", "second"):
                for a, b in zip(alone, run_ranks(_pullbacks, 2, stage, ckpt, between)):
                    assert torch.equal(a, b), f"stage {stage} {ckpt} {between}"


def _nested_pullback(rank: int, stage: int, ckpt: bool | str, second: bool) -> torch.Tensor:
    """A vjp of `_Adapters` (reentrant segments, or segments nested in one) pulled back while a
    second vjp's graph lives (``second``) or alone."""
    torch.manual_seed(0)
    state = zfunc.init(_Adapters(ckpt), zfunc.Config(stage=stage))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    out, pullback = zfunc.vjp(state, lambda m, x: m(x), x)
    kept = zfunc.vjp(state, lambda m, x: m(x), x * 3) if second else None
    grads = pullback(torch.ones_like(out)).grads.clone()
    del kept
    return grads


def test_a_nested_segment_recomputes_on_its_call_while_another_graph_lives():
    """An inner segment's recomputation runs in the outer segment's own backward, which reached no
    call's outputs: it belongs to the call of the backward it runs inside
    (`zfunc.autograd.calls.InFlight.enclosing`), not to either of the two live calls at random
    (refused as ambiguous)."""
    for stage in (0, 2, 3):
        for ckpt in (True, "nested"):
            alone = run_ranks(_nested_pullback, 2, stage, ckpt, False)
            for a, b in zip(alone, run_ranks(_nested_pullback, 2, stage, ckpt, True)):
                assert torch.equal(a, b), (stage, ckpt)


def _kept_aux(rank: int, stage: int, ckpt: str) -> list[torch.Tensor]:
    """backward_step with the outputs returned as aux and kept (as loops keep logits for metrics)."""
    units = ["blocks.0", "blocks.1"] if stage == 3 else None
    state = zfunc.init(_model(ckpt), zfunc.Config(stage=stage, grad_accum=2, units=units, persist_threshold=0,
                                                  optimizer=zfunc.adamw(lr=1e-2)))
    g = torch.Generator().manual_seed(rank)

    def loss_fn(m, b):
        out = m(b[0])
        return ((out - b[1]) ** 2).mean(), out

    kept = []
    for _ in range(2):
        for _ in range(2):
            state, (_, aux) = zfunc.backward_step(state, loss_fn, (torch.randn(4, 8, generator=g),
                                                                  torch.randn(4, 1, generator=g)), has_aux=True)
            kept.append(aux)
        state = zfunc.apply_step(state)
    return list(zfunc.full_params(state).values())


def test_kept_outputs_do_not_confuse_a_later_recomputation():
    for stage in (0, 1, 2, 3):
        plain = run_ranks(_kept_aux, 2, stage, None)
        for a, b in zip(plain, run_ranks(_kept_aux, 2, stage, "non_reentrant")):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), stage


def _grads_with(stage: int, ckpt: str, interfere: str | None) -> tuple[torch.Tensor, list[BaseException]]:
    """One checkpointed micro-batch on a state that trained a step (its weights are not the
    module's), with another thread running zfunc on the same module: in the middle of the
    backward (``"during"``: a forward and backward of its own, before the recomputation), or at
    the same time (``"concurrent"``: its own micro-batches)."""
    import threading

    units = ["blocks.0"] if stage == 3 else None
    cfg = zfunc.Config(stage=stage, persist_threshold=0, units=units, optimizer=zfunc.adamw(lr=1e-1))
    model = _model(ckpt)
    state = zfunc.init(model, cfg)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))
    state = zfunc.apply_step(zfunc.backward_step(state, _stack_loss, batch)[0])
    errors: list[BaseException] = []

    def other() -> None:
        for _ in range(1 if interfere == "during" else 5):
            try:
                zfunc.backward_step(state, _stack_loss, batch)
            except RuntimeError as e:  # reported by the test
                errors.append(e)

    once: list[threading.Thread] = []

    def hook(grad: torch.Tensor) -> None:
        if interfere == "during" and not once:
            once.append(threading.Thread(target=other))
            once[0].start()
            once[0].join()

    handle = model.blocks[2].register_forward_hook(
        lambda m, a, out: None if not out.requires_grad else (out.register_hook(hook), None)[1])
    thread = threading.Thread(target=other) if interfere == "concurrent" else None
    if thread is not None:
        thread.start()
    grads = []
    for _ in range(5 if thread else 1):
        try:
            grads.append(zfunc.backward_step(state, _stack_loss, batch)[0].grads)
        except RuntimeError as e:
            errors.append(e)
    if thread is not None:
        thread.join()
    handle.remove()
    return torch.stack(grads) if grads else torch.empty(0), errors


@pytest.mark.parametrize("ckpt", ["nonreentrant", "reentrant"])
def test_zfunc_in_another_thread_gives_right_gradients_or_a_clear_error(ckpt):
    """A zfunc call in another thread while a checkpointed backward is in flight leaves its
    gradients exact (the call itself runs, or, once the backward recomputes, when the module
    holds that backward's tensors until its end, is refused naming the cause); two threads
    running one module at once get exact gradients, or (where their forwards overlap) an error
    that names the cause, never wrong numbers."""
    for stage in (0, 2, 3):
        alone, none = _grads_with(stage, ckpt, None)
        during, errors = _grads_with(stage, ckpt, "during")
        assert not none and len(during) == 1 and torch.equal(during, alone), stage
        assert all("in another thread now" in str(e) for e in errors), (stage, errors)
        both, errors = _grads_with(stage, ckpt, "concurrent")
        assert all(torch.equal(g, alone[0]) for g in both), stage
        assert all("in another thread now" in str(e) for e in errors), (stage, errors)


class _Paused(torch.nn.Module):
    """A module holding a parameter and a child; its forward can wait, in thread "A", for the
    test to go on (``gate``)."""

    def __init__(self, gate: dict):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.c = torch.nn.Linear(4, 4)
        self.gate = gate

    def forward(self, x):
        h = x * self.w
        if self.gate.get("on") and threading.current_thread().name == "A":
            self.gate["inside"].set()
            self.gate["go"].wait(10)
        return self.c(h)


class _PausedNet(torch.nn.Module):
    def __init__(self, ckpt: str, gate: dict):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.p, self.ckpt = torch.nn.Linear(4, 4), _Paused(gate), ckpt

    def forward(self, x, whole: bool):
        h = self.inp(x)
        reentrant = self.ckpt == "reentrant"
        if whole:  # the covering module
            return torch.utils.checkpoint.checkpoint(self.p, h, use_reentrant=reentrant)
        return torch.utils.checkpoint.checkpoint(self.p.c, h * self.p.w, use_reentrant=reentrant)  # its child alone


def _paused(ckpt: str, stage: int, overlap: bool) -> tuple[Any, Any]:
    """Two states of one binding with other weights: A's backward recomputes the module that
    covers its subtree, B's recomputes only the child; with ``overlap``, B's runs while A's
    recomputation waits inside the module (in thread "A"). B's gradients (or its error) and A's."""
    gate = {"on": False, "inside": threading.Event(), "go": threading.Event()}
    cfg = zfunc.Config(stage=stage, persist_threshold=0, optimizer=zfunc.sgd(lr=0.5))
    first = zfunc.init(_PausedNet(ckpt, gate), cfg)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    second = zfunc.apply_step(zfunc.backward_step(first, lambda m, x: m(x, True).pow(2).sum(), x)[0])
    out_a, pullback_a = zfunc.vjp(first, lambda m, x: m(x, True), x)
    out_b, pullback_b = zfunc.vjp(second, lambda m, x: m(x, False), x)
    if not overlap:
        return pullback_b(torch.ones_like(out_b)).grads, pullback_a(torch.ones_like(out_a)).grads
    gate["on"] = True
    got_a: list[Any] = []

    def a() -> None:
        try:
            got_a.append(pullback_a(torch.ones_like(out_a)).grads)
        except RuntimeError as e:
            got_a.append(e)

    thread = threading.Thread(target=a, name="A")
    thread.start()
    assert gate["inside"].wait(10)
    try:
        got_b: Any = pullback_b(torch.ones_like(out_b)).grads
    except RuntimeError as e:
        got_b = e
    gate["go"].set()
    thread.join()
    return got_b, got_a[0]


@pytest.mark.parametrize("ckpt", ["nonreentrant", "reentrant"])
def test_a_recomputation_in_another_thread_is_not_covered_by_this_ones(ckpt):
    """While thread A's recomputation covers a module's subtree, thread B's recomputation of a
    child of it (its own state) is refused with an error naming the cause, and A's gradients
    are exact (the hooks of the modules below a covering one are asleep in its thread only:
    B's ran on A's tensors, 2.0 off)."""
    for stage in (0, 2, 3):
        alone_b, alone_a = _paused(ckpt, stage, False)
        got_b, got_a = _paused(ckpt, stage, True)
        assert isinstance(got_b, RuntimeError) and "in another thread now" in str(got_b), (stage, got_b)
        assert torch.equal(got_a, alone_a), stage


class _Interrupting(torch.nn.Module):
    """A layer that raises ``KeyboardInterrupt`` once in a recomputation (``armed``)."""

    def __init__(self):
        super().__init__()
        self.l, self.armed = torch.nn.Linear(4, 4), False

    def forward(self, x):
        if self.armed and graph_task() != -1:  # in a backward: the recomputation
            self.armed = False
            raise KeyboardInterrupt
        return self.l(x)


class _InterruptedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = torch.nn.Linear(4, 4), _Interrupting()

    def forward(self, x):
        return self.mlp(torch.tanh(torch.utils.checkpoint.checkpoint(self.attn, x, use_reentrant=False)))


class _InterruptedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.blk, self.head = torch.nn.Linear(4, 4), _InterruptedBlock(), torch.nn.Linear(4, 1)

    def forward(self, x, outer: bool):
        h = self.pre(x)
        h = torch.utils.checkpoint.checkpoint(self.blk, h, use_reentrant=False) if outer else self.blk(h)
        return self.head(h)


def _after_an_interrupt(stage: int, units: list, interrupt: bool) -> list[torch.Tensor]:
    state = zfunc.init(_InterruptedNet(), zfunc.Config(stage=stage, units=units, persist_threshold=0,
                                                        optimizer=zfunc.sgd(lr=0.5)))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    loss = lambda outer: lambda m, x: m(x, outer).square().sum()  # noqa: E731
    state = zfunc.apply_step(zfunc.backward_step(state, loss(False), x)[0])
    if interrupt:
        state.binding.module.blk.mlp.armed = True
        with pytest.raises(KeyboardInterrupt):
            zfunc.backward_step(state, loss(True), x)
    for _ in range(3):  # the block's child recomputed with the block's module not around it
        state = zfunc.apply_step(zfunc.backward_step(state, loss(False), x)[0])
    return list(zfunc.full_params(state).values())


def test_training_goes_on_exact_after_an_interrupted_recomputation():
    """A ``KeyboardInterrupt`` inside a forward recomputed in backward (a notebook's interrupt):
    torch runs the always-called post-hooks on an ``Exception`` only, so the unit's module was
    left counted as running, and the next recomputation of its child slept and ran on the
    module's own tensors (6.4 off after three steps at stage 3, for good). The next backward
    through a call undoes what it left: training goes on as without the interrupt."""
    for stage, units in ((1, ["blk"]), (3, ["blk"]), (3, ["blk", "blk.attn"])):
        plain = _after_an_interrupt(stage, units, False)
        after = _after_an_interrupt(stage, units, True)
        assert all(torch.equal(a, b) for a, b in zip(plain, after)), (stage, units)


class _TwoInits(torch.nn.Module):
    def __init__(self, ckpt: str):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.b, self.ckpt = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), ckpt

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.b, self.inp(x), use_reentrant=self.ckpt == "reentrant")


def test_two_inits_of_one_module_in_one_checkpointed_backward_are_refused():
    """Two states made by separate ``init`` calls on one module (two bindings), other weights,
    a loss through a call of each, checkpointed: each recomputation would run on the other's
    parameters (4.1 off), so it is refused, naming the cause; each state's backward on its own
    trains as plain torch on its weights; the module keeps its own parameters."""
    from zfunc.core.backward import bind, sinks_into

    for ckpt in ("reentrant", "nonreentrant"):
        for stage in (0, 2, 3):
            model = _TwoInits(ckpt)
            own = [p for p in model.parameters()]
            cfg = zfunc.Config(stage=stage, optimizer=zfunc.sgd(lr=0.5))
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
            first, second = zfunc.init(model, cfg), zfunc.init(model, cfg)
            second = zfunc.apply_step(zfunc.backward_step(second, lambda m, x: m(x).sum(), x)[0])
            grads = [torch.zeros(s.layout.full_numel) for s in (first, second)]
            with pytest.raises(RuntimeError, match="separate zfunc.init calls on one module"):
                sum(bind(s, sinks_into(s, g))(x).pow(2).sum() for s, g in zip((first, second), grads)).backward()
            assert [p for p in model.parameters()] == own and all(type(p) is torch.nn.Parameter for p in own)
            for s in (first, second):
                ref = _TwoInits(ckpt)
                ref.load_state_dict(zfunc.full_params(s))
                ref(x).pow(2).sum().backward()
                got = zfunc.backward_step(s, lambda m, x: m(x).pow(2).sum(), x)[0].grads
                want = torch.cat([p.grad.flatten() for p in ref.parameters()])
                assert (got[:want.numel()] - want).abs().max().item() < 1e-6, (ckpt, stage)


class _ReadsEmbedding(torch.nn.Module):
    """A checkpointed segment that reads the embedding's weight outside any module's forward (an
    output projection tied by hand, ``h @ emb.weight.T``): with the block (``"block"``), or alone
    after it (``"head"``: no module of the model is recomputed); or (``"calls"``) a segment that
    calls its own output layer only."""

    def __init__(self, how: str):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.blk = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 10)
        self.how = how

    def forward(self, x):
        h = self.emb(x)
        if self.how == "head":
            return torch.utils.checkpoint.checkpoint(lambda h: h @ self.emb.weight.T, torch.tanh(self.blk(h)),
                                                     use_reentrant=True)
        head = (lambda h: h @ self.emb.weight.T) if self.how == "block" else self.out
        return torch.utils.checkpoint.checkpoint(lambda h: head(torch.tanh(self.blk(h))), h, use_reentrant=True)


def _read_off(rank: int, stage: int, units: list | None, how: str, call: str) -> str | list[torch.Tensor]:
    torch.manual_seed(0)
    model = _ReadsEmbedding(how)
    model(torch.tensor([[1]])).sum().backward()  # a .grad the model had before init: not the call's
    state = zfunc.init(model, zfunc.Config(stage=stage, units=units, persist_threshold=0,
                                           optimizer=zfunc.sgd(lr=0.5)))
    x = torch.tensor([[1, 2, 3 + rank]])
    loss = lambda m, x: m(x).square().mean()  # noqa: E731
    try:
        for _ in range(2):
            if call == "backward_step":
                state, _ = zfunc.backward_step(state, loss, x)
            else:
                out, pullback = zfunc.vjp(state, lambda m: loss(m, x))
                state = pullback(torch.ones_like(out))
            state = zfunc.apply_step(state)
    except RuntimeError as e:
        return str(e)
    return list(zfunc.full_params(state).values())


def _read_off_in_torch(how: str) -> list[torch.Tensor]:
    """`_read_off`'s two SGD steps of a world of two in plain torch (its mean over the ranks)."""
    torch.manual_seed(0)
    model = _ReadsEmbedding(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        (sum(model(torch.tensor([[1, 2, 3 + rank]])).square().mean() for rank in range(2)) / 2).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_a_segment_reading_a_weight_off_a_module_it_does_not_call_trains_or_is_refused():
    """Under reentrant checkpointing a segment that reads a weight off a module it does not call:
    after a module of the model was recomputed in that backward (``"block"``), the module holds
    the call's parameters (put in at the first one) and it trains as torch; with none recomputed
    (``"head"``), or at stage 3 none holding a parameter of the root (the block a unit: the root
    is gathered again only for a module that holds part of it), the read sends that gradient to
    the module's own ``.grad``: the backward raises at its end, naming the parameter, on every
    rank, instead of training without it. A segment that calls its modules trains (a ``.grad``
    the model had before ``init`` is not taken for a read)."""
    for stage, units in ((0, None), (2, None), (3, None), (3, ["blk"])):
        for call in ("backward_step", "vjp"):
            for how in ("head", "block") if units else ("head",):
                for message in run_ranks(_read_off, 2, stage, units, how, call):
                    assert isinstance(message, str) and "the .grad of the model's own ['emb.weight']," in message, (
                        stage, units, how, call, message)
            for how in ("calls",) if units else ("block", "calls"):
                want = _read_off_in_torch(how)
                for got in run_ranks(_read_off, 2, stage, units, how, call):
                    assert not isinstance(got, str), (stage, units, how, call, got)
                    assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-6, (stage, units, how, call)


class _Head(torch.nn.Module):
    """Holds no parameter of its own: its forward reads its child's weight and bias without
    calling the child (a tied projection written ``F.linear(h, self.proj.weight)``)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, h):
        return torch.tanh(torch.nn.functional.linear(h, self.proj.weight) + self.proj.bias)


class _Encoder(torch.nn.Module):
    """Under checkpointing, a module whose forward reads a child's parameters: torch's own
    ``nn.TransformerEncoderLayer`` (``"encoder"``: its attention's forward reads
    ``out_proj.weight`` and ``out_proj.bias`` without calling ``out_proj``), or `_Head`
    (``"head"``)."""

    def __init__(self, ckpt: str | None, kind: str = "encoder"):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.layer = (torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
                      if kind == "encoder" else _Head())
        self.ckpt = ckpt

    def forward(self, x):
        h = self.inp(x)
        if self.ckpt is None:
            return self.layer(h)
        return torch.utils.checkpoint.checkpoint(self.layer, h, use_reentrant=self.ckpt == "reentrant")


def _encoder(rank: int, stage: int, ckpt: str | None, kind: str = "encoder") -> list[torch.Tensor]:
    torch.manual_seed(0)
    # SGD: the recomputed attention sums in another order (about 1e-8 apart), which Adam's first
    # steps would turn into lr-sized moves wherever a gradient is about zero
    cfg = zfunc.Config(stage=stage, persist_threshold=0, optimizer=zfunc.sgd(lr=0.1))
    state = zfunc.init(_Encoder(ckpt, kind), cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        state, _ = zfunc.backward_step(state, lambda m, x: m(x).square().mean(), torch.randn(2, 3, 8, generator=g))
        state = zfunc.apply_step(state)
    return list(zfunc.full_params(state).values())


@pytest.mark.parametrize("kind", ["encoder", "head"])
def test_a_module_reading_a_childs_weight_in_its_forward_recomputes_on_the_call(kind):
    """The outermost recomputed module puts in its whole subtree's parameters from the call, not
    only its own, and a module holding none of its own does too: torch's
    ``nn.MultiheadAttention`` reads its ``out_proj`` parameters in its own forward; `_Head`
    holds no parameter and reads its child's. Three steps under either checkpointing equal the
    unchecked run."""
    for stage in (0, 2, 3):
        plain = run_ranks(_encoder, 2, stage, None, kind)
        for ckpt in ("reentrant", "nonreentrant"):
            for a, b in zip(plain, run_ranks(_encoder, 2, stage, ckpt, kind)):
                assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-6, (stage, ckpt)


class _Block(torch.nn.Module):
    """A unit's module (with ``Config.units``, or stage 3's blocks) whose forward checkpoints
    one of its own children: the recomputation runs the child, not the unit's module."""

    def __init__(self, ckpt: str | None):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.ckpt = ckpt

    def forward(self, h):
        h = torch.tanh(self.a(h))
        if self.ckpt is None:
            return torch.tanh(self.b(h))
        return torch.tanh(torch.utils.checkpoint.checkpoint(self.b, h, use_reentrant=self.ckpt == "reentrant"))


class _Blocks(torch.nn.Module):
    def __init__(self, ckpt: str | None):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList([_Block(ckpt), _Block(ckpt)])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


def _blocks(rank: int, cfg: dict, ckpt: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    state = zfunc.init(_Blocks(ckpt), zfunc.Config(persist_threshold=0, optimizer=zfunc.sgd(lr=0.1), **cfg))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        state, _ = zfunc.backward_step(state, lambda m, x: m(x).square().mean(), torch.randn(4, 8, generator=g))
        state = zfunc.apply_step(state)
    return list(zfunc.full_params(state).values())


def test_a_unit_checkpointing_one_of_its_children_recomputes_on_the_call():
    """A checkpointed child of a unit's module (a block's attention or MLP) is recomputed
    without the unit's module around it: it puts in its unit's parameters itself (at stage 3
    the unit gathered again; at stages 1-2 with units, views of the call's buffer). Three steps
    under either checkpointing equal the unchecked run, with units by default (stage 3), by
    path and by class."""
    for cfg in ({"stage": 3}, {"stage": 3, "units": ["blocks.0"]}, {"stage": 3, "units": [_Block]},
                {"stage": 2, "units": ["blocks.0", "blocks.1"]}, {"stage": 1, "units": [_Block]}):
        plain = run_ranks(_blocks, 2, cfg, None)
        for ckpt in ("reentrant", "nonreentrant"):
            for a, b in zip(plain, run_ranks(_blocks, 2, cfg, ckpt)):
                assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-6, (cfg, ckpt)


class _NormBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.register_buffer("seen", torch.zeros(()))  # reassigned, not updated in place

    def forward(self, h):
        self.seen = self.seen + 1
        return torch.tanh(self.bn(self.lin(h)))


class _Normed(torch.nn.Module):
    """Blocks holding buffers (BatchNorm's statistics; a float scale), each checkpointed."""

    def __init__(self, ckpt: str | None):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(_NormBlock() for _ in range(2))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8) + 1e-3)
        self.ckpt = ckpt

    def forward(self, x):
        h = self.inp(x) * self.scale
        for b in self.blocks:
            h = b(h) if self.ckpt is None else torch.utils.checkpoint.checkpoint(
                b, h, use_reentrant=self.ckpt == "reentrant")
        return h


def test_a_recomputed_forward_runs_on_the_calls_buffers():
    """A recomputed module runs on the call's buffers, not on the module's own: BatchNorm's
    statistics are updated again in the recomputation (as torch's checkpointing does to a plain
    model's), in the state, a buffer the recomputation reassigns too, and the module's own
    buffers never move. Three steps against plain torch with the same checkpointing."""
    import copy

    for ckpt in ("reentrant", "nonreentrant"):
        for stage in (0, 2, 3):
            torch.manual_seed(0)
            ref = _Normed(ckpt)
            model, before = copy.deepcopy(ref), copy.deepcopy(ref)
            opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            state = zfunc.init(model, zfunc.Config(stage=stage, persist_threshold=0, optimizer=zfunc.sgd(lr=0.1)))
            g = torch.Generator().manual_seed(1)
            for _ in range(3):
                x = torch.randn(4, 8, generator=g)
                ref(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                state, _ = zfunc.backward_step(state, lambda m, x: m(x).square().mean(), x)
                state = zfunc.apply_step(state)
            params = zfunc.full_params(state)
            assert max((params[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()) < 1e-6
            assert ref.blocks[0].bn.num_batches_tracked.item() == ref.blocks[0].seen.item() == 6  # recomputed too
            for n, b in ref.named_buffers():
                assert (state.buffers[n].double() - b.double()).abs().max().item() < 1e-6, (ckpt, stage, n)
            for (n, a), b in zip(model.named_buffers(), before.buffers()):
                assert torch.equal(a, b), (ckpt, stage, n)


def _engine_buffers(ckpt: str | None, stage: int) -> tuple[dict, dict, dict]:
    """Three steps of two micro-batches of `_Normed` through the engine: the state's buffers,
    the module's, and plain torch's with the same checkpointing."""
    torch.manual_seed(0)
    ref = _Normed(ckpt)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(0)
    model = _Normed(ckpt)
    engine, *_ = zfunc.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for _ in range(2):
            x = torch.randn(4, 8, generator=g)
            (ref(x).square().mean() / 2).backward()
            engine.backward(engine(x).square().mean())
            engine.step()
        opt.step()
        opt.zero_grad()
    return dict(engine.state.buffers), dict(model.named_buffers()), dict(ref.named_buffers())


def test_the_engine_keeps_the_buffers_a_forward_reassigns():
    """Through the engine a buffer the forward reassigns (``self.n = self.n + 1``), or its
    recomputation under checkpointing, goes into the state and the module shows it, as plain
    torch's module has it (it was dropped: the state and the module kept the first value); one
    updated in place (BatchNorm's) too."""
    for ckpt in (None, "reentrant", "nonreentrant"):
        for stage in (0, 3):
            state, module, ref = _engine_buffers(ckpt, stage)
            assert ref["blocks.0.seen"].item() == (6 if ckpt is None else 12), ckpt
            for n, b in ref.items():
                assert (state[n].double() - b.double()).abs().max().item() < 1e-6, (ckpt, stage, n)
                assert (module[n].double() - b.double()).abs().max().item() < 1e-6, (ckpt, stage, n)


def test_a_pullback_called_again_leaves_the_first_results_buffers():
    """A `zfunc.vjp` pullback called twice (``retain_graph=True``) recomputes the checkpointed
    blocks in each backward, on the call's buffers: BatchNorm's statistics are updated again,
    in the second result (as torch's two backwards update a plain model's), and the first
    result keeps what it was given."""
    for ckpt in ("reentrant", "nonreentrant"):
        for stage in (0, 2, 3):
            torch.manual_seed(0)
            state = zfunc.init(_Normed(ckpt), zfunc.Config(stage=stage, persist_threshold=0))
            out, pullback = zfunc.vjp(state, lambda m, x: m(x), torch.randn(4, 8))
            first = pullback(torch.ones_like(out), retain_graph=True)
            kept = {n: b.clone() for n, b in first.buffers.items()}
            second = pullback(torch.ones_like(out))
            assert all(torch.equal(first.buffers[n], b) for n, b in kept.items()), (ckpt, stage)
            assert first.buffers["blocks.0.bn.num_batches_tracked"].item() == 2, (ckpt, stage)
            assert second.buffers["blocks.0.bn.num_batches_tracked"].item() == 3, (ckpt, stage)


def _normed(rank: int, cfg: dict, ckpt: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    state = zfunc.init(_Normed(ckpt).eval(), zfunc.Config(persist_threshold=0, optimizer=zfunc.sgd(lr=0.1), **cfg))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        state, _ = zfunc.backward_step(state, lambda m, x: m(x).float().square().mean(), torch.randn(4, 8, generator=g))
        state = zfunc.apply_step(state)
    return [t.float() for t in zfunc.full_params(state).values()]


def test_a_recomputed_forward_runs_on_the_calls_buffers_in_their_dtype():
    """In bf16 the call's buffers are bf16 (the module's own stay float32): a recomputation on
    the module's own computed otherwise (non-reentrant checkpointing refused it on the dtype,
    reentrant trained 2.3e-5 off). Three steps equal the unchecked run (BatchNorm in eval mode:
    its statistics are read, not updated)."""
    for cfg in ({"stage": 2, "precision": "bf16"}, {"stage": 3, "precision": "bf16"}):
        plain = run_ranks(_normed, 2, cfg, None)
        for ckpt in ("reentrant", "nonreentrant"):
            for a, b in zip(plain, run_ranks(_normed, 2, cfg, ckpt)):
                assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-6, (cfg, ckpt)


def _beside_a_pending_pullback(stage: int, units: list) -> float:
    """Two steps of a fresh state while a state made earlier from the same module has a
    pullback pending (its graph, and so its binding's hooks, still on the module); against the
    same two steps with nothing pending."""
    cfg = zfunc.Config(stage=stage, units=units, persist_threshold=0, optimizer=zfunc.sgd(lr=0.5))
    loss = lambda m, x: m(x).square().mean()  # noqa: E731
    x = torch.tensor([[1, 2, 3]])

    def two_steps(state):
        for _ in range(2):
            state, _ = zfunc.backward_step(state, loss, x)
            state = zfunc.apply_step(state)
        return zfunc.full_params(state)

    torch.manual_seed(0)
    model = _ReadsEmbedding("calls")
    out, pullback = zfunc.vjp(zfunc.init(model, cfg), lambda m: loss(m, x))
    beside = two_steps(zfunc.init(model, cfg))
    torch.manual_seed(0)
    alone = two_steps(zfunc.init(_ReadsEmbedding("calls"), cfg))
    del out, pullback
    return max((beside[k] - alone[k]).abs().max().item() for k in alone)


def test_a_fresh_state_beside_a_pending_pullback_recomputes_on_its_own_call():
    """Stage 3: the earlier state's unit hooks are on the module too; in the fresh state's
    backward they do nothing (no backward through their calls runs), so its recomputation
    gathers its own call's units, not the pending call's."""
    assert _beside_a_pending_pullback(3, ["blk"]) == 0.0



def test_the_recompute_hooks_go_on_at_the_first_recomputation_only(monkeypatch):
    """A backward that recomputes nothing puts no hook on the module's modules and takes none
    off: one pre-hook in torch's global table stands for them from the moment a backward reaches
    the call's outputs until a hooked module is called while it runs (a recomputation), and none
    is left once no call's graph lives. The first module recomputed gets its recompute hook ahead
    of the user's pre-hook, which reads the call's weight there (as a weight-norm hook does), not
    the module's own (stale after a step)."""
    from torch.nn.modules import module as torch_module

    monkeypatch.setattr("zfunc.autograd.recompute.compiled_anything", lambda: False)  # (another test may compile)

    def on_modules(model: torch.nn.Module) -> int:
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    for ckpt in (None, "reentrant", "non_reentrant"):
        for stage in (0, 3):
            where = (ckpt, stage)
            torch.manual_seed(0)
            model = Stack(3)
            model.ckpt = ckpt
            seen: list[float] = []
            for block in model.blocks:
                block[0].register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.sum().item()))
            observed: list[tuple[int, int]] = []

            def observe(g: torch.Tensor) -> None:  # the gradient reaches the head's input: no block recomputed yet
                observed.append((on_modules(model), len(torch_module._global_forward_pre_hooks)))

            def watch_head(mod: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
                if args[0].requires_grad:
                    args[0].register_hook(observe)

            model.out.register_forward_hook(watch_head)
            user = on_modules(model)
            state = zfunc.init(model, zfunc.Config(stage=stage, persist_threshold=0, optimizer=zfunc.sgd(lr=0.5)))
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            state, _ = zfunc.backward_step(state, _stack_loss, (x, y))
            state = zfunc.apply_step(state)  # the state's weights differ from the module's own now
            seen.clear()
            after_forward: list[int] = []

            def loss_fn(m, batch):
                out = m(batch[0])
                after_forward.append(on_modules(model))  # the call's own hooks (stage 3's unit hooks)
                return ((out - batch[1]) ** 2).mean()

            state, _ = zfunc.backward_step(state, loss_fn, (x, y))
            assert observed[-1] == (after_forward[0], 1), (where, observed, after_forward)
            assert on_modules(model) == user and not torch_module._global_forward_pre_hooks, where
            forward, again = seen[:3], seen[3:]
            assert len(again) == (3 if ckpt else 0), (where, seen)
            assert sorted(again) == sorted(forward[:len(again)] if not ckpt else forward), (where, seen)
            own = [b[0].weight.sum().item() for b in model.blocks]
            assert all(abs(a - b) > 1e-3 for a, b in zip(forward, own)), where  # (the check tells them apart)


class _Gate(torch.autograd.Function):
    """Identity; its backward, where ``ctx.events`` is set, signals and waits (a backward paused
    midway, after it reached the call's outputs)."""

    @staticmethod
    def forward(ctx, x, events):
        ctx.events = events
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.events is not None:
            ctx.events[0].set()
            ctx.events[1].wait(30)
        return g, None


class _GatedNet(torch.nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant, self.events = reentrant, None
        self.i, self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.a, self.i(x), use_reentrant=self.reentrant)
        return self.b(torch.tanh(_Gate.apply(h, self.events)))


@pytest.mark.parametrize("reentrant", [False, True])
def test_plain_torch_in_another_thread_during_a_zfunc_backward_recomputes_on_its_own(reentrant):
    """While a zfunc backward through a checkpointed model is paused midway in one thread, plain
    torch (no zfunc call) runs the same module with its checkpointing in another: its
    recomputation runs on the module's own weights (no backward through a call runs in its
    thread), so its gradients are torch's, and the zfunc backward's are as when it runs alone."""
    def loss_fn(m, x):
        return m(x).square().mean()

    torch.manual_seed(0)
    model = _GatedNet(reentrant)
    state = zfunc.init(model, zfunc.Config(stage=0, optimizer=zfunc.sgd(lr=0.5)))
    state = zfunc.apply_step(zfunc.backward_step(state, loss_fn, torch.randn(3, 4))[0])  # differs from the module's
    xa, xb = torch.randn(3, 4), torch.randn(3, 4)
    params = list(model.parameters())

    def plain() -> list[torch.Tensor]:  # (torch's reentrant checkpointing refuses autograd.grad: into .grad)
        loss_fn(model, xb).backward()
        grads = [p.grad.clone() for p in params]
        model.zero_grad(set_to_none=True)
        return grads

    alone_b = plain()
    alone_a = zfunc.backward_step(state, loss_fn, xa)[0].grads.clone()
    events = (threading.Event(), threading.Event())
    out: dict[str, Any] = {}

    def zfunc_thread() -> None:
        model.events = events
        try:
            out["a"] = zfunc.backward_step(state, loss_fn, xa)[0].grads.clone()
        except Exception as e:  # noqa: BLE001 (reported below)
            out["a"] = e
        finally:
            events[0].set()

    t = threading.Thread(target=zfunc_thread)
    t.start()
    assert events[0].wait(30)
    model.events = None
    try:
        got_b = plain()
    finally:
        events[1].set()
        t.join()
    assert all(torch.equal(g, e) for g, e in zip(got_b, alone_b))
    assert not isinstance(out["a"], Exception), out["a"]
    assert torch.equal(out["a"], alone_a)


def test_a_graph_kept_after_its_backward_leaves_no_global_hook(monkeypatch):
    """The global pre-hook that stands for the recompute hooks is there only while a backward
    runs through the call: a backward that recomputed nothing, whose graph stays referenced (a
    loop's last ``loss``, a kept output), leaves none in torch's table, at every stage; a second
    backward through the kept graph arms it again and leaves none either."""
    from torch.nn.modules import module as torch_module

    monkeypatch.setattr("zfunc.autograd.recompute.compiled_anything", lambda: False)  # (another test may compile)
    for stage in (0, 3):
        torch.manual_seed(0)
        state = zfunc.init(Stack(2), zfunc.Config(stage=stage, persist_threshold=0))
        base = len(torch_module._global_forward_pre_hooks)
        backward = zfunc.core.backward
        state, _ = zfunc.backward_step(state, _stack_loss, (torch.randn(4, 8), torch.randn(4, 1)))  # (a gradient buffer)
        base = len(torch_module._global_forward_pre_hooks)
        out = backward.bind(state, backward.sinks_into(state, state.grads))(torch.randn(4, 8)).sum()
        during: list[int] = []
        inner = out.grad_fn.next_functions[0][0]  # reached after the call's outputs: armed by then
        inner.register_prehook(lambda g: during.append(len(torch_module._global_forward_pre_hooks)))
        out.backward(retain_graph=True)
        assert during == [base + 1], (stage, during, base)
        assert len(torch_module._global_forward_pre_hooks) == base, stage  # `out` still holds the graph
        out.backward()
        assert during == [base + 1] * 2 and len(torch_module._global_forward_pre_hooks) == base, stage
        del out, inner
        assert len(torch_module._global_forward_pre_hooks) == base, stage


def _compiled_wrappers(rank: int, reentrant: bool, compiled: bool) -> tuple[torch.Tensor, list[int], int, list[str]]:
    """A backward of `Stack` with each block checkpointed, compiled as ``torch.compile`` wrappers
    or eager: the gradient, the size of torch's global pre-hook table during the backward (and
    before it), and the warnings that named global hooks."""
    import warnings

    from torch.nn.modules import module as torch_module

    torch.manual_seed(0)
    model = Stack(2)
    model.ckpt = "reentrant" if reentrant else "non_reentrant"
    if compiled:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="eager")
    state = zfunc.init(model, zfunc.Config(stage=0, optimizer=zfunc.sgd(lr=0.1)))
    table: list[int] = []

    def loss_fn(m, batch):
        out = m(batch[0])
        out.register_hook(lambda g: table.append(len(torch_module._global_forward_pre_hooks)))
        return ((out - batch[1]) ** 2).mean()

    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, _ = zfunc.backward_step(state, loss_fn, batch)
    said = [str(w.message) for w in caught if "global hooks" in str(w.message)]
    return state.grads.clone(), table, len(torch_module._global_forward_pre_hooks), said


@pytest.mark.parametrize("reentrant", [False, True])
def test_once_torch_compile_ran_no_global_hook_is_armed(reentrant):
    """In a process where ``torch.compile`` has run, compiled code may run anywhere (a block's
    ``torch.compile`` wrapper, another model in another thread), and a hook in torch's global
    table would make it warn ("global hooks on modules") and recompile: the recompute hooks go on
    the modules at once instead, and the table stays as it was. Blocks compiled as wrappers under
    checkpointing train as eager, without that warning."""
    (eager, _, _, _), = run_ranks(_compiled_wrappers, 1, reentrant, False)
    (got, table, base, said), = run_ranks(_compiled_wrappers, 1, reentrant, True)
    assert table == [base] and said == [], (table, base, said)  # nothing armed during the backward
    assert torch.allclose(got, eager, atol=1e-6)


class _Pair(torch.nn.Module):
    """Two linear layers, checkpointed as one segment (its forward calls both)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class _Pairs(torch.nn.Module):
    """An input layer, then two `_Pair` segments under activation checkpointing."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(6, 6)
        self.pairs = torch.nn.ModuleList(_Pair() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for pair in self.pairs:
            x = torch.utils.checkpoint.checkpoint(pair, x, use_reentrant=self.reentrant)
        return x.pow(2).sum()


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_recomputation_runs_on_the_calls_tensors_with_no_hook_on_its_modules(reentrant, monkeypatch):
    """At the first module a backward recomputes, the call's parameters go in the module's entries
    for the rest of that backward (as ``functional_call`` puts a call's in): every recomputed
    layer reads them there with no zfunc hook on it (none on the pairs or their layers while
    they run: the plain call path, as in torch), the module holds its own parameters again once
    the backward is done, with no hook left, and one SGD step gives torch's gradients."""
    monkeypatch.setattr("zfunc.autograd.recompute.compiled_anything", lambda: False)  # (another test may compile)
    torch.manual_seed(0)
    model = _Pairs(reentrant)
    x = torch.randn(5, 6)
    names = [n for n, _ in model.named_parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    own = list(model.parameters())
    seen: list[tuple[int, int, bool]] = []  # at each layer b's recomputation: zfunc's hooks on its pair and layers
    for pair in model.pairs:
        pair.b.register_forward_pre_hook(
            lambda mod, args, pair=pair: seen.append(
                (sum(len(m._forward_hooks) for m in pair.modules()),
                 sum(len(m._forward_pre_hooks) for m in pair.modules()) - 1,  # (this hook)
                 type(pair.a.weight) is torch.nn.Parameter))
            if torch.is_grad_enabled() else None)
    state = zfunc.init(model, zfunc.Config(stage=0, grad_accum=1, optimizer=zfunc.sgd(lr=0.5)))
    state, _ = zfunc.backward_step(state, lambda m, x: m(x), x)
    assert seen[-2:] == [(0, 0, False)] * 2, seen  # the two recomputations: no hook, the call's tensors
    assert all(len(m._forward_hooks) == 0 and len(m._forward_pre_hooks) == (m in [p.b for p in model.pairs])
               for m in model.modules())  # the user's hooks only
    assert all(a is b for a, b in zip(model.parameters(), own))
    got = zfunc.full_params(zfunc.apply_step(state))
    for name, p0, g in zip(names, before, expected):
        torch.testing.assert_close(got[name], p0 - 0.5 * g, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("donate", [True, False])
def test_recompute_leaves_are_kept_for_the_next_backward_on_the_same_memory(donate, monkeypatch):
    """The leaves a reentrant recomputation makes over the state's compute buffer are kept for
    the next backward on the same memory (the micro-batches of a step; with donation, the next
    step too: the donated buffer's successor takes them over), and let go with the buffer (no
    memory outlives the states). Three steps of two micro-batches give torch's SGD weights."""
    monkeypatch.setattr("zfunc.autograd.recompute.compiled_anything", lambda: False)  # (another test may compile)
    torch.manual_seed(0)
    model = _Pairs(reentrant=True)
    ref = _Pairs(reentrant=True)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = [torch.randn(5, 6) for _ in range(6)]
    seen: list[int] = []  # the weight tensor layer a of the first pair recomputes on, by identity
    model.pairs[0].a.register_forward_pre_hook(
        lambda mod, args: seen.append(id(mod.weight)) if torch.is_grad_enabled() else None)
    state = zfunc.init(model, zfunc.Config(stage=0, grad_accum=2, optimizer=zfunc.sgd(lr=0.1)))
    spares = state.binding.spares
    for step in range(3):
        for x in batches[2 * step:2 * step + 2]:
            state, _ = zfunc.backward_step(state, lambda m, x: m(x), x, donate=donate)
            (ref(x) / 2).backward()
        state = zfunc.apply_step(state, donate=donate)
        opt.step()
        opt.zero_grad()
    assert len(seen) == 6
    # The second micro-batch of each step reuses the first one's leaf; with donation every step does.
    assert seen[1] == seen[0] and seen[3] == seen[2] and seen[5] == seen[4], seen
    assert (len(set(seen)) == 1) == donate, seen
    got = zfunc.full_params(state)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-6)
    assert len(spares._by) == (1 if donate else 0)  # (without donation each step makes a new buffer)
    state, _ = zfunc.backward_step(state, lambda m, x: m(x), batches[0])
    assert len(spares._by) == 1
    del state
    assert len(spares._by) == 0  # the buffer went, and its leaves with it (by reference counting)


class _ScaledChild(torch.nn.Module):
    """A layer and a buffer: inside a unit, its pre-hooks are two (the unit's parameters, and
    the buffer, which no unit holds)."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.register_buffer("scale", torch.full((d,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class _CheckpointsChild(torch.nn.Module):
    """A unit's module whose child is checkpointed on its own: the unit's module does not run
    around the child's recomputation."""

    def __init__(self, reentrant: bool, d: int):
        super().__init__()
        self.c, self.out, self.reentrant = _ScaledChild(d), torch.nn.Linear(d, d), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(torch.utils.checkpoint.checkpoint(self.c, x, use_reentrant=self.reentrant)))


class _UnitWithCheckpointedChild(torch.nn.Module):
    def __init__(self, reentrant: bool, d: int = 6):
        super().__init__()
        self.inp, self.b, self.head = torch.nn.Linear(d, d), _CheckpointsChild(reentrant, d), torch.nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.inp(x))).sum()


@pytest.mark.parametrize("stage,persist", [(1, None), (2, None), (3, 0), (3, 100)])
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_module_of_two_recompute_pre_hooks_undoes_both(stage, persist, reentrant, monkeypatch):
    """A module inside a unit whose subtree holds the unit's parameters and what no unit holds
    (a buffer; at stage 3 with a persist threshold, its bias) has two recompute pre-hooks, each
    putting its part in: checkpointed on its own, both are undone after it (nothing stays in its
    entries, no hook stays on the module), and three steps give torch's SGD weights."""
    monkeypatch.setattr("zfunc.autograd.recompute.compiled_anything", lambda: False)  # (another test may compile)
    torch.manual_seed(0)
    model, ref = _UnitWithCheckpointedChild(reentrant), _UnitWithCheckpointedChild(reentrant)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    extra = {} if persist is None else {"persist_threshold": persist}
    state = zfunc.init(model, zfunc.Config(stage=stage, grad_accum=1, units=["b"], optimizer=zfunc.sgd(lr=0.1),
                                           **extra))
    for _ in range(3):
        x = torch.randn(4, 6)
        state, _ = zfunc.backward_step(state, lambda m, x: m(x), x)
        assert not state.binding._covering and not state.binding._users
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
        assert isinstance(model.b.c.lin.weight, torch.nn.Parameter)
        state = zfunc.apply_step(state)
        ref(x).backward()
        opt.step()
        opt.zero_grad()
    got = zfunc.full_params(state)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-6)


class _HookedLayer(torch.nn.Linear):
    """Registers a hook doubling its weight's gradient in each forward autograd records (under
    reentrant checkpointing, the recomputation), and counts the hook's calls."""

    calls: list[int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls.append(0)
            self.weight.register_hook(lambda g: self.calls.__setitem__(-1, self.calls[-1] + 1) or g * 2)
        return super().forward(x)


class _Around(torch.nn.Module):
    """An input layer, then ``layer`` under reentrant checkpointing."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.inp, self.a = torch.nn.Linear(6, 6), layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.a, self.inp(x), use_reentrant=True)


def test_a_hook_a_recomputed_forward_registers_on_a_weight_stays_with_that_recomputation(monkeypatch):
    """A recomputed forward that registers a hook on its weight gets a fresh leaf for it in the
    next backward (a kept one would carry every earlier backward's hook): each recomputation's
    hook runs once, and donating or not (which decides whether the next step's leaves over the
    same memory are kept) trains alike."""
    monkeypatch.setattr("zfunc.autograd.recompute.compiled_anything", lambda: False)  # (another test may compile)
    out = {}
    for donate in (True, False):
        torch.manual_seed(0)
        layer = _HookedLayer(6, 6)
        layer.calls = []
        model = _Around(layer)
        loss_fn = lambda m, x: m(x).sum()  # noqa: E731
        state = zfunc.init(model, zfunc.Config(stage=0, grad_accum=2, optimizer=zfunc.sgd(lr=0.01)))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for _ in range(2):
                state, _ = zfunc.backward_step(state, loss_fn, torch.randn(4, 6, generator=g), donate=donate)
            state = zfunc.apply_step(state, donate=donate)
        assert layer.calls == [1] * 6, (donate, layer.calls)
        out[donate] = zfunc.full_params(state)["a.weight"]
    torch.testing.assert_close(out[True], out[False], rtol=0, atol=0)


class _RootAndBlocks(torch.nn.Module):
    """An embedding and a head (the root at stage 3) around two checkpointed blocks (units), the
    head checkpointed too with ``head``."""

    def __init__(self, reentrant: bool, head: bool):
        super().__init__()
        self.emb = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2))
        self.head = torch.nn.Linear(8, 1)
        self.reentrant, self.checkpoint_head = reentrant, head

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
        if self.checkpoint_head:
            return torch.utils.checkpoint.checkpoint(self.head, h, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [True, False])
def test_stage3_gathers_the_root_again_only_for_a_recomputed_module_that_holds_part_of_it(reentrant, monkeypatch):
    """At stage 3 a backward that recomputes only units gathers the root (the embedding and the
    head) no second time; one that recomputes the head gathers it once more, for the rest of the
    backward. Both train as torch (one SGD step)."""
    from zfunc.autograd.gather import UnitGatherer

    gathered: list[int] = []
    views = UnitGatherer.views
    monkeypatch.setattr(UnitGatherer, "views", lambda self, names: gathered.append(len(names)) or views(self, names))
    for head in (False, True):
        torch.manual_seed(0)
        model = _RootAndBlocks(reentrant, head)
        x = torch.randn(3, 4)
        before = [p.detach().clone() for p in model.parameters()]
        model(x).square().sum().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        state = zfunc.init(model, zfunc.Config(stage=3, units=["blocks.0", "blocks.1"], persist_threshold=0,
                                               optimizer=zfunc.sgd(lr=0.5)))
        gathered.clear()
        state, _ = zfunc.backward_step(state, lambda m, x: m(x).square().sum(), x)
        assert gathered == ([4] if head else []), (head, gathered)  # emb and head, weight and bias each
        got = list(zfunc.full_params(zfunc.apply_step(state)).values())
        for p0, g, p in zip(before, expected, got):
            torch.testing.assert_close(p, p0 - 0.5 * g, rtol=1e-6, atol=1e-6)


class _SharedPairTwice(torch.nn.Module):
    """An input layer, then one `_Pair` applied twice, each time as its own reentrant segment (a
    block shared by two layers, as ALBERT shares its layer); or, ``shared=False``, two pairs."""

    def __init__(self, shared: bool):
        super().__init__()
        self.inp = torch.nn.Linear(6, 6)
        self.pairs = torch.nn.ModuleList([_Pair()] if shared else [_Pair(), _Pair()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i in range(2):
            x = torch.utils.checkpoint.checkpoint(self.pairs[i % len(self.pairs)], x, use_reentrant=True)
        return x.pow(2).sum()


def _shared_twice(rank: int, shared: bool, stage: int) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """Three SGD steps of `_SharedPairTwice` with a bucket per parameter, zfunc's and torch's (the
    mean over two ranks' batches), and whether the segments' gradients went bucket by bucket."""
    torch.manual_seed(0)
    model = _SharedPairTwice(shared)
    ref = _SharedPairTwice(shared)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    state = zfunc.init(model, zfunc.Config(stage=stage, bucket_mb=1e-5, optimizer=zfunc.sgd(lr=0.1)))
    for step in range(3):
        xs = [torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(2)]
        state = zfunc.apply_step(zfunc.backward_step(state, lambda m, x: m(x), xs[rank])[0])
        opt.zero_grad()
        (sum(ref(x) for x in xs) / 2).backward()
        opt.step()
    return list(zfunc.full_params(state).values()), [p.detach() for p in ref.parameters()], state.binding.spares.early


def test_a_block_shared_by_two_reentrant_segments_trains_as_torch():
    """A block applied twice, each time a reentrant segment of its own, with each parameter in a
    bucket of its own (stage 0, reduced in the micro-batch's backward; stage 2): its gradient
    comes in two parts, one per segment. The first backward hands the segments' gradients over at
    its end and sees a bucket's first parameter differentiated twice, so no later one hands them
    over bucket by bucket (the second part would come after its bucket started): three steps give
    torch's parameters. Two blocks instead, none shared, go bucket by bucket from the second
    backward on, and train as torch too."""
    for stage in (0, 2):
        for shared in (True, False):
            for got, want, early in run_ranks(_shared_twice, 2, shared, stage):
                assert early is (not shared), (stage, shared, early)
                assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-6, (stage, shared)


class _HookedStem(torch.nn.Module):
    """A stem, two checkpointed blocks (``reentrant`` or not; None: not checkpointed) and a head;
    ``hook`` (when set) goes on the stem's output, so it runs once backward has recomputed both
    blocks."""

    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.stem = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.head = torch.nn.Linear(4, 1)
        self.reentrant, self.hook = reentrant, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.hook is not None and x.requires_grad:
            x.register_hook(self.hook)
        for block in self.blocks:
            if self.reentrant is None:
                x = torch.tanh(block(x))
            else:
                x = torch.utils.checkpoint.checkpoint(lambda t, b=block: torch.tanh(b(t)), x,
                                                      use_reentrant=self.reentrant)
        return self.head(x)


def _squares(model: Any, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum()


def _step_in_a_hook(rank: int, reentrant: bool, where: str, stage: int, units: list | None,
                    separate: bool = False) -> tuple | str:
    """One SGD step of a backward_step, and one of a second backward_step of the same state that
    a gradient hook of the first one's backward makes (on another batch); with the plain-torch
    steps of the mean loss over the ranks, for both. ``separate``: the second one of a state
    made by another ``init`` of the module (the error, if refused)."""
    torch.manual_seed(0)
    model = _HookedStem(reentrant)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    batches = [torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    mine = batches[rank]
    cfg = zfunc.Config(stage=stage, optimizer=zfunc.sgd(lr=1.0), persist_threshold=0, units=units)
    state = zfunc.init(model, cfg)
    second = zfunc.init(model, cfg) if separate else state
    inner: dict[str, Any] = {}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not inner:
            inner["busy"] = True  # (the second call's own backward runs this hook too)
            with torch.enable_grad():  # (a gradient hook runs under no_grad)
                inner["state"] = zfunc.backward_step(second, _squares, mine[1])[0]
        return grad

    def outer_loss(bound: Any, x: torch.Tensor) -> torch.Tensor:
        out = bound(x)
        if where == "output":
            out.register_hook(hook)
        return out.pow(2).sum()

    model.hook = hook if where == "stem" else None
    try:
        outer, _ = zfunc.backward_step(state, outer_loss, mine[0])
    except RuntimeError as e:
        return str(e)
    model.hook = None
    got, want = [], []
    for k, st in ((0, outer), (1, inner["state"])):
        plain = _HookedStem(reentrant)
        plain.load_state_dict(reference)
        (sum(_squares(plain, b[k]) for b in batches) / world).backward()
        want.append({n: (p - p.grad).detach() for n, p in plain.named_parameters()})
        got.append(zfunc.full_params(zfunc.apply_step(st)))
    return got, want


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_step_a_gradient_hook_makes_during_a_checkpointed_backward_trains_as_torch(reentrant):
    """A ``backward_step`` that a gradient hook makes during another ``backward_step``'s backward
    of the same state (on the model's output: before any block is recomputed; on the stem's
    output: once both blocks were recomputed on the first call's tensors) is a call of its own:
    its forward is not taken for a recomputation of the first call, its backward recomputes its
    blocks on its own tensors and gradients (nested inside the first backward's), and the first
    backward goes on with its own. Both SGD steps equal plain torch's, on two ranks, at stages
    0, 2 and 3, with and without units. The second call on a state of another ``init`` of the
    module, once the first backward recomputed a block, is refused, naming the cause."""
    for where in ("output", "stem"):
        for stage, units in ((0, None), (2, None), (2, ["blocks.0", "blocks.1"]), (3, None),
                             (3, ["blocks.0", "blocks.1"])):
            for got, want in run_ranks(_step_in_a_hook, 2, reentrant, where, stage, units):
                for k in (0, 1):
                    worst = max((got[k][n] - want[k][n]).abs().max().item() for n in want[k])
                    assert worst < 1e-6, (where, stage, units, ("outer", "inner")[k], worst)
    # A state of another init of the module, once the first backward recomputed a block: refused
    # (each would recompute on the other's tensors), as two such states in one backward are.
    for stage in (0, 2, 3):
        got = _step_in_a_hook(0, reentrant, "stem", stage, None, separate=True)
        assert isinstance(got, str) and "separate zfunc.init calls on one module" in got, (stage, got)


def _whole_call_checkpointed(rank: int, stage: int, units: list | None) -> list[float]:
    """One SGD step of a loss_fn that checkpoints the whole bound call (reentrant: its forward
    runs without autograd, and again in backward), against plain torch's on the mean loss over
    the ranks; the largest difference, per checkpointing of the call's blocks (none, not
    reentrant, reentrant)."""
    world = torch.distributed.get_world_size()
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]

    def loss(m: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(m, x.clone().requires_grad_(), use_reentrant=True).pow(2).sum()

    out = []
    for inner in (None, False, True):
        torch.manual_seed(0)
        plain = _HookedStem(inner)
        model = _HookedStem(inner)
        model.load_state_dict(plain.state_dict())
        (sum(loss(plain, b) for b in batches) / world).backward()
        cfg = zfunc.Config(stage=stage, optimizer=zfunc.sgd(lr=1.0), persist_threshold=0, units=units)
        state, _ = zfunc.backward_step(zfunc.init(model, cfg), loss, batches[rank])
        got = zfunc.full_params(zfunc.apply_step(state))
        out.append(max((got[n] - (p - p.grad)).abs().max().item() for n, p in plain.named_parameters()))
    return out


def test_the_whole_call_under_a_reentrant_checkpoint_trains_as_torch():
    """``checkpoint(model, x, use_reentrant=True)`` over the whole bound model: the forward runs
    under ``no_grad`` (its parameters made there carry no gradient and are not kept for the
    call's next use) and again in backward, where the gradients reach the state. With the
    blocks inside checkpointed too: not reentrant, or reentrant (recomputed in the backward the
    outer checkpoint runs through the recomputed call's outputs, on that call's tensors). On
    two ranks, stages 0, 2 and 3, with and without units, one SGD step equals torch's."""
    for stage, units in ((0, None), (2, None), (2, ["blocks.0", "blocks.1"]), (3, None), (3, ["blocks.0", "blocks.1"])):
        for worst in run_ranks(_whole_call_checkpointed, 2, stage, units):
            assert max(worst) < 1e-6, (stage, units, worst)
