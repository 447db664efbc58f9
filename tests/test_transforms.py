"""torch.func through zfunc: ``vmap`` over the bound model and ``torch.func.grad`` inside
``loss_fn`` train as the same loss does on a plain torch model, at every stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zfunc
from tests.helpers import run_ranks
from zfunc.tools.launch import WorldError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2))


def _per_sample(model, x: torch.Tensor) -> torch.Tensor:
    # the model on one sample at a time, vmapped over the batch
    return torch.func.vmap(lambda xi: model(xi.unsqueeze(0)).squeeze(0))(x).pow(2).mean()


def _input_gradient(model, x: torch.Tensor) -> torch.Tensor:
    # an input gradient (a saliency feature) computed inside the loss, then used detached
    g = torch.func.grad(lambda x: model(x).sum())(x)
    return (model(x) * g.detach().sum(1, keepdim=True)).pow(2).mean()


def _train(rank: int, stage: int, which: str) -> float:
    world = zfunc.comm.world().size
    loss_fn = {"vmap": _per_sample, "grad": _input_gradient}[which]
    units = ["0", "2"] if stage == 3 else None
    state = zfunc.init(_model(), zfunc.Config(stage=stage, units=units, persist_threshold=0,
                                              optimizer=zfunc.adamw(lr=1e-2)))
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def data(i: int, r: int) -> torch.Tensor:
        return torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * i + r))

    for i in range(3):
        state, _ = zfunc.backward_step(state, loss_fn, data(i, rank))
        state = zfunc.apply_step(state)
        opt.zero_grad()
        for r in range(world):
            (loss_fn(ref, data(i, r)) / world).backward()
        opt.step()
    full = zfunc.full_params(state)
    return max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_vmap_over_the_bound_model(stage):
    for world in (1, 2):
        for diff in run_ranks(_train, world, stage, "vmap"):
            assert diff <= 2e-6, (world, diff)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torch_func_grad_inside_loss_fn(stage):
    # grad_accum * world == 1: the model's output factor is 1, so torch.func.grad is exact
    for diff in run_ranks(_train, 1, stage, "grad"):
        assert diff <= 2e-6, diff


class _Blocks(nn.Module):
    def __init__(self, ckpt: str | None = None, n: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 8)
        norm = nn.BatchNorm1d if ckpt else nn.Identity  # with checkpointing, a block holding buffers
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), norm(8), nn.GELU(), nn.Linear(8, 8))
                                    for _ in range(n))
        self.out = nn.Linear(8, 2)
        self.ckpt = ckpt  # each block under activation checkpointing ("reentrant" or "nonreentrant")

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + (b(h) if self.ckpt is None else
                     torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.ckpt == "reentrant"))
        return self.out(h)


def _compiled(rank: int, stage: int, how: str, donate: bool = False, by_class: bool = False,
              ckpt: str | None = None, persist: int | None = 0, n: int = 2) -> list[torch.Tensor]:
    """Three steps with the model ``"eager"``, compiled per block (``"blocks"``, torchtitan's way:
    each block on its own, no graph break allowed), or compiled whole (``"whole"``: the compiled
    model given to ``init``); the units named by path (by default at stage 3; with ``ckpt``, each
    block checkpointed, at stages 1-2 too), or by class (each block's); ``persist`` the
    ``persist_threshold`` (None: the default); ``n`` blocks."""
    import torch._dynamo

    torch._dynamo.reset()
    model = _Blocks(ckpt, n)
    if how == "whole":
        model = torch.compile(model, backend="aot_eager")
    elif how == "blocks":
        for i, b in enumerate(model.blocks):
            model.blocks[i] = torch.compile(b, fullgraph=True, backend="aot_eager")
    by_path = [f"blocks.{i}" for i in range(n)] if stage == 3 or (ckpt and stage) else None
    units = ([nn.Sequential] if stage else None) if by_class else by_path
    kept = {} if persist is None else {"persist_threshold": persist}
    state = zfunc.init(model, zfunc.Config(stage=stage, units=units, grad_accum=2, optimizer=zfunc.adamw(lr=1e-2),
                                           **kept), donate=donate)
    step = zfunc.train_step(lambda m, x: m(x).pow(2).mean())
    for i in range(3):
        state = step(state, torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * i + rank)))
    return [t.clone() for t in zfunc.full_params(state).values()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_block_compile_fullgraph_trains_like_eager(stage):
    for world in (1, 2):
        eager = run_ranks(_compiled, world, stage, "eager")
        for donate in (False, True):  # a donated module's refusing hooks trace without a break too
            for a, b in zip(eager, run_ranks(_compiled, world, stage, "blocks", donate)):
                assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= 1e-6, (world, stage, donate)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_whole_model_and_blocks_by_class_compiled_train_like_eager(stage):
    """A compiled block named as a unit by its class is the compiled module (zfunc's unit hooks
    outside the compiled code, fullgraph holds); the whole model compiled trains too (at stage 3
    with a graph break at each unit, where it is gathered)."""
    eager = run_ranks(_compiled, 2, stage, "eager", False, True)
    for how in ("whole", "blocks"):
        for a, b in zip(eager, run_ranks(_compiled, 2, stage, how, False, True)):
            assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= 1e-6, (stage, how)


class _Block(nn.Module):
    """A block of the user's own class (torch compiles no frame of its own modules' code, so an
    ``nn.Sequential`` compiled in place would run eagerly)."""

    def __init__(self, norm: type[nn.Module]):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 8), norm(8), nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.norm(self.a(h))))


def _compiled_in_place(rank: int, stage: int, compiled: bool, ckpt: str | None = None, units: bool = False,
                       norm: type[nn.Module] = nn.LayerNorm, rows: int = 4) -> tuple[list[torch.Tensor], int]:
    """Three steps of a model whose blocks are compiled in place (``block.compile()``, torch's
    ``nn.Module.compile``: the module's own call is compiled, its hooks inside; ``fullgraph``
    where no block is a unit nor checkpointed), or eager; each block a unit at stage 3 and, with
    ``units``, at stages 1-2; checkpointed with ``ckpt``; ``norm`` in each block; ``rows`` a batch.
    Its parameters, and the graphs Dynamo made."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _Blocks(ckpt, 2)
    model.blocks = nn.ModuleList(_Block(norm) for _ in range(2))
    units = ["blocks.0", "blocks.1"] if stage == 3 or units else None
    if compiled:  # no graph break where no unit is gathered and nothing recomputed
        for b in model.blocks:
            b.compile(fullgraph=units is None and ckpt is None, backend="aot_eager")
    state = zfunc.init(model, zfunc.Config(stage=stage, units=units, persist_threshold=0, grad_accum=2,
                                           optimizer=zfunc.adamw(lr=1e-2)))
    step = zfunc.train_step(lambda m, x: m(x).pow(2).mean())
    for i in range(3):
        state = step(state, torch.randn(rows, 3, generator=torch.Generator().manual_seed(10 * i + rank)))
    return [t.clone() for t in zfunc.full_params(state).values()], int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_blocks_compiled_in_place_train_like_eager(stage):
    """``block.compile()`` compiles the block's own call, zfunc's hooks on it inside: at stages
    0-2 with no graph break (the recompute hooks return at once in a forward), at stage 3 with a
    break where a unit is gathered; under checkpointing with each block a unit (stages 1-3: its
    unit hooks, there in the forward too, put the call's parameters in for the recomputation,
    outside the compiled code, and the recomputation runs the forward's graphs). Trains as eager,
    on two ranks. The unit hooks run eagerly at their graph breaks, and Dynamo traces none of
    zfunc's code: one graph serves both blocks (two under reentrant checkpointing, whose forward
    runs without grad), where a graph per unit and per zfunc function it traced would reach
    Dynamo's recompile limit."""
    for ckpt in (None, "reentrant", "nonreentrant") if stage else (None,):
        units = ckpt is not None
        eager = run_ranks(_compiled_in_place, 2, stage, False, ckpt, units)
        for (a, _), (b, graphs) in zip(eager, run_ranks(_compiled_in_place, 2, stage, True, ckpt, units)):
            assert 1 <= graphs <= (2 if ckpt == "reentrant" else 1), (stage, ckpt, graphs)  # compiled, zfunc's code not
            assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= 1e-6, (stage, ckpt)


