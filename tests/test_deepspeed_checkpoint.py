"""DeepSpeed ZeRO checkpoints in: made by DeepSpeed 0.19.8 itself (tests/fixtures/deepspeed/make.py),
continued in zfunc at other world sizes and stages."""

from __future__ import annotations

import os

import pytest
import torch

import zfunc
from tests.fixtures.deepspeed.make import BETAS, CLIP, EPS, LR, WD, Small, batch
from tests.helpers import run_ranks
from zfunc.io.deepspeed_checkpoint import read_deepspeed

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "deepspeed")
CASES = [f"zero{s}_{p}" for s in (1, 2, 3) for p in ("fp32", "bf16")]


def _config(stage: int, grad_accum: int, precision: str = "fp32") -> zfunc.Config:
    return zfunc.Config(stage=stage, grad_accum=grad_accum, clip=CLIP, precision=precision,
                        optimizer=zfunc.adamw(lr=LR, weight_decay=WD, betas=BETAS, eps=EPS))


def _continued(rank: int, case: str, stage: int) -> tuple[dict[str, torch.Tensor], int, int]:
    """Load DeepSpeed's step-3 checkpoint and run its steps 3 and 4: the same two micro-batches
    per step (DeepSpeed's ranks 0 and 1), split over this world."""
    world = zfunc.comm.world().size
    torch.manual_seed(123)  # other initial values than the checkpoint's
    state = zfunc.load(os.path.join(HERE, case), like=zfunc.init(Small(), _config(stage, 2 // world)))
    steps, count = int(state.step), int(state.opt.count)
    for step in (3, 4):
        for micro in range(2 // world):
            state, _ = zfunc.backward_step(state, lambda m, x: m(x), batch(step, rank * (2 // world) + micro),
                                           donate=True)
        state = zfunc.apply_step(state, donate=True)
    return zfunc.full_params(state), steps, count


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("fp32")])
def test_continuing_a_deepspeed_checkpoint_equals_continuing_in_deepspeed(case):
    after = torch.load(os.path.join(HERE, case, "after.pt"))
    for world in (1, 2):
        for stage in (0, 1, 2, 3):
            for params, steps, count in run_ranks(_continued, world, case, stage):
                assert steps == 3 and count == 3
                assert sorted(params) == sorted(after)
                worst = max((params[n] - after[n]).abs().max().item() for n in after)
                assert worst <= 1e-6, f"{case} world {world} stage {stage}: {worst}"


def _loaded(rank: int, case: str, stage: int, precision: str) -> tuple[dict, dict, dict, int]:
    state = zfunc.load(os.path.join(HERE, case), like=zfunc.init(Small(), _config(stage, 1, precision)))
    moments = {k: zfunc.core.create.gather_by_name(state, getattr(state.opt, k)) for k in ("mu", "nu")}
    return zfunc.full_params(state), moments, {**state.frozen}, int(state.opt.count)


@pytest.mark.parametrize("case", CASES)
def test_any_world_and_stage_reads_the_masters_moments_and_frozen_values(case):
    ck = read_deepspeed(os.path.join(HERE, case))
    precision = case.split("_")[1]
    for world in (1, 3):
        for stage in (0, 3) if world == 1 else (1, 2, 3):
            for params, moments, frozen, count in run_ranks(_loaded, world, case, stage, precision):
                assert count == ck.step == 3
                assert all(torch.equal(params[n], ck.master[n]) for n in ck.master), (case, world, stage)
                assert all(torch.equal(moments["mu"][n], ck.moments["exp_avg"][n].to(moments["mu"][n].dtype))
                           and torch.equal(moments["nu"][n], ck.moments["exp_avg_sq"][n].to(moments["nu"][n].dtype))
                           for n in ck.master)
                assert all(torch.equal(frozen[n], ck.frozen[n].to(frozen[n].dtype)) for n in ck.frozen)


def test_a_deepspeed_checkpoint_of_another_model_or_optimizer_is_refused():
    other = zfunc.init(torch.nn.Linear(3, 2), _config(2, 1))
    with pytest.raises(zfunc.CheckpointError, match="a DeepSpeed checkpoint of another model: parameters only in"):
        zfunc.load(os.path.join(HERE, "zero2_fp32"), like=other)
    sgd = zfunc.init(Small(), zfunc.Config(optimizer=zfunc.sgd(lr=0.1, momentum=0.9)))
    with pytest.raises(zfunc.CheckpointError, match="holds Adam moments; this state trains with sgd"):
        zfunc.load(os.path.join(HERE, "zero3_fp32"), like=sgd)


def _engine_continues(rank: int, case: str) -> tuple[dict[str, torch.Tensor], int, int]:
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
          "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": list(BETAS), "eps": EPS}}}
    engine, *_ = zfunc.initialize(model=Small(), config=ds)
    path, client = engine.load_checkpoint(os.path.join(HERE, case))
    steps, samples = engine.global_steps, engine.global_samples
    for step in (3, 4):
        engine.backward(engine(batch(step, rank)))
        engine.step()
    return zfunc.full_params(engine.state), steps, samples


def test_the_engine_loads_a_deepspeed_checkpoint_and_continues_as_deepspeed():
    after = torch.load(os.path.join(HERE, "zero2_fp32", "after.pt"))
    for params, steps, samples in run_ranks(_engine_continues, 2, "zero2_fp32"):
        assert steps == 3 and samples == 24
        assert max((params[n] - after[n]).abs().max().item() for n in after) <= 1e-6


def test_a_deepspeed_checkpoint_with_a_missing_rank_file_names_it(tmp_path):
    import shutil

    broken = tmp_path / "ckpt"
    shutil.copytree(os.path.join(HERE, "zero2_fp32"), broken)
    os.remove(broken / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    like = zfunc.init(Small(), _config(2, 1))
    with pytest.raises(zfunc.CheckpointError, match=r"saved this checkpoint on 2 ranks, but rank files are missing: "
                                                    r"\['zero_pp_rank_1_mp_rank_00_optim_states.pt'\]"):
        zfunc.load(str(broken), like=like)


def test_convert_reads_a_deepspeed_checkpoint_one_parameter_at_a_time(tmp_path):
    from safetensors.torch import load_file

    from zfunc.io.convert import convert

    for case in ("zero2_fp32", "zero3_bf16"):
        ck = read_deepspeed(os.path.join(HERE, case))
        (f,) = convert(os.path.join(HERE, case), str(tmp_path / f"{case}.safetensors"), progress=False)
        got = load_file(f)
        assert sorted(got) == sorted([*ck.master, *ck.frozen])
        assert all(torch.equal(got[n], ck.master[n]) for n in ck.master)
        state = zfunc.init(Small(), _config(3, 1), weights=f)  # and into a zfunc run of its own
        assert all(torch.equal(v, ck.master[n]) for n, v in zfunc.full_params(state).items())


def _as_muon(monkeypatch) -> None:
    """DeepSpeed's ZeRO-2 checkpoint as a Muon run leaves it: each group's optimizer state holds a
    ``momentum_buffer``, no Adam moments (the fixture's files, read through a rename)."""
    import zfunc.io.deepspeed_checkpoint as dsc

    real = dsc._load

    def load(path: str):
        out = real(path)
        if "optimizer_state_dict" in out:
            state = out["optimizer_state_dict"]["base_optimizer_state"]["state"]
            for g in list(state):
                state[g] = {"momentum_buffer": state[g]["exp_avg"], "step": state[g]["step"]}
        return out

    monkeypatch.setattr(dsc, "_load", load)


def test_a_deepspeed_muon_checkpoint_is_refused_by_name_and_its_weights_load(monkeypatch, tmp_path):
    from tests.fixtures.deepspeed.make import Small

    _as_muon(monkeypatch)
    path = os.path.join(HERE, "zero2_fp32")
    torch.manual_seed(0)
    state = zfunc.init(Small(), zfunc.Config(stage=2))
    with pytest.raises(zfunc.CheckpointError, match=r"holds \['momentum_buffer'\], not Adam's exp_avg and "
                                                    r"exp_avg_sq .*load_module_only=True"):
        zfunc.load(path, like=state)
    weights = zfunc.load(path, like=state, weights_only=True)
    expected = read_deepspeed(path).master
    full = zfunc.full_params(weights)
    assert all(torch.equal(full[n], expected[n]) for n in expected)
    assert torch.equal(weights.opt.mu, state.opt.mu)  # the optimizer state stays the state's
    engine, *_ = zfunc.initialize(model=Small(), config={"train_micro_batch_size_per_gpu": 4,
                                                         "zero_optimization": {"stage": 2}})
    assert engine.load_checkpoint(path, load_module_only=True)[0] is not None
    with pytest.raises(zfunc.CheckpointError, match="momentum_buffer"):
        engine.load_checkpoint(path)
    from zfunc.io.convert import convert

    out = convert(path, tmp_path / "m.safetensors")  # weights whatever the optimizer
    assert out and all(os.path.exists(f) for f in out)


def _pad_for_alignment(src: str, dst: str, align: int) -> list[int]:
    """Rewrite the ZeRO-2 fixture ``src`` at ``dst`` as DeepSpeed lays it out with
    ``zero_optimization.parameter_alignment`` (``stage_1_and_2.py``): every parameter of the group
    but the last followed by zeros up to a multiple of ``align`` elements, the paddings recorded as
    ``param_alignment_paddings``; the flat buffer split evenly over the two ranks, the last
    rank's part ending with the group's padding. Returns the paddings."""
    import math
    import shutil

    from zfunc.io.deepspeed_checkpoint import _STAND_INS, _load

    shutil.copytree(src, dst)
    tag = os.path.join(dst, "global_step3")
    truth = read_deepspeed(src)
    shapes = _load(os.path.join(tag, "mp_rank_00_model_states.pt"))["param_shapes"][0]
    names, pads, end = list(shapes), [], 0
    for i, name in enumerate(names):
        end += math.prod(shapes[name])
        pads.append(0 if i == len(names) - 1 else -end % align)
        end += pads[-1]
    world = 2
    total = -(-end // (2 * world)) * (2 * world)

    def flat(values: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [t for n, p in zip(names, pads) for t in (values[n].reshape(-1).float(), torch.zeros(p))]
        out = torch.cat(parts)
        return torch.cat([out, torch.zeros(total - out.numel())])

    master, mu, nu = flat(truth.master), flat(truth.moments["exp_avg"]), flat(truth.moments["exp_avg_sq"])
    size = total // world
    for r in range(world):
        f = os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        with torch.serialization.safe_globals(_STAND_INS):
            sd = torch.load(f, map_location="cpu", weights_only=True)
        o, lo = sd["optimizer_state_dict"], r * size
        pad = max(0, min(size, lo + size - end))
        o.update(group_paddings=[pad], param_alignment_paddings=[pads], loss_scaler=None, zero_stage=int(o["zero_stage"]),
                 single_partition_of_fp32_groups=[master[lo:lo + size - pad].clone()])
        o.pop("param_slice_mappings", None)
        o["base_optimizer_state"]["state"][0].update(exp_avg=mu[lo:lo + size].clone(), exp_avg_sq=nu[lo:lo + size].clone())
        torch.save(sd, f)
    return pads


def test_a_deepspeed_checkpoint_with_parameter_alignment_skips_the_paddings(tmp_path):
    """``param_alignment_paddings`` (between the parameters of a group's flat buffer) are skipped
    as DeepSpeed's ``zero_to_fp32`` skips them: masters and moments come out as without them."""
    src = os.path.join(HERE, "zero2_fp32")
    pads = _pad_for_alignment(src, str(tmp_path / "aligned"), align=4)  # fp32: 16 bytes
    assert sum(pads) > 0, pads
    truth, got = read_deepspeed(src), read_deepspeed(str(tmp_path / "aligned"))
    for name in truth.master:
        assert torch.equal(got.master[name], truth.master[name]), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got.moments[moment][name], truth.moments[moment][name]), (name, moment)
    state = zfunc.load(str(tmp_path / "aligned"), like=zfunc.init(Small(), _config(2, 1)))
    assert all(torch.equal(t, truth.master[n]) for n, t in zfunc.full_params(state).items())


def test_weights_only_of_a_deepspeed_checkpoint_keeps_the_window_as_zfuncs_does(tmp_path):
    """Mid-window (one of two micro-batches in), ``weights_only`` of a DeepSpeed checkpoint keeps
    the window's gradients and count, as of a zfunc checkpoint: the engine's ``micro_steps`` and
    the state's ``micro_step`` stay in step."""
    like = zfunc.init(Small(), _config(2, 2))
    like, _ = zfunc.backward_step(like, lambda m, x: m(x), batch(0, 0))
    zpath = zfunc.save(zfunc.init(Small(), _config(2, 2)), str(tmp_path / "z"))
    for path in (os.path.join(HERE, "zero2_fp32"), zpath):
        got = zfunc.load(path, like=like, weights_only=True)
        assert got.micro_step.item() == 1 and torch.equal(got.grads, like.grads), path
        assert got.loss_sum.item() == like.loss_sum.item()
