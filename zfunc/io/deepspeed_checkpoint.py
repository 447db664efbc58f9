"""DeepSpeed ZeRO checkpoints in: master weights, Adam moments and step count into a zfunc state.

A DeepSpeed 0.19 checkpoint directory (``latest``, ``<tag>/mp_rank_00_model_states.pt`` or at
stage 3 one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank, and one
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank) of any stage (1-3), precision
(fp32, bf16) and world size becomes the full fp32 master weights and both Adam moments of every
parameter (`read_deepspeed`), which `zfunc.load` then cuts for its own world size and stage,
so training continues where DeepSpeed stopped.

DeepSpeed's layout, as its files record it:

- stages 1-2: each parameter group is one flat buffer of the group's parameters in
  ``param_shapes`` order, split evenly over the ranks; rank ``r`` stores its part of the fp32
  master (``single_partition_of_fp32_groups``, without the group's trailing padding,
  ``group_paddings``) and of each moment (with it);
- stage 3: each parameter is split on its own into ``ceil(numel / world)`` elements per rank
  (the last rank's part padded); rank ``r`` stores its parts of every parameter back to back
  (``fp32_flat_groups``, and the moments alike); frozen parameters likewise, in the model
  states (``frozen_param_fragments``).

The files are read with ``weights_only=True``: the three DeepSpeed classes they hold (its
loss scaler, its stage enum, its fragment addresses) are read as plain stand-ins, so neither
DeepSpeed nor arbitrary code is needed to read them.
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from zfunc.errors import CheckpointError

__all__ = ["is_deepspeed_checkpoint", "read_deepspeed", "load_deepspeed", "DeepSpeedCheckpoint"]


def _stand_in(module: str, name: str, base: type = object) -> type:
    cls = type(name, (base,), {"__module__": module, "__qualname__": name})
    return cls


_STAND_INS = [_stand_in("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
              _stand_in("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
              _stand_in("deepspeed.runtime.zero.config", "ZeroStageEnum", int),
              _stand_in("deepspeed.utils.tensor_fragment", "fragment_address")]


def _load(path: str) -> Any:
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - whatever an unreadable pickle raises
        raise CheckpointError(f"{path}: unreadable as a DeepSpeed checkpoint file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]})") from e


def _tag_dir(path: str, tag: str | None) -> str | None:
    if tag is not None:
        return os.path.join(path, tag)
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    if glob.glob(os.path.join(path, "*mp_rank_00_model_states.pt")):
        return path  # the tag directory itself
    return None


def is_deepspeed_checkpoint(path: str | os.PathLike, tag: str | None = None) -> bool:
    """Whether ``path`` (a save directory with ``latest``, or a tag directory) holds a DeepSpeed
    checkpoint."""
    where = _tag_dir(os.fspath(path), tag)
    return where is not None and bool(glob.glob(os.path.join(where, "*mp_rank_00_model_states.pt")))


class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint read in full: ``master`` and ``moments`` (``"exp_avg"``,
    ``"exp_avg_sq"``, where every group holds Adam's; empty for a Muon run, whose keys
    ``optimizer_keys`` lists) by parameter name (fp32, the model's shapes), ``frozen`` parameters and
    ``buffers`` by name, ``step`` (optimizer updates applied), ``global_steps``, the saved
    ``world`` and ``stage``, each group's ``lr``, and ``client_state`` (what the engine's
    ``save_checkpoint`` was given, and the scheduler's state)."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)


def read_deepspeed(path: str | os.PathLike, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Read the DeepSpeed checkpoint at ``path`` (see the module docstring).

    Raises:
        CheckpointError: not a DeepSpeed checkpoint, a file missing or unreadable, or pieces
            that do not add up to the shapes the checkpoint records.
    """
    path = os.fspath(path)
    where = _tag_dir(path, tag)
    if where is None or not os.path.isdir(where):
        raise CheckpointError(f"{path}: no DeepSpeed checkpoint (no 'latest' file and no *_model_states.pt)")
    model_files = sorted(glob.glob(os.path.join(where, "*mp_rank_00_model_states.pt")), key=_rank_of)
    optim_files = sorted(glob.glob(os.path.join(where, "*zero_pp_rank_*_mp_rank_00_optim_states.pt")), key=_rank_of)
    if not optim_files:
        raise CheckpointError(f"{where}: no *zero_pp_rank_*_optim_states.pt files: not a ZeRO checkpoint (stage 0 "
                              "checkpoints keep the optimizer in the model states; zfunc reads ZeRO stages 1-3)")
    model = _load(model_files[0])
    optims = [_load(f)["optimizer_state_dict"] for f in optim_files]
    world = len(optims)
    count = optims[0].get("partition_count", world)
    expected = int(count[0] if isinstance(count, (list, tuple)) else count)
    ranks = [_rank_of(f) for f in optim_files]
    if ranks != list(range(expected)):
        prefix = os.path.basename(optim_files[0]).split("zero_pp_rank_")[0]
        missing = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(expected) if r not in ranks]
        raise CheckpointError(f"{where}: DeepSpeed saved this checkpoint on {expected} ranks, but rank files are "
                              f"missing: {missing}. Nothing was loaded; copy the whole checkpoint directory")
    stage = int(optims[0]["zero_stage"])
    shapes = [dict(g) for g in model["param_shapes"]]
    if stage == 3:
        flat = _stage3(optims, shapes, world, where)
        frozen = _stage3_frozen([_load(f) for f in model_files], model["frozen_param_shapes"], world, where)
        inner = optims[0]["optimizer_state_dict"]
    else:
        flat = _stage12(optims, shapes, where)
        # Stages 1-2 keep full tensors in the module's state dict: what is not trained, shared or a buffer
        module = model["module"]
        trained = {n for g in shapes for n in g} | set(model.get("shared_params") or {}) | set(model["buffer_names"])
        frozen = {n: t.clone() for n, t in module.items() if n not in trained}
        inner = optims[0]["base_optimizer_state"]
    step = inner["state"][0]["step"] if inner["state"] else 0
    module = model["module"]
    buffers = {n: module[n].clone() for n in model.get("buffer_names", []) if n in module}
    extra = {k: v for k, v in model.items() if k not in _MODEL_KEYS}
    held = sorted({k for s in inner["state"].values() for k in s if isinstance(s, dict)} - {"step"})
    return DeepSpeedCheckpoint(
        master=flat["master"], moments={k: v for k, v in flat.items() if k != "master"}, optimizer_keys=held,
        frozen=frozen, buffers=buffers, shared=dict(model.get("shared_params", {})),
        step=int(float(step)), global_steps=int(model.get("global_steps", 0)),
        global_samples=int(model.get("global_samples", 0)), world=world, stage=stage,
        lr=[float(g["lr"]) for g in inner["param_groups"]], lr_scheduler=model.get("lr_scheduler"),
        client_state=extra, where=where)


