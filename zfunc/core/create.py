"""`init`: a model and a `Config` become the first `TrainState`; `full_params` reads it back.

``init`` checks that every rank built the same model, groups the trainable parameters into
units (`zfunc.distributed.layout`), broadcasts rank 0's values, keeps this rank's shards, and binds the
module to the layout (`zfunc.autograd.binding.ModuleBinding`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping

import torch

from zfunc.distributed import comm
from zfunc.autograd.binding import ModuleBinding, was_donated
from zfunc.core.config import Config
from zfunc.core.materialize import materialize, on_meta
from zfunc.core.weights import Weights, open_weights
from zfunc.core.donation import check_live
from zfunc.errors import ConfigError
from zfunc.distributed.layout import Layout, make_layout, master_view
from zfunc.distributed.mesh import Mesh, make_mesh
from zfunc.core import opt_state
from zfunc.core.optim import assign_groups
from zfunc.core.scaler import scaler_init
from zfunc.core.state import GroupHyper, Metrics, TrainState, accumulator_numel, host_flag, released_grads
from zfunc.core.update import learning_rate

__all__ = ["init", "full_params", "gather_by_name", "units_of", "group_hyper", "trainable_params", "place_master"]


def trainable_params(model: torch.nn.Module, cfg: Config) -> dict[str, torch.Tensor]:
    """The parameters ``cfg`` trains: ``requires_grad`` and not in ``cfg.freeze``, by name.

    Examples:
        >>> import torch, zfunc
        >>> sorted(trainable_params(torch.nn.Linear(2, 1), zfunc.Config(freeze=["bias"])))
        ['weight']
    """
    named = dict(model.named_parameters())
    unknown = sorted(set(cfg.freeze) - set(named))
    if unknown:
        raise ConfigError(f"freeze: {unknown[:5]} are not parameters of the model")
    return {n: p for n, p in named.items() if p.requires_grad and n not in cfg.freeze}


def _signature(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()]


def _fingerprint(cfg: Config, model: torch.nn.Module) -> dict[str, str]:
    """What must agree across ranks (anything that changes collectives or math): the `Config`
    fields, each parameter group's hyperparameters and members, the frozen names, and the
    learning-rate schedule at a few steps."""
    fields = ("stage", "precision", "grad_accum", "clip", "loss_scale", "master_dtype", "moment_dtype",
              "grad_accum_dtype", "comm_dtype", "autocast", "units", "persist_threshold", "align", "optimizer",
              "shard_size", "bucket_mb", "prefetch", "offload_optimizer", "grad_reduce")
    out = {f: repr(getattr(cfg, f)) for f in fields}
    out["param_groups"] = repr([{f.name: getattr(g, f.name) for f in dataclasses.fields(g) if f.name != "params"}
                                for g in cfg.param_groups])
    out["freeze"] = repr(sorted(cfg.freeze or ()))
    try:  # the groups' members: a selector may read anything
        trainable = trainable_params(model, cfg)
        groups = assign_groups(cfg.param_groups, trainable)
        out["param_groups (members)"] = repr([groups[n] for n in trainable])
    except ConfigError as e:
        out["param_groups (members)"] = f"refused: {e}"
    if cfg.lr_schedule is not None:
        try:
            out["lr_schedule"] = repr([float(cfg.lr_schedule(torch.tensor(k))) for k in (0, 1, 10, 100, 1000, 10_000)])
        except Exception as e:  # noqa: BLE001 - the schedule's own error comes when it runs
            out["lr_schedule"] = f"raised {type(e).__name__}"
    return out


def _check_same_everywhere(model: torch.nn.Module, cfg: Config, group: comm.Group) -> None:
    """Every rank must build the same model with the same config; say where they differ (on every
    rank, before any collective that would otherwise hang or mix up shards). One all-gather of a
    small object per `init` (so per ``initialize``)."""
    mine = _fingerprint(cfg, model)
    seen = comm.all_gather_object((_signature(model), mine), group)
    for field in mine:
        values = [fp[field] for _, fp in seen]
        if any(v != values[0] for v in values):
            raise ConfigError(f"{field}: differs across ranks ({', '.join(f'rank {r}: {v}' for r, v in enumerate(values))}); "
                              "give every rank the same Config")
    sigs = [sig for sig, _ in seen]
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


def units_of(model: torch.nn.Module, cfg: Config,
           trainable: dict[str, torch.Tensor]) -> tuple[list[list[tuple[str, tuple, int]]], list[str]]:
    """Group trainable parameters into units: one for stages 0-2; for stage 3 one per unit
    module, plus ``"root"`` for the rest, for small parameters and for weights shared by two
    units. Each entry is ``(name, shape, parameter group)``."""
    frozen = [n for n, _ in model.named_parameters() if n not in trainable]
    group_of = assign_groups(cfg.param_groups, trainable, frozen)
    if cfg.stage < 3:
        return [[(n, tuple(p.shape), group_of[n]) for n, p in trainable.items()]], ["model"]
    wanted = cfg.units if cfg.units is not None else _default_units(model)
    modules = dict(model.named_modules())
    unknown = [u for u in wanted if isinstance(u, str) and u not in modules]
    if unknown:
        near = sorted(f"_orig_mod.{u}" for u in unknown if f"_orig_mod.{u}" in modules)
        raise ConfigError(f"units: {unknown} are not module names of the model" + (
            f"; the model has {near[:3]} (torch.compile(model) holds the model as _orig_mod: name its modules "
            "with that prefix, or the unit modules by class)" if near else ""))
    absent = [u.__name__ for u in wanted if isinstance(u, type) and not any(_is(m, u) for m in modules.values())]
    if absent:
        raise ConfigError(f"units: the model has no module of class {absent} (every parameter would stay in the root "
                          "unit, gathered whole); name classes or modules the model has")
    owner: dict[int, set[str]] = {}
    unit_names: list[str] = []
    for mname, mod in model.named_modules():
        inside = any(mname.startswith(u + ".") for u in unit_names)
        if mname and not inside and any(u == mname or (isinstance(u, type) and _is(mod, u)) for u in wanted):
            unit_names.append(mname)
            for p in mod.parameters():
                owner.setdefault(id(p), set()).add(mname)
        elif not inside and mname not in unit_names:  # used outside every unit: must be in root
            for p in mod.parameters(recurse=False):
                owner.setdefault(id(p), set()).add("")
    groups: dict[str, list[tuple[str, tuple, int]]] = {"root": []}
    for n, p in trainable.items():
        units = owner.get(id(p), set())
        unit = next(iter(units)) if len(units) == 1 and p.numel() > cfg.persist_threshold else ""
        unit = unit or "root"
        groups.setdefault(unit, []).append((n, tuple(p.shape), group_of[n]))
    if not groups["root"]:
        del groups["root"]
    return list(groups.values()), list(groups)


def _is(mod: torch.nn.Module, cls: type) -> bool:
    """``mod`` is a ``cls``, or ``torch.compile``'s wrapper of one (its ``_orig_mod``): a unit named
    by class is then the compiled module, so zfunc's unit hooks run outside the compiled code."""
    return isinstance(mod, cls) or isinstance(getattr(mod, "_orig_mod", None), cls)


