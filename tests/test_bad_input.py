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


def test_train_step_keeps_the_state_it_is_given_whole_until_its_step_succeeds():
    """A micro-batch after the first failing leaves the state given to `train_step` as it was (a
    BatchNorm's statistics included), usable; a step that succeeds uses it up (its weights and
    optimizer state were updated in place)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    state = zfunc.init(model, zfunc.Config(stage=2, grad_accum=2))
    kept = [t.clone() for t in zfunc.tree.leaves(state) if isinstance(t, torch.Tensor)]
    seen = []

    def loss_fn(m, b):
        seen.append(1)
        out = m(b).square().mean()
        if len(seen) == 2:
            raise ValueError("the second micro-batch fails")
        return out

    with pytest.raises(ValueError, match="second micro-batch") as caught:
        zfunc.train_step(loss_fn)(state, torch.randn(8, 3))
    assert caught.value.__notes__ == ["train_step: the state given to it is whole; go on from it"]
    now = [t for t in zfunc.tree.leaves(state) if isinstance(t, torch.Tensor)]
    torch.testing.assert_close(now, kept, rtol=0, atol=0, equal_nan=True)  # (metrics.loss is NaN before a step)
    new = zfunc.train_step(lambda m, b: m(b).square().mean())(state, torch.randn(8, 3))
    assert new.step.item() == 1
    with pytest.raises(RuntimeError, match="donated to train_step"):
        zfunc.apply_step(state)


def test_a_donating_call_that_fails_uses_the_state_up_and_says_so():
    """``backward_step(..., donate=True)`` whose ``loss_fn`` fails after the forward (BatchNorm's
    statistics already updated in place): the state given is refused from then on, and the error
    says why; without ``donate`` it stays whole."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    for donate in (False, True):
        state = zfunc.init(model, zfunc.Config(stage=2))
        before = state.buffers["1.running_mean"].clone()
        with pytest.raises(TypeError, match="scalar tensor") as caught:
            zfunc.backward_step(state, lambda m, b: m(b), torch.randn(4, 3), donate=donate)
        if donate:
            assert "used up" in caught.value.__notes__[0]
            with pytest.raises(RuntimeError, match="donated to backward_step"):
                zfunc.backward_step(state, lambda m, b: m(b).sum(), torch.randn(4, 3))
        else:
            assert torch.equal(state.buffers["1.running_mean"], before)
            assert zfunc.backward_step(state, lambda m, b: m(b).sum(), torch.randn(4, 3))[0].micro_step.item() == 1


def test_a_loss_that_needs_no_gradient_is_refused_by_name():
    state = zfunc.init(torch.nn.Linear(3, 1), zfunc.Config())
    for bad in (lambda m, b: m(b).sum().detach(), lambda m, b: (m(b).sum() > 0).long()):
        with pytest.raises(TypeError, match="loss_fn must return a floating-point loss computed with the model"):
            zfunc.backward_step(state, bad, torch.ones(2, 3))
    assert state.micro_step.item() == 0


def test_selectors_that_select_nothing_are_refused():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    with pytest.raises(zfunc.ConfigError, match=r"param_groups\[0\]: its predicate failed on '0.weight' "
                                                r"\(TypeError"):
        zfunc.init(model, zfunc.Config(param_groups=[zfunc.ParamGroup(lambda n: True, lr=1e-4)]))
    with pytest.raises(zfunc.ConfigError, match=r"param_groups\[0\]: its predicate failed on '0.weight' "
                                                r"\(RuntimeError: Boolean value of Tensor"):
        zfunc.init(model, zfunc.Config(param_groups=[zfunc.ParamGroup(lambda n, p: p > 0, lr=1e-4)]))
    import re  # a truthy answer selects (re.search), and a group that selects nothing is kept (no biases here)
    state = zfunc.init(torch.nn.Linear(3, 4, bias=False), zfunc.Config(param_groups=[
        zfunc.ParamGroup(lambda n, p: re.search(r"weight$", n), lr=1e-4),
        zfunc.ParamGroup(lambda n, p: p.ndim < 2, weight_decay=0.0)]))
    assert state.layout.units[0].slots[0].group == 1
    with pytest.raises(zfunc.ConfigError, match=r"units: the model has no module of class \['LayerNorm'\]"):
        zfunc.init(model, zfunc.Config(stage=3, units=[torch.nn.LayerNorm]))
    for stage in (2.0, True):
        with pytest.raises(zfunc.ConfigError, match="stage: expected one of 0, 1, 2, 3"):
            zfunc.Config(stage=stage)


