"""The module binding, the one micro-batch record, and purity for buffers and pullbacks."""

from __future__ import annotations

import ast
import copy
import dataclasses
import math
import pathlib
import tempfile

import pytest
import torch
from torch import nn

import zfunc
from tests.helpers import bitwise_equal, paused_in_thread, run_ranks, snapshot

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRECISIONS = {"fp32": {}, "bf16": {"precision": "bf16"},
              "fp16": {"precision": "fp16", "loss_scale": zfunc.DynamicLossScale(init=2.0**8)}}


class BNNet(nn.Module):
    """Linear -> BatchNorm -> Linear: a model with buffers (running statistics, a counter)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh()),
                                     nn.Sequential(nn.Linear(6, 3))])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def bn_loss(model, batch):
    return ((model(batch[0]).float() - batch[1]) ** 2).mean()


def bn_batch(rank: int, i: int = 0):
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)


def _config(stage: int, precision: str, **kw) -> zfunc.Config:
    return zfunc.Config(stage=stage, persist_threshold=0, grad_accum=2, clip=1.0, **PRECISIONS[precision], **kw)


# -- purity with buffers ---------------------------------------------------------------------

def _bn_purity(rank: int, stage: int, precision: str) -> dict:
    torch.manual_seed(0)
    model = BNNet()
    if rank == 1:  # a different local init: init must make the buffers equal (rank 0's)
        with torch.no_grad():
            model.blocks[0][1].running_mean.add_(1.0)
    state = zfunc.init(model, _config(stage, precision))
    init_mean = state.buffers["blocks.0.1.running_mean"].float().sum().item()
    before = snapshot(state)
    s1, _ = zfunc.backward_step(state, bn_loss, bn_batch(rank))
    pure_bwd = bitwise_equal(before, snapshot(state))
    mid = snapshot(s1)
    s2 = zfunc.apply_step(s1)
    pure_apply = bitwise_equal(mid, snapshot(s1))
    d1, _ = zfunc.backward_step(state, bn_loss, bn_batch(rank), donate=True)
    d2 = zfunc.apply_step(d1, donate=True)
    name = "blocks.0.1.running_mean"
    return {"pure": pure_bwd and pure_apply, "same": bitwise_equal(snapshot(s2), snapshot(d2)),
            "moved": not torch.equal(s1.buffers[name], before_buffer(before, s1, name)),  # (state was donated)
            "counted": s1.buffers["blocks.0.1.num_batches_tracked"].item(),
            "dtype": str(s1.buffers[name].dtype), "buffer0": s1.buffers[name].float().sum().item(),
            "init_mean": init_mean}


def before_buffer(before: list[torch.Tensor], state: zfunc.TrainState, name: str) -> torch.Tensor:
    leaves = zfunc.tree.leaves(state)
    index = next(i for i, t in enumerate(leaves) if t is state.buffers[name])
    return before[index]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_buffers_are_new_leaves_and_the_input_stays_unchanged(precision):
    for world in (1, 2):
        for stage in (0, 1, 2, 3):
            for r in run_ranks(_bn_purity, world, stage, precision):
                assert r["pure"], (world, stage, precision)
                assert r["same"], (world, stage, precision)
                assert r["moved"] and r["counted"] == 1, r
                assert r["dtype"] == {"fp32": "torch.float32", "bf16": "torch.bfloat16",
                                      "fp16": "torch.float16"}[precision]
                assert r["init_mean"] == 0.0  # rank 0's buffers everywhere


def test_batchnorm_statistics_match_torch():
    torch.manual_seed(0)
    model = BNNet()
    ref = BNNet()
    ref.load_state_dict(model.state_dict())
    state = zfunc.init(model, zfunc.Config(stage=2))
    x, y = bn_batch(0)
    state, loss = zfunc.backward_step(state, bn_loss, (x, y))
    ref_loss = bn_loss(ref, (x, y))
    assert abs(loss.item() - ref_loss.item()) < 1e-6
    for name, b in ref.named_buffers():
        assert torch.allclose(state.buffers[name], b, atol=1e-7), name
    assert torch.equal(model.blocks[0][1].running_mean, torch.zeros(6))  # the module is untouched


class _ScaledEMA(nn.Module):
    """A buffer multiplied in (saved for backward), then another updated in place in the same
    forward (an EMA of the activations): the buffers must not share a version counter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 6)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x):
        h = self.lin(x) * self.scale
        self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return h.sum(1)


