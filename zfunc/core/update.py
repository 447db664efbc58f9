"""`apply_step`: reduce, check, clip, update, gather.

The one optimizer step of every stage, written so the algorithm reads plainly:

1. reduce the accumulated gradient to its owners (stage 0: all-reduce; stage 1: reduce-scatter;
   stages 2-3 already reduced during backward);
2. check: one read-only pass gives ``found_inf`` and the sum of squares; one tiny all-reduce
   makes every rank agree on both (and on the mean loss);
3. clip: ``coef = min(1, clip / (norm + 1e-6))``, as `torch.nn.utils.clip_grad_norm_`;
4. update: one fused pass unscales, clips, skips on overflow, applies Adam/AdamW and writes the
   compute-dtype copy; with ``Config.offload_optimizer`` the gradient shard goes to the host,
   the pass runs there on the host arena, and the new compute-dtype shard comes back;
5. gather the updated compute parameters (stages 1-2; with ``Config.units`` the next forward
   gathers them unit by unit, `zfunc.autograd.forward_gather`);
6. give every rank rank 0's buffers (BatchNorm statistics), as DDP's ``broadcast_buffers`` does.

Nothing here reads a device value on the host, except under offload on a GPU (the host pass needs
the step's scalars: one wait per step, as DeepSpeed's CPU Adam).
"""

from __future__ import annotations

import dataclasses

import torch

import zfunc_kernels
from zfunc.distributed import comm
from zfunc.distributed.pool import whole
from zfunc._probes import tensors_over
from zfunc.core import opt_state
from zfunc.core.donation import check_live, check_not_giving, donate_
from zfunc.core.muon import muon_step
from zfunc.core.optim import MuonConfig
from zfunc.distributed.layout import master_view
from zfunc.core.scaler import scaler_update
from zfunc.core.state import (GroupHyper, Metrics, TrainState, accumulator, accumulator_numel, host_flag, is_released,
                         released_grads)

__all__ = ["apply_step", "learning_rate", "learning_rates", "set_hyperparams"]


def learning_rates(state: TrainState) -> torch.Tensor:
    """Each parameter group's learning rate for the next applied step (float32, on the device).

    Without a schedule, ``state.hyper.lr``. With one, the schedule's value scaled per group by
    ``hyper.lr[g] / optimizer.lr`` (as torch's schedulers scale each group's initial lr); a
    DeepSpeed scheduler read by `zfunc.Config.from_deepspeed` follows DeepSpeed's rule per group.
    Schedules advance with applied steps only: a step skipped for overflow does not move them.

    Examples:
        >>> import torch, zfunc
        >>> cfg = zfunc.Config(optimizer=zfunc.adamw(lr=0.1), param_groups=[zfunc.ParamGroup("bias", lr=0.2)])
        >>> [round(x, 6) for x in zfunc.learning_rates(zfunc.init(torch.nn.Linear(1, 1), cfg)).tolist()]
        [0.1, 0.2]
    """
    cfg = state.cfg
    lrs = state.hyper.lr
    if cfg.lr_schedule is not None:
        per_group = getattr(cfg.lr_schedule, "per_group", None)  # a schedule with a rule per group of its own
        if per_group is not None:
            return per_group(state.opt.count, lrs).to(state.device, torch.float32)
        base = torch.as_tensor(cfg.lr_schedule(state.opt.count), dtype=torch.float64).to(state.device)
        return (base * _schedule_ratio(state).to(state.device)).to(torch.float32)
    return lrs.to(state.device, torch.float32)


def _schedule_ratio(state: TrainState) -> torch.Tensor:
    """Each group's share of the schedule: ``hyper.lr / optimizer.lr`` (1 when that lr is 0)."""
    base = state.cfg.optimizer.lr
    return state.hyper.lr / base if base > 0 else torch.ones_like(state.hyper.lr)


