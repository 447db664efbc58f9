"""Hybrid sharding (``Config.shard_size``): shard within groups of ranks, replicate across them.

Parity with single-process torch at world 4 with shard_size 2 (and world 6 with shard_size 3),
stages 1-3, grad_accum 1 and 4, fp32 (2e-6, as test_parity) and bf16 autocast (losses within 1e-2
of torch autocast, as test_precision); replicas hold bitwise equal shards; checkpoints reshard
hybrid(4, 2) -> flat(2) -> hybrid(6, 3) exactly.
"""

from __future__ import annotations

import pytest
import torch

import zfunc
from tests.helpers import MODELS, autocast_losses, bitwise_equal, max_param_diff, reference_run, run_ranks, zfunc_run
from zfunc.core.create import gather_by_name

STEPS = 6
TOL = 2e-6


def _cfg(stage: int, grad_accum: int, shard_size: int | None, **kw) -> zfunc.Config:
    return zfunc.Config(stage=stage, grad_accum=grad_accum, clip=1.0, shard_size=shard_size,
                        optimizer=zfunc.adamw(lr=1e-2, weight_decay=0.01), **kw)


def _fp32_parity(rank: int, shard_size: int, cases: list[tuple]) -> list[tuple]:
    """``cases``: ``(model, stage, grad_accum)``, or with a fourth entry, ``bucket_mb``."""
    world = zfunc.comm.world().size
    out = []
    for name, stage, grad_accum, *bucket_mb in cases:
        kw = {"bucket_mb": bucket_mb[0]} if bucket_mb else {}
        state, norms = zfunc_run(rank, name, STEPS, _cfg(stage, grad_accum, shard_size, **kw))
        ref, ref_norms = reference_run(name, world, STEPS, grad_accum=grad_accum, clip=1.0)
        # The ranks holding the same shard (one per replica) hold the same bytes.
        shard = zfunc.comm.all_gather_object([t.clone() for t in (state.params, state.opt.mu, state.opt.nu)])
        twin = (rank + shard_size) % world
        out.append((name, stage, grad_accum, max_param_diff(state, ref), norms, ref_norms,
                    state.layout.world, bitwise_equal(shard[rank], shard[twin])))
    return out


def _check_fp32(results: list[list[tuple]], shard_size: int) -> None:
    for rank, rows in enumerate(results):
        for name, stage, grad_accum, diff, norms, ref_norms, lay_world, same in rows:
            case = f"rank {rank} {name} stage {stage} grad_accum {grad_accum}"
            assert lay_world == shard_size, case  # sharded over the group, not the world
            assert diff <= TOL, f"{case}: params differ from torch AdamW by {diff:.3g}"
            assert norms == pytest.approx(ref_norms, rel=1e-5), case
            assert same, f"{case}: the replicas of a shard differ"
    for i, row in enumerate(results[0]):  # every rank reports the same (global) grad norms
        assert all(rows[i][4] == row[4] for rows in results), row[:3]


def test_world4_shard2_matches_single_process_adamw():
    cases = [("zoo", s, ga) for s in (1, 2, 3) for ga in (1, 4)] + [("gpt", 3, 4), ("gpt", 2, 1)]
    cases += [("zoo", 2, 4, 0.0002), ("gpt", 2, 1, 0.0002)]  # stage 2's gradient buckets within the shard group
    _check_fp32(run_ranks(_fp32_parity, 4, 2, cases), 2)


def test_world4_shard1_is_replicated_data_parallel():
    _check_fp32(run_ranks(_fp32_parity, 4, 1, [("zoo", 2, 4)]), 1)


def _bf16_autocast(rank: int, stage: int, grad_accum: int, shard_size: int) -> tuple[list[float], list[float]]:
    return autocast_losses(rank, _cfg(stage, grad_accum, shard_size, autocast=torch.bfloat16))