def _scaled_ema(rank: int, stage: int) -> float:
    world = zfunc.comm.world().size
    state = zfunc.init(_ScaledEMA(), zfunc.Config(stage=stage, optimizer=zfunc.adamw(lr=1e-2)))
    ref = _ScaledEMA()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = zfunc.train_step(lambda m, x: m(x).pow(2).mean())
    data = lambda i, r: torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * i + r))  # noqa: E731
    for i in range(3):
        state = step(state, data(i, rank))
        opt.zero_grad()
        for r in range(world):
            (ref(data(i, r)).pow(2).mean() / world).backward()
        opt.step()
    full = zfunc.full_params(state)
    return max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_buffer_saved_for_backward_beside_one_updated_in_place_trains_on_two_ranks(stage):
    """At world 2 each step gives every rank rank 0's buffers, broadcast as one flat tensor per
    dtype, each then in memory of its own: an in-place update of one buffer in forward (an EMA;
    a train-mode BatchNorm's statistics inside a checkpointed part of a compiled block) leaves
    the version of another that the multiplication saved alone, from the second step on too.
    The weights match plain torch averaged over the two ranks' batches."""
    for diff in run_ranks(_scaled_ema, 2, stage):
        assert diff <= 2e-6, diff


# -- pullbacks -----------------------------------------------------------------------------

def test_pullback_calls_are_independent_or_refused():
    torch.manual_seed(0)
    state = zfunc.init(nn.Linear(3, 2), zfunc.Config(stage=0))
    out, pullback = zfunc.vjp(state, lambda m, x: m(x), torch.ones(4, 3))
    first = pullback(torch.ones_like(out), retain_graph=True)
    second = pullback(torch.ones_like(out))
    assert torch.equal(first.grads, second.grads) and first.grads is not second.grads
    assert first.micro_step.item() == 1 and second.micro_step.item() == 1
    assert state.grads.abs().sum().item() == 0  # the input state is untouched
    with pytest.raises(RuntimeError, match="first call freed the graph"):
        pullback(torch.ones_like(out))
    out, pullback = zfunc.vjp(state, lambda m, x: m(x), torch.ones(4, 3), donate=True)
    pullback(torch.ones_like(out), retain_graph=True)
    with pytest.raises(RuntimeError, match="donate=True"):
        pullback(torch.ones_like(out))


# -- the micro-batch record -------------------------------------------------------------------

def _loss_fn(model, x):
    return model(x).pow(2).mean()


def _loop_losses() -> dict[str, float]:
    torch.manual_seed(0)
    x = torch.ones(2, 3)
    make = lambda: zfunc.init(nn.Linear(3, 1), zfunc.Config(stage=2, grad_accum=2))  # noqa: E731
    out = {}
    s = make()
    for _ in range(2):
        s, loss = zfunc.backward_step(s, _loss_fn, x)
    out["backward_step"] = (zfunc.apply_step(s).metrics.loss.item(), loss.item())
    s = make()
    for _ in range(2):
        y, pullback = zfunc.vjp(s, lambda m, x: m(x), x)
        s = pullback(torch.ones_like(y))
    out["vjp"] = zfunc.apply_step(s).metrics.loss.item()
    s = make()
    for _ in range(2):
        y, pullback = zfunc.vjp(s, _loss_fn, x)
        s = pullback(torch.ones_like(y), loss=y)
    out["vjp_loss"] = (zfunc.apply_step(s).metrics.loss.item(), y.item())
    s = make()
    for _ in range(2):
        s = zfunc.accumulate(s, {"weight": torch.ones(1, 3)}, strict=False)
    out["accumulate"] = zfunc.apply_step(s).metrics.loss.item()
    s = zfunc.accumulate(make(), {"weight": torch.ones(1, 3)}, loss=torch.tensor(3.0), strict=False)
    s = zfunc.accumulate(s, {"weight": torch.ones(1, 3)}, loss=torch.tensor(5.0), strict=False)
    out["accumulate_loss"] = zfunc.apply_step(s).metrics.loss.item()
    for style in ("backward", "loss.backward"):
        torch.manual_seed(0)
        engine, *_ = zfunc.initialize(model=nn.Linear(3, 1), config={
            "train_batch_size": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}})
        for _ in range(2):
            loss = _loss_fn(engine, x)
            engine.backward(loss) if style == "backward" else loss.backward()
            engine.step()
        out[style] = (engine.state.metrics.loss.item(), loss.item())
    out["nothing"] = zfunc.apply_step(zfunc.accumulate(make(), {}, strict=False)).metrics.loss.item()
    return out


