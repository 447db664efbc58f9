"""The state as a value: purity, donation, memory, counters, collectives per micro-step."""

from __future__ import annotations

import copy

from typing import Any

import pytest
import torch
from torch import nn

import zfunc
from tests.helpers import (MODELS, between_steps, bitwise_equal as _bitwise_equal, run_ranks, snapshot as _snapshot,
                           zoo_batch, zoo_loss)


def _purity(rank: int, stage: int) -> tuple[bool, bool, bool]:
    make, loss_fn, batch_fn = MODELS["zoo"]
    torch.manual_seed(0)
    state = zfunc.init(make(), zfunc.Config(stage=stage, grad_accum=2, clip=1.0))
    b = batch_fn(0, rank, 4)
    # Without donation: every step leaves its input bitwise unchanged.
    before = _snapshot(state)
    s1, _ = zfunc.backward_step(state, loss_fn, b)
    unchanged_bwd = _bitwise_equal(before, _snapshot(state))
    mid = _snapshot(s1)
    s2 = zfunc.apply_step(s1)
    unchanged_apply = _bitwise_equal(mid, _snapshot(s1))
    # With donation: the same result, computed in the input's buffers.
    d1, _ = zfunc.backward_step(state, loss_fn, b, donate=False)
    given = d1.opt.mu.data_ptr(), d1.params.data_ptr()
    d2 = zfunc.apply_step(d1, donate=True)
    same = _bitwise_equal(_snapshot(s2), _snapshot(d2))
    reused = (d2.opt.mu.data_ptr(), d2.params.data_ptr()) == given
    return unchanged_bwd and unchanged_apply, same, reused


def test_pure_without_donation_identical_with_it():
    for world in (1, 2):
        for stage in (0, 1, 2, 3):
            for rank, (pure, same, reused) in enumerate(run_ranks(_purity, world, stage)):
                assert pure, f"stage {stage} world {world} rank {rank}: input state changed"
                assert same, f"stage {stage} world {world} rank {rank}: donated result differs"
                assert reused, f"stage {stage} world {world} rank {rank}: donation copied the optimizer state"


def _donated_reuse(rank: int, stage: int) -> list[str]:
    """Every way of using a donated state again; the message each gives (all must refuse; a
    pickle of one would not load)."""
    import pickle

    make, loss_fn, batch_fn = MODELS["zoo"]
    torch.manual_seed(0)
    state = zfunc.init(make(), zfunc.Config(stage=stage, grad_accum=2))
    b = batch_fn(0, rank, 2)
    s1, _ = zfunc.backward_step(state, loss_fn, b, donate=True)
    s2 = zfunc.accumulate(s1, {}, strict=False, donate=True)
    s3 = zfunc.apply_step(s2, donate=True)
    out, pullback = zfunc.vjp(s3, lambda m, x: loss_fn(m, x), b, donate=True)
    s4 = pullback(torch.ones(()))
    uses = [lambda: zfunc.backward_step(state, loss_fn, b), lambda: zfunc.accumulate(s1, {}, strict=False),
            lambda: zfunc.apply_step(s2), lambda: zfunc.vjp(s3, loss_fn, b),
            lambda: zfunc.full_params(s2), lambda: s2.params + 1, lambda: s2.params.sum(), lambda: torch.add(s3.compute, 1),
            lambda: float(s1.step), lambda: s2.opt.count, lambda: pickle.dumps(s1), lambda: copy.deepcopy(s2)]
    said = []
    for use in uses:
        try:
            use()
            said.append("no error")
        except RuntimeError as e:
            said.append(str(e))
    # the states returned train on, and their static fields stay readable on the donated ones
    s4 = zfunc.apply_step(s4)
    assert s4.step.item() == 2 and state.cfg.stage == stage
    return said


def test_a_donated_state_refuses_every_further_use():
    for stage in (0, 1, 2, 3):
        for rank, said in enumerate(run_ranks(_donated_reuse, 2, stage)):
            for message in said:
                assert "donated to" in message and "donate=True" in message, (stage, rank, message)



