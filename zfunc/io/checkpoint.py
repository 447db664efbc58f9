"""Checkpoints: every rank writes its own pieces, keyed by parameter name and offset.

``save`` stores each rank's owned part of every parameter's master weights and Adam moments as
``p/<name>/<role>/<offset>`` through ``torch.distributed.checkpoint`` (one file per rank, written
in parallel), plus the scalars of the state (step counters, the loss scaler with its hysteresis,
metrics), frozen parameters and buffers, and each rank's RNG. Because pieces are named by
parameter and offset, not by rank, ``load`` can cut them differently: another world size or
another ZeRO stage. Rank 0 stores the replicated tensors (scalars, frozen parameters, buffers),
so a checkpoint holds rank 0's values of those. Every piece's CRC-32 is recorded in
``meta.json`` and checked by ``load``. A save never replaces anything but a zfunc checkpoint,
and commits through `zfunc.io.commit` so that at every instant of a crash ``load(path)`` finds the
old or the new complete checkpoint. Every failure is a `zfunc.CheckpointError`.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import uuid
import warnings
import zlib
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from zfunc.core import opt_state
from zfunc.distributed import comm

from zfunc.io import commit
from zfunc._tree import tree
from zfunc.core.create import place_master
from zfunc.core.donation import check_live
from zfunc.io.deepspeed_checkpoint import is_deepspeed_checkpoint, load_deepspeed
from zfunc.errors import CheckpointError
from zfunc.distributed.layout import Layout, Unit
from zfunc.core.state import TrainState, accumulator_numel, host_flag, released_grads

__all__ = ["save", "load", "exists", "CheckpointError", "read_meta", "read_extra", "read_checked", "stored_pieces"]

_FORMAT = 2


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


_RECORDS = ("scaler", "metrics", "hyper")  # state records stored leaf by leaf among the scalars


def _key(record: str, path: tuple) -> str:
    return record + "/" + "/".join(map(str, path))


def _scalars(state: TrainState) -> dict[str, torch.Tensor]:
    """The state's small tensors under their checkpoint keys, where the state keeps them."""
    picked = {"step": state.step, "micro_step": state.micro_step, "loss_sum": state.loss_sum,
              **{_count_key(k): r.count for k, r in enumerate(opt_state.records(state))}}
    for record in _RECORDS:
        value = getattr(state, record)
        for path, leaf in zip(tree.paths(value), tree.leaves(value)):
            picked[_key(record, path)] = leaf
    return {f"s/{k}": v for k, v in picked.items()}


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
    check_live(state, "save")
    group = state.group
    path = os.path.abspath(os.fspath(path))
    problem, token = None, uuid.uuid4().hex[:12]
    if state.micro_step.item() != 0:
        problem = ("save: the state holds accumulated micro-batches (micro_step != 0); save right after "
                   "apply_step")
    extra_bytes = io.BytesIO()
    if group.rank == 0 and problem is None:
        try:
            torch.save(extra or {}, extra_bytes)
            commit.recover(path)
            commit.check_target(path)
        except CheckpointError as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 - anything torch.save cannot store
            problem = f"save: extra cannot be stored ({type(e).__name__}: {e}); pass picklable values"
    problem, token = comm.all_gather_object((problem, token), group)[0]  # rank 0 decides for all
    if problem is not None:
        raise CheckpointError(problem)
    tmp = f"{path}.tmp-{token}"
    sd = _pieces(state)
    crc = {k: _crc(v) for k, v in sd.items()}
    # Each barrier is an agreement (`agree`): what fails on one rank fails on every rank, at once.
    _attempt(lambda: os.makedirs(tmp) if group.rank == 0 else None, group, tmp, path)  # the directory exists
    _attempt(lambda: _dcp_save(sd, tmp, group), group, tmp, path)
    crcs = comm.all_gather_object(crc, group)
    if group.rank == 0:
        meta = {"format": _FORMAT, "world": group.size, "shard_size": state.mesh.shard.size, "stage": state.stage,
                "params": {s.name: list(s.shape) for u in state.layout.units for s in u.slots},
                "master_dtype": str(state.params.dtype), "moment_dtype": str(state.cfg.moment_dtype),
                "optimizer": state.cfg.optimizer.name, "optimizers": _optimizer_names(state),
                "frozen": sorted(_replicated(state)),
                "replicated": {n: list(t.shape) for n, t in _replicated(state).items()},
                "groups": state.hyper.lr.numel(),
                "crc": {k: v for c in crcs for k, v in c.items()}}

    def finish() -> None:
        if group.rank == 0:
            _write(os.path.join(tmp, "extra.pt"), extra_bytes.getvalue())
            _write(os.path.join(tmp, commit.META), json.dumps(meta, indent=1))
            _write(os.path.join(tmp, commit.MARKER), "ok\n")
            commit.commit(tmp, path, token)

    _attempt(finish, group, tmp, path)  # committed on every rank's word
    return path