def test_metrics_loss_after_each_loop_style():
    got = _loop_losses()
    mean, last = got["backward_step"]
    assert mean == pytest.approx(last)  # both micro-batches are the same data
    assert math.isnan(got["vjp"]) and math.isnan(got["accumulate"]) and math.isnan(got["loss.backward"][0])
    assert got["vjp_loss"][0] == pytest.approx(got["vjp_loss"][1])
    assert got["accumulate_loss"] == 4.0
    assert got["backward"][0] == pytest.approx(got["backward"][1])
    assert math.isnan(got["nothing"])  # a micro-batch whose loss zfunc was not given: no loss


def test_more_micro_batches_than_grad_accum_are_refused():
    state = zfunc.init(nn.Linear(3, 1), zfunc.Config(grad_accum=2))
    for _ in range(2):
        state, _ = zfunc.backward_step(state, _loss_fn, torch.ones(2, 3))
    before = snapshot(state)
    with pytest.raises(RuntimeError, match=r"backward_step: grad_accum=2 micro-batches are accumulated"):
        zfunc.backward_step(state, _loss_fn, torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="vjp: grad_accum=2"):
        zfunc.vjp(state, lambda m, x: m(x), torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="accumulate: grad_accum=2"):
        zfunc.accumulate(state, {}, strict=False)
    assert bitwise_equal(before, snapshot(state))
    state = zfunc.apply_step(state)
    state, _ = zfunc.backward_step(state, _loss_fn, torch.ones(2, 3))  # room again after the step
    assert state.micro_step.item() == 1


# -- outputs outside the pytree -------------------------------------------------

@dataclasses.dataclass
class Extra:  # not registered with zfunc.tree
    value: torch.Tensor
    note: str = "x"


class TwoHeads(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.mean = nn.Linear(3, 2)
        self.scale = nn.Linear(3, 2)

    def forward(self, x):
        if self.kind == "dataclass":
            return self.mean(x), Extra(self.scale(x))
        return torch.distributions.Normal(self.mean(x), nn.functional.softplus(self.scale(x)) + 0.1)


def _objective(kind, out, y):
    if kind == "dataclass":
        return ((out[0] - y) ** 2).mean() + out[1].value.pow(2).mean()
    return -out.log_prob(y).mean()


@pytest.mark.parametrize("kind", ["dataclass", "distribution"])
def test_objects_in_the_output_train_like_torch(kind):
    torch.manual_seed(0)
    model = TwoHeads(kind)
    ref = TwoHeads(kind)
    ref.load_state_dict(model.state_dict())
    state = zfunc.init(model, zfunc.Config(stage=0, grad_accum=4))
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(4)]
    for x, y in data:
        state, _ = zfunc.backward_step(state, lambda m, b: _objective(kind, m(b[0]), b[1]), (x, y))
        (_objective(kind, ref(x), y) / 4).backward()
    unit = state.layout.units[0]
    grads = state.layout.views(unit, state.grads.narrow(0, 0, unit.padded))
    for name, p in ref.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-6), (name, (grads[name] / p.grad).flatten()[:3])


class Slotted:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class SlottedOut(nn.Linear):
    def forward(self, x):
        return Slotted(super().forward(x))