def test_train_step_refuses_a_batch_it_cannot_split_whole():
    import numpy as np

    state = zfunc.init(torch.nn.Linear(3, 1), zfunc.Config(grad_accum=2))
    step = zfunc.train_step(lambda m, b: m(b["x"]).sum(), donate=False)
    with pytest.raises(zfunc.ConfigError, match=r"batch: its tensors' dim 0 differ \(\[4, 6\]\)"):
        step(state, {"x": torch.ones(4, 3), "w": torch.ones(6)})
    with pytest.raises(zfunc.ConfigError, match="batch: a numpy.ndarray of shape \\[4, 3\\] would go whole"):
        step(state, {"x": torch.ones(4, 3), "np": np.ones((4, 3))})
    assert state.micro_step.item() == 0 and state.step.item() == 0


def test_engine_state_takes_only_a_state_of_its_own_model_and_config(tmp_path):
    """``engine.state = ...`` refuses a state of another model, or of another Config, naming it;
    a state made from ``engine.state`` (a load, the functional steps) is taken."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    engine, *_ = zfunc.initialize(model=model, config={"train_batch_size": 2, "zero_optimization": {"stage": 2},
                                                       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    kept = engine.state
    with pytest.raises(ValueError, match="engine.state: the state assigned is of another model"):
        engine.state = zfunc.init(torch.nn.Linear(4, 2), zfunc.Config(stage=2))
    with pytest.raises(ValueError, match="of another model"):
        engine.state = zfunc.init(model, zfunc.Config(stage=2))  # another init: another binding
    with pytest.raises(ValueError, match=r"of another Config \(clip differ\)"):
        engine.state = engine.state.replace(cfg=engine.state.cfg.replace(clip=0.5))
    assert engine.state is kept
    engine.state = zfunc.load(zfunc.save(engine.state, str(tmp_path / "c")), like=engine.state)
    engine.state, _ = zfunc.backward_step(engine.state, lambda m, x: m(x).sum(), torch.ones(2, 3))
    assert engine.state.micro_step.item() == 1


def test_accumulate_takes_real_floating_gradients_only():
    import numpy as np

    state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config())
    full = {"weight": torch.ones(1, 2), "bias": torch.ones(1)}
    for bad, match in (({**full, "bias": None}, r"no gradient for \['bias'\]"),):
        with pytest.raises(KeyError, match=match):
            zfunc.accumulate(state, bad)
    for value in (torch.ones(1, 2, dtype=torch.complex64), torch.ones(1, 2, dtype=torch.int64), np.ones((1, 2)), 1.0):
        with pytest.raises(TypeError, match="accumulate: gradients must be floating-point tensors"):
            zfunc.accumulate(state, {**full, "weight": value})
    for loss in (1.5, torch.ones(3)):
        with pytest.raises(TypeError, match="accumulate: loss must be a one-element tensor"):
            zfunc.accumulate(state, full, loss=loss)
    assert state.micro_step.item() == 0
    with pytest.raises(zfunc.ConfigError, match=r"a numpy scalar: pass a Python number"):
        zfunc.Config(grad_accum=np.int64(2))


def test_a_donating_vjp_that_fails_uses_the_state_up():
    """``vjp(..., donate=True)``: an output that is not a tensor (after the forward updated
    BatchNorm's statistics in place), or a pullback whose backward fails, uses the state given up."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    state = zfunc.init(model, zfunc.Config(stage=2))
    with pytest.raises(TypeError, match="every output of the function must be a tensor"):
        zfunc.vjp(state, lambda m, x: (m(x), "label"), torch.randn(4, 3), donate=True)
    with pytest.raises(RuntimeError, match="donated to vjp"):
        zfunc.backward_step(state, lambda m, x: m(x).sum(), torch.randn(4, 3))
    def failing_backward(m, x):
        y = m(x)
        y.register_hook(lambda g: (_ for _ in ()).throw(ArithmeticError("a hook fails in backward")))
        return y

    state = zfunc.init(model, zfunc.Config(stage=2))
    out, pullback = zfunc.vjp(state, failing_backward, torch.randn(4, 3), donate=True)
    with pytest.raises(ArithmeticError, match="a hook fails") as caught:
        pullback(torch.ones_like(out))
    assert "used up" in caught.value.__notes__[0]
    with pytest.raises(RuntimeError, match="donated to vjp"):
        zfunc.apply_step(state)
