"""Bytes per rank: `memory_report` reads them off a state, `memory_plan` computes them from shapes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zfunc.core.donation import check_live

from zfunc.core import opt_state
from zfunc.core.config import Config
from zfunc.core.create import trainable_params, units_of
from zfunc.distributed.layout import make_layout
from zfunc.distributed.mesh import shard_ranks
from zfunc.core.state import TrainState, accumulator_numel, is_released

__all__ = ["memory_report", "memory_plan", "peak_allocated"]


def memory_report(state: TrainState) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state, and where.

    ``params`` counts the compute copy and the master copy once each (once in total where they
    share memory); ``grads`` the gradient accumulator, 0 between optimizer steps (it is released
    after each step and allocated by the next micro-batch); ``optimizer`` counts the optimizer's
    slots (Adam's two moments, SGD's, Lion's or Adagrad's one); ``total`` adds them up. ``device``
    and ``host`` split ``total`` between the compute device and the host arena of
    ``Config.offload_optimizer`` (which holds the master and the optimizer's slots; ``host`` is 0
    without offload).

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(7, 1), zfunc.Config(stage=0))
        >>> rep = zfunc.memory_report(state)
        >>> rep["params"], rep["grads"], rep["optimizer"], rep["host"]
        (32, 0, 64, 0)
        >>> state, _ = zfunc.backward_step(state, lambda model, x: model(x).sum(), torch.ones(1, 7))
        >>> zfunc.memory_report(state)["grads"]                      # during a step
        32
    """
    check_live(state, "memory_report")
    def nbytes(*ts: torch.Tensor) -> int:
        seen: dict[int, int] = {}
        for t in ts:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return sum(seen.values())

    slots = [getattr(r, n) for o, r in zip(opt_state.optimizers(state.cfg), opt_state.records(state))
             for n in o.moments]
    grads = 0 if is_released(state.grads) else nbytes(state.grads)
    rep = {"params": nbytes(state.params, state.compute), "grads": grads,
           "optimizer": sum(nbytes(t) for t in slots)}
    host = nbytes(state.params) + rep["optimizer"] if state.cfg.offload_optimizer else 0
    return _totals(rep, host)


def _totals(rep: dict[str, int], host: int) -> dict[str, int]:
    total = sum(rep.values())
    return {**rep, "total": total, "device": total - host, "host": host}


def memory_plan(model: torch.nn.Module, cfg: Config, world_size: int) -> dict[str, int]:
    """The bytes `memory_report` will show on each rank during a step, computed from shapes alone.

    ``grads`` is the gradient accumulator a step allocates with its first micro-batch (between
    steps `memory_report` shows 0 there), so ``total`` is the model state's peak.

    Nothing is allocated and no process group is needed, so any world size can be planned.
    With ``cfg.shard_size`` the state is sharded over that many ranks instead of the world; with
    ``cfg.offload_optimizer`` the master and optimizer state count under ``host``.

    Examples:
        >>> import torch, zfunc
        >>> model = torch.nn.Linear(1000, 1000)                      # 1,001,000 parameters
        >>> for stage in range(4):  # 4 micro-batches per step (stage 1 then keeps a full gradient)
        ...     plan = zfunc.memory_plan(model, zfunc.Config(stage=stage, grad_accum=4), world_size=8)
        ...     print(stage, round(plan["total"] / 2**20, 2), "MiB per rank")
        0 15.27 MiB per rank
        1 8.59 MiB per rank
        2 5.25 MiB per rank
        3 1.91 MiB per rank
        >>> off = zfunc.memory_plan(model, zfunc.Config(stage=2, offload_optimizer="cpu"), world_size=8)
        >>> round(off["device"] / 2**20, 2), round(off["host"] / 2**20, 2)
        (4.3, 1.43)
    """
    trainable = trainable_params(model, cfg)
    units, names = units_of(model, cfg, trainable)
    lay = make_layout(units, world=shard_ranks(cfg.shard_size, world_size), rank=0, align=cfg.align, names=names)
    size = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731
    opt_numel = lay.full_numel if cfg.stage == 0 else lay.arena_numel
    compute = (lay.arena_numel if cfg.stage == 3 else lay.full_numel) * size(cfg.compute_dtype)
    offload = cfg.offload_optimizer is not None
    shared = cfg.compute_dtype == cfg.master_dtype and not offload  # the master is a view of the compute copy
    master = 0 if shared else opt_numel * size(cfg.master_dtype)
    grads = accumulator_numel(cfg, lay) * size(cfg.grad_accum_dtype)
    opt_runs = opt_state.runs(cfg, lay)  # rank 0's share of each optimizer's elements
    optimizer = sum(len(o.moments) * opt_state.numel(r) for o, r in zip(opt_state.optimizers(cfg), opt_runs)
                    ) * size(cfg.moment_dtype)
    plan = {"params": compute + master, "grads": grads, "optimizer": optimizer}
    return _totals(plan, master + optimizer if offload else 0)


def peak_allocated(fn: Callable[[], object]) -> int:
    """The most bytes ``fn()`` held allocated at once beyond what was live before it, from the
    torch profiler's allocation and free records in time order (tensors on the CPU; a measure
    for tests and benchmarks, not for a training loop: the profiler slows ``fn`` down).

    Examples:
        >>> import torch
        >>> def twice():
        ...     for _ in range(2):
        ...         torch.empty(1000).sum()  # 4000 bytes each time, freed before the next
        >>> peak_allocated(twice) >= 4000, peak_allocated(twice) < 8000
        (True, True)
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for _, delta in sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                           if e.self_cpu_memory_usage):
        live += delta
        peak = max(peak, live)
    return peak