@pytest.mark.parametrize("ckpt", ["reentrant", "nonreentrant"])
def test_a_checkpointed_block_compiled_in_place_is_refused_where_zfunc_cannot_cover_it(ckpt):
    """A block compiled in place and recomputed by activation checkpointing, where its own
    recompute hook would have to put tensors in (not a unit at stages 0-2; a unit holding buffers
    at stage 3, a BatchNorm's): that hook runs inside the compiled call, so the recomputation is
    refused with an error naming the fix, also where the saved tensors' shapes coincide (a
    micro-batch of 8 rows, 8 features), where running on the module's own tensors would go
    unnoticed by checkpointing's metadata check."""
    for stage, units, norm, rows in ((0, False, nn.LayerNorm, 4), (0, False, nn.LayerNorm, 16), (2, False, nn.LayerNorm, 16),
                                     (3, True, nn.BatchNorm1d, 16)):
        with pytest.raises(WorldError, match=r"recomputes _Block inside compiled code: it was compiled in place"):
            run_ranks(_compiled_in_place, 1, stage, True, ckpt, units, norm, rows)


class _ChildCheckpointed(nn.Module):
    """A block whose forward checkpoints its first layer on its own."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.a, self.b, self.reentrant = nn.Linear(8, 8), nn.Linear(8, 8), reentrant

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(torch.utils.checkpoint.checkpoint(self.a, h, use_reentrant=self.reentrant)))


def _child_compiled_in_place(rank: int, ckpt: str) -> None:
    """A backward of two `_ChildCheckpointed` units at stage 3, their checkpointed layers compiled
    in place."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), _ChildCheckpointed(ckpt == "reentrant"), _ChildCheckpointed(ckpt == "reentrant"))
    for block in (model[1], model[2]):
        block.a.compile(backend="aot_eager")
    state = zfunc.init(model, zfunc.Config(stage=3, units=["1", "2"], persist_threshold=0))
    zfunc.backward_step(state, lambda m, x: m(x).pow(2).mean(), torch.randn(4, 3))