@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_from_a_hook_of_a_donating_backward_is_refused(stage):
    """A donating ``backward_step`` (``donate=True``) writes the state's gradient buffer as its
    backward goes: a step function on the same state from a gradient hook of that backward
    (at the second micro-batch, where it would read half-written gradients) is refused, naming
    the cause, and the donating call fails as a failed donating call does. From its ``loss_fn``
    (before the backward) a step, and a read, go through: the inner step's gradient is that of
    its own micro-batch."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    state = zfunc.init(model, zfunc.Config(stage=stage, grad_accum=2, optimizer=zfunc.sgd(lr=1.0)))
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    sq = lambda m, x: m(x).square().sum()  # noqa: E731
    state, _ = zfunc.backward_step(state, sq, x)
    box: dict[str, Any] = {}

    def hooked(what):
        def loss_fn(m, x):
            out = m(x)
            step = zfunc.apply_step if what == "apply_step" else lambda st: zfunc.backward_step(st, sq, x)
            out.register_hook(lambda g: (step(box["given"]), g)[1])
            return out.square().sum()
        return loss_fn

    for what in ("backward_step", "apply_step"):
        box["given"] = copy.deepcopy(state)
        with pytest.raises(RuntimeError, match=f"{what}: this state was given to backward_step"):
            zfunc.backward_step(box["given"], hooked(what), x, donate=True)

    def inside_loss(m, x):
        box["read"] = zfunc.full_params(box["given"])
        box["inner"] = zfunc.backward_step(box["given"], sq, 2 * x)[0]
        return sq(m, x)

    box["given"] = copy.deepcopy(state)
    outer, _ = zfunc.backward_step(box["given"], inside_loss, x, donate=True)
    alone = zfunc.backward_step(copy.deepcopy(state), sq, 2 * x)[0]
    assert torch.equal(box["inner"].grads, alone.grads)
    assert torch.equal(outer.grads, zfunc.backward_step(copy.deepcopy(state), sq, x)[0].grads)

def _memory(rank: int, stage: int) -> tuple[dict, int, int, dict, dict, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 31), torch.nn.Linear(31, 5))  # 1121 params
    cfg = zfunc.Config(stage=stage, persist_threshold=0, units=["0", "1"] if stage else None,
                       grad_accum=2)  # stage 1: full grads
    plan = zfunc.memory_plan(model, cfg, zfunc.comm.world().size)
    bf16 = cfg.replace(precision="bf16", master_dtype=torch.bfloat16, moment_dtype=torch.bfloat16)
    bf16_plan = zfunc.memory_plan(model, bf16, zfunc.comm.world().size)
    state = zfunc.init(model, cfg)
    loss_fn, x = (lambda m, x: m(x).sum()), torch.randn(2, 30)
    reports = [zfunc.memory_report(state)]  # at init, after a micro-batch, after the step
    state, _ = zfunc.backward_step(state, loss_fn, x)
    reports.append(zfunc.memory_report(state))
    state, _ = zfunc.backward_step(state, loss_fn, x)
    reports.append(zfunc.memory_report(zfunc.apply_step(state)))
    torch.manual_seed(0)
    low, _ = zfunc.backward_step(zfunc.init(torch.nn.Sequential(torch.nn.Linear(30, 31), torch.nn.Linear(31, 5)),
                                            bf16), loss_fn, x)
    return reports, state.layout.numel, state.layout.full_numel, plan, bf16_plan, zfunc.memory_report(low)


def test_memory_report_follows_the_zero_formula():
    for world in (1, 2, 3):
        for stage in (0, 1, 2, 3):
            for (at_init, rep, after), numel, padded, plan, bf16_plan, bf16_report in run_ranks(_memory, world, stage):
                assert rep == plan and bf16_plan == bf16_report  # the plan is what a step holds
                assert at_init == after == between_steps(plan)  # no gradient memory between steps
                assert numel == 1121
                units = 1 if stage < 3 else 2  # each unit is padded to a multiple of world * 4
                assert padded % (world * 4) == 0 and padded - numel < units * world * 4
                shard = padded // world
                # fp32: 4 bytes per element; params always full at stages 0-2 (master aliases it).
                params = 4 * (shard if stage == 3 else padded)
                grads = 4 * (padded if stage < 2 else shard)
                moments = 8 * (padded if stage == 0 else shard)
                total = params + grads + moments
                assert rep == {"params": params, "grads": grads, "optimizer": moments,
                               "total": total, "device": total, "host": 0}, (world, stage, rep)


class _Counting:
    """Stands in for torch.distributed inside zfunc.comm and counts collective calls."""

    def __init__(self, real):
        self.real, self.calls, self.inside = real, [], None

    def __getattr__(self, name):
        attr = getattr(self.real, name)
        if name in ("all_reduce", "reduce", "broadcast", "all_gather_object"):
            def counted(*a, **k):
                if self.inside is None:  # not a step of a flat collective counted already
                    self.calls.append(name)
                return attr(*a, **k)
            return counted
        return attr

    def flat(self, name, fn):
        """``fn`` (a flat collective, however built) counted as one ``name``."""
        def counted(*a, **k):
            if self.inside is not None:  # a step of a flat collective counted already
                return fn(*a, **k)
            self.calls.append(name)
            self.inside = name
            try:
                return fn(*a, **k)
            finally:
                self.inside = None
        return counted


def _collectives(rank: int, stage: int) -> tuple[list, list, list]:
    from zfunc import comm

    torch.manual_seed(0)
    state = zfunc.init(MODELS["zoo"][0](), zfunc.Config(stage=stage, grad_accum=2))
    counter = _Counting(comm.dist)
    flat = {"rs": comm._reduce_scatter_flat, "ag": comm._all_gather_flat, "rs_": comm.reduce_scatter_,
            "rs0": comm.reduce_scatter_start, "r": comm.reduce_}
    comm.dist = counter
    comm._reduce_scatter_flat = counter.flat("reduce_scatter", flat["rs"])
    comm.reduce_scatter_ = counter.flat("reduce_scatter", flat["rs_"])  # point-to-point on gloo
    comm.reduce_scatter_start = counter.flat("reduce_scatter", flat["rs0"])
    comm.reduce_ = counter.flat("reduce", flat["r"])
    comm._all_gather_flat = counter.flat("all_gather", flat["ag"])
    try:
        state, _ = zfunc.backward_step(state, zoo_loss, zoo_batch(0, rank, 2))
        first = list(counter.calls)
        counter.calls.clear()
        state, _ = zfunc.backward_step(state, zoo_loss, zoo_batch(1, rank, 2))
        second = list(counter.calls)
        counter.calls.clear()
        zfunc.apply_step(state)
        boundary = list(counter.calls)
    finally:
        comm.dist = counter.real
        comm._reduce_scatter_flat, comm._all_gather_flat = flat["rs"], flat["ag"]
        comm.reduce_scatter_, comm.reduce_scatter_start, comm.reduce_ = flat["rs_"], flat["rs0"], flat["r"]
    return first, second, boundary


def test_collectives_per_micro_step():
    expected = {  # (the first micro-step, the last, apply_step)
        # stages 0-1: the last micro-batch's backward reduces the accumulated gradient (one
        # bucket here: an all-reduce at stage 0, a reduce to each owner at stage 1)
        0: ([], ["all_reduce"], ["all_reduce"]),  # apply_step: loss and counts
        1: ([], ["reduce", "reduce"], ["all_reduce", "all_gather"]),
        # stage 2: every micro-batch reduces each bucket (one here) to each owner in backward
        2: (["reduce", "reduce"], ["reduce", "reduce"], ["all_reduce", "all_gather"]),
        # stage 3: each unit's gather, the units-agree check after forward, the reduce-scatter
        3: (["all_gather", "all_reduce", "reduce_scatter"], ["all_gather", "all_reduce", "reduce_scatter"],
            ["all_reduce"]),
    }
    for stage, (micro, last, boundary) in expected.items():
        for first, second, at_step in run_ranks(_collectives, 2, stage):
            assert first == micro and second == last, (stage, first, second)
            assert at_step == boundary, (stage, at_step)


def test_counters_and_metrics():
    torch.manual_seed(0)
    state = zfunc.init(torch.nn.Linear(3, 1), zfunc.Config(grad_accum=2, optimizer=zfunc.adamw(lr=0.5)))
    step = zfunc.train_step(lambda m, b: m(b).pow(2).mean())
    state = step(state, torch.ones(4, 3))
    assert state.step.item() == 1 and state.micro_step.item() == 0 and state.opt.count.item() == 1
    assert state.metrics.lr.item() == 0.5 and state.metrics.skipped.item() == 0
    assert state.grads.abs().sum().item() == 0
    for leaf in zfunc.tree.leaves(state.metrics):
        assert leaf.dim() == 0


def test_state_is_a_pytree_in_the_zfunc_namespace():
    state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=1))
    leaves, spec = zfunc.tree.flatten(state)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    again = zfunc.tree.unflatten(spec, [x.clone() for x in leaves])
    assert isinstance(again, zfunc.TrainState) and again.layout is state.layout
    doubled = zfunc.tree.map(lambda t: t * 2 if t.is_floating_point() else t, state)
    assert torch.equal(doubled.params, state.params * 2)
    assert state.replace(step=state.step + 5).step.item() == 5 and state.step.item() == 0


def _copies(rank: int, stage: int, how: str) -> tuple[bool, bool]:
    """A state copied (deepcopy, or pickle) after one step trains bit for bit as the
    original, with activation checkpointing, apart from it (stepping the copy leaves it as it was)."""
    import copy
    import pickle

    from tests.test_checkpointing import _model
    from tests.test_stage3 import _stack_loss

    units = ["blocks.0"] if stage == 3 else None
    cfg = zfunc.Config(stage=stage, grad_accum=2, clip=1.0, persist_threshold=0, units=units,
                       optimizer=zfunc.adamw(lr=1e-2))
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(4)]

    def step(state, bs):
        for b in bs:
            state, _ = zfunc.backward_step(state, _stack_loss, b)
        return zfunc.apply_step(state)

    state = step(zfunc.init(_model("nonreentrant"), cfg), batches[:2])
    kept = _snapshot(state)
    twin = copy.deepcopy(state) if how == "deepcopy" else pickle.loads(pickle.dumps(state))
    trained_twin = step(twin, batches[2:])
    untouched = _bitwise_equal(kept, _snapshot(state))
    trained = step(state, batches[2:])
    return untouched, _bitwise_equal(_snapshot(trained), _snapshot(trained_twin))


def test_a_copied_or_pickled_state_trains_like_the_original():
    for stage in (0, 1, 2, 3):
        for world, how in ((1, "deepcopy"), (2, "deepcopy"), (1, "pickle"), (2, "pickle")):
            for rank, (untouched, same) in enumerate(run_ranks(_copies, world, stage, how)):
                case = f"stage {stage} world {world} {how} rank {rank}"
                assert untouched, f"{case}: training the copy changed the original"
                assert same, f"{case}: the copy trains differently from the original"


def test_no_zfunc_hook_on_the_module_between_calls():
    """zfunc's hooks are on the module only while a call runs or its graph lives: the unit hooks
    from a call's start (none in a forward without units), the recompute hooks from the first module
    a backward through the call's outputs recomputes (activation checkpointing needs them there), all off once no call runs and no call's graph lives. Between calls none, while states
    live, at every stage; a graph kept unused keeps them until it is dropped. Reference counting
    alone takes them off: no cycle."""
    import gc

    from torch.nn.modules import module as torch_module

    def hooks(m: torch.nn.Module) -> int:  # and torch's global table's (none of the user's here)
        return sum(len(getattr(x, d)) for x in m.modules() for d in ("_forward_pre_hooks", "_forward_hooks")) + \
            len(torch_module._global_forward_pre_hooks) + len(torch_module._global_forward_hooks)

    gc.disable()
    try:
        for stage in (0, 1, 2, 3):
            model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
            cfg = zfunc.Config(stage=stage, units=["0"] if stage else None, persist_threshold=0)
            states = [zfunc.init(model, cfg) for _ in range(3)]
            seen: list[int] = []
            mine = model[1].register_forward_pre_hook(lambda m, a: seen.append(hooks(model) - 1))
            assert hooks(model) == 1, stage  # the user's own only
            later, _ = zfunc.backward_step(states[0], lambda m, x: m(x).sum(), torch.ones(2, 3))
            assert (seen[-1] > 0) == (stage > 0) and hooks(model) == 1, (stage, seen)  # off after the call
            later = zfunc.apply_step(later)
            kept = zfunc.core.backward.bind(later, zfunc.core.backward.sinks_into(later, later.grads))(torch.ones(1, 3))
            assert (hooks(model) > 1) == (stage > 0), stage  # a graph that may still be differentiated keeps them
            del kept
            assert hooks(model) == 1, stage
            mine.remove()
            del states, later
            assert hooks(model) == 0, stage
    finally:
        gc.enable()


def test_a_users_hook_under_any_id_stays_and_runs():
    """zfunc's call hooks go in under ids of their own, never one of torch's counter: a module
    unpickled in a process carries its user's hooks under the ids of the process that made them,
    where the counter may hand out the same ones (simulated here: the user's pre-hook under the
    id the counter gives next). The user's hook runs in every call and stays, at every stage."""
    from torch.utils.hooks import RemovableHandle

    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        ran: list[int] = []

        def doubled(m: nn.Module, args: tuple) -> tuple:
            ran.append(1)
            return (args[0] * 2,)

        key = RemovableHandle.next_id
        model[0]._forward_pre_hooks[key] = doubled
        ref = copy.deepcopy(model)
        state = zfunc.init(model, zfunc.Config(stage=stage, units=["0"] if stage else None, persist_threshold=0))
        x = torch.ones(2, 4)
        losses = []
        for _ in range(2):
            state, loss = zfunc.backward_step(state, lambda m, x: m(x).sum(), x)
            state = zfunc.apply_step(state)
            losses.append(loss)
        assert len(ran) == 2 and model[0]._forward_pre_hooks.get(key) is doubled, stage
        assert torch.allclose(losses[0], ref(x).sum()), stage  # the hook's doubling in it