def test_an_output_zfunc_cannot_reach_into_is_returned_as_it_is():
    """zfunc attaches nothing to the model's outputs, so an object whose tensors sit in
    ``__slots__`` trains like any other: the output is the module's own object."""
    torch.manual_seed(0)
    model, ref = SlottedOut(3, 2), SlottedOut(3, 2)
    ref.load_state_dict(model.state_dict())
    state = zfunc.init(model, zfunc.Config(stage=0, grad_accum=2))
    seen = []

    def loss_fn(m, x):
        out = m(x)
        seen.append(type(out))
        return out.value.sum()

    for _ in range(2):
        state, _ = zfunc.backward_step(state, loss_fn, torch.ones(1, 3))
        (ref(torch.ones(1, 3)).value.sum() / 2).backward()
    unit = state.layout.units[0]
    grads = state.layout.views(unit, state.grads.narrow(0, 0, unit.padded))
    assert seen == [Slotted, Slotted]
    assert all(torch.allclose(grads[n], p.grad, atol=1e-7) for n, p in ref.named_parameters())


# -- the module stays the user's -----------------------------------------------------------

def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1))


def _bound_attrs(obj: nn.Module) -> list[str]:
    found = []
    for name, mod in obj.named_modules():
        found += [f"{name}.{k}" for k in vars(mod) if k.startswith("_zfunc")]
    for name, t in [*obj.named_parameters(), *obj.named_buffers()]:
        found += [f"{name}.{k}" for k in getattr(t, "__dict__", {}) if k.startswith("_zfunc")]
    return found


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_init_leaves_the_module_usable(stage):
    model = _stack()
    x = torch.randn(2, 4)
    expected = model(x).detach()
    cfg = zfunc.Config(stage=stage, units=["0", "2"] if stage else None, persist_threshold=0,
                       optimizer=zfunc.adamw(lr=0.1))
    first = zfunc.init(model, cfg)
    first, _ = zfunc.backward_step(first, _loss_fn, x)
    first = zfunc.apply_step(first)
    assert torch.equal(model(x), expected)                   # plain torch, original weights
    second = zfunc.init(model, cfg)                          # a second init of the same module
    assert torch.equal(zfunc.full_params(second)["0.weight"], model[0].weight.detach())
    with tempfile.TemporaryDirectory() as d:
        path = zfunc.save(first, d + "/ckpt")
        loaded = zfunc.load(path, like=zfunc.init(model, cfg))
    assert all(torch.equal(a, b) for a, b in zip(zfunc.full_params(loaded).values(),
                                                 zfunc.full_params(first).values()))
    second, _ = zfunc.backward_step(second, _loss_fn, x)     # both states still train
    loaded, _ = zfunc.backward_step(loaded, _loss_fn, x)
    assert _bound_attrs(model) == []
    for s in (first, second, loaded):
        s.binding.remove()
    assert all(len(m._forward_pre_hooks) == 0 and len(m._forward_hooks) == 0 for m in model.modules())
    assert torch.equal(model(x), expected)


def test_a_donated_module_is_refused_clearly():
    model = _stack()
    state = zfunc.init(model, zfunc.Config(stage=3, units=["0", "2"], persist_threshold=0), donate=True)
    assert all(p.numel() == 0 for p in model.parameters())
    with pytest.raises(RuntimeError,
                       match=r"live in a zfunc state \(the module was given to init\(\.\.\., donate=True\)"):
        model(torch.ones(1, 4))
    with pytest.raises(zfunc.ConfigError, match="donated to another zfunc state"):
        zfunc.init(model, zfunc.Config(stage=3))
    state, _ = zfunc.backward_step(state, _loss_fn, torch.ones(2, 4))
    assert state.micro_step.item() == 1


