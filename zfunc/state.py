"""`TrainState`: the whole training run as one immutable pytree, and how it is made.

Leaves are tensors; what never changes during training (the module, the config, the layout,
the group) is static metadata. Reading a leaf is the only thing that syncs with the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zfunc import comm
from zfunc._tree import dataclass, field
from zfunc.config import Config, ConfigError
from zfunc.gather import install_hooks
from zfunc.layout import Layout, make_layout
from zfunc.scaler import ScalerState, scaler_init

__all__ = ["TrainState", "AdamState", "Metrics", "init", "full_params", "memory_report", "memory_plan"]


@dataclass(frozen=True)
class AdamState:
    """Adam moments over this rank's arena, and the number of updates applied.

    Examples:
        >>> import torch, zfunc
        >>> opt = zfunc.init(torch.nn.Linear(3, 1), zfunc.Config(stage=0)).opt
        >>> opt.mu.shape, opt.nu.dtype, opt.count.item()
        (torch.Size([4]), torch.float32, 0)
    """

    mu: torch.Tensor
    nu: torch.Tensor
    count: torch.Tensor


@dataclass(frozen=True)
class Metrics:
    """Device scalars of the last optimizer step (read them to log; reading syncs).

    Examples:
        >>> import torch, zfunc
        >>> m = zfunc.init(torch.nn.Linear(3, 1), zfunc.Config()).metrics
        >>> m.grad_norm.item(), m.loss_scale.item(), m.skipped.item()
        (0.0, 1.0, 0.0)
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor
    loss_scale: torch.Tensor
    skipped: torch.Tensor
    lr: torch.Tensor


@dataclass(frozen=True)
class TrainState:
    """One rank's view of a training run.

    Attributes:
        params: master parameters this rank owns (its arena; the full buffer at stage 0).
        compute: the compute-dtype parameters forward uses: the full padded flat buffer for
            stages 0-2, this rank's arena for stage 3. Aliases ``params`` when the dtypes agree.
        grads: the gradient accumulator: full for stages 0-1, this rank's arena for 2-3.
        opt: `AdamState` shaped like ``params``.
        scaler: `zfunc.scaler.ScalerState`.
        step: optimizer steps taken (skipped ones included), int64.
        micro_step: micro-batches accumulated since the last step, int64.
        loss_sum: sum of this rank's micro-batch losses since the last step.
        metrics: `Metrics` of the last step.
        frozen: parameters that do not train and buffers, replicated, by name.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=2))
        >>> state.stage, state.params.shape, state.compute.shape, state.grads.shape
        (2, torch.Size([8]), torch.Size([8]), torch.Size([8]))
        >>> later = state.replace(step=state.step + 1)
        >>> later.step.item(), state.step.item()
        (1, 0)
    """

    params: torch.Tensor
    compute: torch.Tensor
    grads: torch.Tensor
    opt: AdamState
    scaler: ScalerState
    step: torch.Tensor
    micro_step: torch.Tensor
    loss_sum: torch.Tensor
    metrics: Metrics
    frozen: dict[str, torch.Tensor]
    module: torch.nn.Module = field(pytree_node=False)
    cfg: Config = field(pytree_node=False)
    layout: Layout = field(pytree_node=False)
    group: comm.Group = field(pytree_node=False)

    def replace(self, **changes: Any) -> TrainState:
        """A new state with ``changes``; the tensors not named are shared, not copied."""
        return dataclasses.replace(self, **changes)

    @property
    def stage(self) -> int:
        return self.cfg.stage

    @property
    def device(self) -> torch.device:
        return self.params.device


def _signature(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]


def _check_same_everywhere(model: torch.nn.Module, group: comm.Group) -> None:
    sigs = comm.all_gather_object(_signature(model), group)
    for i in range(max(len(s) for s in sigs)):
        entries = [s[i] if i < len(s) else None for s in sigs]
        if any(e != entries[0] for e in entries):
            seen = ", ".join(f"rank {r}: {e if e is None else f'{e[0]} {list(e[1])} {e[2]}'}"
                             f"{'' if e is None or e[3] else ' (frozen)'}"
                             for r, e in enumerate(entries))
            raise ConfigError(
                f"model: the parameters differ across ranks at parameter #{i} ({seen}); "
                "build the same model on every rank")


def _default_units(model: torch.nn.Module) -> list[str]:
    """The elements of the outermost ``nn.ModuleList``s (e.g. transformer blocks)."""
    names: list[str] = []
    for mname, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and not any(mname.startswith(n + ".") for n in names):
            names.extend(f"{mname}.{child}" if mname else child for child, _ in mod.named_children())
    return names