def _gathered_units(model: torch.nn.Module, cfg: Config,
                    trainable: dict[str, torch.Tensor]) -> list[tuple[str, list[str]]]:
    """Stages 1-2 with ``Config.units``: each unit's ``(module name, parameter names)``, chosen as
    stage 3 chooses them (a parameter shared with the rest of the model stays outside)."""
    if cfg.stage not in (1, 2) or cfg.units is None:
        return []
    groups, names = units_of(model, cfg.replace(stage=3, persist_threshold=0), trainable)
    return [(name, [n for n, _, _ in g]) for g, name in zip(groups, names) if name != "root"]


def _check_matrices(model: torch.nn.Module, cfg: Config, trainable: dict[str, torch.Tensor]) -> None:
    """An optimizer for matrices only (Muon) given other parameters is an error naming them."""
    frozen = [n for n, _ in model.named_parameters() if n not in trainable]
    group_of = assign_groups(cfg.param_groups, trainable, frozen)
    opts, owner = opt_state.optimizers(cfg), opt_state.optimizer_of(cfg)
    for k, opt in enumerate(opts):
        if not getattr(opt, "matrices_only", False):
            continue
        where = "optimizer" if k == 0 else f"param_groups[{owner.index(k) - 1}].optimizer"
        odd = [f"{n} {list(p.shape)}" for n, p in trainable.items() if owner[group_of[n]] == k and p.ndim != 2]
        if odd:
            raise ConfigError(f"{where}: {opt.name} takes 2-D parameters only, and is given {odd[:5]}"
                              f"{' ...' if len(odd) > 5 else ''}; give it the matrices through a zfunc.ParamGroup "
                              "(params=lambda name, p: p.ndim == 2, optimizer=zfunc.muon(...)) and keep another "
                              "optimizer for the rest")
        if cfg.offload_optimizer is not None:
            raise ConfigError(f"{where}: {opt.name} with offload_optimizer is not supported (its Newton-Schulz "
                              "step runs on the compute device); leave offload_optimizer None")