@pytest.mark.parametrize("grad_accum", [1, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world4_shard2_bf16_autocast_matches_torch(stage, grad_accum):
    for ours, theirs in run_ranks(_bf16_autocast, 4, stage, grad_accum, 2):
        assert ours == pytest.approx(theirs, rel=1e-2), (ours, theirs)


def _bf16_hybrid_vs_flat(rank: int) -> float:
    """precision="bf16" (bf16 weights and gradients on the wire): hybrid ends where flat does."""
    cfg = dict(precision="bf16", comm_dtype=torch.bfloat16)
    hybrid, _ = zfunc_run(rank, "gpt", STEPS, _cfg(2, 4, 2, **cfg))
    flat, _ = zfunc_run(rank, "gpt", STEPS, _cfg(2, 4, None, **cfg))
    a, b = zfunc.full_params(hybrid), zfunc.full_params(flat)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_world4_shard2_bf16_weights_track_flat_sharding():
    for diff in run_ranks(_bf16_hybrid_vs_flat, 4):
        assert diff < 5e-3, diff  # bf16 sums in another order: a few ulps of bf16 at most


def test_world4_shard2_overflow_on_one_rank_skips_everywhere():
    from tests.test_precision import _inject

    for stage in (1, 2, 3):  # only rank 3 overflows: its shard's twin (rank 1) sees it after the all-reduce
        for rank, r in enumerate(run_ranks(_inject, 4, stage, "fp16", float("inf"), 2)):
            assert r["unchanged"] and r["skipped"] == 1 and r["scale"] == 128.0, (stage, rank, r)


def _engine_hybrid(rank: int, stage: int) -> tuple[float, int]:
    make, loss_fn, batch_fn = MODELS["zoo"]
    torch.manual_seed(0)
    engine, *_ = zfunc.initialize(model=make(), config={
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "mics_shard_size": 2}})
    for i in range(STEPS):
        engine.backward(loss_fn(engine, batch_fn(i, rank, 4)))
        engine.step()
    ref, _ = reference_run("zoo", zfunc.comm.world().size, STEPS, grad_accum=1, clip=1.0, micro=4)
    return max_param_diff(engine.state, ref), engine.state.layout.world


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_with_mics_shard_size_matches_single_process_adamw(stage):
    for diff, lay_world in run_ranks(_engine_hybrid, 4, stage):
        assert lay_world == 2 and diff <= TOL, (lay_world, diff)


# --- checkpoints: hybrid(4, 2) -> flat(2) -> hybrid(6, 3) ---------------------------------------

def _roles(state: zfunc.TrainState) -> dict[str, dict[str, torch.Tensor]]:
    return {role: gather_by_name(state, t) for role, t in
            (("master", state.params), ("mu", state.opt.mu), ("nu", state.opt.nu))}


def _train_and_save(rank: int, stage: int, shard_size: int | None, path: str) -> dict:
    state, _ = zfunc_run(rank, "zoo", 3, _cfg(stage, 2, shard_size))
    zfunc.save(state, path)
    return _roles(state)


def _load_and_save(rank: int, stage: int, shard_size: int | None, path: str, out: str | None) -> tuple:
    make = MODELS["zoo"][0]
    like = zfunc.init(make(), _cfg(stage, 2, shard_size))
    state = zfunc.load(path, like=like)
    if out is not None:
        zfunc.save(state, out)
    return _roles(state), state.opt.count.item(), state.layout.world


def test_checkpoint_reshards_hybrid_flat_hybrid(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    saved = run_ranks(_train_and_save, 4, 3, 2, a)[0]
    for roles, count, lay_world in run_ranks(_load_and_save, 2, 2, None, a, b):
        assert count == 3 and lay_world == 2
        assert all(torch.equal(roles[r][n], saved[r][n]) for r in saved for n in saved[r])
    for roles, count, lay_world in run_ranks(_load_and_save, 6, 1, 3, b, c):
        assert count == 3 and lay_world == 3
        assert all(torch.equal(roles[r][n], saved[r][n]) for r in saved for n in saved[r])
    for roles, _, _ in run_ranks(_load_and_save, 2, 3, None, c, None):  # and back from hybrid
        assert all(torch.equal(roles[r][n], saved[r][n]) for r in saved for n in saved[r])


def test_world6_shard3_matches_single_process_adamw():
    _check_fp32(run_ranks(_fp32_parity, 6, 3, [("zoo", 3, 4), ("zoo", 1, 1)]), 3)


# --- bad input ------------------------------------------------------------------------------------

def _init_with(rank: int, cfg: zfunc.Config) -> str:
    try:
        zfunc.init(MODELS["zoo"][0](), cfg)
    except zfunc.ConfigError as e:
        return str(e)
    return "no error"


def test_shard_size_must_divide_the_world():
    errors = run_ranks(_init_with, 2, zfunc.Config(stage=2, shard_size=3))
    assert all("shard_size: 3 is larger than the world size 2" in e for e in errors), errors
    errors = run_ranks(_init_with, 3, zfunc.Config(stage=3, shard_size=2))
    assert all("shard_size: 2 does not divide the world size 3" in e for e in errors), errors
    errors = run_ranks(_init_with, 2, zfunc.Config(stage=0, shard_size=1))
    assert all("stage 0" in e for e in errors), errors
    with pytest.raises(zfunc.ConfigError, match="shard_size"):
        zfunc.Config(shard_size=0)
    with pytest.raises(zfunc.ConfigError, match="shard_size: 3 is larger than the world size 2"):
        zfunc.memory_plan(torch.nn.Linear(3, 3), zfunc.Config(shard_size=3), world_size=2)


def test_memory_plan_shards_over_the_group():
    model = torch.nn.Linear(1000, 1000)
    flat = zfunc.memory_plan(model, zfunc.Config(stage=3), world_size=8)
    hybrid = zfunc.memory_plan(model, zfunc.Config(stage=3, shard_size=4), world_size=8)
    group = zfunc.memory_plan(model, zfunc.Config(stage=3), world_size=4)
    assert hybrid == group and hybrid["total"] > 1.9 * flat["total"]


def test_deepspeed_mics_shard_size_maps_and_hpz_is_refused():
    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "mics_shard_size": 2}}
    assert zfunc.Config.from_deepspeed(base, world_size=4).shard_size == 2
    off = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "mics_shard_size": -1,
                                                                      "zero_hpz_partition_size": 1}}
    assert zfunc.Config.from_deepspeed(off, world_size=4).shard_size is None
    hpz = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}
    with pytest.raises(zfunc.ConfigError, match="zero_hpz_partition_size.*mics_shard_size"):
        zfunc.Config.from_deepspeed(hpz, world_size=4)


# --- two "nodes": two torchrun agents on this machine ---------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_two_torchrun_agents_train_hybrid_like_one_process(tmp_path):
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "multinode_job.py")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    port = _free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", "zfunc-two-nodes", script, str(tmp_path), "3"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    logs = [a.communicate(timeout=280)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), "\n".join(log[-3000:] for log in logs)
    results = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(4)]
    for r in results:
        assert r["world"] == 4 and r["shard"] == 2
        assert len(set(r["shard_nodes"])) == 1, r["shard_nodes"]  # a shard group stays on one node
        assert r["diff"] <= TOL, r["diff"]
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5)
