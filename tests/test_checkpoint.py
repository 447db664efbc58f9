"""Checkpoints: bitwise resume, resharding across world sizes and stages, crash safety, export,
errors, the engine's tags, and an elastic restart under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import zfunc
from tests.helpers import MODELS, bitwise_equal, run_ranks, snapshot
from zfunc.tools.launch import World, WorldError
from zfunc.core.create import gather_by_name

GLOBAL = 6  # samples per step, split evenly over 1, 2 or 3 ranks


def _batch(step: int, rank: int, world: int) -> dict:
    full = MODELS["gpt"][2](step, 0, GLOBAL)
    n = GLOBAL // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in full.items()}


def _cfg(stage: int, fp16: bool = False) -> zfunc.Config:
    return zfunc.Config(stage=stage, clip=1.0, optimizer=zfunc.adamw(lr=1e-2), persist_threshold=0,
                        precision="fp16" if fp16 else "fp32",
                        loss_scale=zfunc.DynamicLossScale(init=2.0**10, hysteresis=2) if fp16 else None)


def _train(state, start: int, stop: int, rank: int, world: int, overflow_at: int | None = None):
    for i in range(start, stop):
        state, _ = zfunc.backward_step(state, MODELS["gpt"][1], _batch(i, rank, world), donate=True)
        if i == overflow_at:
            state.grads.view(-1)[0] = float("inf")  # an fp16 overflow on every rank
        state = zfunc.apply_step(state, donate=True)
    return state


def _fresh(stage: int, fp16: bool):
    torch.manual_seed(0)
    return zfunc.init(MODELS["gpt"][0](), _cfg(stage, fp16))


def _straight(rank: int, stage: int, fp16: bool, steps: int, overflow_at):
    world = zfunc.comm.world().size
    return snapshot(_train(_fresh(stage, fp16), 0, steps, rank, world, overflow_at))


def _first_half(rank: int, stage: int, fp16: bool, k: int, path: str, overflow_at):
    world = zfunc.comm.world().size
    zfunc.save(_train(_fresh(stage, fp16), 0, k, rank, world, overflow_at), path)


def _second_half(rank: int, stage: int, fp16: bool, k: int, steps: int, path: str):
    world = zfunc.comm.world().size
    state = zfunc.load(path, like=_fresh(stage, fp16))
    return snapshot(_train(state, k, steps, rank, world))


@pytest.mark.parametrize("stage,fp16", [(2, False), (3, False), (1, True)])
def test_resume_is_bitwise_equal(tmp_path, stage, fp16):
    path = str(tmp_path / "ckpt")
    overflow_at = 2 if fp16 else None  # an overflow just before the save (k = 3)
    straight = run_ranks(_straight, 2, stage, fp16, 6, overflow_at)
    with World(2) as w:
        w.run(_first_half, stage, fp16, 3, path, overflow_at)
    with World(2) as w:  # a new process world
        resumed = w.run(_second_half, stage, fp16, 3, 6, path)
    for a, b in zip(straight, resumed):
        assert bitwise_equal(a, b)


def _save_at(rank: int, stage: int, path: str) -> None:
    state = _train(_fresh(stage, False), 0, 3, rank, zfunc.comm.world().size)
    zfunc.save(state, path)


def _reload(rank: int, stage: int, path: str, more: int):
    world = zfunc.comm.world().size
    state = zfunc.load(path, like=_fresh(stage, False))
    gathered = {role: gather_by_name(state, t) for role, t in
                (("master", state.params), ("mu", state.opt.mu), ("nu", state.opt.nu))}
    count = state.opt.count.item()
    after = zfunc.full_params(_train(state, 3, 3 + more, rank, world))  # donates state
    return gathered, after, count


def test_reshard_across_world_sizes_and_stages(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_at, 2, 2, path)
    base_gathered, base_after, _ = run_ranks(_reload, 2, 2, path, 2)[0]
    for world, stage in ((3, 2), (1, 2), (3, 3), (2, 0), (1, 1)):
        for gathered, after, count in run_ranks(_reload, world, stage, path, 2):
            assert count == 3
            for role in gathered:  # exactly equal right after load
                for n, t in gathered[role].items():
                    assert torch.equal(t, base_gathered[role][n]), (world, stage, role, n)
            diff = max((after[n] - base_after[n]).abs().max().item() for n in after)
            assert diff < 1e-6, (world, stage, diff)


def _crashing_save(rank: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = _train(_fresh(2, False), 0, 1, rank, 2)
    real = dcp.save

    def dying(*a, **k):
        if rank == 1:
            os._exit(3)  # the rank dies mid-save, before its pieces are written
        real(*a, **k)
    dcp.save = dying
    zfunc.save(state, path)


def _load_params(rank: int, path: str):
    return zfunc.full_params(zfunc.load(path, like=_fresh(2, False)))


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_at, 2, 2, path)
    before = run_ranks(_load_params, 2, path)[0]
    with World(2, timeout=20) as w, pytest.raises(WorldError, match="died"):
        w.run(_crashing_save, path)
    after = run_ranks(_load_params, 2, path)[0]
    assert all(torch.equal(before[n], after[n]) for n in before)
    # The surviving rank removes the unfinished directory if it gets the chance; whatever is left
    # is never taken for a checkpoint, and the next save to the path clears it.
    for left in [p for p in os.listdir(tmp_path) if ".tmp-" in p]:
        assert not os.path.exists(os.path.join(tmp_path, left, "COMPLETE"))
        with pytest.raises(zfunc.CheckpointError, match="not a complete zfunc checkpoint"):
            zfunc.load(os.path.join(tmp_path, left), like=_fresh(2, False))
    run_ranks(_save_at, 2, 2, path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_export_with_tied_weights_reloads_into_a_plain_module(tmp_path):
    from safetensors.torch import load_file

    state = _train(_fresh(3, False), 0, 2, 0, 1)
    file = zfunc.export(state, str(tmp_path / "model.safetensors"))
    plain = MODELS["gpt"][0]()
    missing, unexpected = plain.load_state_dict(load_file(file), strict=False)
    assert missing == ["head.weight"] and unexpected == []  # tied to tok.weight, stored once
    x = _batch(9, 0, 1)["x"]
    expected = torch.func.functional_call(MODELS["gpt"][0](), zfunc.full_params(state), (x,))
    assert torch.equal(plain(x), expected)
    path = zfunc.save(state, str(tmp_path / "ckpt"))
    from_dir = load_file(zfunc.export(path, str(tmp_path / "again.safetensors")))
    assert all(torch.equal(from_dir[k], v) for k, v in load_file(file).items())


def test_load_refuses_what_does_not_fit(tmp_path):
    state = _fresh(2, False)
    path = zfunc.save(state, str(tmp_path / "ckpt"))
    torch.manual_seed(0)
    other = zfunc.init(torch.nn.Sequential(torch.nn.Linear(3, 4)), zfunc.Config(stage=2))
    kept = snapshot(other)
    with pytest.raises(zfunc.CheckpointError, match=r"parameters missing from the checkpoint: \['0.bias'"):
        zfunc.load(path, like=other)
    assert bitwise_equal(kept, snapshot(other))
    bf16 = zfunc.init(MODELS["gpt"][0](), _cfg(2).replace(master_dtype=torch.bfloat16, precision="bf16"))
    with pytest.raises(zfunc.CheckpointError, match="master_dtype is torch.float32 in the checkpoint but torch.bfloat16"):
        zfunc.load(path, like=bf16)
    with pytest.raises(zfunc.CheckpointError, match="not a complete zfunc checkpoint"):
        zfunc.load(str(tmp_path), like=state)


def _engine_round_trip(rank: int, save_dir: str) -> tuple:
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    torch.manual_seed(0)
    engine, *_ = zfunc.initialize(model=MODELS["gpt"][0](), config=cfg)
    for i in range(2):
        engine.backward(MODELS["gpt"][1](engine, _batch(i, rank, 2)))
        engine.step()
    engine.save_checkpoint(save_dir, client_state={"epoch": 7, "cursor": [1, 2]})
    torch.manual_seed(0)
    fresh, *_ = zfunc.initialize(model=MODELS["gpt"][0](), config=cfg)
    path, client = fresh.load_checkpoint(save_dir)
    same = bitwise_equal(snapshot(engine.state), snapshot(fresh.state))
    return os.path.basename(path), client, same, fresh.global_steps, fresh.micro_steps


def test_engine_checkpoint_tags_latest_and_client_state(tmp_path):
    for tag, client, same, steps, micro in run_ranks(_engine_round_trip, 2, str(tmp_path)):
        assert tag == "global_step2" and client == {"epoch": 7, "cursor": [1, 2]}
        assert same and steps == 2 and micro == 0  # a fresh engine counts its own micro-batches, as DeepSpeed
    assert (tmp_path / "latest").read_text() == "global_step2"
    engine, *_ = zfunc.initialize(model=MODELS["gpt"][0](), config={"train_batch_size": 2})
    assert engine.load_checkpoint(str(tmp_path / "nothing")) == (None, None)


def _load_keywords(rank: int, save_dir: str, sched: bool) -> dict:
    """A run saved after 2 steps; fresh engines trained 1 step load it with DeepSpeed's keywords."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}

    def engine():
        torch.manual_seed(0)
        model = MODELS["gpt"][0]()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1)) if sched else None
        e, *_ = zfunc.initialize(model=model, optimizer=opt, lr_scheduler=lam, config=cfg)
        return e

    def train(e, steps, first=0):
        for i in range(first, first + steps):
            e.backward(MODELS["gpt"][1](e, _batch(i, rank, 2)))
            e.step()

    saved = engine()
    train(saved, 2)
    saved.save_checkpoint(save_dir, client_state={"epoch": 3})
    out = {}
    for kw in ({}, {"load_module_only": True}, {"load_optimizer_states": False},
               {"load_lr_scheduler_states": False}):
        e = engine()
        train(e, 1, first=5)
        before = e.state
        path, client = e.load_checkpoint(save_dir, **kw)
        st = e.state
        out[tuple(kw)] = {
            "client": client, "sched": getattr(e.lr_scheduler, "last_epoch", None), "steps": e.global_steps, "micro": e.micro_steps, "lr": e.get_lr(),
            "weights": bitwise_equal([st.params, st.compute], [saved.state.params, saved.state.compute]),
            "moments_loaded": bitwise_equal(snapshot(st.opt), snapshot(saved.state.opt)),
            "moments_kept": bitwise_equal(snapshot(st.opt), snapshot(before.opt)),
        }
    return out