def _dcp_save(sd: dict[str, torch.Tensor], tmp: str, group: comm.Group) -> None:
    with _quiet():
        dcp.save(sd, checkpoint_id=tmp, **_dcp_kwargs(group))


def _attempt(fn: Any, group: comm.Group, tmp: str, path: str) -> None:
    """``fn()`` on this rank, then `agree`: a failure anywhere discards the new checkpoint and
    raises on every rank (the previous checkpoint at ``path`` stays)."""
    problem = None
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - torch.distributed.checkpoint raises CheckpointException
        problem = (f"save: writing {path} failed ({type(e).__name__}: {str(e).strip()[:300]}); the previous "
                   "checkpoint there, if any, is unchanged")
    try:
        agree(problem, group)
    except CheckpointError:
        if group.rank == 0 and os.path.isdir(tmp):
            commit.discard(tmp)
        raise


def agree(problem: str | None, group: comm.Group) -> None:
    """Raise the same `CheckpointError` on every rank when any rank found ``problem``: one small
    all-gather, so a failure on one rank never leaves the others waiting in a later collective.

    Examples:
        >>> import zfunc
        >>> agree(None, zfunc.comm.world())
        >>> try:
        ...     agree("load: piece p/w/master/0 damaged", zfunc.comm.world())
        ... except zfunc.CheckpointError as e:
        ...     print(e)  # on more ranks it ends with the ranks that found it: "(rank 1)"
        load: piece p/w/master/0 damaged
    """
    if group.size == 1:
        if problem is not None:
            raise CheckpointError(problem)
        return
    problems = comm.all_gather_object(problem, group)
    found = [(r, p) for r, p in enumerate(problems) if p is not None]
    if found:
        ranks = ", ".join(str(r) for r, _ in found)
        raise CheckpointError(f"{found[0][1]} (rank{'s' if len(found) > 1 else ''} {ranks})")


def _pieces(state: TrainState) -> dict[str, torch.Tensor]:
    """This rank's pieces: its owned slices of every parameter, its RNG; rank 0 also the
    replicated tensors (scalars, frozen parameters, buffers), so they are rank 0's values."""
    group, sd = state.group, {}
    roles_of = _roles_of(state)
    for unit in state.layout.units if state.mesh.replicas.rank == 0 else ():  # one copy of each shard
        lo, hi = state.layout.owned(unit)
        for role, t in _role_tensors(state).items():
            owned = _owned(state.stage, state.layout, t, unit)
            for name, start, at, n in _overlaps(unit, lo, hi):
                if role in roles_of[name]:
                    sd[f"p/{name}/{role}/{start}"] = owned.narrow(0, at, n).detach().cpu()
    if group.rank == 0:
        sd.update({k: v.detach().cpu().clone() for k, v in _scalars(state).items()})
        sd.update({f"f/{n}": t.detach().cpu() for n, t in _replicated(state).items()})
    sd[f"rng/{group.rank}"] = torch.get_rng_state()
    return sd