def test_a_state_sharing_buffers_with_a_donated_one_is_refused_by_name():
    """``s, _ = backward_step(own, ...)`` shares ``own``'s weights and moments; donating ``s``
    empties them, so ``own`` is spent too: every use of it says so and names the donation,
    instead of failing on shapes or answering zeros (``memory_report``) and empty copies, at
    every stage."""
    import pickle

    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        own = zfunc.init(nn.Linear(3, 2), zfunc.Config(stage=stage))
        s, _ = zfunc.backward_step(own, lambda m, x: m(x).square().mean(), torch.ones(2, 3))
        zfunc.apply_step(s, donate=True)
        for use in (lambda: zfunc.backward_step(own, lambda m, x: m(x).sum(), torch.ones(2, 3)),
                    lambda: zfunc.full_params(own), lambda: zfunc.memory_report(own),
                    lambda: copy.deepcopy(own), lambda: pickle.dumps(own)):
            with pytest.raises(RuntimeError, match="shares its buffers with a state donated to apply_step"):
                use()


def test_a_tensor_kept_from_a_donated_state_never_reads_the_next_one():
    """Each way a user can keep one: a field, a leaf of zfunc.tree.leaves, full_params (stage 0)."""
    for stage in (0, 2):
        state = zfunc.init(nn.Linear(3, 2), zfunc.Config(stage=stage, optimizer=zfunc.adamw(lr=0.1)))
        state, _ = zfunc.backward_step(state, lambda m, x: m(x).sum(), torch.ones(1, 3))
        params, leaves, full = state.params, zfunc.tree.leaves(state), zfunc.full_params(state)
        before = full["weight"].clone()
        new = zfunc.apply_step(state, donate=True)
        assert params.numel() == 0  # emptied: arithmetic with it fails on the shape
        with pytest.raises(RuntimeError):
            params + new.params
        assert all(t.numel() == 0 for t in leaves if t.untyped_storage().data_ptr() ==
                   new.params.untyped_storage().data_ptr())
        assert torch.equal(full["weight"], before)  # full_params gives tensors of its own
        assert not torch.equal(zfunc.full_params(new)["weight"], before)  # and the step did move


