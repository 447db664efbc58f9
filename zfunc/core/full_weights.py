"""The full weights out of the shards, one unit at a time (`iter_full_params`).

Every rank iterates together: before each unit the ranks agree, in one small all-gather over the
state's world, on what they iterate (a fingerprint of the layout, the dtype and the destination)
and where they are; then the unit's parameters are gathered (to every rank, or to one), each
straight into a tensor of its own (`zfunc.comm.gather_split`), and yielded. A rank that stops early, or iterates something
else, makes every rank raise at the next agreement instead of leaving the others waiting in a
gather: a generator that is dropped or closed tells the others it stopped.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from zfunc.autograd.forward_gather import settle
from zfunc.core.create import model_order
from zfunc.core.donation import check_live
from zfunc.core.state import TrainState
from zfunc.distributed import comm
from zfunc.distributed.mesh import global_ranks

__all__ = ["iter_full_params"]

_GO, _DONE, _STOP = 0, 1, 2
_SAYS = {_GO: "went on", _DONE: "had finished", _STOP: "stopped iterating"}


def iter_full_params(state: TrainState, dtype: torch.dtype | None = None,
                     dst: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter in full, ``(name, tensor)``, one gather unit at a time: a collective that
    every rank of the state's world iterates together.

    The trainable parameters come unit by unit (each unit's in the model's order), then the
    frozen ones; names are those of ``model.named_parameters()`` (a tied weight once, under its
    first name) at `zfunc.init` (`zfunc.full_params`). Buffers are not parameters:
    `zfunc.TrainState.buffers` holds them whole on every rank. Each tensor yielded is new, with storage of its own: a loop that lets go of them holds
    about one unit at a time (plus this rank's shard in ``dtype``), where `zfunc.full_params`
    holds the whole model. A loop that may stop early on some rank should close the iterator
    (``contextlib.closing``, or ``close()`` in its error handler) before its next collective:
    closing tells the other ranks, which then raise; a dropped iterator does so when Python frees
    it.

    Args:
        state: the training state (not donated).
        dtype: the dtype to yield. ``None``: the compute dtype (the weights forward uses). Another
            dtype is cast from the master weights (``torch.float32`` gives `zfunc.full_params`'
            values even when the compute copy is bf16); frozen parameters, which have no masters,
            are cast from the compute dtype. At stages 1-2 the layout is one unit, so that cast
            gathers the whole model's masters at once, as `zfunc.full_params` does; the compute
            dtype needs no gather there (every rank holds the compute copy whole).
        dst: ``None``: every rank receives the weights. A rank of the state's world: only that
            rank does (at stages 1-3 its shard group gathers to it alone); the others yield
            nothing but must still iterate to the end.

    Raises:
        ValueError: ``dtype`` is not a floating dtype, or ``dst`` is not a rank of the world.
        RuntimeError: the ranks do not iterate together (one stopped early, or they iterate
            different states, dtypes or destinations): every rank raises, naming the ranks.

    Examples:
        >>> import torch, zfunc
        >>> torch.manual_seed(0) and None
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        >>> state = zfunc.init(model, zfunc.Config(stage=3, units=[torch.nn.Linear]))
        >>> [(n, tuple(t.shape)) for n, t in zfunc.iter_full_params(state)]
        [('0.weight', (4, 3)), ('0.bias', (4,)), ('1.weight', (2, 4)), ('1.bias', (2,))]
        >>> full = zfunc.full_params(state)
        >>> all(torch.equal(t, full[n]) for n, t in zfunc.iter_full_params(state, dtype=torch.float32))
        True
    """
    check_live(state, "iter_full_params")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"iter_full_params: dtype must be a floating torch.dtype or None, got {dtype!r}")
    world = state.mesh.world
    if dst is not None and not (isinstance(dst, int) and not isinstance(dst, bool) and 0 <= dst < world.size):
        raise ValueError(f"iter_full_params: dst must be None (every rank) or a rank of the state's world "
                         f"(0..{world.size - 1}), got {dst!r}")
    stream = _stream(state, dtype, dst)
    next(stream)  # to its first pause, before any collective: dropped or closed from here on, it says so
    return stream