@pytest.mark.parametrize("ckpt", ["reentrant", "nonreentrant"])
def test_a_checkpointed_layer_of_a_unit_compiled_in_place_is_refused(ckpt):
    """A layer inside a unit's module, compiled in place and checkpointed on its own (its unit's
    module not running around its recomputation): its unit recompute hook, which gathers the
    unit again and puts it in, would run inside the compiled call, so the recomputation is
    refused with an error naming the fix."""
    with pytest.raises(WorldError, match=r"recomputes Linear inside compiled code: it was compiled in place"):
        run_ranks(_child_compiled_in_place, 1, ckpt)


def _compiled_after_init(rank: int, stage: int, compiled: bool, ckpt: str | None) -> tuple[dict, list[str]]:
    """Three steps of `_Blocks` whose blocks are put in place as ``torch.compile(block)`` after
    `zfunc.init` (or left eager): `zfunc.full_params`, and the names `zfunc.iter_full_params`
    gives."""
    import torch._dynamo

    torch._dynamo.reset()
    model = _Blocks(ckpt, 2)
    units = ["blocks.0", "blocks.1"] if stage == 3 else None
    state = zfunc.init(model, zfunc.Config(stage=stage, units=units, persist_threshold=0, grad_accum=2,
                                           optimizer=zfunc.adamw(lr=1e-2)))
    if compiled:
        for i, b in enumerate(model.blocks):
            model.blocks[i] = torch.compile(b, backend="aot_eager")
    step = zfunc.train_step(lambda m, x: m(x).pow(2).mean())
    for i in range(3):
        state = step(state, torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * i + rank)))
    import pickle

    try:  # a pickled state carries the module as code: the code's names must be the state's
        pickle.dumps(state)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return zfunc.full_params(state), [n for n, _ in zfunc.iter_full_params(state)], refused


@pytest.mark.parametrize("stage", [0, 3])
def test_blocks_compiled_after_init_keep_their_parameter_names(stage):
    """A block put in place as ``torch.compile(block)`` after `zfunc.init` renames its parameters
    in the model (``blocks.0._orig_mod.0.weight``): `zfunc.full_params` and
    `zfunc.iter_full_params` give every parameter under the name it had at `init`, as eager
    training does. Pickling the state is refused, naming the cause (the module as code has other
    names than the state's). Under checkpointing at stage 0 the recomputation is refused, naming
    compilation after `init` (the wrapper has none of zfunc's hooks)."""
    [(eager, eager_names, kept)] = run_ranks(_compiled_after_init, 1, stage, False, None)
    [(full, names, refused)] = run_ranks(_compiled_after_init, 1, stage, True, None)
    assert kept == "" and "have other names now than at zfunc.init" in refused, (kept, refused)
    assert list(full) == list(eager) and names == eager_names and sorted(names) == sorted(full) and len(names) == 12, names
    assert max((full[n] - eager[n]).abs().max().item() for n in eager) <= 1e-6
    if stage == 0:
        with pytest.raises(WorldError, match=r"or compiled with torch.compile after zfunc.init"):
            run_ranks(_compiled_after_init, 1, stage, True, "nonreentrant")