def learning_rate(state: TrainState) -> torch.Tensor:
    """The learning rate the next applied step uses (a float32 device scalar): that of the first
    parameter group holding parameters (group 0 unless every parameter is in a `zfunc.ParamGroup`).

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(1, 1), zfunc.Config(optimizer=zfunc.adamw(lr=0.1)))
        >>> round(zfunc.learning_rate(state).item(), 6)
        0.1
    """
    return learning_rates(state)[state.layout.groups[0]]


def set_hyperparams(state: TrainState, group: int = 0, **values: float | tuple[float, float]) -> TrainState:
    """A state whose parameter group ``group`` uses new hyperparameters from the next step on.

    ``values``: any hyperparameter the optimizer reads (``lr``, ``weight_decay``, and ``betas``
    and ``eps`` for Adam; ``momentum`` and ``dampening`` for SGD; ``betas`` for Lion;
    ``lr_decay`` and ``eps`` for Adagrad), checked as the optimizer's own. The state keeps
    them, and so does a checkpoint of it. Changing the learning rate every iteration by hand
    (nanoGPT's loop) is ``state = set_hyperparams(state, g, lr=...)`` for each group ``g``.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config(optimizer=zfunc.adamw(lr=0.1)))
        >>> later = zfunc.set_hyperparams(state, lr=0.05, betas=(0.9, 0.95))
        >>> later.hyper.lr.tolist(), later.hyper.beta2.tolist(), state.hyper.lr.tolist()
        ([0.05], [0.95], [0.1])
    """
    h = state.hyper
    if not (isinstance(group, int) and 0 <= group < h.lr.numel()):
        raise ValueError(f"set_hyperparams: group must be in [0, {h.lr.numel()}), got {group!r}")
    opt = opt_state.optimizers(state.cfg)[opt_state.optimizer_of(state.cfg)[group]]
    names = {"betas" if n.startswith("beta") else n for n in opt.live}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"set_hyperparams: {opt.name} does not read {sorted(unknown)}; it reads "
                         f"{', '.join(sorted(names))}")
    current = {name: getattr(h, name)[group].item() for name in opt.live}
    changes = dict(values)
    if "betas" in changes:
        b1, b2 = changes.pop("betas")
        changes.update(beta1=b1, beta2=b2)
    merged = {**current, **changes}
    fields = dict(merged)
    if "beta1" in fields:
        fields["betas"] = (fields.pop("beta1"), fields.pop("beta2"))
    type(opt)(**fields)  # the same checks as the optimizer's own values
    new = {}
    for name in (f.name for f in dataclasses.fields(h)):
        t = getattr(h, name)
        if name in changes:
            t = t.clone()
            t[group] = float(merged[name])
        new[name] = t
    return state.replace(hyper=GroupHyper(**new))


def _reduce(state: TrainState, donate: bool) -> torch.Tensor:
    """This rank's summed gradient over the optimizer's domain, in the accumulation dtype.

    Stage 0 all-reduces over the world; stage 1 with ``grad_accum > 1`` reduce-scatters over the
    shard group; unless backward reduced already (`Config.shards_grads`, or ``state.reduced``:
    the step's last micro-batch folded the reduce into its backward). With
    replicas (``Config.shard_size``) the shard is then all-reduced across them, once per step: the
    only collective that crosses replicas.
    """
    cfg, mesh = state.cfg, state.mesh
    grads = state.grads
    if is_released(grads):  # a step without a micro-batch: zeros, a buffer of our own
        grads, donate = accumulator(grads, donate, state.binding.pool), True
    if not (cfg.shards_grads or state.reduced) and mesh.world.size > 1:
        wire = grads.to(cfg.reduce_dtype)
        if state.stage == 0:
            out = comm.all_reduce_(_scratch(wire, grads, donate), "sum", mesh.world)
        elif donate or wire is not grads:  # the donated buffer (or its cast copy) is scratch
            out = comm.reduce_scatter_(wire, "sum", mesh.shard)
        else:
            out = comm.reduce_scatter(wire, "sum", mesh.shard)
        grads, donate = out.to(cfg.grad_accum_dtype), True  # a new buffer: free to reduce in place
    if state.stage > 0 and mesh.replicas.size > 1:
        wire = grads.to(cfg.reduce_dtype)
        out = comm.all_reduce_(_scratch(wire, grads, donate), "sum", mesh.replicas)
        grads = out.to(cfg.grad_accum_dtype)
    return grads