def _stream(state: TrainState, dtype: torch.dtype | None, dst: int | None
            ) -> Iterator[tuple[str, torch.Tensor] | None]:
    lay, world = state.layout, state.mesh.world
    out_dtype = dtype or state.compute.dtype
    receive = dst is None or dst == world.rank
    order = model_order(state)
    masters = dtype is not None and dtype != state.compute.dtype  # cast from the masters
    src = state.params if masters else state.compute
    gathers, to = _gather_target(state, dst)
    sign = _fingerprint(state, dtype, dst)
    n = len(lay.units)
    at = 0  # the agreement this rank takes part in next
    try:
        yield None  # primed: `iter_full_params` takes this one
        for i, unit in enumerate(lay.units):
            _agree(state, sign, at, _GO)
            at += 1
            whole = _whole_here(state, src, masters)
            if whole is not None:  # every rank holds the unit already: a copy per parameter
                if receive:
                    views = lay.views(unit, whole.narrow(0, lay.full_starts[i], unit.padded))
                    for name in sorted(views, key=order):
                        yield name, views.pop(name).to(state.device, out_dtype, copy=True)
                continue
            if not gathers:  # another shard group gathers to dst
                continue
            shard = lay.arena_slice(src, unit).to(state.device, out_dtype)
            parts = comm.gather_split(shard, [s.numel for s in unit.slots], state.mesh.shard, dst=to)
            if parts is not None:
                views = {s.name: p.view(s.shape) for s, p in zip(unit.slots, parts)}
                del parts
                for name in sorted(views, key=order):
                    yield name, views.pop(name)
        _agree(state, sign, n, _DONE)
        at = -1
    except GeneratorExit:
        if at >= 0:
            _agree(state, sign, at, _STOP)
        raise
    if receive:
        for name in sorted(state.frozen, key=order):
            yield name, state.frozen[name].to(out_dtype, copy=True)


def _fingerprint(state: TrainState, dtype: torch.dtype | None, dst: int | None) -> int:
    """What is iterated, as one number every rank computes alike (not Python's salted ``hash``)."""
    lay = state.layout
    what = (state.stage, state.mesh.shard.size, str(dtype or state.compute.dtype), dst,
            tuple((u.padded, tuple((s.name, s.shape) for s in u.slots)) for u in lay.units),
            tuple((k, tuple(v.shape)) for k, v in state.frozen.items()))
    return zlib.crc32(repr(what).encode())


def _agree(state: TrainState, sign: int, at: int, status: int) -> None:
    """Every rank says what it iterates, where it is and whether it goes on; all must say the
    same, or every rank raises here (an agreed stop returns quietly)."""
    world = state.mesh.world
    if world.size == 1:
        return
    mine = torch.tensor([sign, at, status], dtype=torch.int64, device=state.device)
    every = comm.all_gather(mine, world).view(world.size, 3).tolist()
    if all(row == every[0] for row in every):
        return

    def by(col: int) -> dict[int, list[int]]:  # each value said in column ``col``: the ranks that said it
        said = sorted({row[col] for row in every})
        return {v: [r for r, row in enumerate(every) if row[col] == v] for v in said}

    if len(by(0)) > 1:
        groups = "; ".join(f"ranks {rs}" for rs in by(0).values())
        raise RuntimeError(
            f"iter_full_params: the ranks iterate different things ({groups} differ in the state's layout, "
            "stage, shard size, dtype or dst): call it on every rank with the same state, dtype and dst")
    said = "; ".join(f"ranks {rs} {_SAYS[s]}" for s, rs in by(2).items())
    units = "; ".join(f"ranks {rs} at unit {a} of {len(state.layout.units)}" for a, rs in by(1).items())
    raise RuntimeError(
        f"iter_full_params is a collective and the ranks did not iterate together ({said}; {units}): "
        "every rank iterates it to the end (a loop on a rank that wants nothing can use dst=), or every "
        "rank stops at the same place")


def _whole_here(state: TrainState, src: torch.Tensor, masters: bool) -> torch.Tensor | None:
    """``src`` when it holds every unit whole on this rank, else ``None``: stage 0's masters and
    compute copy, and at stages 1-2 the compute copy (gathered here, in its own buffer, where the
    step left the other ranks' slices to the next forward)."""
    if state.stage == 0:
        return src
    if state.stage == 3 or masters:
        return None
    if not bool(state.gathered):
        settle(state)  # what the next forward would do to this buffer, unit by unit
    return src


def _gather_target(state: TrainState, dst: int | None) -> tuple[bool, int | None]:
    """Whether this rank's shard group gathers the units, and to which of its ranks (``None``:
    to every rank): with ``dst``, only dst's shard group gathers, to dst."""
    if dst is None:
        return True, None
    target = global_ranks(state.mesh.world)[dst]
    members = global_ranks(state.mesh.shard)
    return (True, members.index(target)) if target in members else (False, None)
