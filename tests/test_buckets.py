"""Stage 2's bucketed gradient reduction during backward (`zfunc.autograd.buckets`).

Tiny ``bucket_mb`` cuts the fixtures into many buckets, so every path runs with several: parity
with single-process torch at worlds 1-3 (a parameter unused on some ranks, a tied weight, odd
sizes, grad_accum 4), a model called twice in one loss, a pullback run twice, and the engine's
plain ``loss.backward()``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zfunc
from tests.helpers import MODELS, max_param_diff, reference_run, run_ranks, split, zfunc_run
from zfunc.autograd.buckets import Bucket, plan_buckets

TOL = 2e-6
SMALL = 0.0002  # MiB: about 50 fp32 elements per bucket


def _cfg(grad_accum: int = 4, bucket_mb: float = SMALL) -> zfunc.Config:
    return zfunc.Config(stage=2, grad_accum=grad_accum, clip=1.0, bucket_mb=bucket_mb,
                        optimizer=zfunc.adamw(lr=1e-2, weight_decay=0.01))


def _parity(rank: int, name: str) -> tuple[float, list, list, int]:
    world = zfunc.comm.world().size
    state, norms = zfunc_run(rank, name, 6, _cfg())
    ref, ref_norms = reference_run(name, world, 6, grad_accum=4, clip=1.0)
    return max_param_diff(state, ref), norms, ref_norms, len(state.binding.buckets(state))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["zoo", "gpt"])
def test_bucketed_stage2_matches_single_process_adamw(name, world):
    for diff, norms, ref_norms, buckets in run_ranks(_parity, world, name):
        assert buckets >= 5, buckets  # many buckets, so the bucketed path is the one tested
        assert diff <= TOL, diff
        assert norms == pytest.approx(ref_norms, rel=1e-5)


def test_buckets_cover_the_buffer_and_its_owners():
    from zfunc.core.create import trainable_params, units_of
    from zfunc.distributed.layout import make_layout

    model = MODELS["gpt"][0]()
    cfg = zfunc.Config(stage=2)
    units, names = units_of(model, cfg, trainable_params(model, cfg))
    for world in (1, 2, 3):
        lay = make_layout(units, world=world, rank=0, align=4, names=names)
        (unit,) = lay.units
        buckets = plan_buckets(lay, 60)
        spans = sorted((b.start, b.stop) for b in buckets)
        assert spans[0][0] == 0 and spans[-1][1] == unit.padded
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # back to back, no gap
        for b in buckets:
            assert sum(stop - start for _, start, stop in b.pieces) == b.stop - b.start
            for owner, start, stop in b.pieces:  # each piece inside its owner's shard
                assert owner * unit.shard <= start < stop <= (owner + 1) * unit.shard


def _twice_in_one_loss(rank: int, bucket_mb: float) -> list[float]:
    """A loss of two calls of the model (two bucket reducers in one backward)."""
    make, loss_fn, batch_fn = MODELS["gpt"]
    torch.manual_seed(0)
    state = zfunc.init(make(), _cfg(1, bucket_mb))
    for i in range(3):
        a, b = split(batch_fn(i, rank, 4), 2)
        state, _ = zfunc.backward_step(state, lambda m, batch: loss_fn(m, a) + loss_fn(m, b), None)
        state = zfunc.apply_step(state)
    return torch.cat([p.flatten() for p in zfunc.full_params(state).values()]).tolist()


def test_model_called_twice_in_one_loss():
    bucketed = run_ranks(_twice_in_one_loss, 2, SMALL)
    whole = run_ranks(_twice_in_one_loss, 2, 100.0)  # one bucket: the one-piece reduce-scatter
    assert bucketed[0] == pytest.approx(whole[0], abs=1e-6)


def _pullback_twice(rank: int) -> tuple[list, list]:
    make, loss_fn, batch_fn = MODELS["gpt"]
    torch.manual_seed(0)
    state = zfunc.init(make(), _cfg(2))
    batch = batch_fn(0, rank, 2)
    out, pullback = zfunc.vjp(state, lambda m: loss_fn(m, batch))
    first = pullback(torch.ones(()), retain_graph=True)
    second = pullback(torch.ones(()))
    once, _ = zfunc.backward_step(state, loss_fn, batch)
    return [first.grads, second.grads], once.grads


def test_a_pullback_run_twice_gives_the_same_gradient():
    for (first, second), once in run_ranks(_pullback_twice, 2):
        assert torch.equal(first, once) and torch.equal(second, once)


def _engine(rank: int) -> list[float]:
    make, loss_fn, batch_fn = MODELS["gpt"]
    torch.manual_seed(0)
    cfg = zfunc.Config.from_deepspeed({
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2}})
    engine, *_ = zfunc.initialize(model=make(), config=cfg.replace(bucket_mb=SMALL))
    losses = []
    for _ in range(3):
        loss = loss_fn(engine, batch_fn(0, rank, 2))  # one batch: the loss must fall
        loss.backward()  # plain torch backward: the step must see it arrive
        engine.step()
        losses.append(loss.item())
    return losses


def test_engine_plain_backward_with_buckets():
    for losses in run_ranks(_engine, 2):
        assert losses[2] < losses[1] < losses[0], losses


def _different_buckets(rank: int) -> str:
    try:
        zfunc.init(MODELS["zoo"][0](), _cfg(1, SMALL if rank == 0 else 25.0))
    except zfunc.ConfigError as e:
        return str(e)
    return "no error"


def test_bucket_size_must_agree_across_ranks():
    # Different bucket plans would pair different collectives across ranks: refused at init.
    for message in run_ranks(_different_buckets, 2):
        assert message.startswith("bucket_mb: differs across ranks"), message


class _WithEmpty(torch.nn.Module):
    """A parameter of no elements between two others: it shares its flat offset with the next."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 7)
        self.empty = torch.nn.Parameter(torch.zeros(0))
        self.b = torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.empty.sum()


