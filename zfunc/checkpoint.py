"""Checkpoints: every rank writes its own pieces, keyed by parameter name and offset.

``save`` stores each rank's owned part of every parameter's master weights and Adam moments as
``p/<name>/<role>/<offset>`` through ``torch.distributed.checkpoint`` (one file per rank, written
in parallel), plus the scalars of the state (step counters, the loss scaler with its hysteresis,
metrics), frozen parameters and buffers, and each rank's RNG. Because pieces are named by
parameter and offset, not by rank, ``load`` can cut them differently: another world size or
another ZeRO stage. A save goes to a temporary directory that is renamed into place after a
``COMPLETE`` marker is written, so a crash mid-save leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from zfunc import comm
from zfunc._tree import tree
from zfunc.create import full_params
from zfunc.layout import Layout, Unit, master_view
from zfunc.state import AdamState, TrainState

__all__ = ["save", "load", "export", "CheckpointError", "read_meta", "read_extra"]

_FORMAT = 1
_MARKER = "COMPLETE"
_ROLES = ("master", "mu", "nu")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or does not fit the state it is loaded into.

    Examples:
        >>> import tempfile, zfunc
        >>> try:
        ...     zfunc.load(tempfile.mkdtemp(), like=None)
        ... except zfunc.CheckpointError as e:
        ...     print(str(e).split(": ", 1)[1][:40])
        not a complete zfunc checkpoint (no COMP
    """


def _dcp_kwargs(group: comm.Group) -> dict[str, Any]:
    return {"process_group": group.pg} if group.size > 1 else {"no_dist": True}


@contextlib.contextmanager
def _quiet() -> Any:
    with warnings.catch_warnings():  # DCP warns that a world of one is "a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _owned(stage: int, lay: Layout, t: torch.Tensor, unit: Unit) -> torch.Tensor:
    """This rank's slice ``[lo, hi)`` of ``unit``'s flat buffer, from a role tensor of a state."""
    if stage == 0:
        lo, hi = lay.owned(unit)
        return t.narrow(0, lo, hi - lo)
    return lay.arena_slice(t, unit)


def _overlaps(unit: Unit, lo: int, hi: int) -> list[tuple[str, int, int, int]]:
    """``(name, start in param, start in [lo, hi), length)`` of every parameter piece in [lo, hi)."""
    out = []
    for s in unit.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            out.append((s.name, a - s.offset, a - lo, b - a))
    return out


def _scalars(state: TrainState) -> dict[str, torch.Tensor]:
    picked = {"step": state.step, "micro_step": state.micro_step, "loss_sum": state.loss_sum,
              "count": state.opt.count}
    for path, leaf in zip(tree.paths(state.scaler), tree.leaves(state.scaler)):
        picked["scaler/" + "/".join(map(str, path))] = leaf
    for path, leaf in zip(tree.paths(state.metrics), tree.leaves(state.metrics)):
        picked["metrics/" + "/".join(map(str, path))] = leaf
    return {f"s/{k}": v.detach().cpu().clone() for k, v in picked.items()}


def save(state: TrainState, path: str | os.PathLike, *, extra: dict[str, Any] | None = None) -> str:
    """Write ``state`` to the directory ``path`` (call on every rank; each writes its own pieces).

    Args:
        state: the `TrainState`, at a step boundary (no accumulated micro-batches).
        path: the checkpoint directory; an existing one is replaced once the new one is complete.
        extra: picklable data stored beside the state (a data cursor, client state); `read_extra`
            returns it.

    Returns:
        The checkpoint directory.

    Examples:
        >>> import tempfile, torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=2))
        >>> path = zfunc.save(state, tempfile.mkdtemp() + "/ckpt")
        >>> again = zfunc.load(path, like=state)
        >>> torch.equal(again.params, state.params)
        True
    """
    group = state.group
    if state.micro_step.item() != 0:
        raise CheckpointError("save: the state holds accumulated micro-batches (micro_step != 0); "
                              "save right after apply_step")
    path = os.path.abspath(os.fspath(path))
    token = comm.all_gather_object(uuid.uuid4().hex[:12], group)[0]
    tmp = f"{path}.tmp-{token}"
    sd: dict[str, torch.Tensor] = {}
    for unit in state.layout.units:
        lo, hi = state.layout.owned(unit)
        for role, t in zip(_ROLES, (state.params, state.opt.mu, state.opt.nu)):
            owned = _owned(state.stage, state.layout, t, unit)
            for name, start, at, n in _overlaps(unit, lo, hi):
                sd[f"p/{name}/{role}/{start}"] = owned.narrow(0, at, n).detach().cpu()
    sd.update(_scalars(state))
    sd.update({f"f/{n}": t.detach().cpu() for n, t in _replicated(state).items()})
    sd[f"rng/{group.rank}"] = torch.get_rng_state()
    if group.rank == 0:
        os.makedirs(tmp)
    comm.all_gather_object(None, group)  # barrier: the directory exists
    with _quiet():
        dcp.save(sd, checkpoint_id=tmp, **_dcp_kwargs(group))
    if group.rank == 0:
        meta = {"format": _FORMAT, "world": group.size, "stage": state.stage,
                "params": {s.name: list(s.shape) for u in state.layout.units for s in u.slots},
                "master_dtype": str(state.params.dtype), "moment_dtype": str(state.opt.mu.dtype),
                "frozen": sorted(_replicated(state))}
        _write(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
        torch.save(extra or {}, os.path.join(tmp, "extra.pt"))
        _write(os.path.join(tmp, _MARKER), "ok\n")
        old = f"{path}.old-{token}"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    comm.all_gather_object(None, group)  # barrier: committed
    return path


def _write(file: str, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's description; raises `CheckpointError` if it is incomplete."""
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, _MARKER)):
        raise CheckpointError(f"{path}: not a complete zfunc checkpoint (no {_MARKER} marker): the save was "
                              "interrupted or this is not a checkpoint directory; load an earlier one")
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def read_extra(path: str | os.PathLike) -> Any:
    """What was passed to `save` as ``extra``."""
    read_meta(path)
    return torch.load(os.path.join(os.fspath(path), "extra.pt"), weights_only=False)