_MODEL_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
               "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
               "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
               "ds_version", "checkpoint_parallel_dimensions"}


def _rank_of(f: str) -> int:
    m = re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f))
    return int(m.group(1)) if m else 0


class _Lazy(Mapping):
    """Parameters by name, each assembled from the ranks' pieces when asked for (the rank files
    are memory-mapped: only the pieces of that parameter are read)."""

    def __init__(self, where: dict[str, list[tuple[torch.Tensor, int, int]]], shapes: dict[str, Any]):
        self.where, self.shapes = where, shapes  # name -> [(rank tensor, start, length)] in order

    def __getitem__(self, name: str) -> torch.Tensor:
        parts = [t.narrow(0, a, n).float() for t, a, n in self.where[name]]
        return torch.cat(parts).view(tuple(self.shapes[name])) if parts else torch.empty(0)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def _moment_keys(states: list[dict]) -> list[str]:
    """Adam's moments, where every group of every rank holds both (a Muon run holds others)."""
    return [k for k in ("exp_avg", "exp_avg_sq") if states and all(k in s for s in states)]


def _stage12(optims: list[dict], shapes: list[dict[str, Any]], where: str) -> dict[str, _Lazy]:
    """Each group's flat buffer, split evenly over the ranks in rank order (the last rank's part
    ends with the group's padding)."""
    keys = _moment_keys([o["base_optimizer_state"]["state"].get(g, {}) for o in optims for g in range(len(shapes))])
    out: dict[str, dict[str, list]] = {"master": {}, **{k: {} for k in keys}}
    named: dict[str, Any] = {}
    # With zero_optimization.parameter_alignment, each parameter but the group's last is followed
    # by its padding in the flat buffer (DeepSpeed's zero_to_fp32 skips it likewise)
    aligned = optims[0].get("param_alignment_paddings")
    for g, group_shapes in enumerate(shapes):
        pads = [o.get("group_paddings", [0] * len(shapes))[g] for o in optims]
        gaps = list(aligned[g]) if aligned is not None and g < len(aligned) else [0] * len(group_shapes)
        if len(gaps) != len(group_shapes):
            raise CheckpointError(f"{where}: param_alignment_paddings has {len(gaps)} entries for group {g}, whose "
                                  f"param_shapes list {len(group_shapes)} parameters: the files do not belong together")
        for role in out:
            ranks = [o["single_partition_of_fp32_groups"][g] if role == "master"
                     else o["base_optimizer_state"]["state"][g][role] for o in optims]
            ranks = [t.reshape(-1) for t in ranks]
            lengths = [t.numel() - (0 if role == "master" else pad) for t, pad in zip(ranks, pads)]
            starts = [sum(lengths[:r]) for r in range(len(ranks))]
            at = 0
            for (name, shape), gap in zip(group_shapes.items(), gaps):
                n = math.prod(shape)
                pieces = []
                for t, lo, length in zip(ranks, starts, lengths):
                    a, b = max(at, lo), min(at + n, lo + length)
                    if a < b:
                        pieces.append((t, a - lo, b - a))
                if sum(p[2] for p in pieces) != n:
                    raise CheckpointError(f"{where}: the {role} pieces hold fewer elements than the parameters "
                                          f"recorded in param_shapes ({name!r} is cut short)")
                out[role][name] = pieces
                named[name] = shape
                at += n + gap
            if at > sum(lengths):
                raise CheckpointError(f"{where}: the {role} pieces of group {g} hold {sum(lengths)} elements, fewer "
                                      f"than its parameters and their alignment paddings ({at})")
    return {role: _Lazy(pieces, named) for role, pieces in out.items()}


