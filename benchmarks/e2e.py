"""End-to-end benchmark: zfunc ZeRO stages 0-3 against DDP and FSDP2 on one small GPT.

Every contender trains the same GPT (vocab 8192, context 128, 4 layers, 8 heads, d_model 512)
on the same synthetic tokens (one fixed micro-batch of 8 x 128 tokens per rank, reused every
step, identical across contenders), with AdamW (lr 1e-3, weight decay 0.01) and global norm
clipping at 1.0, on a local world of 2 gloo ranks with one torch thread each. The loss after the
last step is printed per contender: in fp32 all of them should agree to about 4 decimals.

Contenders (``--only`` picks a comma-separated subset):

* ``ddp``    DistributedDataParallel + torch.optim.AdamW (fused=True where it runs, else foreach)
* ``fsdp2``  torch.distributed.fsdp.fully_shard per block + root, + AdamW
* ``zero0`` .. ``zero3``  zfunc ZeRO stage 0..3 with one unit per transformer block
  (``Config(units=[Block])``): stage 3 gathers them one by one; stages 1-2 overlap the step's
  all-gather with the next forward unit by unit (`zfunc.autograd.forward_gather`)
* ``atonce1``, ``atonce2``  zfunc ZeRO-1/2 without units: the all-gather done before
  ``apply_step`` returns (DeepSpeed's way), the A/B of the overlap
* ``noprefetch3``  zfunc ZeRO-3 with ``prefetch=0`` (each unit gathered when its module starts), to
  measure what the prefetch buys
* ``gloored1`` .. ``gloored3``  zfunc ZeRO-1..3 with gloo's own reduces instead of the
  point-to-point sums (`zfunc.comm.Group.p2p`), the A/B of those
* ``atstep0``, ``atstep1``  zfunc ZeRO-0/1 reducing the accumulated gradient at the step, in one
  piece, instead of in the last micro-batch's backward: what the boundary reduce buys
* ``offload1`` .. ``offload3``  the same with ``offload_optimizer="cpu"`` (on this CPU machine the
  host arena is a second copy in the same memory: the cost of the copies, not of a PCIe link)
* ``cddp``, ``cfsdp2``, ``czero0`` .. ``czero3``  the same with each transformer block compiled on
  its own, ``torch.compile(block, fullgraph=True)`` with inductor (torchtitan's default); zfunc's
  units are then the compiled blocks, by name. Give ``--warmup`` enough steps for the compiles
* ``ds1`` .. ``ds3``  DeepSpeed's engine, ZeRO stage 1..3 (torch AdamW inside, ``torch_adam``), when
  ``import deepspeed`` works; run this script with the DeepSpeed venv's python (recipe below)

Each contender runs in a *fresh* world (`zfunc.launch` starts new processes per call), so
``ru_maxrss`` is that contender's own peak. Peak RSS includes the interpreter, torch and the
model as built on every rank; the "+RSS" column subtracts the peak measured just after the model
is built (before the wrapper/optimizer/state exists), i.e. what the contender itself added.

Timing: ``--warmup`` untimed steps, then ``--steps`` timed steps. Every step starts after a
barrier and is timed with ``time.perf_counter`` around the whole step (forward, backward,
collectives, clipping, optimizer). A step's time is the slowest rank's; the table shows the
median over steps. The fwd+bwd / optimizer split is measured inside the same steps. The CPU
column is ``time.process_time`` over the same interval (slowest rank, median): on a shared
machine it is far less disturbed by other processes than wall time; the page-fault column counts
the minor faults of the step (slowest rank, median): what the step touches of freshly allocated
memory, free of timing noise. ``--interleave`` instead builds every contender in one world and
alternates their steps, so background load hits all of them alike (no RSS numbers then), and
prints per-round paired ratios (each contender against its peer in the same round).

    python benchmarks/e2e.py                          # everything, fp32
    python benchmarks/e2e.py --precision bf16
    python benchmarks/e2e.py --only ddp,zero2 --steps 20
    python benchmarks/e2e.py --interleave             # robust time ratios on a busy machine
    python benchmarks/e2e.py --only zero2 --profile torch     # profile rank 0 for 2 steps
    python benchmarks/e2e.py --only ddp,zero2 --profile cprofile

DeepSpeed 0.19.8 runs on this CPU machine in its own virtual environment::

    python3 -m venv .venv-ds && .venv-ds/bin/pip install torch==2.13.0
    DS_BUILD_OPS=0 .venv-ds/bin/pip install deepspeed==0.19.8 numba optree einops safetensors
    .venv-ds/bin/pip install --no-deps -e .
    DS_ACCELERATOR=cpu .venv-ds/bin/python benchmarks/e2e.py --interleave --only ddp,fsdp2,ds1,ds2,ds3,zero1,zero2,zero3

(the ranks join the gloo world ``zfunc.launch`` made; ``deepspeed.init_distributed`` finds it). Its
model-state bytes are those of every tensor its engine's optimizer holds (its communication buckets,
at DeepSpeed's default sizes, included), plus the module's parameters and gradients.

bf16: zfunc runs ``precision="bf16"`` (bf16 compute copy, fp32 masters, moments and gradient
accumulator); DDP runs its forward under ``torch.autocast("cpu", torch.bfloat16)`` with fp32
parameters; FSDP2 uses ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.
DeepSpeed's bf16 accumulates and reduces gradients in bf16 (its ``grad_accum_dtype`` and
``communication_data_type`` default to the model's dtype); ``lowgrad1``-``lowgrad3`` are zfunc's
stages with those dtypes (``Config(grad_accum_dtype=bf16, comm_dtype=bf16)``), the same work.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks

import argparse
import contextlib
import dataclasses
import io
import platform
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import zfunc
from machine import cpu_line
from zfunc.models import GPT, GPTConfig, lm_loss

MODEL = dict(vocab_size=8192, block_size=128, n_layer=4, n_head=8, d_model=512)
SEQ = 128
MICRO_BATCH = 8
WORLD = 2
LR, WD, CLIP = 1e-3, 0.01, 1.0
CONTENDERS = ["ddp", "fsdp2", "zero0", "zero1", "zero2", "zero3", "noprefetch3", "atstep0", "atstep1", "gloored1",
              "gloored2", "gloored3", "atonce1", "atonce2", "lowgrad1", "lowgrad2", "lowgrad3", "engine2", "offload1",
              "offload2", "offload3", "ds1", "ds2", "ds3", "cddp", "cfsdp2", "czero0", "czero1", "czero2", "czero3"]


# ----------------------------------------------------------------------------- helpers

def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _batches(rank: int, n: int, accum: int = 1) -> list[list[dict[str, torch.Tensor]]]:
    """``n`` steps' micro-batches for ``rank`` (``accum`` per step): one fixed synthetic batch
    per rank, reused for every micro-batch.

    The same for every contender. Reusing it lets the model memorise it, so the loss falls
    steeply within a few steps and the final losses are a sharp check that all contenders
    compute the same training run (random fresh tokens would keep every loss near ln(vocab)).
    """
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH, SEQ + 1), generator=g)
    batch = {"x": tokens[:, :-1].contiguous(), "y": tokens[:, 1:].contiguous()}
    return [[batch] * accum] * n


def _build_model(compiled: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and for every contender
    model = GPT(GPTConfig(**MODEL))
    if compiled:  # torchtitan's default: each block compiled on its own (inductor), no graph break
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)
    return model


def _nbytes_unique(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards for DTensors)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def _torch_state_bytes(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict[str, int]:
    opt_tensors = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    rep = {"params": _nbytes_unique(params), "grads": _nbytes_unique([p.grad for p in params]),
           "optimizer": _nbytes_unique(opt_tensors)}
    rep["total"] = sum(rep.values())
    return rep


def _adamw(params: list[torch.Tensor], kind: str) -> tuple[torch.optim.Optimizer, str]:
    """AdamW with fused=True if that works here for this kind of parameter, else foreach."""
    try:
        if kind == "dtensor":
            from torch.distributed.tensor import DTensor, Replicate
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            probe = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Replicate()]))
            probe.grad = DTensor.from_local(torch.ones(4), mesh, [Replicate()])
        else:
            probe = torch.nn.Parameter(torch.ones(4))
            probe.grad = torch.ones(4)
        torch.optim.AdamW([probe], lr=LR, weight_decay=WD, fused=True).step()
        return torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True), "fused"
    except Exception:  # noqa: BLE001 - fused AdamW not available for this device/tensor type
        return torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True), "foreach"


_FWD: list[tuple[float, float]] = []  # this step's forwards: (wall s, main-thread CPU s) each


def _loss(model: Any, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """``lm_loss``, with the wall and main-thread CPU time of the forward noted for the by-phase
    split (zfunc's ``backward_step`` calls it inside; the others call it directly)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    out = lm_loss(model, mb)
    _FWD.append((time.perf_counter() - t0, time.thread_time() - c0))
    return out


_MID: list[float] = []  # the main thread's CPU time where this step's backward ended


def _mid() -> float:
    """The end of the step's forward and backward: wall time returned, main-thread CPU noted."""
    _MID.append(time.thread_time())
    return time.perf_counter()


# ----------------------------------------------------------------------------- contenders
# Each setup returns (step_fn, info) where step_fn(batch) -> (t_fwd_bwd_end,) runs one full step
# and info() -> dict with "state_bytes", "loss" (last step's loss, averaged over ranks), "note".

def _setup_ddp(precision: str, accum: int, compiled: bool = False):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _build_model(compiled)
    ddp = DDP(model)
    params = [p for p in ddp.parameters() if p.requires_grad]
    opt, how = _adamw(params, "plain")
    def ctx():
        if precision == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()
    last = {}

    def step(mbs):
        opt.zero_grad(set_to_none=True)
        for i, mb in enumerate(mbs):  # no all-reduce until the last micro-batch
            with ctx(), (ddp.no_sync() if i < len(mbs) - 1 else contextlib.nullcontext()):
                loss = _loss(ddp, mb) / len(mbs)
                loss.backward()
        t_mid = _mid()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        last["loss"] = loss.detach() * len(mbs)
        return t_mid

    def info():
        loss = last["loss"].clone()
        dist.all_reduce(loss)
        return {"state_bytes": _torch_state_bytes(params, opt), "loss": loss.item() / dist.get_world_size(),
                "note": f"AdamW {how}" + (", autocast bf16" if precision == "bf16" else "")}
    return step, info


def _setup_fsdp2(precision: str, accum: int, compiled: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = _build_model(compiled)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if precision == "bf16" else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, how = _adamw(params, "dtensor")
    last = {}

    def step(mbs):
        opt.zero_grad(set_to_none=True)
        for i, mb in enumerate(mbs):  # reduce-scatter only after the last micro-batch
            model.set_requires_gradient_sync(i == len(mbs) - 1)
            loss = _loss(model, mb) / len(mbs)
            loss.backward()
        t_mid = _mid()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        opt.step()
        last["loss"] = loss.detach() * len(mbs)
        return t_mid

    def info():
        loss = last["loss"].clone()
        dist.all_reduce(loss)
        return {"state_bytes": _torch_state_bytes(params, opt), "loss": loss.item() / dist.get_world_size(),
                "note": f"AdamW {how}" + (", param bf16/reduce fp32" if precision == "bf16" else "")}
    return step, info


def _setup_zfunc(stage: int, precision: str, accum: int, offload: str | None = None, prefetch: int = 1,
                 fold: bool = True, p2p: bool = True, low_grads: bool = False, units: bool = True,
                 compiled: bool = False):
    import zfunc.core.backward
    from zfunc.models.gpt import Block
    model = _build_model(compiled)
    blocks = [f"blocks.{i}" for i in range(len(model.blocks))] if compiled else (Block,)  # the compiled wrappers
    cfg = zfunc.Config(stage=stage, precision=precision, clip=CLIP, grad_accum=accum, offload_optimizer=offload,
                       optimizer=zfunc.adamw(lr=LR, weight_decay=WD), prefetch=prefetch,
                       units=blocks if stage >= 1 and units else None)
    if low_grads:  # DeepSpeed's bf16 defaults: gradients accumulated and reduced in the model's dtype
        cfg = dataclasses.replace(cfg, grad_accum_dtype=cfg.compute_dtype, comm_dtype=cfg.compute_dtype)
    box = {"state": zfunc.init(model, cfg, donate=True)}  # the module runs only through zfunc
    if not p2p:  # this state's shard group without its point-to-point twin: gloo's reduces
        mesh = box["state"].mesh
        box["state"] = box["state"].replace(mesh=dataclasses.replace(
            mesh, shard=dataclasses.replace(mesh.shard, p2p=None)))

    # zfunc.train_step(lm_loss) is exactly this (it donates too); calling the two halves
    # directly lets the benchmark time them separately.
    def step(mbs):
        state = box["state"]
        ends_step = zfunc.core.backward._ends_step
        if not fold:  # this contender's steps only: the last micro-batch reduces nothing
            zfunc.core.backward._ends_step = lambda state: None
        try:
            for mb in mbs:
                state, _ = zfunc.backward_step(state, _loss, mb, donate=True)
        finally:
            zfunc.core.backward._ends_step = ends_step
        t_mid = _mid()
        box["state"] = zfunc.apply_step(state, donate=True)
        return t_mid

    def info():
        st = box["state"]
        # Bytes the module's own parameters still hold outside the state (memory_report does not
        # count them; they are dead weight once the state owns the parameters).
        ours = {t.untyped_storage().data_ptr() for t in (st.params, st.compute, st.grads)}
        extra = _nbytes_unique([p for p in st.module.parameters()
                                if p.untyped_storage().data_ptr() not in ours])
        return {"state_bytes": zfunc.memory_report(st), "loss": st.metrics.loss.item(),
                "note": f"{len(st.layout.units)} unit(s); module keeps {extra / 2**20:.0f} MiB of "
                        "original params (not counted)"}
    return step, info


def _setup_engine(stage: int, precision: str, accum: int):
    """The DeepSpeed-style shim over the same pure functions: engine(x), backward, step."""
    model = _build_model()
    ds = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": accum, "gradient_clipping": CLIP,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
          "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}
    engine, *_ = zfunc.initialize(model=model, config=ds)

    def step(mbs):
        for mb in mbs[:-1]:
            engine.backward(_loss(engine, mb))
            engine.step()
        engine.backward(_loss(engine, mbs[-1]))
        t_mid = _mid()
        engine.step()
        engine.state.metrics.loss.item()  # the same sync the functional contender has in info
        return t_mid

    def info():
        return {"state_bytes": zfunc.memory_report(engine.state), "loss": engine.state.metrics.loss.item(),
                "note": "zfunc.initialize + engine.backward/step"}
    return step, info


def _tensor_bytes(obj: Any, seen: dict[int, int], depth: int = 0) -> None:
    """Unique storage bytes of the tensors reachable from ``obj`` (lists, dicts, attributes)."""
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensor_bytes(v, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensor_bytes(v, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for v in vars(obj).values():
            _tensor_bytes(v, seen, depth + 1)


def _setup_deepspeed(stage: int, precision: str, accum: int):
    """DeepSpeed's own engine (ZeRO stage 1-3) in the same gloo world."""
    import deepspeed

    for key, value in (("LOCAL_RANK", dist.get_rank()), ("RANK", dist.get_rank()),
                       ("WORLD_SIZE", dist.get_world_size()), ("LOCAL_WORLD_SIZE", dist.get_world_size())):
        os.environ.setdefault(key, str(value))  # what a launcher would set; DeepSpeed asserts on them
    deepspeed.init_distributed(dist_backend="gloo")  # the world zfunc.launch made is reused
    model = _build_model()
    ds = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": accum,
          "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
          "bf16": {"enabled": precision == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    last = {}

    def step(mbs):
        for mb in mbs[:-1]:
            engine.backward(_loss(engine, mb))
            engine.step()
        loss = _loss(engine, mbs[-1])
        engine.backward(loss)
        t_mid = _mid()
        engine.step()
        last["loss"] = loss.detach().float()
        return t_mid

    def info():
        loss = last["loss"].clone()
        dist.all_reduce(loss)
        seen: dict[int, int] = {}
        _tensor_bytes(engine.optimizer, seen)
        _tensor_bytes([t for p in engine.module.parameters() for t in (p, p.grad) if t is not None], seen)
        total = sum(seen.values())
        return {"state_bytes": {"params": 0, "grads": 0, "optimizer": total, "total": total},
                "loss": loss.item() / dist.get_world_size(),
                "note": f"DeepSpeed {deepspeed.__version__} ZeRO-{stage}, torch AdamW; state = every tensor its "
                        "optimizer holds (communication buckets at their default sizes included) + module params "
                        "and grads"}
    return step, info


def _setup(name: str, precision: str, accum: int):
    if name in ("cddp", "cfsdp2"):
        return (_setup_ddp if name == "cddp" else _setup_fsdp2)(precision, accum, compiled=True)
    if name.startswith("czero"):
        return _setup_zfunc(int(name[5:]), precision, accum, compiled=True)
    if name.startswith("ds"):
        return _setup_deepspeed(int(name[2:]), precision, accum)
    if name.startswith("engine"):
        return _setup_engine(int(name[6:]), precision, accum)
    if name == "ddp":
        return _setup_ddp(precision, accum)
    if name == "fsdp2":
        return _setup_fsdp2(precision, accum)
    if name.startswith("zero"):
        return _setup_zfunc(int(name[4:]), precision, accum)
    if name.startswith("offload"):
        return _setup_zfunc(int(name[7:]), precision, accum, offload="cpu")
    if name == "noprefetch3":
        return _setup_zfunc(3, precision, accum, prefetch=0)
    if name.startswith("atstep"):
        return _setup_zfunc(int(name[6:]), precision, accum, fold=False)
    if name.startswith("gloored"):
        return _setup_zfunc(int(name[7:]), precision, accum, p2p=False)
    if name.startswith("atonce"):
        return _setup_zfunc(int(name[6:]), precision, accum, units=False)
    if name.startswith("lowgrad"):
        return _setup_zfunc(int(name[7:]), precision, accum, low_grads=True)
    raise ValueError(f"unknown contender {name!r}; expected one of {CONTENDERS}")


# ----------------------------------------------------------------------------- one rank

def _faults() -> int:
    """Minor page faults of this process so far: a fresh buffer costs one per page it touches (on
    this VM about 24 ms per 67 MB zeroed, against 3.4 ms to zero a reused one), the same on every
    run, so the count shows what a step allocates afresh without the noise of wall time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _profiled(kind: str, fn, rows: int) -> str:
    if kind == "torch":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("cumulative").print_stats(rows)
    st.sort_stats("tottime").print_stats(rows)
    return buf.getvalue()


def _timed(step, b) -> dict[str, float]:
    """One step: wall, process CPU and main-thread CPU, each whole and up to the end of backward,
    the forwards' share, and the minor page faults."""
    _FWD.clear()
    _MID.clear()
    f0 = _faults()
    c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
    t_mid = step(b)
    t1, c1, m1 = time.perf_counter(), time.process_time(), time.thread_time()
    return {"times": t1 - t0, "fwdbwd": t_mid - t0, "cpu": c1 - c0, "faults": _faults() - f0,
            "main": m1 - m0, "main_fwdbwd": _MID[-1] - m0, "fwd": sum(w for w, _ in _FWD),
            "main_fwd": sum(c for _, c in _FWD)}


PHASE_KEYS = ("times", "fwdbwd", "cpu", "faults", "main", "main_fwdbwd", "fwd", "main_fwd")


def run_rank(rank: int, name: str, precision: str, warmup: int, steps: int,
             profile: str | None, profile_steps: int, rows: int, accum: int = 1) -> dict[str, Any]:
    torch.set_num_threads(1)
    batches = _batches(rank, warmup + steps, accum)
    _build_model()  # a throwaway build, so that the baseline below includes a built model
    base_rss = _maxrss_bytes()
    step, info = _setup(name, precision, accum)
    setup_rss = _maxrss_bytes()
    for b in batches[:warmup]:
        step(b)
    if profile:
        # Both ranks run the profiled steps (collectives need both); rank 0 records them.
        def run():
            for b in batches[warmup:warmup + profile_steps]:
                dist.barrier()
                step(b)
        dist.barrier()
        t0 = time.perf_counter()
        text = _profiled(profile, run, rows) if rank == 0 else (run() or "")
        return {"profile": text, "seconds": time.perf_counter() - t0}
    rec: dict[str, list[float]] = {k: [] for k in PHASE_KEYS}
    for b in batches[warmup:]:
        dist.barrier()
        for k, v in _timed(step, b).items():
            rec[k].append(v)
    out = info()
    if torch.get_num_threads() != 1:  # something in the contender's step changed it
        out["note"] += f"; WARNING: torch threads 1 -> {torch.get_num_threads()} during the run (not reset)"
    out.update(rec, base_rss=base_rss, setup_rss=setup_rss, peak_rss=_maxrss_bytes())
    return out


def run_rank_interleaved(rank: int, names: list[str], precision: str, warmup: int,
                         steps: int, accum: int = 1) -> dict[str, dict[str, Any]]:
    """All ``names`` in one world, their steps alternating (round-robin, rotating the order).

    Background load on a shared machine then hits every contender alike, so the time ratios are
    robust; peak RSS is meaningless here (every contender is alive at once) and is not reported.
    """
    torch.set_num_threads(1)
    batches = _batches(rank, warmup + steps, accum)
    runs = {n: _setup(n, precision, accum) for n in names}
    rec: dict[str, dict[str, Any]] = {n: {**{k: [] for k in PHASE_KEYS}, "threads": set()} for n in names}
    for b in batches[:warmup]:
        for n in names:
            torch.set_num_threads(1)
            runs[n][0](b)
            rec[n]["threads"].add(torch.get_num_threads())
    for i, b in enumerate(batches[warmup:]):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            torch.set_num_threads(1)  # one contender must not change the threads of the next
            dist.barrier()
            for key, v in _timed(runs[n][0], b).items():
                rec[n][key].append(v)
            rec[n]["threads"].add(torch.get_num_threads())
    for n in names:
        changed = sorted(rec[n].pop("threads") - {1})
        rec[n].update(runs[n][1]())
        if changed:
            rec[n]["note"] += (f"; WARNING: its step set torch threads 1 -> {changed} "
                               "(reset to 1 before every step here)")
        rec[n].update(base_rss=0, setup_rss=0, peak_rss=0)
    return rec


# ----------------------------------------------------------------------------- driver

def _summarise(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(per_rank[0]["times"])
    step_max = [max(r["times"][i] for r in per_rank) for i in range(n)]
    fb_max = [max(r["fwdbwd"][i] for r in per_rank) for i in range(n)]
    # the optimizer part of the slowest rank's step
    opt_max = [max(r["times"][i] - r["fwdbwd"][i] for r in per_rank) for i in range(n)]
    cpu_max = [max(r["cpu"][i] for r in per_rank) for i in range(n)]
    faults_max = [max(r["faults"][i] for r in per_rank) for i in range(n)]
    return {"median": statistics.median(step_max), "min": min(step_max), "max": max(step_max), "steps": step_max,
            "cpu": statistics.median(cpu_max), "faults": statistics.median(faults_max),
            "fwdbwd": statistics.median(fb_max), "opt": statistics.median(opt_max),
            "phases": _phases(per_rank),
            "peak_rss": [r["peak_rss"] for r in per_rank],
            "add_rss": [r["peak_rss"] - r["base_rss"] for r in per_rank],
            "state": [r["state_bytes"] for r in per_rank],
            "loss": per_rank[0]["loss"], "note": per_rank[0]["note"]}


def _phases(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """The slowest rank's step split by phase (medians over steps, seconds): forward, backward
    and optimizer each as wall time and the main thread's CPU time (the wall time beyond it is
    waiting: for a collective, or for the core), and the CPU time of the process's other threads
    (gloo's workers: the collectives' copies and sums)."""
    n = len(per_rank[0]["times"])
    slow = [max(per_rank, key=lambda r: r["times"][i]) for i in range(n)]
    def med(f) -> float:
        return statistics.median(f(r, i) for i, r in enumerate(slow))
    return {"fwd": med(lambda r, i: r["fwd"][i]), "fwd_cpu": med(lambda r, i: r["main_fwd"][i]),
            "bwd": med(lambda r, i: r["fwdbwd"][i] - r["fwd"][i]),
            "bwd_cpu": med(lambda r, i: r["main_fwdbwd"][i] - r["main_fwd"][i]),
            "opt": med(lambda r, i: r["times"][i] - r["fwdbwd"][i]),
            "opt_cpu": med(lambda r, i: r["main"][i] - r["main_fwdbwd"][i]),
            "comm_cpu": med(lambda r, i: r["cpu"][i] - r["main"][i])}


def _phase_table(results: dict[str, dict[str, Any]]) -> str:
    """By phase, ms: wall time (main thread's CPU time) per phase, and the other threads' CPU."""
    head = ("| contender | step | forward | backward | optimizer | waiting (wall - main CPU) | "
            "collective threads' CPU |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in results.items():
        p = r["phases"]
        wait = sum(p[k] - p[k + "_cpu"] for k in ("fwd", "bwd", "opt"))
        lines.append(f"| {name} | {r['median'] * 1e3:.0f} | " + " | ".join(
            f"{p[k] * 1e3:.0f} ({p[k + '_cpu'] * 1e3:.0f})" for k in ("fwd", "bwd", "opt"))
            + f" | {wait * 1e3:.0f} | {p['comm_cpu'] * 1e3:.0f} |")
    return "\n".join(lines)


def _pairs(names: list[str]) -> list[tuple[str, str]]:
    """The comparisons the goals name, and each A/B contender against its zfunc stage."""
    out = [(f"zero{k}", f"ds{k}") for k in (1, 2, 3)]
    out += [("zero1", "ddp"), ("zero2", "ddp"), ("zero3", "ddp"), ("zero3", "fsdp2"), ("zero0", "ddp"), ("zero3", "noprefetch3")]
    out += [(f"zero{k}", f"{ab}{k}") for ab in ("atstep", "gloored", "atonce") for k in (0, 1, 2, 3)]
    out += [(f"lowgrad{k}", f"ds{k}") for k in (1, 2, 3)]
    out += [("cddp", "ddp"), ("cfsdp2", "fsdp2")] + [(f"czero{k}", f"zero{k}") for k in (0, 1, 2, 3)]
    out += [("czero1", "cddp"), ("czero2", "cddp"), ("czero3", "cddp"), ("czero3", "cfsdp2")]
    return [(a, b) for a, b in out if a in names and b in names]


def _paired(results: dict[str, dict[str, Any]], interleaved: bool) -> str:
    """Per-round ratios: in an interleaved run every round times each contender once, close in
    time, so ``a[i] / b[i]`` cancels the machine's drift between rounds; their median (and
    quartiles) is the robust A/B. Without --interleave the rounds are minutes apart: not shown."""
    if not interleaved:
        return ""
    lines = ["paired ratios (median over rounds of a / b in the same round [quartiles]; < 1: a is faster):"]
    for a, b in _pairs(list(results)):
        ratios = sorted(x / y for x, y in zip(results[a]["steps"], results[b]["steps"]))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        lines.append(f"  {a:>8s} / {b:<11s} {statistics.median(ratios):.3f}  [{q[0]:.3f}, {q[2]:.3f}]")
    return "\n".join(lines) if len(lines) > 1 else ""


# (a, b, limit): a's step time at most limit x b's
GOALS = [("zero1", "ddp", 1.0), ("zero2", "ddp", 1.0), ("zero3", "ddp", 1.05),
         ("czero2", "cddp", 1.0), ("czero3", "cddp", 1.05),
         ("zero1", "ds1", 0.9), ("zero2", "ds2", 0.9), ("zero3", "ds3", 0.9), ("engine2", "zero2", 1.02)]


def _goals(results: dict[str, dict[str, Any]], interleaved: bool) -> str:
    """Each goal whose contenders ran: the paired median ratio (interleaved) or the ratio of
    medians, and the ratio of CPU time per step."""
    lines = []
    for a, b, limit in GOALS:
        if a in results and b in results:
            if interleaved:
                q = statistics.median(x / y for x, y in zip(results[a]["steps"], results[b]["steps"]))
            else:
                q = results[a]["median"] / results[b]["median"]
            c = results[a]["cpu"] / results[b]["cpu"]
            lines.append(f"goal {a} <= {limit:.2f}x {b}: {q:.3f}x -> {'MET' if q <= limit else 'NOT MET'} "
                         f"(CPU time per step {c:.3f}x)")
    return "\n".join(lines)


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f}"


def _table(results: dict[str, dict[str, Any]]) -> str:
    """One markdown table; ratios are against ``ddp`` when it ran (RSS ratios use the larger rank)."""
    ref = results.get("ddp")

    def vs(value: float, ref_value: float | None) -> str:
        return f"{value / ref_value:.2f}x" if ref_value else "-"

    head = ("| contender | step ms (median) | min-max ms | vs DDP | CPU ms/step | vs DDP | page faults/step | fwd+bwd ms | "
            "optim ms | peak RSS MiB r0/r1 | +RSS MiB r0/r1 | vs DDP | model state MiB/rank (p+g+o) | "
            "vs DDP | final loss | notes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in results.items():
        st = r["state"][0]
        has_rss = r["peak_rss"][0] > 0
        peak = "/".join(_mib(x) for x in r["peak_rss"]) if has_rss else "-"
        add = "/".join(_mib(x) for x in r["add_rss"]) if has_rss else "-"
        add_vs = vs(max(r["add_rss"]), max(ref["add_rss"])) if ref and has_rss else "-"
        state = f"{_mib(st['total'])} ({_mib(st['params'])}+{_mib(st['grads'])}+{_mib(st['optimizer'])})"
        cells = [name, f"{r['median'] * 1e3:.0f}", f"{r['min'] * 1e3:.0f}-{r['max'] * 1e3:.0f}",
                 vs(r["median"], ref and ref["median"]), f"{r['cpu'] * 1e3:.0f}",
                 vs(r["cpu"], ref and ref["cpu"]), f"{r['faults'] / 1e3:.1f}k",
                 f"{r['fwdbwd'] * 1e3:.0f}", f"{r['opt'] * 1e3:.0f}", peak, add, add_vs, state,
                 vs(st["total"], ref and ref["state"][0]["total"]), f"{r['loss']:.4f}", r["note"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(CONTENDERS),
                   help=f"comma-separated contenders (default all: {','.join(CONTENDERS)})")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warmup steps (default 2)")
    p.add_argument("--profile", choices=["torch", "cprofile"], default=None,
                   help="instead of timing, profile rank 0 for --profile-steps steps after warmup")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=30, help="rows of profiler output")
    p.add_argument("--json", default=None, help="also write the summary to this JSON file (for plot.py)")
    p.add_argument("--interleave", action="store_true",
                   help="run all contenders in one world with their steps alternating (robust time "
                        "ratios on a loaded machine; no RSS numbers)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parse(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in names if n not in CONTENDERS]
    if bad:
        raise SystemExit(f"--only: unknown contender(s) {bad}; expected from {CONTENDERS}")
    try:
        import deepspeed  # noqa: F401
        ds = f"deepspeed: {deepspeed.__version__} (contenders ds1, ds2, ds3)"
    except Exception:  # noqa: BLE001
        ds = "deepspeed: not installed (ds1-ds3 skipped; see the module docstring for its venv)"
        names = [n for n in names if not n.startswith("ds")]
    import zfunc_kernels
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{WORLD} ranks x 1 thread (gloo), zfunc {zfunc.__version__}, "
          f"zfunc_kernels from {os.path.dirname(zfunc_kernels.__file__)}", flush=True)
    print(f"CPU: {cpu_line()}", flush=True)
    print(f"GPT {MODEL}, seq {SEQ}, micro-batch {MICRO_BATCH}/rank, AdamW lr {LR} wd {WD}, clip {CLIP}, "
          f"{args.precision}, grad_accum {args.grad_accum}, warmup {args.warmup}, timed steps {args.steps}",
          flush=True)
    print(ds, flush=True)
    results: dict[str, dict[str, Any]] = {}
    interleaved = False
    if args.interleave and not args.profile:
        t0 = time.perf_counter()
        per_rank = zfunc.launch(run_rank_interleaved, world_size=WORLD, threads=1, timeout=3600,
                                args=(names, args.precision, args.warmup, args.steps, args.grad_accum))
        print(f"interleaved: all contenders in one world, steps alternating "
              f"[{time.perf_counter() - t0:.0f} s]; RSS columns are not measured in this mode", flush=True)
        results = {n: _summarise([r[n] for r in per_rank]) for n in names}
        names, interleaved = [], True
    for name in names:
        t0 = time.perf_counter()
        per_rank = zfunc.launch(run_rank, world_size=WORLD, threads=1, timeout=1800,
                                args=(name, args.precision, args.warmup, args.steps,
                                      args.profile, args.profile_steps, args.rows, args.grad_accum))
        if args.profile:
            print(f"\n===== {name}: {args.profile} profile of rank 0, {args.profile_steps} steps "
                  f"({per_rank[0]['seconds']:.2f} s) =====\n{per_rank[0]['profile']}", flush=True)
            continue
        results[name] = _summarise(per_rank)
        r = results[name]
        print(f"{name:6s} median step {r['median'] * 1e3:7.1f} ms  (CPU {r['cpu'] * 1e3:.0f} ms; "
              f"fwd+bwd {r['fwdbwd'] * 1e3:.0f}, optim {r['opt'] * 1e3:.0f})  loss {r['loss']:.4f}  "
              f"[{time.perf_counter() - t0:.0f} s incl. spawn]", flush=True)
    if results:
        print()
        print(_table(results))
        print("\nby phase, ms (slowest rank, median over steps): wall (main thread's CPU); the wall time beyond the "
              "main thread's CPU is waiting, for a collective or for the core")
        print(_phase_table(results))
        paired = _paired(results, interleaved)
        if paired:
            print("\n" + paired)
        goals = _goals(results, interleaved)
        if goals:
            print("\n" + goals)
    if args.json and results:
        import json
        with open(args.json, "w") as f:
            json.dump({"precision": args.precision, "grad_accum": args.grad_accum, "steps": args.steps,
                       "interleave": args.interleave,
                       "results": {n: {k: r[k] for k in ("median", "min", "max", "cpu", "fwdbwd", "opt", "loss",
                                                         "steps", "faults", "phases")}
                                   | {"state_mib": r["state"][0]["total"] / 2**20} for n, r in results.items()}},
                      f, indent=1)
    return results


if __name__ == "__main__":
    main()