def _check_fits(meta: dict[str, Any], like: TrainState, path: str) -> None:
    ours = {s.name: list(s.shape) for u in like.layout.units for s in u.slots}
    theirs = meta["params"]
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    problems = []
    if missing:
        problems.append(f"parameters missing from the checkpoint: {missing[:5]}")
    if extra:
        problems.append(f"parameters the model does not have: {extra[:5]}")
    shapes = [f"{n} {theirs[n]} vs {ours[n]}" for n in ours if n in theirs and theirs[n] != ours[n]]
    if shapes:
        problems.append(f"shapes differ (checkpoint vs model): {shapes[:5]}")
    for key, have in (("master_dtype", like.params.dtype), ("moment_dtype", like.opt.mu.dtype)):
        if meta[key] != str(have):
            problems.append(f"{key} is {meta[key]} in the checkpoint but {have} in the state")
    if sorted(_replicated(like)) != meta["frozen"]:
        problems.append(f"frozen parameters/buffers differ: {meta['frozen'][:5]} vs {sorted(_replicated(like))[:5]}")
    if problems:
        raise CheckpointError(f"{path} does not fit this state (a checkpoint of another model or "
                              f"configuration?): " + "; ".join(problems) + ". Nothing was loaded.")


def load(path: str | os.PathLike, like: TrainState, *, restore_rng: bool = True) -> TrainState:
    """The state saved at ``path``, laid out like ``like`` (call on every rank).

    The world size and the ZeRO stage may differ from the saving run's. ``like`` is only read.
    With ``restore_rng`` and an equal world size, each rank's torch RNG is restored too.

    Raises:
        CheckpointError: incomplete directory, or a checkpoint of another model (missing or extra
            parameters, other shapes or dtypes). Nothing is loaded then.

    Examples:
        >>> import tempfile, torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=0))
        >>> path = zfunc.save(state, tempfile.mkdtemp() + "/ckpt")
        >>> other = zfunc.init(torch.nn.Linear(3, 4), zfunc.Config(stage=0))
        >>> try:
        ...     zfunc.load(path, like=other)
        ... except zfunc.CheckpointError as e:
        ...     print(str(e)[str(e).index("shapes"):])
        shapes differ (checkpoint vs model): ['weight [2, 3] vs [4, 3]', 'bias [2] vs [4]']. Nothing was loaded.
    """
    path = os.path.abspath(os.fspath(path))
    meta = read_meta(path)
    _check_fits(meta, like, path)
    lay, group = like.layout, like.group
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    pieces: dict[str, dict[str, list[int]]] = {}
    for key in stored:
        if key.startswith("p/"):
            name, role, start = key[2:].rsplit("/", 2)
            pieces.setdefault(f"{name}/{role}", []).append(int(start))
    want: dict[str, torch.Tensor] = {}
    plan = []  # (role, unit, at, param name, start in param, length)
    for unit in lay.units:
        lo, hi = lay.owned(unit)
        for name, start, at, n in _overlaps(unit, lo, hi):
            for role in _ROLES:
                for s in sorted(pieces[f"{name}/{role}"]):
                    size = stored[f"p/{name}/{role}/{s}"].size[0]
                    if s < start + n and start < s + size:
                        key = f"p/{name}/{role}/{s}"
                        want[key] = torch.empty(size, dtype=stored[key].properties.dtype)
            plan.append((unit, at, name, start, n))
    scalars = {k: torch.empty_like(v) for k, v in _scalars(like).items()}
    frozen = {f"f/{n}": torch.empty_like(t, device="cpu") for n, t in _replicated(like).items()}
    rng_key = f"rng/{group.rank}" if restore_rng and meta["world"] == group.size else None
    rng = {rng_key: torch.empty_like(torch.get_rng_state())} if rng_key else {}
    with _quiet():
        dcp.load({**want, **scalars, **frozen, **rng}, checkpoint_id=path, **_dcp_kwargs(group))

    dev = like.device
    roles = {role: torch.zeros(t.numel(), dtype=t.dtype, device=dev)
             for role, t in zip(_ROLES, (like.params, like.opt.mu, like.opt.nu))}
    for unit, at, name, start, n in plan:
        for role in _ROLES:
            dst = _owned(like.stage, lay, roles[role], unit).narrow(0, at, n)
            for s in pieces[f"{name}/{role}"]:
                key = f"p/{name}/{role}/{s}"
                if key not in want:
                    continue
                a, b = max(start, s), min(start + n, s + want[key].numel())
                if a < b:
                    dst.narrow(0, a - start, b - a).copy_(want[key].narrow(0, a - s, b - a))
    if like.stage == 0 and group.size > 1:  # every rank holds all of it: share the owned slices
        for role in _ROLES:
            for unit in lay.units:
                lo, hi = lay.owned(unit)
                full = comm.all_gather(roles[role].narrow(0, lo, hi - lo), group)
                roles[role].narrow(0, 0, unit.padded).copy_(full)
    scalars = {k[2:]: v if k == "s/micro_step" else v.to(dev) for k, v in scalars.items()}  # a host counter
    return _assemble(like, roles, scalars,
                     {k[2:]: v.to(dev) for k, v in frozen.items()}, rng.get(rng_key))