def _empty_param(rank: int) -> float:
    world = zfunc.comm.world().size
    torch.manual_seed(0)
    model = _WithEmpty()
    ref = copy.deepcopy(model)
    state = zfunc.init(model, _cfg(1))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for i in range(3):
        xs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * i + r)) for r in range(world)]
        state, _ = zfunc.backward_step(state, lambda m, x: m(x).pow(2).mean(), xs[rank])
        state = zfunc.apply_step(state)
        opt.zero_grad()
        sum(ref(x).pow(2).mean() / world for x in xs).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    full = zfunc.full_params(state)
    return max((full[n] - p).abs().max().item() for n, p in ref.named_parameters() if p.numel())


def test_a_parameter_of_no_elements_in_a_bucket():
    for diff in run_ranks(_empty_param, 2):
        assert diff <= TOL, diff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [1.0, 0.125, 1 / 3])
def test_a_bucket_added_at_once_sums_as_one_by_one(factor, dtype):
    """The local accumulator's batched add (`_AddLocal.many`) gives, bit for bit, what adding each
    gradient on its own gives: keys out of order, gaps (a parameter not reached), a transposed
    gradient, a bfloat16 one large enough for the widening kernel, empty parameters (one at the
    offset of the next parameter, listed after it; one at the end of a run), small gradients back
    to back (added as one run, `zfunc.autograd.buckets.runs`), a large one between two runs; an
    fp32 and a bf16 accumulator (whose adds round the same only one by one), a factor that is not
    a power of two."""
    import types

    from zfunc.autograd.local import _AddLocal

    gen = torch.Generator().manual_seed(0)
    pairs = [(5064, torch.randn(2, 2, generator=gen)), (22, torch.randn(7, generator=gen)),
             (22, torch.empty(0)),  # an empty parameter shares the offset of the one before it in keys
             (0, torch.randn(3, 5, generator=gen)), (40, torch.randn(4, 6, generator=gen).t()),
             (15, None), (29, torch.empty(0)), (29, torch.randn(11, generator=gen)),  # a run: 22..29, 29..40
             (64, torch.randn(5000, generator=gen).bfloat16()), (5068, torch.empty(0, 3)),
             (25071, torch.randn(2, 2, generator=gen)), (5068, torch.randn(20000, generator=gen)),  # large
             (25068, torch.randn(3, generator=gen))]  # a run after the large one: 25068..25071, 25071..25075
    end = 25075
    for n in (7, 13, 30, 5, 21):  # a longer run: in one add, parts of it fall in the vectorised body
        pairs.append((end, torch.randn(n, generator=gen)))
        end += n
    if dtype != torch.float32:  # the accumulator's own dtype (the widening kernel's case aside)
        pairs = [(k, g if g is None or g.dtype != torch.float32 else g.to(dtype)) for k, g in pairs]
    keys = tuple(k for k, _ in pairs)
    avg = types.SimpleNamespace(factor=factor)
    sums = []
    for batched in (True, False):
        sink = torch.zeros(end, requires_grad=True, dtype=dtype)
        sink.grad = torch.randn(end, generator=torch.Generator().manual_seed(1)).to(dtype)
        add = _AddLocal(sink, avg)
        for _ in range(2):  # a second micro-batch adds onto the first
            if batched:
                add.many(keys, tuple(g for _, g in pairs))
            else:
                for k, g in pairs:
                    if g is not None:
                        add(k, g)
        sums.append(sink.grad)
    assert torch.equal(sums[0], sums[1])
    base = torch.randn(end, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(sums[0][15:22], base[15:22])  # the gap (nothing reached it) keeps its values
    assert not torch.equal(sums[0], base)


def _reducer(buckets, keyed, sink_size, shard, fold, factor, rank):
    """A `_Reducer` over ``buckets`` without a world: its reduces are not started (`_advance` is
    left out), so what it put in place can be read."""
    import types

    from zfunc.autograd.buckets import Fold, TapPlan, _Reducer

    plan = TapPlan.of(keyed)
    r = object.__new__(_Reducer)
    r.buckets, r.slots, r.keys = tuple(buckets), plan.flat, plan.keys
    r.avg, r.dtype = types.SimpleNamespace(factor=factor), torch.float32
    r.fold = Fold(len(buckets)) if fold else None
    r.shard = 0 if fold else shard
    r.sink = torch.zeros(sink_size, requires_grad=True)
    r.sink.grad = torch.randn(sink_size, generator=torch.Generator().manual_seed(1))
    r.group = types.SimpleNamespace(rank=rank)
    r.pool = types.SimpleNamespace(take=lambda n, dt, dev: torch.full((n,), float("nan"), dtype=dt))
    r.state = types.SimpleNamespace(layout=types.SimpleNamespace(units=[types.SimpleNamespace(shard=shard)]),
                                    device=torch.device("cpu"))
    r.recomputed = None
    r._reset()
    r._advance = lambda: None
    return r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bucket_put_in_place_at_once_is_one_by_ones(dtype):
    """The bucket reducer's batched placing (`_Reducer.many`, runs of small gradients back to
    back as one) leaves the accumulator, the staging buffers and the bookkeeping as placing each
    gradient on its own does, bit for bit: random layouts of two buckets over three owners (empty
    parameters, gaps, large ones, transposed gradients, ones not reached), one to three calls (a
    gradient arriving again adds), at the boundary and reduce-scattered, a factor of 1/3, fp32
    gradients and bf16 ones (widened as they are placed)."""
    import itertools
    import random

    from zfunc.autograd.buckets import SMALL
    from zfunc.distributed.layout import Slot

    for trial in range(60):
        rng = random.Random(trial)
        gen = torch.Generator().manual_seed(trial)
        slots, off = [], 0
        for i in range(rng.randint(3, 25)):
            n = rng.choice([0, 1, 3, 7, 50, 300, 2000, SMALL, SMALL + 1])
            shape = rng.choice([(0,), (0, 3)]) if n == 0 else (n // 50, 50) if n % 50 == 0 and rng.random() < 0.4 else (n,)
            slots.append(Slot(f"p{i}", shape, off))
            off += n + (rng.choice([0, 0, 1, 3]) if n else 0)
        shard = -(-(off + 5) // 3)
        cut = rng.randint(1, len(slots) - 1)
        groups = [slots[:cut], slots[cut:]]
        buckets = []
        for g, nxt in zip(groups, [slots[cut].offset, 3 * shard]):
            start = g[0].offset
            pieces = tuple((r, max(start, r * shard), min(nxt, (r + 1) * shard)) for r in range(3)
                           if max(start, r * shard) < min(nxt, (r + 1) * shard))
            buckets.append(Bucket(start, nxt, tuple(g), pieces))
        count = itertools.count()
        keyed = [[(next(count), s) for s in b.slots] for b in buckets]
        calls = []
        for _ in range(rng.randint(1, 3)):
            keys = rng.sample(range(len(slots)), rng.randint(1, len(slots)))
            grads = []
            for k in keys:
                shape = slots[k].shape
                if rng.random() < 0.15:
                    grads.append(None)
                elif len(shape) == 2 and shape[0] > 1 and rng.random() < 0.5:
                    grads.append(torch.randn(shape[::-1], generator=gen).to(dtype).t())
                else:
                    grads.append(torch.randn(shape, generator=gen).to(dtype))
            calls.append((tuple(keys), tuple(grads)))
        fold, rank = rng.random() < 0.5, rng.randint(0, 2)
        seen = []
        for batched in (True, False):
            r = _reducer(buckets, keyed, 3 * shard if fold else shard, shard, fold, 1 / 3, rank)
            for keys, grads in calls:
                if batched:
                    r.many(keys, grads)
                else:
                    for k, g in zip(keys, grads):
                        if g is not None:
                            r._put(k, g)
            seen.append((r.sink.grad, [None if t is None else t.nan_to_num(7.0) for t in r.staged],
                         r.missing, r.complete))
        (acc, staged, missing, complete), (acc1, staged1, missing1, complete1) = seen
        assert torch.equal(acc, acc1), trial
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(staged, staged1)), trial
        assert (missing, complete) == (missing1, complete1), trial


@pytest.mark.parametrize("limit", [0, 20, 10**6])
def test_recomputed_leaves_collect_what_their_backwards_gave(limit):
    """On the local accumulator's path a recomputed forward's parameters are leaves
    (`zfunc.autograd.rebind.Rebind`): separate backwards (a reentrant checkpoint's segments) accumulate into them
    in torch's engine, one parameter in two of them, and `collect` adds it all, times the factor,
    into the accumulator: when more than ``limit`` elements were handed out since the last
    collect, and at the end. Under the limit nothing is added before the end."""
    import types

    from zfunc.autograd.buckets import TapPlan
    from zfunc.autograd.rebind import Rebind
    from zfunc.autograd.local import _AddLocal
    from zfunc.distributed.layout import Slot

    gen = torch.Generator().manual_seed(0)
    slots = [Slot("a", (3, 4), 0), Slot("b", (28,), 12), Slot("c", (7,), 40)]
    plan = TapPlan.of([[(s.offset, s) for s in slots]])
    compute = torch.randn(48, generator=gen)
    sink = torch.zeros(48, requires_grad=True)
    sink.grad = torch.randn(48, generator=gen)
    expected = sink.grad.clone().double()
    rb = Rebind(compute, plan, _AddLocal(sink, types.SimpleNamespace(factor=0.5)).many, limit)
    before = sink.grad.clone()
    for names in (["a", "c"], ["b"], ["a"]):  # three segments, "a" in two of them
        views = rb.views(names)
        weights = {n: torch.randn(views[n].shape, generator=gen) for n in names}
        sum((views[n] * weights[n]).sum() for n in names).backward()
        for n in names:
            s = next(s for s in slots if s.name == n)
            expected[s.offset:s.offset + s.numel] += 0.5 * weights[n].double().reshape(-1)
    if limit == 10**6:
        assert torch.equal(sink.grad, before)  # under the limit: all of it waits for the collect
    else:
        assert not torch.equal(sink.grad, before)
    rb.collect()
    assert torch.allclose(sink.grad.double(), expected, atol=1e-6, rtol=0)
    assert all(v.grad is None for v in rb._made[-1].values())  # nothing collected twice
    rb.collect()
    assert torch.allclose(sink.grad.double(), expected, atol=1e-6, rtol=0)