def _engine_attrs(rank: int, stage: int) -> list[str]:
    model = _stack()
    engine, *_ = zfunc.initialize(model=model, config={"train_batch_size": 2 * zfunc.comm.world().size,
                                                       "zero_optimization": {"stage": stage}})
    for _ in range(2):
        loss = _loss_fn(engine, torch.randn(2, 4))
        loss.backward()
        engine.step()
    state = zfunc.init(_stack(), zfunc.Config(stage=stage))
    step = zfunc.train_step(_loss_fn)
    other = state.module
    state = step(state, torch.randn(2, 4))
    return _bound_attrs(model) + _bound_attrs(other)


def test_no_zfunc_attributes_on_user_objects():
    for stage in (0, 1, 2, 3):
        for found in run_ranks(_engine_attrs, 2, stage):
            assert found == [], found


# -- module structure -----------------------------------------------------------------------

def _imports(path: pathlib.Path) -> set[str]:
    """Every zfunc module ``path`` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zfunc"):
            found |= _targets(node)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("zfunc.")}
    return found


def _runtime_imports(path: pathlib.Path) -> set[str]:
    """As `_imports`, leaving out imports under ``if TYPE_CHECKING:`` (types only)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip |= {id(n) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zfunc."):
            found |= _targets(node)
    return found


def _targets(node: ast.ImportFrom) -> set[str]:
    """The modules ``from M import a, b`` reads: ``M.a`` where that is a module (``from
    zfunc.distributed import comm``), else ``M``."""
    subs = {f"{node.module}.{a.name}" for a in node.names}
    found = {m for m in subs if m in _MODULES}
    return found if found else {node.module}


_MODULES = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in (ROOT / "zfunc").rglob("*.py")
            if p.stem != "__init__"}


def test_state_is_data_and_zfunc_has_no_import_circle():
    modules = _MODULES
    assert len(modules) > 25 and "zfunc.autograd.binding" in modules
    assert _runtime_imports(modules["zfunc.core.state"]) <= {"zfunc._tree"}
    graph = {m: {d for d in _runtime_imports(p) if d in modules} for m, p in modules.items()}

    def visit(m: str, path: list[str]) -> None:
        for d in graph[m]:
            assert d not in path, "import circle: " + " -> ".join([*path, d])
            visit(d, [*path, d])

    for m in graph:
        visit(m, [m])
    assert "zfunc.core.config" not in _imports(modules["zfunc.core.deepspeed_config"])
    assert _imports(modules["zfunc.errors"]) == set()