def _assemble(like: TrainState, roles: dict[str, torch.Tensor], s: dict[str, torch.Tensor],
              frozen: dict[str, torch.Tensor], rng: torch.Tensor | None) -> TrainState:
    lay, cfg = like.layout, like.cfg
    master = roles["master"]
    if like.stage == 3:
        compute = master if cfg.compute_dtype == master.dtype else master.to(cfg.compute_dtype)
    else:
        full = master if like.stage == 0 else torch.cat(
            [comm.all_gather(lay.arena_slice(master, u), like.group) for u in lay.units])
        compute = full.to(cfg.compute_dtype)
        if compute.dtype == master.dtype:
            master = master_view(compute, lay, like.stage)
    scaler = tree.unflatten(tree.structure(like.scaler),
                            [s["scaler/" + "/".join(map(str, p))] for p in tree.paths(like.scaler)])
    metrics = tree.unflatten(tree.structure(like.metrics),
                             [s["metrics/" + "/".join(map(str, p))] for p in tree.paths(like.metrics)])
    if rng is not None:
        torch.set_rng_state(rng)
    return like.replace(params=master, compute=compute, grads=torch.zeros_like(like.grads),
                        opt=AdamState(mu=roles["mu"], nu=roles["nu"], count=s["count"]),
                        scaler=scaler, metrics=metrics, step=s["step"], micro_step=s["micro_step"],
                        loss_sum=s["loss_sum"], frozen={n: frozen[n] for n in like.frozen},
                        buffers={n: frozen[n] for n in like.buffers})


def _replicated(state: TrainState) -> dict[str, torch.Tensor]:
    """The tensors every rank holds whole: frozen parameters and buffers (stored under ``f/``)."""
    return {**state.frozen, **state.buffers}


def export(source: TrainState | str | os.PathLike, file: str | os.PathLike) -> str:
    """Full weights as safetensors, for inference: trainable parameters, frozen ones and buffers.

    A tied weight is stored once under its first name; ``model.load_state_dict(weights,
    strict=False)`` restores it (its aliases share the tensor). From a state this gathers (call on
    every rank; rank 0 writes); from a checkpoint directory it runs in one process.

    Examples:
        >>> import tempfile, torch, zfunc
        >>> from safetensors.torch import load_file
        >>> state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=3))
        >>> f = zfunc.export(state, tempfile.mkdtemp() + "/model.safetensors")
        >>> sorted(load_file(f))
        ['bias', 'weight']
    """
    from safetensors.torch import save_file

    if isinstance(source, TrainState):
        weights = {**full_params(source), **_replicated(source)}
        rank = source.group.rank
    else:
        weights, rank = _weights_from(os.fspath(source)), 0
    if rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, os.fspath(file),
                  metadata={"format": "zfunc"})
    return os.fspath(file)


def _weights_from(path: str) -> dict[str, torch.Tensor]:
    meta = read_meta(path)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    want = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in stored.items()
            if (k.startswith("p/") and k.rsplit("/", 2)[1] == "master") or k.startswith("f/")}
    with _quiet():
        dcp.load(want, checkpoint_id=path, no_dist=True)
    out = {}
    for name, shape in meta["params"].items():
        flat = torch.empty(int(torch.Size(shape).numel()), dtype=getattr(torch, meta["master_dtype"].split(".")[1]))
        for k, v in want.items():
            if k.startswith(f"p/{name}/master/"):
                start = int(k.rsplit("/", 1)[1])
                flat.narrow(0, start, v.numel()).copy_(v)
        out[name] = flat.view(shape)
    out.update({k[2:]: v for k, v in want.items() if k.startswith("f/")})
    return out