def _crc(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (detects corrupted data that still parses)."""
    return zlib.crc32(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())


def _write(file: str, data: str | bytes) -> None:
    with open(file, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a complete checkpoint to `load` (for resuming after a restart).

    Examples:
        >>> import tempfile, torch, zfunc
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> before = zfunc.io.checkpoint.exists(d)
        >>> _ = zfunc.save(zfunc.init(torch.nn.Linear(2, 1), zfunc.Config()), d)
        >>> before, zfunc.io.checkpoint.exists(d)
        (False, True)
    """
    return commit.locate(os.path.abspath(os.fspath(path))) is not None


def locate(path: str | os.PathLike) -> str:
    """The directory holding the complete checkpoint ``path`` stands for (see `zfunc.io.commit`).

    Raises:
        CheckpointError: there is none.
    """
    path = os.path.abspath(os.fspath(path))
    found = commit.locate(path)
    if found is not None:
        return found
    partial = glob.glob(glob.escape(path) + ".tmp-*")
    if os.path.isdir(path) or partial:
        what = "a save to it was interrupted" if partial or os.listdir(path) else "it is an empty directory"
        raise CheckpointError(f"{path}: not a complete zfunc checkpoint (no {commit.MARKER} marker): {what}; "
                              "load an earlier one")
    parent = os.path.dirname(path)
    tags = sorted(d for d in os.listdir(parent) if os.path.isdir(os.path.join(parent, d))
                  and (commit.is_complete(os.path.join(parent, d))
                       or glob.glob(os.path.join(glob.escape(parent), glob.escape(d), "*mp_rank_00_model_states.pt")))) \
        if os.path.isdir(parent) else []
    raise CheckpointError(f"{path}: no such checkpoint; " + (f"{parent} holds {tags}" if tags else
                          f"{parent} holds no checkpoint" if os.path.isdir(parent) else f"{parent} does not exist"))


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's description; raises `CheckpointError` if it is incomplete or unreadable."""
    where = locate(path)
    try:
        with open(os.path.join(where, commit.META)) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where}/{commit.META}: unreadable ({e}); the checkpoint is damaged") from e
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise CheckpointError(f"{where}: checkpoint format {meta.get('format') if isinstance(meta, dict) else '?'}"
                              f", this zfunc reads format {_FORMAT}")
    return meta