def _units(model: torch.nn.Module, cfg: Config,
           trainable: dict[str, torch.Tensor]) -> tuple[list[list[tuple[str, tuple]]], list[str]]:
    """Group trainable parameters into units: one for stages 0-2; for stage 3 one per unit
    module, plus ``"root"`` for the rest, for small parameters and for weights shared by two
    units."""
    if cfg.stage < 3:
        return [[(n, tuple(p.shape)) for n, p in trainable.items()]], ["model"]
    wanted = cfg.units if cfg.units is not None else _default_units(model)
    unknown = [u for u in wanted if isinstance(u, str) and u not in dict(model.named_modules())]
    if unknown:
        raise ConfigError(f"units: {unknown} are not module names of the model")
    owner: dict[int, set[str]] = {}
    unit_names: list[str] = []
    for mname, mod in model.named_modules():
        inside = any(mname.startswith(u + ".") for u in unit_names)
        if mname and not inside and any(u == mname or (isinstance(u, type) and isinstance(mod, u)) for u in wanted):
            unit_names.append(mname)
            for p in mod.parameters():
                owner.setdefault(id(p), set()).add(mname)
        elif not inside and mname not in unit_names:  # used outside every unit: must be in root
            for p in mod.parameters(recurse=False):
                owner.setdefault(id(p), set()).add("")
    groups: dict[str, list[tuple[str, tuple]]] = {"root": []}
    for n, p in trainable.items():
        units = owner.get(id(p), set())
        unit = next(iter(units)) if len(units) == 1 and p.numel() > cfg.persist_threshold else ""
        unit = unit or "root"
        groups.setdefault(unit, []).append((n, tuple(p.shape)))
    if not groups["root"]:
        del groups["root"]
    return list(groups.values()), list(groups)