def test_engine_load_checkpoint_honours_deepspeeds_keywords(tmp_path):
    for r in run_ranks(_load_keywords, 2, str(tmp_path), True):
        every, module, no_opt, no_sched = (r[k] for k in ((), ("load_module_only",), ("load_optimizer_states",),
                                                             ("load_lr_scheduler_states",)))
        # (micro_steps stays the loading engine's own, 1 here, as DeepSpeed restores none)
        assert every["weights"] and every["moments_loaded"] and every["steps"] == 2 and every["micro"] == 1
        assert every["client"] == {"epoch": 3} and every["lr"] == [pytest.approx(1e-2 / 3)]
        # the weights alone: the engine's optimizer state and counters (1 step) stay
        assert module["weights"] and module["moments_kept"] and not module["moments_loaded"]
        assert module["steps"] == 1 and module["micro"] == 1 and module["lr"] == [pytest.approx(1e-2 / 2)]
        # everything but the optimizer state: weights, counters and the torch scheduler
        assert no_opt["weights"] and no_opt["moments_kept"] and no_opt["steps"] == 2 and no_opt["micro"] == 1
        assert no_opt["lr"] == [pytest.approx(1e-2 / 2)]  # the groups' lr is optimizer state: kept
        # the scheduler stays where it was (one step); the groups' lr is the loaded optimizer's
        assert no_sched["weights"] and no_sched["moments_loaded"] and no_sched["steps"] == 2
        assert no_sched["lr"] == [pytest.approx(1e-2 / 3)] and no_sched["sched"] == 1
        assert every["sched"] == 2