def _stage3(optims: list[dict], shapes: list[dict[str, Any]], world: int, where: str) -> dict[str, _Lazy]:
    """Each parameter split on its own, ``ceil(numel / world)`` per rank, back to back per group."""
    keys = _moment_keys([o["optimizer_state_dict"]["state"].get(g, {}) for o in optims for g in range(len(shapes))])
    out: dict[str, dict[str, list]] = {"master": {}, **{k: {} for k in keys}}
    named: dict[str, Any] = {}
    for g, group_shapes in enumerate(shapes):
        for role in out:
            ranks = [(o["fp32_flat_groups"][g] if role == "master" else o["optimizer_state_dict"]["state"][g][role])
                     .reshape(-1) for o in optims]
            at = 0
            for name, shape in group_shapes.items():
                n = math.prod(shape)
                each = -(-n // world)
                if any(at + each > t.numel() for t in ranks):
                    raise CheckpointError(f"{where}: the {role} parts of {name!r} run past what the ranks stored")
                pieces, left = [], n
                for t in ranks:
                    take = min(each, left)
                    if take > 0:
                        pieces.append((t, at, take))
                    left -= take
                out[role][name] = pieces
                named[name] = shape
                at += each
    return {role: _Lazy(pieces, named) for role, pieces in out.items()}


def _stage3_frozen(models: list[dict], shapes: dict[str, Any], world: int, where: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        pieces = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        full = torch.cat(pieces)[:n]
        if full.numel() != n:
            raise CheckpointError(f"{where}: the frozen parameter {name!r} has {full.numel()} of {n} elements")
        out[name] = full.view(tuple(shape)).clone()
    return out


def load_deepspeed(path: str | os.PathLike, like: Any, tag: str | None = None, *, weights_only: bool = False) -> Any:
    """The state a DeepSpeed checkpoint holds, laid out like ``like`` (any world size, stage and
    precision): its fp32 master weights, Adam moments (``exp_avg`` as ``mu``, ``exp_avg_sq`` as
    ``nu``) and update count, its step count, frozen parameters and buffers. The loss scaler,
    hyperparameters and metrics are ``like``'s (the config's). `zfunc.load` calls this for a
    DeepSpeed directory.

    With ``weights_only`` the master weights, frozen parameters and buffers alone (the
    optimizer state and counters stay ``like``'s), whatever optimizer DeepSpeed ran.

    Raises:
        CheckpointError: not a DeepSpeed checkpoint, a checkpoint of another model (names or
            shapes), ``like`` trains with another optimizer than Adam, or the checkpoint holds no
            Adam moments (a Muon run). Nothing is loaded.
    """
    from zfunc.core import opt_state
    from zfunc.core.create import place_master
    from zfunc.core.state import accumulator_numel, host_flag, released_grads

    ck = read_deepspeed(path, tag)
    lay, cfg = like.layout, like.cfg
    if not weights_only and set(ck.moments) != {"exp_avg", "exp_avg_sq"}:
        raise CheckpointError(
            f"{ck.where}: this DeepSpeed checkpoint's optimizer state holds {ck.optimizer_keys}, not Adam's exp_avg "
            "and exp_avg_sq (a Muon run, or another optimizer); zfunc continues DeepSpeed runs trained with Adam or "
            "AdamW. Its weights load alone: engine.load_checkpoint(..., load_module_only=True), "
            "zfunc.load(..., weights_only=True), or python -m zfunc.convert DIR model.safetensors. Nothing was loaded")
    if not weights_only and (cfg.optimizer.moments != ("mu", "nu") or like.group_opts):
        raise CheckpointError(f"{ck.where}: a DeepSpeed Adam checkpoint holds Adam moments; this state trains with "
                              f"{'+'.join(o.name for o in opt_state.optimizers(cfg))}. Use zfunc.adamw (or adam) "
                              "for every group to continue from it")
    ours = {s.name: tuple(s.shape) for u in lay.units for s in u.slots}
    theirs = {n: tuple(t.shape) for n, t in ck.master.items()}
    problems = []
    if set(ours) != set(theirs):
        problems.append(f"parameters only in the model: {sorted(set(ours) - set(theirs))[:5]}, only in the "
                        f"checkpoint: {sorted(set(theirs) - set(ours))[:5]}")
    shapes = [f"{n} {list(theirs[n])} vs {list(s)}" for n, s in ours.items() if n in theirs and theirs[n] != s]
    if shapes:
        problems.append(f"shapes differ (checkpoint vs model): {shapes[:5]}")
    replicated = {**like.frozen, **like.buffers}
    absent = sorted(n for n in replicated if n not in {**ck.frozen, **ck.buffers})
    if absent:
        problems.append(f"frozen parameters or buffers missing from the checkpoint: {absent[:5]}")
    if problems:
        raise CheckpointError(f"{ck.where}: a DeepSpeed checkpoint of another model: {'; '.join(problems)}. "
                              "Nothing was loaded.")

    dev = like.device

    def arena(values: dict[str, torch.Tensor], dtype: torch.dtype, device: Any) -> torch.Tensor:
        parts = []
        for u in lay.units:
            flat = lay.flatten_unit(u, values, dtype, device)
            parts.append(flat if like.stage == 0 else flat.narrow(0, *lay.owned_start_len(u)).clone())
        return torch.cat(parts)

    master, compute = place_master(arena(ck.master, like.params.dtype, dev), cfg, lay, like.mesh)
    held = {**ck.frozen, **ck.buffers}
    replicated = dict(frozen={n: held[n].to(t.device, t.dtype) for n, t in like.frozen.items()},
                      buffers={n: held[n].to(t.device, t.dtype) for n, t in like.buffers.items()})
    if weights_only:  # (gradients and counters stay like's, as zfunc.load's weights_only keeps them)
        return like.replace(params=master, compute=compute, gathered=host_flag(True), **replicated)
    moments = {ours_: arena(ck.moments[theirs_], getattr(like.opt, ours_).dtype, getattr(like.opt, ours_).device)
               for ours_, theirs_ in (("mu", "exp_avg"), ("nu", "exp_avg_sq"))}
    if like.params.is_pinned():
        moments = {k: v.pin_memory() for k, v in moments.items()}
    count = torch.tensor(ck.step, dtype=like.opt.count.dtype, device=like.opt.count.device)
    return like.replace(
        params=master, compute=compute, gathered=host_flag(True), reduced=host_flag(False),
        grads=released_grads(accumulator_numel(cfg, lay), cfg.grad_accum_dtype, dev),
        opt=cfg.optimizer.state_class(**moments, count=count),
        step=torch.tensor(ck.global_steps, dtype=like.step.dtype, device=like.step.device),
        micro_step=torch.zeros_like(like.micro_step), loss_sum=torch.zeros_like(like.loss_sum), **replicated)