def group_hyper(cfg: Config) -> GroupHyper:
    """The hyperparameters of the optimizer (group 0) and of each `zfunc.ParamGroup`, on the host.

    Raises:
        ConfigError: a group sets a hyperparameter the optimizer does not read.

    Examples:
        >>> import zfunc
        >>> cfg = zfunc.Config(optimizer=zfunc.adamw(lr=0.1), param_groups=[zfunc.ParamGroup("b", lr=0.2)])
        >>> group_hyper(cfg).lr.tolist()
        [0.1, 0.2]
    """
    rows = [cfg.optimizer.values()]
    for i, g in enumerate(cfg.param_groups):
        opt, given = g.optimizer or cfg.optimizer, g.values()
        extra = sorted(set(given) - set(opt.live))
        if extra:
            raise ConfigError(f"param_groups[{i}]: {opt.name} does not read {extra} (it reads "
                              f"{', '.join(opt.live)}); remove them from the group")
        rows.append({**opt.values(), **given})
    return GroupHyper(**{f.name: torch.tensor([float(r.get(f.name, 0.0)) for r in rows], dtype=torch.float64)
                         for f in dataclasses.fields(GroupHyper)})


def mesh_of(cfg: Config, group: comm.Group) -> Mesh:
    """The `zfunc.distributed.mesh.Mesh` ``cfg.shard_size`` makes of ``group`` (checked against its size)."""
    if cfg.stage == 0 and cfg.shard_size not in (None, group.size):
        raise ConfigError(f"shard_size: {cfg.shard_size} with stage 0, which shards nothing (every rank holds "
                          f"everything); use stage 1-3 with shard_size, or leave shard_size None")
    return make_mesh(group, cfg.shard_size)


def read_weights(files: Weights, layout: Layout, stage: int, pieces: dict[int, torch.Tensor],
                 replicated: dict[str, torch.Tensor]) -> None:
    """Overwrite what this rank keeps (``pieces[i]``: unit ``i``'s owned range, the whole unit at
    stage 0; ``replicated``: frozen parameters and buffers) with the values ``files`` hold,
    reading only those elements. Warns once, naming what the files do not hold."""
    missing = []
    for i, unit in enumerate(layout.units):
        lo, n = (0, unit.padded) if stage == 0 else layout.owned_start_len(unit)
        for s in unit.slots:
            if s.name not in files:
                missing.append(s.name)
                continue
            _check_shape(files, s.name, s.shape)
            a, b = max(lo, s.offset), min(lo + n, s.offset + s.numel)  # the part of the slot kept here
            if a < b:
                pieces[i].narrow(0, a - lo, b - a).copy_(files.read_range(s.name, a - s.offset, b - s.offset))
    for name, t in replicated.items():
        if name not in files:
            missing.append(name)
            continue
        _check_shape(files, name, tuple(t.shape))
        t.copy_(files.read(name))
    if missing:
        warnings.warn(f"weights: {len(missing)} parameters and buffers of the model are not in the files and keep "
                      f"their initial values: {missing[:10]}{' ...' if len(missing) > 10 else ''}", stacklevel=3)


def _check_shape(files: Weights, name: str, shape: tuple[int, ...]) -> None:
    got = files.shape(name)
    if tuple(got) != tuple(shape):
        where = "" if files.key(name) == name else f" (as {files.key(name)!r} in the files)"
        raise ConfigError(f"weights: {name!r}{where} has shape {list(got)} in the files, the model's is {list(shape)}; "
                          "load weights of this model (or map the name elsewhere with weights_map)")


