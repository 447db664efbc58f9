"""Faults and bad input: checkpoint paths that never lose data, damaged checkpoints, buffers equal
across ranks, fp16 scales that cannot overflow themselves, numbers checked at the door, and
failures that are bounded and explained."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from torch import nn

import zfunc
from tests.helpers import MODELS, bitwise_equal, run_ranks, snapshot
from tests.test_binding import BNNet, bn_batch, bn_loss
from zfunc.tools.launch import WorldError


def _state(seed: int = 0, stage: int = 2) -> zfunc.TrainState:
    torch.manual_seed(seed)
    return zfunc.init(BNNet(), zfunc.Config(stage=stage, persist_threshold=0, optimizer=zfunc.adamw(lr=1e-2)))


def _trained(steps: int, stage: int = 2) -> zfunc.TrainState:
    state = _state(stage=stage)
    for i in range(steps):
        state, _ = zfunc.backward_step(state, bn_loss, bn_batch(0, i))
        state = zfunc.apply_step(state)
    return state


# -- checkpoint paths ------------------------------------------------------------------------

def test_save_refuses_what_is_not_a_zfunc_checkpoint(tmp_path):
    user = tmp_path / "run"
    user.mkdir()
    (user / "metrics.jsonl").write_text("{}\n")
    (user / "model_final.pt").write_bytes(b"weights")
    note = tmp_path / "notes.txt"
    note.write_text("keep me")
    state = _trained(1)
    for target in (user, note):
        with pytest.raises(zfunc.CheckpointError, match="save refuses|not a zfunc checkpoint"):
            zfunc.save(state, str(target))
    assert sorted(os.listdir(user)) == ["metrics.jsonl", "model_final.pt"] and note.read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "run"]  # no temporary directory left
    empty = tmp_path / "empty"
    empty.mkdir()
    zfunc.save(state, str(empty))  # an empty directory is fine
    zfunc.save(state, str(empty))  # and so is overwriting a zfunc checkpoint
    assert torch.equal(zfunc.load(str(empty), like=state).params, state.params)


def test_a_save_over_a_checkpoint_keeps_the_users_files(tmp_path):
    path = tmp_path / "ckpt"
    first, second = _trained(1), _trained(2)
    zfunc.save(first, str(path))
    (path / "tokenizer.json").write_text('{"vocab": 7}')
    (path / "assets").mkdir()
    (path / "assets" / "notes.txt").write_text("keep me")
    zfunc.save(second, str(path))  # replaces the checkpoint; the user's files go on with it
    assert (path / "tokenizer.json").read_text() == '{"vocab": 7}'
    assert (path / "assets" / "notes.txt").read_text() == "keep me"
    assert torch.equal(zfunc.load(str(path), like=first).params, second.params)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the old checkpoint's own files are gone
    # A save's leftovers are tidied only when they hold nothing else: one holding a file of the
    # user's (say, a crash after the moves) is kept whole, one holding only ours is removed
    mixed, plain = tmp_path / "ckpt.old-crashed", tmp_path / "ckpt.tmp-crashed"
    for d, names in ((mixed, ("meta.json", "__0_0.distcp", "mine.txt")), (plain, ("meta.json", "__0_0.distcp"))):
        d.mkdir()
        for name in names:
            (d / name).write_text("x")
    zfunc.save(first, str(path))
    assert sorted(os.listdir(mixed)) == ["__0_0.distcp", "meta.json", "mine.txt"] and not plain.exists()
    assert (path / "tokenizer.json").exists()
    zfunc.io.commit.discard(str(mixed))  # and discard itself leaves what a save did not write
    assert os.listdir(mixed) == ["mine.txt"]


def test_a_failed_save_leaves_nothing_behind(tmp_path):
    state = _trained(1)
    path = str(tmp_path / "ckpt")
    zfunc.save(state, path)
    later = _trained(2)
    with pytest.raises(zfunc.CheckpointError, match="extra cannot be stored"):
        zfunc.save(later, path, extra={"f": lambda: 0})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert torch.equal(zfunc.load(path, like=state).params, state.params)  # still the first one


def test_engine_tags_cannot_reach_outside_their_directory(tmp_path):
    (tmp_path / "global_step0").mkdir()
    (tmp_path / "user.txt").write_text("x")
    torch.manual_seed(0)
    engine, *_ = zfunc.initialize(model=nn.Linear(3, 1), config={"train_batch_size": 1})
    for tag in ("", ".", "..", "a/b", "latest"):
        with pytest.raises(ValueError, match="tag"):
            engine.save_checkpoint(str(tmp_path), tag=tag)
    assert sorted(os.listdir(tmp_path)) == ["global_step0", "user.txt"]
    with pytest.raises(zfunc.CheckpointError, match="not a zfunc checkpoint"):
        (tmp_path / "global_step0" / "mine").write_text("user data")
        engine.save_checkpoint(str(tmp_path))  # the default tag names the user's directory
    assert (tmp_path / "global_step0" / "mine").read_text() == "user data"


_CRASH_POINTS = ("write", "first_rename", "second_rename", "cleanup")


def _crash_during_save(rank: int, old: str, new: str, path: str, point: str) -> None:
    """Save the old state at ``path`` (and copies at ``old``/``new``), then die at ``point`` while
    saving the new state over it."""
    from zfunc.io import commit

    first, second = _trained(1), _trained(2)
    zfunc.save(first, old)
    zfunc.save(second, new)
    zfunc.save(first, path)
    calls = {"replace": 0}
    real_replace, real_discard, real_write = os.replace, commit.discard, zfunc.io.checkpoint._write

    def replace(a, b):
        if (point, calls["replace"]) in (("first_rename", 0), ("second_rename", 1)):
            os._exit(7)
        calls["replace"] += 1
        real_replace(a, b)

    def discard(d):
        if point == "cleanup":
            os._exit(7)
        real_discard(d)

    def write(file, data):
        if point == "write" and file.endswith(commit.META):
            os._exit(7)
        real_write(file, data)

    os.replace, commit.discard, zfunc.io.checkpoint._write = replace, discard, write
    zfunc.save(second, path)


def _leaves(path: str) -> list[torch.Tensor]:
    return snapshot(zfunc.load(path, like=_state(), restore_rng=False))


@pytest.mark.parametrize("point", _CRASH_POINTS)
def test_a_crash_at_any_point_of_save_leaves_the_old_or_the_new_checkpoint(tmp_path, point):
    old, new, path = (str(tmp_path / n) for n in ("old", "new", "ckpt"))
    with pytest.raises(WorldError, match="died"):
        zfunc.launch(_crash_during_save, world_size=1, args=(old, new, path, point), timeout=120)
    got = _leaves(path)
    expected = {"write": old, "first_rename": old, "second_rename": new, "cleanup": new}[point]
    assert bitwise_equal(got, _leaves(expected))
    zfunc.save(_trained(3), path)  # the next save finishes whatever was interrupted, and tidies up
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "new", "old"]
    assert bitwise_equal(_leaves(path), snapshot(zfunc.load(path, like=_trained(3), restore_rng=False)))


def _data_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "metadata"])
def test_damaged_checkpoints_raise_checkpoint_error(tmp_path, damage):
    state = _trained(1)
    path = zfunc.save(state, str(tmp_path / "ckpt"))
    if damage == "truncate":
        f = _data_files(path)[0]
        os.truncate(f, os.path.getsize(f) // 2)
    elif damage == "flip":  # one bit inside the stored bytes of a known piece (the data still parses)
        f = _data_files(path)[0]
        with open(f, "rb") as fh:
            data = bytearray(fh.read())
        raw = zfunc.full_params(state)["blocks.0.0.weight"].numpy().tobytes()
        at = data.find(raw)
        assert at >= 0
        data[at + len(raw) // 2] ^= 0x40
        with open(f, "wb") as fh:
            fh.write(bytes(data))
    else:
        with open(os.path.join(path, ".metadata"), "wb") as fh:
            fh.write(b"garbage")
    before = snapshot(state)
    with pytest.raises(zfunc.CheckpointError) as info:
        zfunc.load(path, like=state)
    assert isinstance(info.value, Exception)
    assert "damaged" in str(info.value) or "unreadable" in str(info.value) or "failed" in str(info.value)
    if damage == "flip":
        assert "p/blocks.0.0.weight/master/0" in str(info.value), str(info.value)
    assert bitwise_equal(before, snapshot(state))


def test_a_changed_buffer_shape_is_named(tmp_path):
    path = zfunc.save(_trained(1), str(tmp_path / "ckpt"))
    torch.manual_seed(0)
    other = BNNet()
    other.blocks[0][1].register_buffer("running_mean", torch.zeros(7))
    with pytest.raises(zfunc.CheckpointError, match=r"blocks\.0\.1\.running_mean \[6\] vs \[7\]"):
        zfunc.load(path, like=zfunc.init(other, zfunc.Config(stage=2)))


# -- buffers across ranks --------------------------------------------------------------------

def _bn_train(rank: int, path: str) -> list[float]:
    state = _state()
    for i in range(3):
        state, _ = zfunc.backward_step(state, bn_loss, bn_batch(rank, i))  # each rank its own batch
        state = zfunc.apply_step(state)
    zfunc.save(state, path)
    return [state.buffers[n].float().sum().item() for n in sorted(state.buffers)]


def _bn_load(rank: int, path: str) -> list[float]:
    state = zfunc.load(path, like=_state(stage=3))
    return [state.buffers[n].float().sum().item() for n in sorted(state.buffers)]


def test_batchnorm_statistics_stay_equal_across_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    trained = run_ranks(_bn_train, 2, path)
    assert trained[0] == trained[1]  # rank 0's statistics on every rank, as DDP's broadcast_buffers
    loaded = run_ranks(_bn_load, 3, path)
    assert all(r == trained[0] for r in loaded)  # 2 -> 3 ranks (and stage 2 -> 3)


# -- fp16 loss scales ------------------------------------------------------------------------

def test_a_large_static_fp16_scale_matches_grad_scaler():
    make, loss_fn, batch_fn = MODELS["gpt"]
    cfg = zfunc.Config(stage=2, autocast=torch.float16, loss_scale=2.0**17, optimizer=zfunc.adamw(lr=1e-2))
    torch.manual_seed(0)
    state = zfunc.init(make(), cfg)
    torch.manual_seed(0)
    ref = make()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**17, growth_interval=10**6)
    step = zfunc.train_step(loss_fn)
    for i in range(5):
        batch = batch_fn(i, 0, 4)
        state = step(state, batch)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(ref, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        assert state.metrics.skipped.item() == 0 and scaler.get_scale() == 2.0**17
        assert state.metrics.loss.item() == pytest.approx(loss.item(), rel=1e-2)
    assert state.scaler.skipped.item() == 0


def test_the_default_dynamic_scale_does_not_skip_at_world_one():
    make, loss_fn, batch_fn = MODELS["gpt"]
    torch.manual_seed(0)
    state = zfunc.init(make(), zfunc.Config(stage=0, precision="fp16", loss_scale=zfunc.DynamicLossScale()))
    step = zfunc.train_step(loss_fn)
    for i in range(3):
        state = step(state, batch_fn(i, 0, 4))
    assert state.scaler.skipped.item() == 0 and state.scaler.scale.item() == 2.0**16


# -- numbers at the door -----------------------------------------------------------------------

@pytest.mark.parametrize("make,field", [
    (lambda: zfunc.adamw(eps=math.inf), "optimizer.eps"),
    (lambda: zfunc.adamw(weight_decay=math.inf), "optimizer.weight_decay"),
    (lambda: zfunc.adamw(lr=math.nan), "optimizer.lr"),
    (lambda: zfunc.Config(loss_scale=1e39, precision="fp16"), "loss_scale"),
    (lambda: zfunc.DynamicLossScale(init=math.inf), "loss_scale.init"),
    (lambda: zfunc.Config(clip=math.inf), "clip"),
    (lambda: zfunc.Config.from_deepspeed({"train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 2000}}),
     "fp16.initial_scale_power"),
    (lambda: zfunc.Config.from_deepspeed({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": 1e39}}),
     "fp16.loss_scale"),
    (lambda: zfunc.Config.from_deepspeed({"train_batch_size": 2}, world_size=0), "world_size"),
    (lambda: zfunc.Config.from_deepspeed({"train_batch_size": 1, "optimizer": {"params": {"betas": 0.9}}}),
     "optimizer.params.betas"),
    (lambda: zfunc.Config.from_deepspeed({"train_batch_size": 1, "optimizer": {"params": {"eps": -1}}}),
     "optimizer.params.eps"),
    (lambda: zfunc.Config.from_deepspeed({"train_batch_size": 1, "optimizer": {"type": "Adam",
                                                                              "params": {"adam_w_mode": "false"}}}),
     "optimizer.params.adam_w_mode"),
])
def test_out_of_range_numbers_are_refused_by_name(make, field):
    with pytest.raises(zfunc.ConfigError) as info:
        make()
    message = str(info.value)
    assert message.startswith(field + ":"), message
    assert f"{field}.{field}" not in message and "fp16.fp16" not in message


def test_a_bad_learning_rate_from_a_schedule_stops_before_the_weights():
    for bad in (math.nan, -1.0, math.inf):
        state = zfunc.init(nn.Linear(3, 1), zfunc.Config(stage=0, lr_schedule=lambda step, bad=bad: bad))
        state, _ = zfunc.backward_step(state, lambda m, x: m(x).sum(), torch.ones(2, 3))
        before = snapshot(state)
        with pytest.raises(ValueError, match="lr_schedule: returned"):
            zfunc.apply_step(state, donate=True)
        assert bitwise_equal(before, snapshot(state))


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_parameters_zfunc_cannot_train_exactly_are_refused(dtype):
    model = nn.Linear(2, 2)
    model.weight = nn.Parameter(model.weight.detach().to(dtype))
    with pytest.raises(zfunc.ConfigError, match=rf"'weight \({dtype}\)'"):
        zfunc.init(model, zfunc.Config())


# -- bounded, explained failures ------------------------------------------------------------

def _different_stage(rank: int) -> str:
    try:
        zfunc.init(nn.Linear(3, 2), zfunc.Config(stage=1 + rank))
    except zfunc.ConfigError as e:
        return str(e)
    return "no error"


def test_a_config_that_differs_across_ranks_is_named_on_every_rank():
    t0 = time.monotonic()
    for msg in run_ranks(_different_stage, 2):
        assert msg.startswith("stage: differs across ranks (rank 0: 1, rank 1: 2)"), msg
    assert time.monotonic() - t0 < 30


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x, order):
        for i in order:
            x = self.blocks[i](x)
        return x


def _swapped_units(rank: int) -> str:
    torch.manual_seed(0)
    state = zfunc.init(Pair(), zfunc.Config(stage=3, persist_threshold=0))
    order = [0, 1] if rank == 0 else [1, 0]  # equal sizes: the gathers would silently mix up
    try:
        zfunc.backward_step(state, lambda m, x: m(x, order).sum(), torch.ones(2, 4))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_stage3_units_run_in_another_order_per_rank_are_detected():
    for msg in run_ranks(_swapped_units, 2):
        assert msg.startswith("stage 3: the ranks ran different units"), msg


def test_launch_refuses_a_function_it_cannot_send_at_once():
    t0 = time.monotonic()
    with pytest.raises(TypeError, match="cannot be sent to the rank processes"):
        zfunc.launch(lambda rank: rank, world_size=1)
    assert time.monotonic() - t0 < 10


def _fail_fast(rank: int) -> None:
    if rank == 0:
        raise ValueError("boom")
    time.sleep(120)


def test_world_error_reports_the_real_elapsed_time():
    with pytest.raises(WorldError) as info:
        zfunc.launch(_fail_fast, world_size=2, timeout=60)
    message = str(info.value)
    assert "boom" in message and "rank 0 failed" in message
    seconds = int(message.rsplit("after ", 1)[1].split(" s")[0])
    assert seconds < 30 and "rank(s) [1]" in message, message


def test_engine_step_without_backward_is_refused():
    torch.manual_seed(0)
    engine, *_ = zfunc.initialize(model=nn.Linear(3, 1), config={"train_batch_size": 1})
    before = snapshot(engine.state)
    with pytest.raises(RuntimeError, match="no backward reached the model"):
        engine.step()
    assert bitwise_equal(before, snapshot(engine.state)) and engine.global_steps == 0
    engine(torch.ones(1, 3)).sum().backward()
    engine.step()
    assert engine.global_steps == 1


# -- failures on one rank are errors on every rank; what the ranks must agree on is checked --------

def _damaged_on_rank_0(rank: int, path: str, engine: bool) -> str:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    if engine:
        eng, *_ = zfunc.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                        "zero_optimization": {"stage": 2}})
        eng.save_checkpoint(path, tag="t")
        ckpt = os.path.join(path, "t")
    else:
        state = zfunc.init(model, zfunc.Config(stage=2))
        ckpt = zfunc.save(state, path)
    zfunc.comm.all_gather_object(None, zfunc.comm.world())
    if rank == 0:  # one bit of rank 0's own piece of the weight
        f = os.path.join(ckpt, "__0_0.distcp")
        with open(f, "rb") as fh:
            data = bytearray(fh.read())
        at = data.find(model.weight.detach().reshape(-1)[100:110].numpy().tobytes())
        assert at >= 0
        data[at + 5] ^= 0x40
        with open(f, "wb") as fh:
            fh.write(bytes(data))
    zfunc.comm.all_gather_object(None, zfunc.comm.world())
    try:
        if engine:
            eng.load_checkpoint(path, tag="t")
        else:
            zfunc.load(ckpt, like=state)
    except zfunc.CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("engine", [False, True])
def test_a_piece_damaged_on_one_rank_is_an_error_on_every_rank(tmp_path, engine):
    t0 = time.monotonic()
    for said in run_ranks(_damaged_on_rank_0, 2, str(tmp_path / "ckpt"), engine, timeout=60):
        assert "damaged pieces" in said and "(rank 0)" in said, said
    assert time.monotonic() - t0 < 30


def _latest_fails_on_rank_0(rank: int, path: str, where: str) -> tuple[str, str]:
    engine, *_ = zfunc.initialize(model=nn.Linear(3, 2), config={"train_micro_batch_size_per_gpu": 1})
    engine.save_checkpoint(path, tag="first")
    real = os.replace

    def failing(a: str, b: str) -> None:  # the checkpoint's commit, or the `latest` pointer
        if (os.path.basename(b) == "latest") == (where == "latest"):
            raise OSError("disk full")
        real(a, b)

    if rank == 0:
        os.replace = failing
    try:
        engine.save_checkpoint(path, tag="second")
        said = "no error"
    except zfunc.CheckpointError as e:
        said = str(e)
    finally:
        os.replace = real
    with open(os.path.join(path, "latest")) as f:
        return said, f.read().strip()


@pytest.mark.parametrize("where", ["commit", "latest"])
def test_a_save_checkpoint_failing_on_one_rank_fails_on_every_rank(tmp_path, where):
    for said, latest in run_ranks(_latest_fails_on_rank_0, 2, str(tmp_path / "ckpt"), where, timeout=60):
        assert ("pointing" if where == "latest" else "writing") in said, said
        assert "disk full" in said and "(rank 0)" in said, said
        assert latest == "first"  # the previous checkpoint stays the latest


def _group_lr(rank: int, what: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    if what == "lr":
        cfg = zfunc.Config(stage=1, param_groups=[zfunc.ParamGroup(lambda n, p: p.ndim < 2, lr=0.1 * (rank + 1))])
    elif what == "members":
        cfg = zfunc.Config(stage=1, param_groups=[zfunc.ParamGroup(lambda n, p: n.startswith(str(rank)))])
    else:
        cfg = zfunc.Config(stage=1, lr_schedule=zfunc.schedules.warmup_lr(0.0, 0.1, 10 + rank))
    try:
        zfunc.init(model, cfg)
    except zfunc.ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what,field", [("lr", "param_groups"), ("members", "param_groups (members)"),
                                        ("schedule", "lr_schedule")])
def test_hyperparameters_that_differ_across_ranks_are_named(what, field):
    for said in run_ranks(_group_lr, 2, what, timeout=60):
        assert said.startswith(f"{field}: differs across ranks (rank 0: "), said


def test_a_step_without_a_micro_batch_is_refused():
    state = _state()
    before = snapshot(state)
    with pytest.raises(RuntimeError, match="no micro-batch was accumulated since the last step"):
        zfunc.apply_step(state)
    assert bitwise_equal(before, snapshot(state))
    state = zfunc.apply_step(zfunc.accumulate(state, {}, strict=False))
    with pytest.raises(RuntimeError, match="a loop that calls the step twice"):
        zfunc.apply_step(state)


def test_accumulate_names_the_missing_gradients():
    state = zfunc.init(nn.Linear(3, 2), zfunc.Config())
    with pytest.raises(KeyError, match=r"no gradient for \['bias'\].*strict=False"):
        zfunc.accumulate(state, {"weight": torch.ones(2, 3)})
    assert state.micro_step.item() == 0
    assert zfunc.accumulate(state, {"weight": torch.ones(2, 3)}, strict=False).micro_step.item() == 1


# -- GatheredParameters exits together, and its writes reach every rank -----------------------------

def _gathered(rank: int, stage: int, case: str) -> object:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[1].requires_grad_(False)
    engine, *_ = zfunc.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                       "zero_optimization": {"stage": stage}})
    if case == "caught":  # rank 1 raises inside the block and catches it outside
        try:
            with zfunc.zero.GatheredParameters(model[0].weight, modifier_rank=0):
                with torch.no_grad():
                    model[0].weight.fill_(0.25 if rank == 0 else 7.0)
                if rank == 1:
                    raise ValueError("the user's")
        except ValueError:
            pass
        return zfunc.full_params(engine.state)["0.weight"].flatten()[:2].tolist()
    if case == "tied":
        torch.manual_seed(0)
        tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        tied[1].weight = tied[0].weight
        engine, *_ = zfunc.initialize(model=tied, config={"train_micro_batch_size_per_gpu": 1,
                                                          "zero_optimization": {"stage": stage}})
        with zfunc.zero.GatheredParameters([tied[1].weight], modifier_rank=0):
            with torch.no_grad():
                tied[1].weight.fill_(0.5 if rank == 0 else 9.0)
        return zfunc.full_params(engine.state)["0.weight"].flatten()[:2].tolist()
    if case == "frozen":
        with zfunc.zero.GatheredParameters([model[1].weight], modifier_rank=0):
            with torch.no_grad():
                model[1].weight.fill_(0.5 if rank == 0 else 9.0)
        engine.backward(engine(torch.ones(1, 3)).sum())
        engine.step()
        return engine.state.frozen["1.weight"].flatten()[:2].tolist()
    try:  # a write without modifier_rank
        with zfunc.zero.GatheredParameters(model[0].weight):
            with torch.no_grad():
                model[0].weight.fill_(1.0)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gathered_parameters_exits_on_every_rank_with_the_modifiers_values(stage):
    t0 = time.monotonic()
    for values in run_ranks(_gathered, 2, stage, "caught", timeout=60):
        assert values == [0.25, 0.25]  # DeepSpeed's exit: broadcast whatever happened inside
    for values in run_ranks(_gathered, 2, stage, "frozen", timeout=60):
        assert values == [0.5, 0.5]  # a frozen parameter is the modifier's on every rank too
    for values in run_ranks(_gathered, 2, stage, "tied", timeout=60):
        assert values == [0.5, 0.5]  # so is a tied one, written through its second name
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("stage", [2, 3])
def test_a_write_without_modifier_rank_is_refused_at_stage_3(stage):
    for said in run_ranks(_gathered, 2, stage, "nomod", timeout=60):
        if stage == 3:
            assert "without modifier_rank" in said and "dropped" in said, said
        else:  # stages 0-2: the parameter is the rank's own compute view, written where it is (as DeepSpeed)
            assert said == "no error"


def _edited_lr_kept(rank: int, path: str) -> str:
    engine, optimizer, *_ = zfunc.initialize(model=nn.Linear(3, 2), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    engine.save_checkpoint(path, tag="t")
    optimizer.param_groups[0]["lr"] = 0.1 * (rank + 1)  # a rank's own edit, kept by the next load
    try:
        engine.load_checkpoint(path, tag="t", load_optimizer_states=False)
    except zfunc.ConfigError as e:
        return str(e)
    return "no error"


def test_hyperparameters_that_differ_across_ranks_after_a_load_are_named(tmp_path):
    for said in run_ranks(_edited_lr_kept, 2, str(tmp_path / "ckpt"), timeout=60):
        assert said.startswith("param_groups[0].lr: differs across ranks after load_checkpoint (rank 0: 0.1, rank 1: 0.2"), said