def _scratch(wire: torch.Tensor, grads: torch.Tensor, donate: bool) -> torch.Tensor:
    """``wire`` (``grads`` in the reduce dtype) as a buffer a collective may overwrite: itself when
    it is a cast copy or ``grads`` was donated, else a copy."""
    return wire if (donate or wire is not grads) else wire.clone()


def apply_step(state: TrainState, *, donate: bool = False, micro_batches: int | None = None) -> TrainState:
    """Apply one optimizer step with the gradients accumulated since the last one.

    Reduce, unscale, check for overflow, clip, update, gather. On an overflow (any non-finite
    gradient on any rank) the step is skipped on every rank: parameters and moments stay bitwise
    unchanged, the loss scale backs off, and ``metrics.skipped`` is 1.

    The gradient is the mean over the micro-batches run since the last step on all ranks: after
    ``grad_accum`` of them on every rank, as configured; after fewer (an epoch's short last
    accumulation), the mean over those actually seen, never their sum divided by ``grad_accum``.
    ``micro_batches`` says otherwise: the engine passes ``grad_accum`` (DeepSpeed's rule: each
    backward is ``1 / grad_accum`` of a step, however many ran).

    Args:
        state: the `TrainState`.
        donate: update ``state``'s buffers in place (``state`` must not be used again); without
            it ``state`` is left bitwise unchanged.
        micro_batches: the micro-batches per rank the accumulated gradient is the mean of
            (each came in times ``1 / grad_accum``); default: those accumulated since the last step.

    Returns:
        The new state: ``step + 1``, gradients released (zeros holding no memory until the next
        micro-batch), ``metrics`` filled in.

    Examples:
        >>> import torch, zfunc
        >>> torch.manual_seed(0) and None
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config(optimizer=zfunc.adamw(lr=0.1)))
        >>> loss_fn = lambda model, x: model(x).sum()
        >>> for _ in range(3):
        ...     state, loss = zfunc.backward_step(state, loss_fn, torch.ones(1, 2))
        ...     state = zfunc.apply_step(state)
        ...     print(round(state.metrics.loss.item(), 4))
        -0.208
        -0.5077
        -0.8072
    """
    check_live(state, "apply_step")
    check_not_giving(state, "apply_step")
    if int(state.micro_step) == 0:  # on the host: no wait
        raise RuntimeError(
            "apply_step: no micro-batch was accumulated since the last step (backward_step, vjp's pullback or "
            "accumulate), so there is no gradient to apply, and an update here would still move every weight by "
            "its weight decay and decay the moments (a step without any gradient is a loop's mistake; torch's "
            "optimizers would do nothing). Run a micro-batch first (a loop that calls the step twice?). Nothing "
            "was changed")
    cfg, lay, group = state.cfg, state.layout, state.group
    lrs = learning_rates(state)
    # A schedule's non-finite or negative lr must never reach the weights: on the host (CPU) it is
    # an error at once; on a GPU (no sync) the step is skipped and metrics.lr shows the value.
    if lrs.device.type == "cpu" and not bool((torch.isfinite(lrs) & (lrs >= 0)).all()):
        raise ValueError(f"lr_schedule: returned {lrs.tolist()} for update {int(state.opt.count)}; a learning "
                         "rate must be finite and >= 0. Nothing was changed")
    grad = _reduce(state, donate)

    # Check: found_inf and sum of squares of this rank's part, then agree across ranks.
    stats = zfunc_kernels.overflow_sumsq(grad)
    local = torch.stack([state.loss_sum, state.micro_step.to(state.device, torch.float32)])
    if state.stage == 0:  # every rank holds the whole reduced gradient already
        agreed = torch.cat([stats, comm.all_reduce(local, "sum", group)])
    else:  # each shard counted once: by the first replica (the others hold the same values)
        agreed = comm.all_reduce(torch.cat([stats if state.mesh.replicas.rank == 0 else torch.zeros_like(stats),
                                            local]), "sum", group)
    found_inf = (agreed[0] > 0).to(torch.float32)
    # Each micro-batch's gradient came in times 1 / (grad_accum * world): after fewer micro-batches
    # than that (an epoch's short last accumulation) the step uses their mean, not their sum over
    # grad_accum * world. The factor is exactly 1 after a full accumulation.
    if micro_batches is None:
        mean = (cfg.grad_accum * group.size) / torch.clamp(agreed[-1], min=1.0)
    else:
        mean = torch.full((), cfg.grad_accum / micro_batches, dtype=torch.float32, device=state.device)
    inv_scale = (1.0 / state.scaler.scale).to(torch.float32) * mean
    grad_norm = agreed[1].sqrt() * inv_scale
    if cfg.clip_value > 0:
        clip_coef = torch.clamp(cfg.clip_value / (grad_norm + 1e-6), max=1.0)
    else:
        clip_coef = torch.ones((), dtype=torch.float32, device=state.device)
    skip = torch.maximum(found_inf, (~(torch.isfinite(lrs) & (lrs >= 0)).all()).to(torch.float32))

    # Update this rank's master, moments and compute copy in one pass.
    compute = state.compute if donate else state.compute.clone()
    aliased = state.params.untyped_storage().data_ptr() == state.compute.untyped_storage().data_ptr()
    if aliased:  # the master is (a view of) the compute buffer
        master = compute if state.stage == 3 else master_view(compute, lay, state.stage)
    else:
        master = state.params if donate else _clone(state.params)
    if aliased:
        compute_out = None
    elif state.stage in (0, 3):
        compute_out = compute
    else:  # this rank's slice of the full compute buffer, gathered below
        compute_out = master_view(compute, lay, state.stage)
    target, k_lrs, k_inv, k_clip, k_skip = compute_out, lrs, inv_scale, clip_coef, skip  # what the pass reads
    if cfg.offload_optimizer is not None:  # ZeRO-Offload: the pass runs on the host, where the state lives
        pin = master.is_pinned()
        grad = _host_copy(grad, pin)
        host = torch.cat([lrs, torch.stack([inv_scale, clip_coef, skip])]).cpu()  # one wait, after grad's copy
        k_lrs, (k_inv, k_clip, k_skip) = host[:lrs.numel()], host[lrs.numel():]
        compute_out = torch.empty(target.shape, dtype=target.dtype, pin_memory=pin)
    # Each optimizer: one fused pass per run of one parameter group (Muon: its three parts).
    records, owner = [], opt_state.optimizer_of(cfg)
    for k, (opt, record, runs) in enumerate(zip(opt_state.optimizers(cfg), opt_state.records(state),
                                                opt_state.runs(cfg, lay))):
        moments = [getattr(record, n) if donate else _clone(getattr(record, n)) for n in opt.moments]
        table = {name: getattr(state.hyper, name).tolist() for name in opt.live}  # on the host: no sync
        scalars = zfunc_kernels.StepScalars(step=record.count, lr=k_lrs[0], inv_scale=k_inv, clip_coef=k_clip,
                                            found_inf=k_skip)
        if isinstance(opt, MuonConfig):
            groups = tuple(g for g, o in enumerate(owner) if o == k)  # every rank's, whatever it owns
            muon_step(opt, groups, runs, master, grad, moments[0], compute_out, k_lrs, table, scalars,
                      lay, state.stage == 0, state.mesh.shard)
        else:
            for r in runs:
                opt.fused(r.part(master), r.part(grad), [m.narrow(0, r.at, r.length) for m in moments],
                          scalars._replace(step=record.count.clone(), lr=k_lrs[r.group]),  # a pass bumps its copy
                          {name: values[r.group] for name, values in table.items()}, r.part(compute_out))
        count = record.count + (k_skip == 0).to(record.count.dtype)
        records.append(opt.state_class(**dict(zip(opt.moments, moments)), count=count))

    if compute_out is not target and not bool(k_skip):  # the updated compute-dtype shard back to the
        target.copy_(compute_out, non_blocking=compute_out.is_pinned())  # device (a skipped pass wrote none)
    # Gather the updated compute parameters where forward reads them in full: with units, the
    # next forward gathers them unit by unit as its modules run (zfunc.autograd.forward_gather); else here.
    gathered = True
    if state.stage in (1, 2) and state.mesh.shard.size > 1:
        if state.binding.gather_plan is not None:
            gathered = False
        else:
            comm.all_gather_into(compute, master_view(compute, lay, state.stage), state.mesh.shard)  # in place

    # Until the next micro-batch (sized by the config: a reduced stage-1 gradient is a shard).
    grads = released_grads(accumulator_numel(cfg, lay), state.grads.dtype, state.device)
    scaler = scaler_update(state.scaler, found_inf, cfg, state.step)
    metrics = Metrics(loss=agreed[-2] / agreed[-1],  # NaN when no loss is known (or none was run)
                      grad_norm=grad_norm, loss_scale=state.scaler.scale,
                      skipped=skip, lr=lrs[lay.groups[0]])
    new = state.replace(params=master, compute=compute, grads=grads, buffers=_rank0_buffers(state),
                        opt=records[0], group_opts=tuple(records[1:]), scaler=scaler,
                        step=state.step + 1,
                        micro_step=torch.zeros_like(state.micro_step), loss_sum=torch.zeros_like(state.loss_sum),
                        metrics=metrics, reduced=host_flag(False), gathered=host_flag(gathered))
    if donate:
        # The spent accumulator is kept for the next step's (zfunc.distributed.pool) when it is one
        # of the pool's and no tensor but the state's own leaf is over it (a view the caller made,
        # or the engine's sinks, would read the next step's gradients): that leaf is emptied.
        pool = state.binding.pool
        spent = None if is_released(state.grads) else whole(state.grads)
        reuse = spent is not None and pool.lent(spent) and tensors_over(spent) <= 2  # spent and state.grads
        new = donate_(state, "apply_step", new, ("params", "compute", "opt", "group_opts", "grads"),
                      kept=(spent,) if reuse else ())
        if reuse:
            pool.give(spent)
    return new


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``, page-locked if ``t`` is (an offloaded host arena stays pinned)."""
    return _host_copy(t, True) if t.is_pinned() else t.clone()


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A copy of ``t`` in host memory (page-locked and asynchronous when ``pin``)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=pin)


def _rank0_buffers(state: TrainState) -> dict[str, torch.Tensor]:
    """Rank 0's buffers on every rank: one broadcast per dtype (new tensors; the input is kept),
    each buffer then in memory of its own: views of the one broadcast would share a version
    counter, so a forward updating one in place (BatchNorm's statistics) would fail the backward
    of an op that saved another (a buffer multiplied in, a checkpointed region's inputs)."""
    if state.group.size == 1 or not state.buffers:
        return state.buffers
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, b in state.buffers.items():
        by_dtype.setdefault(b.dtype, []).append(name)
    out = {}
    for names in by_dtype.values():
        flat = torch.cat([state.buffers[n].reshape(-1) for n in names])
        flat = comm.broadcast(flat, 0, state.group)
        parts = torch.split(flat, [state.buffers[n].numel() for n in names])
        out.update({n: p.view(state.buffers[n].shape).clone() for n, p in zip(names, parts)})
    return {n: out[n] for n in state.buffers}