def read_extra(path: str | os.PathLike) -> Any:
    """What was passed to `save` as ``extra``."""
    where = locate(path)
    read_meta(where)
    try:
        return torch.load(os.path.join(where, "extra.pt"), weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged file, whatever pickle makes of it
        raise CheckpointError(f"{where}/extra.pt: unreadable ({type(e).__name__}: {e})") from e


def _check_fits(meta: dict[str, Any], like: TrainState, path: str, weights_only: bool = False) -> None:
    """`CheckpointError` unless the checkpoint holds ``like``'s parameters (names, shapes), frozen
    parameters and buffers (names, shapes; another dtype is cast) and, unless ``weights_only``,
    its optimizers, groups, master and moment dtypes."""
    ours = {s.name: list(s.shape) for u in like.layout.units for s in u.slots}
    theirs = meta["params"]
    if weights_only:  # the weights alone: a parameter trained on one side may be frozen on the other
        ours = {**ours, **{n: list(t.shape) for n, t in like.frozen.items()}}
        theirs = {**theirs, **{n: s for n, s in meta["replicated"].items() if n not in like.buffers}}
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    problems = []
    if missing:
        problems.append(f"parameters missing from the checkpoint: {missing[:5]}")
    if extra:
        problems.append(f"parameters the model does not have: {extra[:5]}")
    shapes = [f"{n} {theirs[n]} vs {ours[n]}" for n in ours if n in theirs and theirs[n] != ours[n]]
    if shapes:
        problems.append(f"shapes differ (checkpoint vs model): {shapes[:5]}")
    if weights_only:
        pass  # (the master weights are cast to the state's master dtype; nothing else is read)
    elif meta["optimizer"] != like.cfg.optimizer.name:
        problems.append(f"optimizer is {meta['optimizer']} in the checkpoint but {like.cfg.optimizer.name} in the state")
    elif meta.get("optimizers", [meta["optimizer"]]) != _optimizer_names(like):
        problems.append(f"the groups' optimizers are {meta.get('optimizers')} in the checkpoint but "
                        f"{_optimizer_names(like)} in the state")
    for key, have in (("master_dtype", like.params.dtype), ("moment_dtype", like.cfg.moment_dtype)):
        if meta[key] != str(have) and not weights_only:
            problems.append(f"{key} is {meta[key]} in the checkpoint but {have} in the state")
    if meta["groups"] != like.hyper.lr.numel() and not weights_only:
        problems.append(f"parameter groups: {meta['groups']} in the checkpoint, {like.hyper.lr.numel()} in the state")
    mine = {n: list(t.shape) for n, t in _replicated(like).items()}
    if weights_only:  # (frozen parameters are compared with the parameters above)
        mine = {n: s for n, s in mine.items() if n in like.buffers}
        meta = {**meta, "replicated": {n: s for n, s in meta["replicated"].items() if n not in theirs}}
    if sorted(mine) != sorted(meta["replicated"]):
        problems.append(f"frozen parameters/buffers differ: {sorted(meta['replicated'])[:5]} vs {sorted(mine)[:5]}")
    else:
        shapes = [f"{n} {meta['replicated'][n]} vs {mine[n]}" for n in mine if meta["replicated"][n] != mine[n]]
        if shapes:
            problems.append(f"frozen parameter/buffer shapes differ (checkpoint vs model): {shapes[:5]}")
    swapped = [n for n in (*missing, *extra) if n in meta["replicated"] or n in like.frozen]
    if swapped and not weights_only:
        problems.append(f"{swapped[:5]} trained on one side and frozen on the other: load the weights alone with "
                        "weights_only=True (the engine: load_module_only=True)")
    if problems:
        raise CheckpointError(f"{path} does not fit this state (a checkpoint of another model or "
                              f"configuration?): " + "; ".join(problems) + ". Nothing was loaded.")


def load(path: str | os.PathLike, like: TrainState, *, restore_rng: bool = True,
         weights_only: bool = False) -> TrainState:
    """The state saved at ``path``, laid out like ``like`` (call on every rank).

    The world size and the ZeRO stage may differ from the saving run's. ``like`` is only read.
    With ``restore_rng`` and an equal world size, each rank's torch RNG is restored too. A
    DeepSpeed ZeRO checkpoint directory loads too (`zfunc.io.deepspeed_checkpoint`): its master
    weights, Adam moments and step counts. With ``weights_only`` the weights alone (master,
    compute copy, frozen parameters, buffers): the optimizer state, hyperparameters, loss scale,
    counters, gradients and the RNG stay ``like``'s, whatever optimizer saved the checkpoint and
    whichever parameters it froze.
    Frozen parameters and buffers saved in another dtype (another ``precision`` or
    ``buffer_dtype``) are cast to ``like``'s.

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
    if not exists(path) and is_deepspeed_checkpoint(path):
        check_live(like, "load")
        return load_deepspeed(path, like, weights_only=weights_only)
    lay, group = like.layout, like.group
    # What this rank finds wrong is agreed on before the next collective (`agree`): every rank
    # raises the same error, none waits for a rank that stopped.
    problem = None
    try:
        path, meta, stored = _open(path, like, weights_only)
    except CheckpointError as e:
        problem = str(e)
    agree(problem, group)
    pieces: dict[str, dict[str, list[int]]] = {}
    for key in stored:
        if key.startswith("p/"):
            name, role, start = key[2:].rsplit("/", 2)
            pieces.setdefault(f"{name}/{role}", []).append(int(start))
    want: dict[str, torch.Tensor] = {}
    plan = []  # (role, unit, at, param name, start in param, length)
    roles_of = {n: ("master",) for n in lay.names} if weights_only else _roles_of(like)
    for unit in lay.units:
        lo, hi = lay.owned(unit)
        for name, start, at, n in _overlaps(unit, lo, hi):
            if f"{name}/master" not in pieces and weights_only:  # frozen when saved: read whole below
                plan.append((unit, at, name, start, n))
                continue
            for role in roles_of[name]:
                for s in sorted(pieces[f"{name}/{role}"]):
                    size = stored[f"p/{name}/{role}/{s}"].size[0]
                    if s < start + n and start < s + size:
                        key = f"p/{name}/{role}/{s}"
                        want[key] = torch.empty(size, dtype=stored[key].properties.dtype)
            plan.append((unit, at, name, start, n))
    scalars = {} if weights_only else {k: torch.empty_like(v, device="cpu") for k, v in _scalars(like).items()}
    # read as saved (their CRC is the saved bytes'), cast to the state's dtype below
    frozen = {f"f/{n}": torch.empty(t.shape, dtype=stored[f"f/{n}"].properties.dtype if f"f/{n}" in stored else t.dtype)
              for n, t in _replicated(like).items() if f"{n}/master" not in pieces or not weights_only}
    if weights_only:
        # frozen when saved, trained now (read whole; this rank's part goes into the master below),
        # and trained when saved, frozen now (its master pieces, assembled below)
        frozen.update({f"f/{n}": torch.empty(meta["replicated"][n], dtype=stored[f"f/{n}"].properties.dtype)
                       for n in lay.names if f"{n}/master" not in pieces and f"f/{n}" in stored})
        want.update({f"p/{n}/master/{s}": torch.empty(stored[f"p/{n}/master/{s}"].size,
                                                      dtype=stored[f"p/{n}/master/{s}"].properties.dtype)
                     for n in like.frozen if f"{n}/master" in pieces for s in pieces[f"{n}/master"]})
    rng_key = f"rng/{group.rank}" if restore_rng and meta["world"] == group.size and not weights_only else None
    rng = {rng_key: torch.empty_like(torch.get_rng_state())} if rng_key else {}
    wanted = {**want, **scalars, **frozen, **rng}
    missing = sorted(k for k in wanted if k not in stored)
    agree(f"{path}: pieces missing from the checkpoint: {missing[:5]}. Nothing was loaded." if missing else None,
          group)
    agree(_read_pieces(wanted, path, meta, **_dcp_kwargs(group)), group)

    dev = like.device  # the master is placed from the compute device (place_master moves it)
    roles = {role: torch.zeros(t.numel(), dtype=t.dtype, device=dev if role == "master" else t.device)
             for role, t in _role_tensors(like).items() if role == "master" or not weights_only}
    for unit, at, name, start, n in plan:
        if f"f/{name}" in frozen and weights_only:  # frozen when saved
            dst = _owned(like.stage, lay, roles["master"], unit).narrow(0, at, n)
            dst.copy_(frozen[f"f/{name}"].reshape(-1).narrow(0, start, n))
            continue
        for role in roles_of[name]:
            dst = _owned(like.stage, lay, roles[role], unit).narrow(0, at, n)
            for s in pieces[f"{name}/{role}"]:
                key = f"p/{name}/{role}/{s}"
                if key not in want:
                    continue
                a, b = max(start, s), min(start + n, s + want[key].numel())
                if a < b:
                    dst.narrow(0, a - start, b - a).copy_(want[key].narrow(0, a - s, b - a))
    if like.stage == 0 and like.mesh.shard.size > 1:  # every rank holds all of it: share the owned slices
        for role in roles:
            for unit in lay.units:
                lo, hi = lay.owned(unit)
                full = comm.all_gather(roles[role].narrow(0, lo, hi - lo), like.mesh.shard)
                roles[role].narrow(0, 0, unit.padded).copy_(full)
    held = _replicated(like)
    if weights_only:  # trained when saved: the whole master from its pieces
        for n in like.frozen:
            if f"{n}/master" in pieces:
                frozen[f"f/{n}"] = torch.cat([want[f"p/{n}/master/{s}"] for s in sorted(pieces[f"{n}/master"])])
    frozen = {k[2:]: v.reshape(held[k[2:]].shape).to(device=dev, dtype=held[k[2:]].dtype)
              for k, v in frozen.items() if k[2:] in held}
    if weights_only:
        master, compute = place_master(roles["master"], like.cfg, lay, like.mesh)
        return like.replace(params=master, compute=compute, gathered=host_flag(True),
                            frozen={n: frozen[n] for n in like.frozen}, buffers={n: frozen[n] for n in like.buffers})
    live = _scalars(like)
    scalars = {k[2:]: v.to(live[k].device) for k, v in scalars.items()}  # where the state keeps each
    return _assemble(like, roles, scalars, frozen, rng.get(rng_key))


def _open(path: str | os.PathLike, like: TrainState,
          weights_only: bool = False) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The complete checkpoint directory at ``path``, its description and DCP's metadata, checked
    to fit ``like``; `CheckpointError` otherwise."""
    path = locate(path)
    meta = read_meta(path)
    _check_fits(meta, like, path, weights_only)
    return path, meta, stored_pieces(path)


def stored_pieces(path: str) -> dict[str, Any]:
    """DCP's description of each piece in the checkpoint directory ``path``; `CheckpointError`
    when it is unreadable."""
    try:
        return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except BaseException as e:  # noqa: BLE001 - DCP's errors include BaseExceptions
        _reraise(e, f"{path}/.metadata: unreadable")


def read_checked(pieces: dict[str, torch.Tensor], path: str, meta: dict[str, Any]) -> None:
    """Read ``pieces`` (key -> a tensor to fill) from the checkpoint directory ``path`` in this
    process alone, and check each against the CRC-32 ``meta`` recorded for it.

    Raises:
        CheckpointError: a piece could not be read, or its bytes differ from the saved ones.
    """
    problem = _read_pieces(pieces, path, meta, no_dist=True)
    if problem is not None:
        raise CheckpointError(problem)


def _read_pieces(pieces: dict[str, torch.Tensor], path: str, meta: dict[str, Any], **dcp_kwargs: Any) -> str | None:
    """Read ``pieces`` from ``path`` (`CheckpointError` when that fails), and what is wrong with
    them: the pieces whose CRC-32 differs from the one ``meta`` recorded, or None."""
    try:
        with _quiet():
            dcp.load(pieces, checkpoint_id=path, **dcp_kwargs)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        _reraise(e, f"{path}: reading the pieces failed")
    damaged = sorted(k for k, t in pieces.items() if meta["crc"].get(k) != _crc(t))
    return (f"{path}: damaged pieces (their CRC-32 differs from the one saved): {damaged[:5]}. Nothing was loaded; "
            "load an earlier checkpoint") if damaged else None


def _assemble(like: TrainState, roles: dict[str, torch.Tensor], s: dict[str, torch.Tensor],
              frozen: dict[str, torch.Tensor], rng: torch.Tensor | None) -> TrainState:
    cfg = like.cfg
    master, compute = place_master(roles["master"], cfg, like.layout, like.mesh)
    records = {r: tree.unflatten(tree.structure(getattr(like, r)),
                                 [s[_key(r, p)] for p in tree.paths(getattr(like, r))]) for r in _RECORDS}
    if rng is not None:
        torch.set_rng_state(rng)
    grads = released_grads(accumulator_numel(cfg, like.layout), cfg.grad_accum_dtype, like.device)
    opts = [opt.state_class(**{n: opt_state.pack(roles[_role(k, n)], runs) for n in opt.moments},
                            count=s[_count_key(k)])
            for k, (opt, runs) in enumerate(zip(opt_state.optimizers(cfg), opt_state.runs(cfg, like.layout)))]
    return like.replace(params=master, compute=compute, gathered=host_flag(True), grads=grads, reduced=host_flag(False),
                        opt=opts[0], group_opts=tuple(opts[1:]), **records, step=s["step"], micro_step=s["micro_step"],
                        loss_sum=s["loss_sum"], frozen={n: frozen[n] for n in like.frozen},
                        buffers={n: frozen[n] for n in like.buffers})


def _reraise(e: BaseException, what: str) -> None:
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
        raise e
    raise CheckpointError(f"{what} ({type(e).__name__}: {str(e).strip()[:500]}); the checkpoint is damaged or "
                          "incomplete. Nothing was loaded") from e


def _role(k: int, moment: str) -> str:
    """The stored name of optimizer ``k``'s moment: ``mu`` for `Config.optimizer`'s, ``1.momentum_buffer``
    for the first group optimizer's."""
    return moment if k == 0 else f"{k}.{moment}"


def _count_key(k: int) -> str:
    return "count" if k == 0 else f"count.{k}"


def _optimizer_names(state: TrainState) -> list[str]:
    return [o.name for o in opt_state.optimizers(state.cfg)]


def _role_tensors(state: TrainState) -> dict[str, torch.Tensor]:
    """Each stored role laid out like the master: the master itself and every optimizer's moments
    (spread over the arena, zeros where another optimizer's groups lie)."""
    out = {"master": state.params}
    total = state.params.numel()
    for k, (opt, record, runs) in enumerate(zip(opt_state.optimizers(state.cfg), opt_state.records(state),
                                               opt_state.runs(state.cfg, state.layout))):
        out.update({_role(k, n): opt_state.spread(getattr(record, n), runs, total) for n in opt.moments})
    return out


def _roles_of(state: TrainState) -> dict[str, tuple[str, ...]]:
    """What is stored per parameter: the master weights and its own optimizer's moments."""
    owner, opts = opt_state.optimizer_of(state.cfg), opt_state.optimizers(state.cfg)
    return {s.name: ("master", *(_role(owner[s.group], n) for n in opts[owner[s.group]].moments))
            for u in state.layout.units for s in u.slots}


def _replicated(state: TrainState) -> dict[str, torch.Tensor]:
    """The tensors every rank holds whole: frozen parameters and buffers (stored under ``f/``)."""
    return {**state.frozen, **state.buffers}