def _pooled(rank: int, stage: int) -> dict[str, Any]:
    """A model whose accumulator and buckets pass the pool's 1 MiB floor, trained donated and not."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(1024, 700), nn.Tanh(), nn.Linear(700, 3))

    cfg = zfunc.Config(stage=stage, grad_accum=2, bucket_mb=1, optimizer=zfunc.adamw(lr=1e-3))
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    batch = lambda k: torch.randn(4, 1024, generator=torch.Generator().manual_seed(10 * k + rank))  # noqa: E731
    plain, donated = zfunc.init(make(), cfg), zfunc.init(make(), cfg)
    out: dict[str, Any] = {"reused": [], "kept_emptied": [], "plain_kept": [], "held": []}
    for step in range(3):
        for k in range(2):
            plain, _ = zfunc.backward_step(plain, loss_fn, batch(2 * step + k))
            donated, _ = zfunc.backward_step(donated, loss_fn, batch(2 * step + k), donate=True)
        kept = donated.grads
        before = plain.grads.clone()
        held = plain.grads
        plain = zfunc.apply_step(plain)
        donated = zfunc.apply_step(donated, donate=True)
        out["kept_emptied"].append(kept.numel() == 0)  # a tensor kept from the donated state reads nothing
        out["plain_kept"].append(torch.equal(held, before))  # without donation the input stays as it was
        out["held"].append(donated.binding.pool.held_bytes() >= donated.grads.numel() * 4)
        pool = donated.binding.pool
        held = pool.held_bytes()
        probe, _ = zfunc.backward_step(donated, loss_fn, batch(99))  # its accumulator comes from the pool
        out["reused"].append(pool.held_bytes() <= held - probe.grads.numel() * 4)
    out["same"] = _bitwise_equal(_snapshot(plain), _snapshot(donated))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_donated_step_keeps_its_gradient_buffer_for_the_next(world):
    """On the CPU the accumulator of a state donated to apply_step (and the bucket staging
    buffers) go back to the binding's pool and the next step accumulates in them: no fresh pages
    each step. Training is bitwise the same as without donation, a tensor kept from the donated
    state is emptied, and a state not donated keeps its gradient."""
    for stage in (0, 1, 2):
        for r in run_ranks(_pooled, world, stage):
            assert all(r["reused"]), (stage, r)
            assert all(r["kept_emptied"]) and all(r["plain_kept"]), (stage, r)
            assert r["same"] and all(r["held"]), (stage, r)


def test_a_view_of_a_donated_gradient_never_reads_the_next_step():
    """A tensor over the donated accumulator that is not the state's own leaf (a view the caller
    made) keeps that step's values: the pool takes the buffer back only when no such tensor is
    left; without a view it does."""
    for stage in (0, 2):
        torch.manual_seed(0)
        cfg = zfunc.Config(stage=stage, bucket_mb=1, optimizer=zfunc.adamw(lr=1e-3))
        state = zfunc.init(nn.Sequential(nn.Linear(1024, 700), nn.Tanh(), nn.Linear(700, 3)), cfg)
        loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
        state, _ = zfunc.backward_step(state, loss_fn, torch.randn(4, 1024), donate=True)
        view, values = state.grads.detach(), state.grads.clone()
        state = zfunc.apply_step(state, donate=True)
        state, _ = zfunc.backward_step(state, loss_fn, torch.randn(4, 1024), donate=True)
        assert torch.equal(view, values), stage
        assert view.untyped_storage().data_ptr() != state.grads.untyped_storage().data_ptr()
        del view
        held = state.binding.pool.held_bytes()
        state = zfunc.apply_step(state, donate=True)
        assert state.binding.pool.held_bytes() > held, stage  # no view now: kept for the next step


def test_replace_checks_each_tensor_against_its_field():
    from tests.test_binding import BNNet

    state = zfunc.init(BNNet(), zfunc.Config(stage=1))
    other = zfunc.init(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(11)), zfunc.Config(stage=1))
    name = next(n for n in state.buffers if n.endswith("running_mean"))
    wrong = {**state.buffers, name: other.buffers["1.running_mean"]}
    with pytest.raises(ValueError, match=r"replace: buffers \(leaf \d+\) has shape \[11\], float32 on cpu; this "
                                         r"state's layout needs \[\d+\]"):
        state.replace(buffers=wrong)
    with pytest.raises(ValueError, match=r"replace: params has shape"):
        state.replace(params=torch.zeros(state.params.numel() + 4))
    with pytest.raises(ValueError, match=r"replace: compute .* bfloat16"):
        state.replace(compute=state.compute.bfloat16())
    assert state.replace(params=state.params.clone()).params.shape == state.params.shape


def _value_like(rank: int, stage: int, shard_size: int | None) -> dict[str, bool]:
    """The static part of a state is the same value across a copy, the micro-batches of a step
    and the step itself, so ``zfunc.tree.map`` combines any two (an EMA of two states)."""
    import copy

    units = ["a", "out"] if stage == 3 else None
    cfg = zfunc.Config(stage=stage, grad_accum=2, units=units, persist_threshold=0, shard_size=shard_size,
                       optimizer=zfunc.adamw(lr=0.1))
    torch.manual_seed(0)
    model = MODELS["zoo"][0]()
    state = zfunc.init(model, cfg)
    twin = copy.deepcopy(state)
    first, _ = zfunc.backward_step(state, zoo_loss, zoo_batch(0, rank, 2))
    last, _ = zfunc.backward_step(first, zoo_loss, zoo_batch(1, rank, 2))  # reduces at stages 0-1 (Fold)
    after = zfunc.apply_step(last)
    states = [state, twin, first, last, after]
    _, spec = zfunc.tree.flatten(state)
    same_spec = all(zfunc.tree.flatten(s)[1] == spec for s in states)
    mapped = all(zfunc.tree.map(lambda a, b: b, state, s).step is s.step for s in states)
    ema = zfunc.tree.map(lambda a, b: (a + b) / 2 if a.is_floating_point() and a.shape == b.shape else a, state, after)
    return {"same_spec": same_spec, "mapped": mapped,
            "ema": torch.equal(ema.params, (state.params + after.params) / 2),
            "module_shared": twin.module is model and twin.binding is state.binding,
            "tensors_own": twin.params.data_ptr() != state.params.data_ptr(),
            "reduced_leaf": ("reduced",) in set(zfunc.tree.paths(state))}


def test_tree_map_works_across_copies_micro_batches_and_steps():
    for world, shard_size in ((1, None), (2, None), (2, 1)):
        for stage in (0, 1, 2, 3) if shard_size is None else (1, 2, 3):
            for rank, checks in enumerate(run_ranks(_value_like, world, stage, shard_size)):
                failed = [k for k, ok in checks.items() if not ok]
                assert not failed, f"stage {stage} world {world} shard_size {shard_size} rank {rank}: {failed}"


def _ema_forward(rank: int, stage: int, how: str) -> tuple[float, bool]:
    """Three steps at stages 1-2 with ``Config.units`` (each step leaves the other ranks' slices
    of ``compute`` to the next forward), an EMA of the states after each, made with
    ``zfunc.tree.map``, ``map_`` (in place) or ``map_with_path``, keeping the EMA's own
    non-float leaves (its ``gathered`` flag among them); then a forward on the EMA against plain
    torch on ``zfunc.full_params(ema)``: how far apart, and the EMA's flag."""
    make, loss_fn, batch_fn = MODELS["zoo"]
    torch.manual_seed(0)
    state = zfunc.init(make(), zfunc.Config(stage=stage, units=["a", "out"], optimizer=zfunc.adamw(lr=5e-2)))
    ema = zfunc.tree.map(torch.clone, state)

    def mix(e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return e.lerp(x, 0.5) if e.is_floating_point() and e.shape == x.shape else e

    for i in range(3):
        state = zfunc.apply_step(zfunc.backward_step(state, loss_fn, batch_fn(i, rank, 4))[0])
        if how == "map":
            ema = zfunc.tree.map(mix, ema, state)
        elif how == "map_with_path":
            ema = zfunc.tree.map_with_path(lambda path, e, x: mix(e, x), ema, state)
        else:
            zfunc.tree.map_(lambda e, x: e.lerp_(x, 0.5) if e.is_floating_point() and e.shape == x.shape else None,
                            ema, state)
    batch = batch_fn(9, 0, 4)
    out, _ = zfunc.vjp(ema, lambda m, b: m(b["x"], b["side"]), batch)
    ref = make()
    ref.load_state_dict({**zfunc.full_params(ema), **ema.frozen}, strict=False)  # (b.weight is a.weight)
    return (out - ref(batch["x"], batch["side"])).abs().max().item(), bool(ema.gathered)


def test_an_ema_of_states_runs_on_its_own_weights():
    """At stages 1-2 with units a step leaves the other ranks' slices of ``compute`` to the next
    forward (``gathered`` False). An EMA made with zfunc.tree's map functions by a function that
    keeps its own non-float leaves is not gathered either (`TrainState.combined`): its next
    forward gathers the EMA's own slices, and computes what plain torch does on its weights, on
    every rank."""
    for world in (2, 3):
        for stage in (1, 2):
            for how in ("map", "map_", "map_with_path"):
                for rank, (gap, gathered) in enumerate(run_ranks(_ema_forward, world, stage, how)):
                    assert not gathered, (world, stage, how, rank)
                    assert gap <= 1e-6, (world, stage, how, rank, gap)


def test_an_in_place_map_updates_memory_two_leaves_share_once():
    """At fp32 a state's ``params`` is its ``compute`` (or this rank's slice of it):
    ``zfunc.tree.map_`` (and its path form) runs the function on ``compute`` and then on
    ``params`` only if that wrote nothing, so an in-place EMA of a deep copy is the EMA (not the
    update applied twice), and a function that picks ``params`` by its path still updates it, at
    every stage. Other trees are mapped as optree maps them (a tensor given twice, twice)."""
    def lerp_(e: torch.Tensor, x: torch.Tensor) -> None:  # (a released gradient buffer is an expanded zero)
        if e.is_floating_point() and e.shape == x.shape and 0 not in e.stride():
            e.lerp_(x, 0.5)

    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        s0 = zfunc.init(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
                        zfunc.Config(stage=stage, optimizer=zfunc.adamw(lr=0.1)))
        s1 = zfunc.apply_step(zfunc.backward_step(s0, lambda m, x: m(x).square().mean(), torch.randn(2, 3))[0])
        old, new = zfunc.full_params(s0), zfunc.full_params(s1)
        for how in ("map_", "map_with_path_"):
            ema = copy.deepcopy(s0)
            assert ema.params.untyped_storage().data_ptr() == ema.compute.untyped_storage().data_ptr()
            if how == "map_":
                zfunc.tree.map_(lerp_, ema, s1)
            else:
                zfunc.tree.map_with_path_(lambda path, e, x: lerp_(e, x), ema, s1)
            got = zfunc.full_params(ema)
            assert all(torch.allclose(got[k], torch.lerp(old[k], new[k], 0.5)) for k in old), (stage, how)
        for field in ("params", "compute"):  # a function that picks one of the two by its path
            ema = copy.deepcopy(s0)
            zfunc.tree.map_with_path_(lambda path, e: e.add_(1.0) if path == (field,) else None, ema)
            got = zfunc.full_params(ema)
            assert all(torch.allclose(got[k], old[k] + 1.0) for k in old), (stage, field)
    base = torch.zeros(4)
    zfunc.tree.map_(lambda t: t.add_(1), {"a": base[1:3], "b": base, "c": base})
    assert base.tolist() == [2.0, 3.0, 3.0, 2.0]  # optree's: each leaf once, whatever it shares


def _pickled(rank: int, stage: int) -> dict[str, Any]:
    """Each rank pickles its state; the pickle carries the module as code (meta tensors) and the
    groups by ranks; unpickled on its rank it is equal in structure, on another rank refused."""
    import pickle

    import torch.distributed as dist

    units = ["a", "out"] if stage == 3 else None
    torch.manual_seed(0)
    state = zfunc.init(MODELS["zoo"][0](), zfunc.Config(stage=stage, units=units, persist_threshold=0))
    blob = pickle.dumps(state)
    leaf_bytes = sum(t.untyped_storage().nbytes() for t in zfunc.tree.leaves(state))
    back = pickle.loads(blob)
    blobs = [None] * dist.get_world_size()
    dist.all_gather_object(blobs, blob)
    try:
        pickle.loads(blobs[1 - rank])
        other = ""
    except RuntimeError as e:
        other = str(e)
    refused = ""
    try:
        back.module(torch.ones(1, 5), torch.tensor(False))
    except RuntimeError as e:
        refused = str(e)
    return {"meta": all(t.is_meta for t in back.module.parameters()) and all(t.is_meta for t in back.module.buffers()),
            "size": len(blob) - leaf_bytes, "mesh": back.mesh == state.mesh and back.mesh is state.mesh,
            "other": other, "refused": refused}


def test_pickle_at_world_2_carries_no_weights_and_resolves_the_ranks():
    for stage in (0, 1, 2, 3):
        for rank, out in enumerate(run_ranks(_pickled, 2, stage)):
            case = f"stage {stage} rank {rank}"
            assert out["meta"], f"{case}: the unpickled module holds weights"
            assert out["size"] < 64_000, f"{case}: the pickle carries {out['size']} bytes beyond the state's tensors"
            assert out["mesh"], f"{case}: the unpickled state talks over other groups"
            assert f"sharded over global ranks [0, 1] (its rank {1 - rank}" in out["other"], (case, out["other"])
            assert "zfunc.load to reshard" in out["other"], (case, out["other"])
            assert "came with an unpickled state" in out["refused"], (case, out["refused"])


def test_a_state_pickled_in_a_world_unpickles_nowhere_else():
    import pickle

    blob = run_ranks(_pickle_blob, 2)[0]
    with pytest.raises(RuntimeError, match=r"sharded over global ranks \[0, 1\].*a process with no process group"):
        pickle.loads(blob)


def _pickle_blob(rank: int) -> bytes:
    import pickle

    return pickle.dumps(zfunc.init(nn.Linear(3, 2), zfunc.Config(stage=2)))


def _lr_floor(step: Any, lr: float) -> torch.Tensor:
    return torch.as_tensor(lr, dtype=torch.float64)


def _only_matrices(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2


def test_a_state_with_schedules_and_groups_pickles_and_maps_over_its_copy():
    """Config is a value: zfunc.schedules' schedules, a DeepSpeed scheduler and functools.partial
    or module-level functions pickle with the state (the schedule still gives the same rates), a
    deepcopy shares the Config (``tree.map`` over a state and its copy works) and ``copy.copy``
    of it is equal."""
    import functools
    import pickle

    from zfunc.schedules import warmup_cosine_lr, warmup_decay_lr, warmup_lr

    ds = {"train_batch_size": 8, "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3, "total_num_steps": 9}}}
    configs = [zfunc.Config(stage=1, lr_schedule=warmup_lr(0.0, 1e-2, 4, "linear")),
               zfunc.Config(stage=1, lr_schedule=warmup_decay_lr(8, 0.0, 1e-2, 3)),
               zfunc.Config(stage=1, lr_schedule=warmup_cosine_lr(8, 1e-2, warmup_num_steps=2)),
               zfunc.Config.from_deepspeed(ds),
               zfunc.Config(stage=1, lr_schedule=functools.partial(_lr_floor, lr=1e-2),
                            param_groups=[zfunc.ParamGroup(_only_matrices, weight_decay=0.0)])]
    for cfg in configs:
        state = zfunc.init(nn.Linear(3, 2), cfg)
        back = pickle.loads(pickle.dumps(state))
        assert [back.cfg.lr_schedule(i).item() for i in range(10)] == [cfg.lr_schedule(i).item() for i in range(10)]
        twin = copy.deepcopy(state)
        assert twin.cfg is state.cfg
        zfunc.tree.map(lambda a, b: a, state, twin)  # one structure
        assert copy.copy(cfg) == cfg


def test_a_pickled_state_holds_its_master_weights_once():
    """In fp32 at stages 1-2 ``params`` (this rank's master slice) views ``compute``: the
    unpickled state keeps it a view (torch pickles each tensor's storage apart, so the state says
    where in ``compute``), trains the same, and its memory report is the original's."""
    import pickle

    make, loss_fn, batch_fn = MODELS["zoo"]
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        state = zfunc.init(make(), zfunc.Config(stage=stage, optimizer=zfunc.adamw(lr=0.1)))
        back = pickle.loads(pickle.dumps(state))
        shares = back.params.untyped_storage().data_ptr() == back.compute.untyped_storage().data_ptr()
        assert shares == (state.params.untyped_storage().data_ptr() == state.compute.untyped_storage().data_ptr()), stage
        assert zfunc.memory_report(back) == zfunc.memory_report(state), stage
        a, b = (zfunc.apply_step(zfunc.backward_step(s, loss_fn, batch_fn(0, 0, 4))[0]) for s in (state, back))
        assert _bitwise_equal(_snapshot(a), _snapshot(b)), stage


def test_tree_map_settles_each_state_it_makes_from_the_states_at_its_place():
    """`TrainState.combined` per place: states nested in tuples and dicts, several at once, a later
    tree deeper than the first elsewhere (optree allows it), the user's ``is_leaf``, and ``map_``
    in place; a map over trees without states returns optree's result."""
    s = zfunc.init(nn.Linear(3, 2), zfunc.Config(stage=1))
    stale = s.replace(gathered=torch.tensor(False))

    def mix(a: Any, b: Any) -> Any:
        return a.lerp(b, 0.5) if isinstance(a, torch.Tensor) and a.is_floating_point() else a

    def flags(*states: Any) -> list[bool]:
        return [bool(x.gathered) for x in states]

    assert flags(zfunc.tree.map(mix, (s, torch.ones(1)), (stale, torch.ones(1)))[0]) == [False]
    assert flags(*zfunc.tree.map(mix, {"a": s, "b": s}, {"a": s, "b": stale}).values()) == [True, False]
    deeper = zfunc.tree.map(lambda a, b: a, (torch.ones(2), s, stale, s), ({"u": 1, "v": 2}, s, s, stale))
    assert flags(*deeper[1:]) == [True, False, False]
    whole = zfunc.tree.map(lambda a, b: zfunc.tree.map(mix, a, b), s, stale, is_leaf=lambda x: isinstance(x, type(s)))
    assert flags(whole) == [False]
    ema = zfunc.tree.map(torch.clone, s)
    zfunc.tree.map_(lambda e, x: e.lerp_(x, 0.5) if e.is_floating_point() else None, ema, stale)
    assert flags(ema, s) == [False, True]
    plain = {"w": torch.ones(2)}
    assert torch.equal(zfunc.tree.map(torch.add, plain, plain)["w"], torch.full((2,), 2.0))