def _default_device(group: comm.Group) -> torch.device:
    """Where a meta-built model's state goes: the current CUDA device under NCCL, else the CPU."""
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if initialised and torch.distributed.get_backend(group.pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def place_master(master: torch.Tensor, cfg: Config, layout: Layout, mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's master weights (its arena, or everything at stage 0, on the compute device)
    as the state's ``(params, compute)``.

    The compute copy is the master in the compute dtype: gathered in full at stages 0-2 (the
    master is then a view of it where the dtypes agree), this rank's arena at stage 3. With
    ``cfg.offload_optimizer`` the master moves to host memory (pinned for CUDA) and is never
    shared with the compute copy.
    """
    cdt = cfg.compute_dtype
    if cfg.stage in (0, 3):
        compute = master.to(cdt)
    else:
        compute = torch.cat([comm.all_gather(layout.arena_slice(master, u).to(cdt), mesh.shard)
                             for u in layout.units])
    if cfg.offload_optimizer is None:
        if compute.dtype == master.dtype:  # one buffer: the master is (a view of) the compute copy
            master = compute if cfg.stage in (0, 3) else master_view(compute, layout, cfg.stage)
        return master, compute
    pin = cfg.offload_pin_memory and master.device.type == "cuda"
    host = torch.empty(master.shape, dtype=master.dtype, pin_memory=pin)
    return host.copy_(master), compute


def masters_from_compute(state: TrainState) -> torch.Tensor:
    """Master weights equal to ``state``'s compute-dtype weights, widened: what DeepSpeed's fp32
    masters start as, since it casts the model to bf16/fp16 before it builds them (the engine
    under a DeepSpeed config uses these; `zfunc.init` keeps the model's own fp32 values).

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(3, 1), zfunc.Config(stage=1, precision="bf16"))
        >>> rounded = masters_from_compute(state)
        >>> torch.equal(rounded, state.params.bfloat16().float()), rounded.dtype
        (True, torch.float32)
    """
    src = state.compute if state.stage in (0, 3) else master_view(state.compute, state.layout, state.stage)
    p = state.params
    out = torch.empty(p.shape, dtype=p.dtype, device=p.device, pin_memory=p.is_pinned())
    return out.copy_(src)


def init(model: torch.nn.Module, cfg: Config, group: comm.Group | None = None, *,
         donate: bool = False, init_fn: Callable[[torch.nn.Module], None] | None = None,
         device: torch.device | str | None = None, weights: str | os.PathLike | None = None,
         weights_map: Mapping[str, str] | Callable[[str], str] | None = None) -> TrainState:
    """The initial `TrainState` of ``model`` trained as ``cfg`` says, on ``group``.

    Rank 0's parameter and buffer values are broadcast to every rank (as DDP and DeepSpeed do).
    The module's values are copied: it stays usable as plain torch, and ``init`` may be called on
    it again. zfunc's calls put forward hooks on it while they run: on the unit modules (stage
    3, and stages 1-2 with ``Config.units``) from a call's start, and on each module with a
    forward whose subtree holds parameters once a backward reaches the call's outputs (for a
    forward that activation checkpointing recomputes in backward). They come off when no call runs and no call's graph
    lives: between calls the module carries none.

    Args:
        model: the module to train. Parameters with ``requires_grad=False`` stay frozen.
        cfg: the `Config`.
        group: the ranks; ``None`` means `zfunc.comm.world()`.
        donate: give the module's trainable parameters to the state: their storage is freed
            (at stage 3 the point of sharding; otherwise the model's copy is dropped too), and
            calling the module outside zfunc raises. Use it when the module will only ever
            run through zfunc; the engine (`zfunc.initialize`) donates at stage 3.
        init_fn: for a model built on the ``meta`` device (``with torch.device("meta"):`` or
            `zfunc.zero.Init`): a function setting one module's own parameters, run on every
            module after their ``reset_parameters`` as ``model.apply(init_fn)`` would
            (`zfunc.core.materialize`). A meta-built model is materialized one unit at a time,
            each rank keeping its shard, with the values an eager CPU build with the same seed
            has; its module keeps no trainable values (as with ``donate``).
        device: where a meta-built model's state lives (default: the current CUDA device under
            NCCL, else the CPU). A model with real parameters stays on their device.
        weights: pretrained values (`zfunc.core.weights.open_weights`: safetensors, a Hugging Face
            shard index, a torch state dict), read straight into this rank's shards: each rank
            reads only the elements it keeps. Parameters and buffers the files do not hold keep
            the model's own (or meta-initialised) values and are listed in a warning; a shape
            that differs is an error naming the parameter.
        weights_map: the files' name of each model name that differs (a dict or a function).

    Returns:
        The state, with zero gradients and moments and ``step == 0``.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=2))
        >>> state.step.item(), state.params.shape, state.layout.numel
        (0, torch.Size([8]), 8)
    """
    group = group or comm.world()
    if was_donated(model):
        raise ConfigError(
            "model: its parameters were donated to another zfunc state by init(..., donate=True) and are "
            "empty now (the weights live in that state, and went with it if it is gone); build the model again "
            "(and load a checkpoint), or init it without donate=True the first time. zfunc.initialize of a module "
            "whose engine is alive takes the weights over from that engine")
    if group.size > 1:
        _check_same_everywhere(model, cfg, group)
    named = dict(model.named_parameters())
    odd = [f"{n} ({p.dtype})" for n, p in named.items() if p.dtype not in (torch.float32, torch.bfloat16, torch.float16)]
    if odd:
        raise ConfigError(f"model: parameters {odd[:3]} have a dtype zfunc does not train (float32, bfloat16 or "
                          "float16 only; float64 would be rounded and complex parts dropped); convert them, e.g. "
                          "model.float(), or keep them out of the model")
    trainable = trainable_params(model, cfg)
    if not trainable:
        raise ConfigError("model: has no parameter with requires_grad=True (outside Config.freeze); nothing to train")
    lazy = on_meta(model)
    if init_fn is not None and not lazy:
        raise ConfigError("init_fn: the model's parameters are already initialised (not on the meta device); "
                          "initialise the model yourself, or build it under torch.device('meta')")
    if lazy:
        device = torch.device(device if device is not None else _default_device(group))
    elif device is not None:
        raise ConfigError(f"device: {device!r} is for a model built on the meta device; move a built model "
                          "with model.to(device) before init")
    else:
        device = next(iter(trainable.values())).device
    _check_matrices(model, cfg, trainable)
    mesh = mesh_of(cfg, group)
    units, unit_names = units_of(model, cfg, trainable)
    layout = make_layout(units, world=mesh.shard.size, rank=mesh.shard.rank, align=cfg.align, names=unit_names)
    cdt, mdt = cfg.compute_dtype, cfg.master_dtype

    def replicated(t: torch.Tensor) -> torch.Tensor:  # rank 0's value, 32/16-bit floats in the compute dtype
        low = t.dtype in (torch.float32, torch.bfloat16, torch.float16)
        return comm.broadcast(t.detach(), 0, group).to(cdt if low else t.dtype)

    # What this rank keeps of each unit's master values (all of it at stage 0), written in place
    master = torch.empty(layout.full_numel if cfg.stage == 0 else layout.arena_numel, dtype=mdt, device=device)
    pieces = {i: master.narrow(0, layout.full_starts[i], u.padded) if cfg.stage == 0
              else layout.arena_slice(master, u)
              for i, u in enumerate(layout.units)}

    def keep(i: int, values: dict[str, torch.Tensor]) -> None:  # one unit's values: rank 0's, sharded
        u = layout.units[i]
        flat = comm.broadcast_(layout.flatten_unit(u, values, mdt, device), 0, group)
        pieces[i].copy_(flat if cfg.stage == 0 else flat.narrow(0, *layout.owned_start_len(u)))

    if lazy:
        slot_of = {s.name: (i, s) for i, u in enumerate(layout.units) for s in u.slots}
        flats: dict[tuple[int, torch.dtype], torch.Tensor] = {}

        def allocate(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            # A unit's parameters are views of one host buffer in the layout's order: one
            # allocation per unit, freed at once when the unit is handed over.
            i, s = slot_of[name]
            flat = flats.get((i, dtype))
            if flat is None:
                flat = flats[(i, dtype)] = torch.empty(layout.units[i].padded, dtype=dtype)
            return flat.narrow(0, s.offset, s.numel).view(shape)

        def keep_and_free(i: int, values: dict[str, torch.Tensor]) -> None:
            keep(i, values)
            for key in [k for k in flats if k[0] == i]:
                del flats[key]

        rest = materialize(model, [[s.name for s in u.slots] for u in layout.units], init_fn, keep_and_free,
                           allocate)
        named = {n: rest[n].to(device) for n in named if n not in trainable}  # frozen
        buffers_of = {n: rest[n].to(device) for n, _ in model.named_buffers()}
        donate = True  # the module holds meta tensors: it runs through zfunc only
    else:
        for i, u in enumerate(layout.units):
            keep(i, trainable)
        buffers_of = dict(model.named_buffers())
    frozen = {n: replicated(p) for n, p in named.items() if n not in trainable}
    buffers = {n: comm.broadcast(b.detach(), 0, group).to(cfg.buffer_dtype_of(b.dtype))
               for n, b in buffers_of.items()}
    if weights is not None:
        read_weights(open_weights(weights, weights_map), layout, cfg.stage, pieces, {**frozen, **buffers})
    params, compute = place_master(master, cfg, layout, mesh)
    opt, group_opts = opt_state.init_records(cfg, layout, params)

    def scalar(v: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(v, dtype=dtype, device=device)

    scaler = scaler_init(cfg, device)
    binding = ModuleBinding(model, layout, cfg.stage, _gathered_units(model, cfg, trainable))
    if donate:
        binding.donate()
    state = TrainState(
        params=params, compute=compute,
        grads=released_grads(accumulator_numel(cfg, layout), cfg.grad_accum_dtype, device),
        opt=opt, group_opts=group_opts,
        hyper=group_hyper(cfg),
        scaler=scaler, step=scalar(0, torch.int64), micro_step=torch.zeros((), dtype=torch.int64),
        loss_sum=scalar(0.0),
        metrics=Metrics(loss=scalar(float("nan")), grad_norm=scalar(0.0), loss_scale=scaler.scale.clone(),
                        skipped=scalar(0.0), lr=scalar(float("nan"))),
        frozen=frozen, buffers=buffers, gathered=host_flag(True), reduced=host_flag(False), binding=binding, cfg=cfg, layout=layout, mesh=mesh)
    return state.replace(metrics=dataclasses.replace(state.metrics, lr=learning_rate(state)))  # step 0 uses it


def full_params(state: TrainState) -> dict[str, torch.Tensor]:
    """Every trainable parameter, full and in the master dtype, by name.

    Names and order are those of ``model.named_parameters()`` (a tied weight appears once; frozen
    parameters are left out), as the model had them at `init` (a module replaced since, such as
    ``torch.compile(block)`` put in a block's place, keeps its parameters' names). At stages 1-3
    this gathers the shards (a collective: call it on every rank).

    Examples:
        >>> import torch, zfunc
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Linear(2, 1)
        >>> p = zfunc.full_params(zfunc.init(model, zfunc.Config()))
        >>> sorted(p), torch.equal(p["weight"], model.weight.detach())
        (['bias', 'weight'], True)
    """
    check_live(state, "full_params")
    return gather_by_name(state, state.params)


def gather_by_name(state: TrainState, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """``t`` (shaped like ``state.params``: the master weights or a moment) in full, by name."""
    lay, out = state.layout, {}
    for unit in lay.units:
        if state.stage == 0:
            flat = t.narrow(0, 0, unit.padded)
        else:
            # through the compute device: an offloaded master or moment is in host memory, and NCCL
            # gathers device tensors only
            flat = comm.all_gather(lay.arena_slice(t, unit).to(state.device), state.mesh.shard)
        out.update({k: v.clone() for k, v in lay.views(unit, flat).items()})
    return {n: out[n] for n in sorted(out, key=model_order(state))}


def model_order(state: TrainState) -> Callable[[str], int]:
    """A sort key for parameter names: their place in ``model.named_parameters()`` as the model
    was at `init` (the binding's entries): a module replaced since (``torch.compile(block)`` put
    in a block's place renames its parameters) changes neither the names nor their order."""
    order: dict[str, int] = {}
    for _, _, name in state.binding.entries:
        order.setdefault(name, len(order))
    return order.__getitem__