def test_engine_load_checkpoint_refuses_keywords_it_cannot_honour(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}
    engine, *_ = zfunc.initialize(model=MODELS["gpt"][0](), config=cfg)
    engine.save_checkpoint(str(tmp_path))
    kept = snapshot(engine.state)
    for kw, match in (({"load_module_strict": False}, "load_module_strict=False"),
                      ({"custom_load_fn": print}, "custom_load_fn"),
                      ({"load_lr_scheduler_states": False}, "same value for both"),
                      ({"load_optimizer_states": False}, "same value for both")):
        with pytest.raises(ValueError, match=match):
            engine.load_checkpoint(str(tmp_path), **kw)
        assert bitwise_equal(kept, snapshot(engine.state))
    both = engine.load_checkpoint(str(tmp_path), load_optimizer_states=False, load_lr_scheduler_states=False)
    assert both[0].endswith("global_step0")


@pytest.mark.timeout(300)
def test_elastic_restart_under_torchrun_resumes_bitwise(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "elastic_job.py")
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": os.getcwd()}
    runs = {}
    for name, fail_at in (("straight", -1), ("restarted", 3)):
        out = tmp_path / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", script, str(out), str(fail_at)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = [torch.load(out / f"final-{r}.pt") for r in range(2)]
        if fail_at > 0:
            assert (out / "attempt-1").exists(), "rank 1 did not fail and restart"
    for a, b in zip(runs["straight"], runs["restarted"]):
        assert bitwise_equal(a, b)