def test_an_interrupt_inside_a_unit_leaves_the_module_free():
    """A ``KeyboardInterrupt`` raised inside a unit's forward skips torch's post-hooks; the
    call still gives the module back: its hooks come off, no saved-tensor hook stays pushed, and
    another thread may run it."""
    import gc
    import threading

    for stage, units in ((3, ["0"]), (2, ["0"])):
        model = _stack()
        state = zfunc.init(model, zfunc.Config(stage=stage, units=units, persist_threshold=0))
        stop = model[0].register_forward_hook(lambda m, a, out: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            zfunc.backward_step(state, _loss_fn, torch.ones(2, model[0].in_features))
        stop.remove()
        gc.collect()  # the traceback's frames held the interrupted call
        assert not state.binding._users and not state.binding._attached, stage
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, stage  # none left pushed
        done: list[bool] = []
        worker = threading.Thread(target=lambda: done.append(
            zfunc.backward_step(state, _loss_fn, torch.ones(2, model[0].in_features))[0] is not None))
        worker.start()
        worker.join()
        assert done == [True], stage


@pytest.mark.parametrize("stage", [0, 3])
def test_a_donated_module_called_directly_during_another_threads_call_is_refused(stage):
    """While one thread runs a zfunc call of a donated module (the state's tensors are in the
    module's entries), a direct call of the module in another thread is refused as any direct
    call is: it never runs on, or sends gradients into, the other thread's call."""
    import threading

    model = _stack()
    cfg = zfunc.Config(stage=stage, **({"units": ["0", "2"], "persist_threshold": 0} if stage == 3 else {}))
    state = zfunc.init(model, cfg, donate=True)
    caller: list = []  # (the thread running the call, its pause)

    def stop(mod, args):
        if caller and threading.get_ident() == caller[0][0]:
            caller[0][1]()

    handle = model[1].register_forward_pre_hook(stop)  # the zfunc call stops inside the module
    out = []

    def run(pause) -> None:
        caller.append((threading.get_ident(), pause))
        out.append(zfunc.backward_step(state, _loss_fn, torch.ones(2, 4))[0])

    try:
        with paused_in_thread(run):
            with pytest.raises(RuntimeError, match=r"live in a zfunc state"):
                model(torch.ones(1, 4))
    finally:
        handle.remove()
    expected = zfunc.backward_step(state, _loss_fn, torch.ones(2, 4))[0]
    assert torch.equal(out[0].grads, expected.grads)


class _SavesOutput(nn.Module):
    """A block whose forward saves an op's own output for backward (``tanh`` keeps its result)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def _zfunc_hooks(model: nn.Module) -> int:
    """The forward hooks on ``model``'s modules, but a donated module's refusing ones (which stay)."""
    return sum(sum(not getattr(h, "refuses_donated", False) for h in m._forward_pre_hooks.values())
               + len(m._forward_hooks) for m in model.modules())


def test_a_stage3_graph_dropped_without_backward_goes_with_its_hooks():
    """At stage 3 the saved-tensor hooks of a unit keep a saved tensor that is no gathered view
    as a detached alias: a saved output held as itself would hold its own autograd node, a cycle
    no collector breaks, and the call, its activations and zfunc's hooks on the module would
    outlive a graph dropped without backward (a pullback never called; an engine forward with
    grad on and no backward, as an evaluation without ``no_grad``). With the collector off,
    reference counting frees them; the gradients stay torch's."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(_SavesOutput(), _SavesOutput())
    ref = nn.Sequential(_SavesOutput(), _SavesOutput())
    ref.load_state_dict(model.state_dict())
    state = zfunc.init(model, zfunc.Config(stage=3, units=["0", "1"], persist_threshold=0,
                                           optimizer=zfunc.sgd(lr=1.0)))
    x = torch.randn(4, 8)
    gc.disable()
    try:
        out, pull = zfunc.vjp(state, lambda m, x: m(x), x)
        assert _zfunc_hooks(model) > 0  # the call's unit hooks, while its graph lives
        del out, pull
        assert _zfunc_hooks(model) == 0
        out, pull = zfunc.vjp(state, lambda m, x: m(x), x)
        new = pull(torch.ones_like(out))
        del out, pull
        assert _zfunc_hooks(model) == 0
    finally:
        gc.enable()
    ref(x).sum().backward()
    before, after = zfunc.full_params(state), zfunc.full_params(zfunc.apply_step(new))
    for n, p in ref.named_parameters():  # one SGD step of lr 1: the gradient
        assert torch.allclose(before[n] - after[n], p.grad, atol=1e-6), n

    torch.manual_seed(0)
    net = nn.Sequential(_SavesOutput(), _SavesOutput())
    engine, *_ = zfunc.initialize(model=net, config={"train_batch_size": 1, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    gc.disable()
    try:
        for _ in range(3):
            engine(x).sum()  # grad on, no backward
        assert all(_zfunc_hooks(b) == 0 for b in net)  # (the engine's routing hooks are on the top module)
    finally:
        gc.enable()
    engine.destroy()


def test_a_stage3_call_after_remove_is_refused():
    """``binding.remove()`` takes the hooks that gather stage 3's units: a call of any state
    sharing the binding refuses, naming the cause
    and the fix; at stages 1-2 the units run unbound and training goes on."""
    x = torch.randn(3, 4)
    for stage in (1, 3):
        torch.manual_seed(0)
        state = zfunc.init(_stack(), zfunc.Config(stage=stage, units=["0", "2"], persist_threshold=0))
        twin = copy.deepcopy(state)
        state.binding.remove()
        for s in (state, twin):
            if stage == 3:
                with pytest.raises(RuntimeError, match=r"hooks were removed \(state.binding.remove\(\).*Make a new state"):
                    zfunc.vjp(s, lambda m, x: m(x), x)
            else:
                assert zfunc.backward_step(s, _loss_fn, x)[0].micro_step.item() == 1