@pytest.mark.parametrize("ckpt", ["reentrant", "nonreentrant"])
def test_compiled_blocks_under_checkpointing_train_like_eager(ckpt):
    """Each block compiled (no graph break allowed) and checkpointed, the blocks units (stage 3,
    stages 1-2 with ``Config.units``), a BatchNorm's buffers in each: in the recomputation the
    recompute hooks of the layers inside a compiled block return at once (the unit's module runs
    around them, its own hooks put in the unit and the buffers), so nothing of theirs is
    traced."""
    for stage in (1, 2, 3):
        eager = run_ranks(_compiled, 1, stage, "eager", False, False, ckpt)
        for a, b in zip(eager, run_ranks(_compiled, 1, stage, "blocks", False, False, ckpt)):
            assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= 1e-6, (stage, ckpt)
    # A donated module's refusing hooks, traced in the recomputation, let it through (they called
    # into what Dynamo cannot trace)
    for stage in (0, 3):
        eager = run_ranks(_compiled, 1, stage, "eager", True, False, ckpt)
        for a, b in zip(eager, run_ranks(_compiled, 1, stage, "blocks", True, False, ckpt)):
            assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= 1e-6, (stage, ckpt, "donated")


@pytest.mark.parametrize("ckpt", ["reentrant", "nonreentrant"])
def test_compiled_blocks_under_checkpointing_with_small_parameters_in_the_root(ckpt):
    """At stage 3 the parameters under ``persist_threshold`` stay in the root unit, inside the
    compiled, checkpointed blocks: some (a block's biases and BatchNorm's, 20), or every one (the
    default: no unit but the root). The compiled block's recompute hooks, outside its compiled
    code, put them in; those of the layers inside it, traced, are asleep (a compiled wrapper
    counts as a module with a forward of its own, and no layer's hook traces
    ``threading.get_ident``)."""
    for persist in (20, None):
        eager = run_ranks(_compiled, 1, 3, "eager", False, False, ckpt, persist)
        for a, b in zip(eager, run_ranks(_compiled, 1, 3, "blocks", False, False, ckpt, persist)):
            assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= 1e-6, (persist, ckpt)


def _graphs_of_many_blocks(rank: int, stage: int, ckpt: str) -> tuple[list[torch.Tensor], int]:
    """Ten compiled blocks, each checkpointed: their parameters after three steps and the
    graphs Dynamo made (one block's code serves all ten)."""
    from torch._dynamo.utils import counters

    counters.clear()  # (a worker process may have compiled before)
    params = _compiled(rank, stage, "blocks", False, False, ckpt, 0, 10)
    return params, int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("ckpt", ["reentrant", "nonreentrant"])
def test_more_compiled_blocks_than_dynamos_limit_under_checkpointing(ckpt):
    """Ten blocks compiled one by one (``fullgraph=True``), each checkpointed, at stages 0 and 3:
    the recompute hooks of every block trace as one (a hook id shared by every module, nothing
    read of a module's own), so the recomputation compiles as plain torch's does (two graphs
    under reentrant checkpointing: the forward without grad, the recomputation with it), not
    one per block up to Dynamo's limit of 8 (``FailOnRecompileLimitHit``); and trains as eager."""
    for stage in (0, 3):
        eager = run_ranks(_compiled, 1, stage, "eager", False, False, ckpt, 0, 10)[0]
        [(compiled, graphs)] = run_ranks(_graphs_of_many_blocks, 1, stage, ckpt)
        assert graphs == (2 if ckpt == "reentrant" else 1), (stage, graphs)
        assert max((x - y).abs().max().item() for x, y in zip(eager, compiled)) <= 1e-6, stage


def _raised_then_compiled(rank: int) -> tuple[int, bool]:
    import warnings

    state = zfunc.init(_Blocks(), zfunc.Config(stage=0))
    sinks = zfunc.core.backward.sinks_into(state, torch.zeros(state.layout.full_numel))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on create_graph=True with .grad
        try:
            zfunc.core.backward.bind(state, sinks)(torch.ones(2, 3)).sum().backward(create_graph=True)
        except RuntimeError as e:
            assert "create_graph" in str(e)
    left = state.binding.flight.backwards
    return left, bool(_compiled(rank, 0, "blocks"))


def test_compile_after_a_backward_that_raised():
    # A backward through a zfunc model that raised (here: refused create_graph) must not leave
    # the recompute hooks awake for the next compiled forward.
    for left, compiled in run_ranks(_raised_then_compiled, 1):
        assert left == 0  # forgotten as autograd let the raised backward go
        assert compiled  # no graph break