def test_a_missing_tag_lists_what_is_there(tmp_path):
    engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={"train_micro_batch_size_per_gpu": 1})
    engine.save_checkpoint(tmp_path, tag="a")
    engine.save_checkpoint(tmp_path, tag="b")
    with pytest.raises(zfunc.CheckpointError, match=r"/zz: no such checkpoint; .* holds \['a', 'b'\]$"):
        engine.load_checkpoint(tmp_path, tag="zz")
    (tmp_path / "latest").write_text("gone")
    with pytest.raises(zfunc.CheckpointError, match=r"/gone: no such checkpoint"):
        engine.load_checkpoint(tmp_path)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(zfunc.CheckpointError, match="a save to it was interrupted"):
        engine.load_checkpoint(tmp_path, tag="half")


def _flip_a_bit_of(path: str, values: torch.Tensor) -> None:
    """Flip one bit inside the stored bytes of ``values`` (their first four elements) in the
    checkpoint directory ``path``."""
    import glob

    for f in glob.glob(os.path.join(path, "*.distcp")):
        with open(f, "rb") as file:
            data = bytearray(file.read())
        at = bytes(data).find(values.reshape(-1)[:4].numpy().tobytes())
        if at >= 0:
            data[at + 1] ^= 0x40
            with open(f, "wb") as file:
                file.write(bytes(data))
            return
    raise AssertionError("values not found in the checkpoint")


def test_export_and_convert_refuse_a_damaged_checkpoint(tmp_path):
    """Reading weights out of a checkpoint directory checks every piece's CRC-32 as `load` does,
    and every failure is a `CheckpointError` (a truncated file, a missing `.metadata`)."""
    import glob
    import shutil

    from zfunc.io.convert import convert, main

    state = _fresh(3, False)
    path = zfunc.save(state, str(tmp_path / "ckpt"))
    _flip_a_bit_of(path, max(zfunc.full_params(state).values(), key=torch.Tensor.numel))  # random values
    for read in (lambda: zfunc.load(path, like=state), lambda: zfunc.export(path, str(tmp_path / "a.safetensors")),
                 lambda: convert(path, str(tmp_path / "b.safetensors"), progress=False)):
        with pytest.raises(zfunc.CheckpointError, match="damaged pieces"):
            read()
    assert main([path, str(tmp_path / "c.safetensors")]) == 2
    whole = zfunc.save(state, str(tmp_path / "whole"))
    cut = str(tmp_path / "cut")
    shutil.copytree(whole, cut)
    f = glob.glob(os.path.join(cut, "*.distcp"))[0]
    os.truncate(f, 100)  # (export reads only the weights: cut into them)
    gone = str(tmp_path / "gone")
    shutil.copytree(whole, gone)
    os.remove(os.path.join(gone, ".metadata"))
    for where in (cut, gone):
        for read in (lambda: zfunc.export(where, str(tmp_path / "d.safetensors")),
                     lambda: convert(where, str(tmp_path / "e.safetensors"), progress=False)):
            with pytest.raises(zfunc.CheckpointError, match="damaged or incomplete|damaged pieces"):
                read()
        assert main([where, str(tmp_path / "f.safetensors")]) == 2