def init(model: torch.nn.Module, cfg: Config, group: comm.Group | None = None) -> TrainState:
    """The initial `TrainState` of ``model`` trained as ``cfg`` says, on ``group``.

    Rank 0's parameter values are broadcast to every rank (as DDP and DeepSpeed do). The module
    itself is not changed; forward binds it to the state's tensors.

    Args:
        model: the module to train. Parameters with ``requires_grad=False`` stay frozen.
        cfg: the `Config`.
        group: the ranks; ``None`` means `zfunc.comm.world()`.

    Returns:
        The state, with zero gradients and moments and ``step == 0``.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=2))
        >>> state.step.item(), state.params.shape, state.layout.numel
        (0, torch.Size([8]), 8)
    """
    group = group or comm.world()
    if group.size > 1:
        _check_same_everywhere(model, group)
    named = dict(model.named_parameters())
    trainable = {n: p for n, p in named.items() if p.requires_grad}
    if not trainable:
        raise ConfigError("model: has no parameter with requires_grad=True; nothing to train")
    device = next(iter(trainable.values())).device
    units, unit_names = _units(model, cfg, trainable)
    layout = make_layout(units, world=group.size, rank=group.rank, align=cfg.align, names=unit_names)
    cdt, mdt = cfg.compute_dtype, cfg.master_dtype
    frozen = {n: comm.broadcast(p.detach(), 0, group).to(cdt if p.is_floating_point() else p.dtype)
              for n, p in named.items() if not p.requires_grad}
    frozen.update({n: b.detach().clone() for n, b in model.named_buffers()})

    full_master = [comm.broadcast(layout.flatten_unit(u, trainable, mdt, device), 0, group)
                   for u in layout.units]
    if cfg.stage == 0:
        params = torch.cat(full_master)
    else:
        params = torch.cat([flat.narrow(0, *_start_len(layout.owned(u))) for u, flat in
                            zip(layout.units, full_master)])
    if cfg.stage == 3:
        compute = params if cdt == mdt else params.to(cdt)
        for p in trainable.values():  # the shards are the parameters now: free the module's copy
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    else:
        compute = torch.cat(full_master).to(cdt)
        if cdt == mdt:  # the master shard is a view of the compute buffer: no second copy
            params = _master_view(compute, layout, cfg.stage)
    grads_numel = layout.full_numel if cfg.stage < 2 else layout.arena_numel
    zeros = torch.zeros(params.numel(), dtype=cfg.moment_dtype, device=device)

    def scalar(v: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(v, dtype=dtype, device=device)

    scaler = scaler_init(cfg, device)
    lr0 = cfg.lr_schedule(0) if cfg.lr_schedule else cfg.optimizer.lr
    state = TrainState(
        params=params, compute=compute,
        grads=torch.zeros(grads_numel, dtype=cfg.grad_accum_dtype, device=device),
        opt=AdamState(mu=zeros, nu=zeros.clone(), count=scalar(0, torch.int64)),
        scaler=scaler, step=scalar(0, torch.int64), micro_step=scalar(0, torch.int64),
        loss_sum=scalar(0.0),
        metrics=Metrics(loss=scalar(float("nan")), grad_norm=scalar(0.0), loss_scale=scaler.scale.clone(),
                        skipped=scalar(0.0), lr=torch.as_tensor(lr0, dtype=torch.float32).to(device)),
        frozen=frozen, module=model, cfg=cfg, layout=layout, group=group)
    if cfg.stage == 3:
        install_hooks(state)
    return state


def _start_len(rng: tuple[int, int]) -> tuple[int, int]:
    return rng[0], rng[1] - rng[0]


def _master_view(compute: torch.Tensor, layout: Layout, stage: int) -> torch.Tensor:
    """The master parameters as a view of the full compute buffer (stages 0-2, one unit)."""
    if stage == 0:
        return compute
    (unit,) = layout.units
    return compute.narrow(0, *_start_len(layout.owned(unit)))


def full_params(state: TrainState) -> dict[str, torch.Tensor]:
    """Every trainable parameter, full and in the master dtype, by name.

    Names and order are those of ``model.named_parameters()`` (a tied weight appears once; frozen
    parameters are left out). At stages 1-3
    this gathers the shards (a collective: call it on every rank).

    Examples:
        >>> import torch, zfunc
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Linear(2, 1)
        >>> p = zfunc.full_params(zfunc.init(model, zfunc.Config()))
        >>> sorted(p), torch.equal(p["weight"], model.weight.detach())
        (['bias', 'weight'], True)
    """
    return gather_by_name(state, state.params)


def gather_by_name(state: TrainState, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """``t`` (shaped like ``state.params``: the master weights or a moment) in full, by name."""
    lay, out = state.layout, {}
    for unit in lay.units:
        if state.stage == 0:
            flat = t.narrow(0, 0, unit.padded)
        else:
            flat = comm.all_gather(lay.arena_slice(t, unit), state.group)
        out.update({k: v.clone() for k, v in lay.views(unit, flat).items()})
    return {n: out[n] for n, _ in state.module.named_parameters() if n in out}  # the model's order


def memory_report(state: TrainState) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state.

    ``params`` counts the compute copy and the master copy once each (once in total where they
    share memory); ``optimizer`` counts the moments; ``total`` adds them up.

    Examples:
        >>> import torch, zfunc
        >>> rep = zfunc.memory_report(zfunc.init(torch.nn.Linear(7, 1), zfunc.Config(stage=0)))
        >>> rep["params"], rep["grads"], rep["optimizer"]
        (32, 32, 64)
    """
    def nbytes(*ts: torch.Tensor) -> int:
        seen: dict[int, int] = {}
        for t in ts:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return sum(seen.values())

    rep = {"params": nbytes(state.params, state.compute), "grads": nbytes(state.grads),
           "optimizer": nbytes(state.opt.mu) + nbytes(state.opt.nu)}
    rep["total"] = sum(rep.values())
    return rep


def memory_plan(model: torch.nn.Module, cfg: Config, world_size: int) -> dict[str, int]:
    """The bytes `memory_report` will show on each rank, computed from shapes alone.

    Nothing is allocated and no process group is needed, so any world size can be planned
    (call it before `init`: stage 3 frees the module's own parameters).

    Examples:
        >>> import torch, zfunc
        >>> model = torch.nn.Linear(1000, 1000)                      # 1,001,000 parameters
        >>> for stage in range(4):
        ...     plan = zfunc.memory_plan(model, zfunc.Config(stage=stage), world_size=8)
        ...     print(stage, round(plan["total"] / 2**20, 2), "MiB per rank")
        0 15.27 MiB per rank
        1 8.59 MiB per rank
        2 5.25 MiB per rank
        3 1.91 MiB per rank
    """
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    units, names = _units(model, cfg, trainable)
    lay = make_layout(units, world=world_size, rank=0, align=cfg.align, names=names)
    size = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731
    opt_numel = lay.full_numel if cfg.stage == 0 else lay.arena_numel
    compute = (lay.arena_numel if cfg.stage == 3 else lay.full_numel) * size(cfg.compute_dtype)
    master = 0 if cfg.compute_dtype == cfg.master_dtype else opt_numel * size(cfg.master_dtype)
    grads = (lay.full_numel if cfg.stage < 2 else lay.arena_numel) * size(cfg.grad_accum_dtype)
    plan = {"params": compute + master, "grads": grads, "optimizer": 2 * opt_numel * size(cfg.moment_dtype)}
    plan["total"] = sum(plan.values())
    return plan
