"""The model ``loss_fn`` receives answers a module's questions: ``named_parameters()``,
``parameters()``, ``named_buffers()`` and ``torch.func.functional_call`` work on it, with the
tensors forward uses, and gradients through them reach the state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zfunc
from tests.helpers import ZooNet, zoo_batch


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_names_and_tensors_are_the_modules(stage):
    torch.manual_seed(0)
    model = ZooNet()  # tied, frozen and odd-sized parameters
    expected = [n for n, _ in model.named_parameters()]
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = zfunc.init(model, zfunc.Config(stage=stage))
    seen = {}

    def loss_fn(m, batch):
        seen["names"] = [n for n, _ in m.named_parameters()]
        seen["all"] = [n for n, _ in m.named_parameters(remove_duplicate=False)]
        seen["prefixed"] = [n for n, _ in m.named_parameters(prefix="net")][:1]
        seen["values"] = {n: p.detach().clone() for n, p in m.named_parameters()}
        seen["same"] = all(a is b for a, b in zip(m.parameters(), m.parameters()))
        seen["trainable"] = {n: p.requires_grad for n, p in m.named_parameters()}
        return ((m(batch["x"], batch["side"]) - batch["y"]) ** 2).mean()

    zfunc.backward_step(state, loss_fn, zoo_batch(0, 0, 4))
    assert seen["names"] == expected
    assert seen["all"] == [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert seen["prefixed"] == ["net." + expected[0]]
    assert all(torch.equal(seen["values"][n], full[n]) for n in expected)
    assert seen["same"]  # every call answers the same tensors
    assert seen["trainable"] == {n: n not in ("frozen.weight", "frozen.bias") for n in expected}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_use_without_autograd_first_leaves_the_parameters_differentiable(stage):
    """A ``loss_fn`` that first calls the model under ``no_grad`` (a baseline), or reads its
    parameters there (a norm to log), then computes its loss: the parameters it then uses carry
    their gradients, as torch's do (views made without autograd carry none, and are not the ones
    later calls share). One SGD step equals torch's."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))

    def loss_fn(m, x):
        with torch.no_grad():
            base = m(x)
            norm = sum(p.square().sum() for p in m.parameters())
        return (m(x) - base * 0.5).square().sum() + 0 * norm

    plain = net()
    loss_fn(plain, x).backward()
    want = {n: (p - p.grad).detach() for n, p in plain.named_parameters()}
    cfg = zfunc.Config(stage=stage, optimizer=zfunc.sgd(lr=1.0), units=[] if stage == 3 else None)
    state, _ = zfunc.backward_step(zfunc.init(net(), cfg), loss_fn, x)
    got = zfunc.full_params(zfunc.apply_step(state))
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-6


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_surrogate_on_the_parameters_reaches_the_state(stage):
    """``sum(p * c)`` over ``named_parameters()`` gives each parameter the gradient ``c``: the
    state's gradient is ``c`` averaged over micro-batches (stage 3: every parameter in the root)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    cfg = zfunc.Config(stage=stage, grad_accum=2, optimizer=zfunc.sgd(lr=1.0), units=[] if stage == 3 else None)
    state = zfunc.init(model, cfg)
    before = zfunc.full_params(state)
    for k in (1.0, 3.0):
        state, _ = zfunc.backward_step(state, lambda m, c: sum((p * c).sum() for p in m.parameters()), k)
    state = zfunc.apply_step(state)
    after = zfunc.full_params(state)
    assert all(torch.allclose(before[n] - after[n], torch.full_like(before[n], 2.0)) for n in before)


def test_functional_call_runs_on_the_parameters_given():
    torch.manual_seed(0)
    state = zfunc.init(nn.Linear(3, 2), zfunc.Config(stage=2, grad_accum=1))
    w = torch.randn(2, 3)
    x = torch.randn(4, 3)
    got = {}

    def loss_fn(m, x):
        b = dict(m.named_parameters())["bias"]
        got["given"] = torch.func.functional_call(m, {"weight": w}, (x,))
        got["expected"] = x @ w.T + b
        return m(x).sum()

    state, _ = zfunc.backward_step(state, loss_fn, x)
    assert torch.allclose(got["given"], got["expected"].detach())
    # and the state's own weight is back for the plain call: its gradient is x summed
    g = state.layout.views(state.layout.units[0], state.grads.narrow(0, 0, state.layout.units[0].padded))
    assert torch.allclose(g["weight"], x.sum(0).expand(2, 3))


def test_buffers_are_the_calls_and_a_given_buffer_stays_out_of_the_state():
    state = zfunc.init(_bn_net(), zfunc.Config(stage=1))
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    seen = {}

    def loss_fn(m, x):
        seen["names"] = [n for n, _ in m.named_buffers()]
        torch.func.functional_call(m, {"1.running_mean": torch.full((4,), 5.0)}, (x,))
        return m(x).sum()

    new, _ = zfunc.backward_step(state, loss_fn, x)
    assert seen["names"] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    ref = _bn_net()  # torch: the buffers not given are the module's, and both calls update them
    torch.func.functional_call(ref, {"1.running_mean": torch.full((4,), 5.0)}, (x,))
    ref(x)
    for name, b in ref.named_buffers():
        assert torch.allclose(new.buffers[name].to(b.dtype), b), name
    assert new.buffers["1.num_batches_tracked"].item() == 2


def test_submodules_are_views_and_parameters_are_refused_by_name():
    state = zfunc.init(_bn_net(), zfunc.Config())
    seen = {}

    def loss_fn(m, x):
        sub = m.get_submodule("0")
        seen["sub"] = [n for n, _ in sub.named_children()], m.get_submodule("1") is not None
        with pytest.raises(AttributeError, match=r"model.0.weight: .*named_parameters\(\)\)\['0.weight'\]"):
            sub.weight  # the module's own tensor: no gradient of it would reach the state
        with pytest.raises(AttributeError, match=r"model.1.running_mean: "):
            m.get_submodule("1").running_mean
        with pytest.raises(RuntimeError, match="call the model itself"):
            sub(x)
        with pytest.raises(AttributeError, match="has no attribute"):
            m.nothing_here
        return m(x).sum()

    zfunc.backward_step(state, loss_fn, torch.randn(4, 3))
    assert seen["sub"] == ([], True)
    weight_model = nn.Linear(2, 1)
    state = zfunc.init(weight_model, zfunc.Config())

    def reads_weight(m, x):
        m.weight
        return m(x).sum()

    with pytest.raises(AttributeError, match=r"dict\(model.named_parameters\(\)\)\['weight'\]"):
        zfunc.backward_step(state, reads_weight, torch.randn(4, 2))


def test_stage_3_with_units_refuses_and_names_the_alternatives():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    state = zfunc.init(model, zfunc.Config(stage=3, units=["0"], persist_threshold=0))
    with pytest.raises(RuntimeError, match=r"zfunc.full_params\(state\).*units=\[\]"):
        zfunc.backward_step(state, lambda m, x: sum(p.sum() for p in m.parameters()), None)
    for tie in (True, False):  # (tie_weights asks named_parameters first)
        with pytest.raises(RuntimeError, match="at ZeRO stage 3"):
            zfunc.backward_step(state, lambda m, x: torch.func.functional_call(
                m, {"2.bias": torch.zeros(2)}, (x,), tie_weights=tie).sum(), torch.ones(1, 3))
    assert state.micro_step.item() == 0


def test_the_mode_is_the_users_modules():
    model = _bn_net()
    state = zfunc.init(model, zfunc.Config())
    seen = []

    def loss_fn(m, x):
        seen.append(m.training)
        m.eval()
        seen.append((m.training, model.training, model[1].training))
        m.train()
        return m(x).sum()

    model.eval()
    zfunc.backward_step(state, loss_fn, torch.randn(4, 3))
    assert seen == [False, (False, False, False)] and model.training


def _penalised(model: nn.Module, batch: tuple) -> torch.Tensor:
    """A gradient penalty with respect to ``parameters()`` taken before the forward, and a hook on
    each that clips its gradient: both need the very tensors forward computes with."""
    params = list(model.parameters())
    for p in params:
        p.register_hook(lambda g: g.clamp(-0.05, 0.05))
    loss = ((model(batch[0]) - batch[1]) ** 2).mean()
    grads = torch.autograd.grad(loss, params, create_graph=True)
    after = list(model.parameters())  # asked again after the forward: the same tensors
    assert all(a is b for a, b in zip(params, after))
    return loss + 0.3 * sum(g.pow(2).sum() for g in grads)


def _penalised_run(rank: int, stage: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    state = zfunc.init(model, zfunc.Config(stage=stage, optimizer=zfunc.sgd(lr=1.0),
                                           units=[] if stage == 3 else None))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * world, 4, generator=g), torch.randn(8 * world, 2, generator=g)
    state, _ = zfunc.backward_step(state, _penalised, (x[8 * rank:8 * rank + 8], y[8 * rank:8 * rank + 8]))
    return zfunc.full_params(zfunc.apply_step(state))


@pytest.mark.parametrize("world", [1, 2])
def test_the_parameters_loss_fn_reads_are_the_ones_forward_uses(world):
    """``torch.autograd.grad`` with respect to ``parameters()`` (a gradient penalty) and hooks on
    them see the forward's use, as on a torch module: the step equals plain torch's (mean of the
    ranks' gradients), stages 0-3 (stage 3: every parameter in the root unit)."""
    from tests.helpers import run_ranks

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * world, 4, generator=g), torch.randn(8 * world, 2, generator=g)
    grads = None
    for r in range(world):  # each rank's gradient, then their mean (hooks and penalty are per rank)
        ref.zero_grad()
        _penalised(ref, (x[8 * r:8 * r + 8], y[8 * r:8 * r + 8])).backward()
        mine = [p.grad.clone() for p in ref.parameters()]
        grads = mine if grads is None else [a + b for a, b in zip(grads, mine)]
    expected = {n: p.detach() - gr / world for (n, p), gr in zip(ref.named_parameters(), grads)}
    for stage in (0, 1, 2, 3):
        for got in run_ranks(_penalised_run, world, stage, world):
            assert max((got[n] - expected[n]).abs().max().item() for n in expected) < 1e-6, stage