def test_weights_only_loads_whatever_optimizer_or_precision_saved_the_checkpoint(tmp_path):
    """``weights_only`` (and the engine's ``load_module_only``) reads the weights alone: another
    optimizer, group optimizer or moment dtype in the checkpoint does not matter, and the RNG stays
    the caller's. Frozen parameters and buffers saved in another dtype (another ``precision``) are
    cast, with or without ``weights_only``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    model[0].requires_grad_(False)
    saved = zfunc.init(model, zfunc.Config(stage=2, optimizer=zfunc.adamw(lr=1e-2)))
    saved, _ = zfunc.backward_step(saved, lambda m, x: m(x).square().sum(), torch.randn(4, 3))
    saved = zfunc.apply_step(saved)
    path = zfunc.save(saved, str(tmp_path / "ckpt"))
    full = zfunc.full_params(saved)
    for cfg in (zfunc.Config(stage=2, optimizer=zfunc.sgd(lr=0.1, momentum=0.9)),
                zfunc.Config(stage=1, optimizer=zfunc.lion(lr=1e-3), moment_dtype=torch.bfloat16)):
        like = zfunc.init(model, cfg)
        kept = snapshot((like.opt, like.step, like.scaler))
        rng = torch.get_rng_state()
        got = zfunc.load(path, like=like, weights_only=True)
        assert torch.equal(rng, torch.get_rng_state())
        assert all(torch.equal(t, full[n]) for n, t in zfunc.full_params(got).items())
        assert torch.equal(got.buffers["1.running_mean"], saved.buffers["1.running_mean"])
        assert bitwise_equal(kept, snapshot((got.opt, got.step, got.scaler)))
        with pytest.raises(zfunc.CheckpointError, match="optimizer is adam"):
            zfunc.load(path, like=like)
    bf16 = zfunc.init(model, zfunc.Config(stage=2, precision="bf16", optimizer=zfunc.adamw(lr=1e-2)))
    got = zfunc.load(path, like=bf16)
    assert got.frozen["0.weight"].dtype == torch.bfloat16
    assert torch.equal(got.frozen["0.weight"], saved.frozen["0.weight"].to(torch.bfloat16))
    assert torch.equal(got.buffers["1.running_var"], saved.buffers["1.running_var"].to(torch.bfloat16))


def _failed_engine_loads(rank: int, save_dir: str) -> dict:
    """An engine checkpoint loaded where it cannot be: one `zfunc.save` wrote (no engine record),
    one of another torch scheduler. Each refusal leaves the engine as it was."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}

    def engine(kind):
        torch.manual_seed(0)
        model = MODELS["gpt"][0]()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = (torch.optim.lr_scheduler.StepLR(opt, 1) if kind == "step" else torch.optim.lr_scheduler.SequentialLR(
            opt, [torch.optim.lr_scheduler.ConstantLR(opt), torch.optim.lr_scheduler.StepLR(opt, 1)], [2]))
        e, *_ = zfunc.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
        e.backward(MODELS["gpt"][1](e, _batch(rank, rank, 2)))
        e.step()
        return e

    saved = engine("step")
    saved.save_checkpoint(os.path.join(save_dir, "engine"))
    zfunc.save(saved.state, os.path.join(save_dir, "plain", "mytag"))
    out = {}
    for name, where, kind in (("plain", "plain", "step"), ("scheduler", "engine", "sequential")):
        e = engine(kind)
        e.backward(MODELS["gpt"][1](e, _batch(5, rank, 2)))
        e.step()
        before = (snapshot(e.state), e.global_steps, e.micro_steps, e.lr_scheduler.state_dict()["last_epoch"])
        try:
            e.load_checkpoint(os.path.join(save_dir, where), tag="mytag" if where == "plain" else None)
            out[name] = "loaded"
        except zfunc.CheckpointError as err:
            after = (snapshot(e.state), e.global_steps, e.micro_steps, e.lr_scheduler.state_dict()["last_epoch"])
            out[name] = (str(err), bitwise_equal(before[0], after[0]) and before[1:] == after[1:])
    e = engine("step")
    e.load_checkpoint(os.path.join(save_dir, "plain"), tag="mytag", load_module_only=True)
    out["module_only"] = bitwise_equal([e.state.params], [saved.state.params])
    # another scheduler whose load_state_dict takes any dict (torch raises nothing): refused too
    e = engine("step")
    e.lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(e.optimizer, T_max=100)
    lr = e.get_lr()
    try:
        e.load_checkpoint(os.path.join(save_dir, "engine"))
        out["cosine"] = "loaded"
    except zfunc.CheckpointError as err:
        out["cosine"] = (str(err), e.get_lr() == lr and e.lr_scheduler.state_dict()["T_max"] == 100)
    # load_module_only of a checkpoint whose extra is any picklable value (zfunc.save's)
    zfunc.save(saved.state, os.path.join(save_dir, "listed", "t"), extra=["cursor", 7])
    e = engine("step")
    out["listed"] = e.load_checkpoint(os.path.join(save_dir, "listed"), tag="t", load_module_only=True)[1]
    return out


def test_a_failed_engine_load_leaves_the_engine_as_it_was(tmp_path):
    for r in run_ranks(_failed_engine_loads, 2, str(tmp_path)):
        assert "not a checkpoint engine.save_checkpoint wrote" in r["plain"][0] and r["plain"][1], r["plain"]
        assert "a StepLR's, and the engine's scheduler is a SequentialLR" in r["scheduler"][0] and r["scheduler"][1]
        assert r["module_only"] and r["listed"] is None
        assert "a StepLR's, and the engine's scheduler is a CosineAnnealingLR" in r["cosine"][0] and r["cosine"][1]


def _freeze_swapped(rank: int, path: str, stage: int, world_saved: int) -> dict:
    """Weights of a run that trained layer 0 and froze layer 2, loaded alone into a state that
    freezes layer 0 and trains layer 2 (and the other way round): every value as saved."""
    def model(frozen: int) -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(3, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 13))
        m[frozen].requires_grad_(False)
        return m

    out = {}
    for saved_frozen, now_frozen in ((2, 0), (0, 2)):
        where = os.path.join(path, f"f{saved_frozen}")
        if zfunc.comm.world().size == world_saved:
            src = zfunc.init(model(saved_frozen), zfunc.Config(stage=3))
            src, _ = zfunc.backward_step(src, lambda m, x: m(x).square().sum(), torch.randn(5, 3))
            src = zfunc.apply_step(src)
            zfunc.save(src, where)
            out[saved_frozen] = {k: v for k, v in {**zfunc.full_params(src), **src.frozen, **src.buffers}.items()}
            continue
        like = zfunc.init(model(now_frozen), zfunc.Config(stage=stage))
        with pytest.raises(zfunc.CheckpointError, match="trained on one side and frozen on the other"):
            zfunc.load(where, like=like)
        got = zfunc.load(where, like=like, weights_only=True)
        out[saved_frozen] = {k: v for k, v in {**zfunc.full_params(got), **got.frozen, **got.buffers}.items()}
    return out


def test_weights_only_loads_across_a_change_of_which_parameters_are_frozen(tmp_path):
    saved = run_ranks(_freeze_swapped, 3, str(tmp_path), 3, 3)[0]
    for world, stage in ((2, 0), (1, 3), (2, 2)):
        for got in run_ranks(_freeze_swapped, world, str(tmp_path), stage, 3):
            for which in (0, 2):
                assert sorted(got[which]) == sorted(saved[which])
                assert all(torch.equal(got[which][n], saved[which][n]) for n in saved[which]), (world, stage, which)
