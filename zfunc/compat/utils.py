"""``deepspeed.utils`` accessors over an engine's state: one parameter's full or local values.

DeepSpeed's user code reads and writes a parameter's fp32 master, gradient and Adam moments
through these (they hide how ZeRO partitions it). Each takes a parameter of ``engine.module``
(the engine that wraps it is found from the parameter); the ``full`` ones are collectives at
stages 1-3 (call them on every rank), the ``local`` ones return this rank's part (flat).
Names and arguments are DeepSpeed's; ``optim_state_key`` is ``"exp_avg"`` or ``"exp_avg_sq"``
(zfunc's ``mu`` and ``nu``). A frozen parameter has no master, gradient or moments: None.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from zfunc.core import opt_state
from zfunc.distributed import comm

__all__ = ["safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
           "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_local_fp32_param",
           "safe_set_local_optimizer_state"]

# id(parameter) -> (the parameter, its engine, its name), all held weakly (a tensor cannot key a
# WeakKeyDictionary: its == is elementwise)
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}
_KEYS = {"exp_avg": "mu", "exp_avg_sq": "nu", "momentum_buffer": "momentum_buffer"}


def register(engine: Any) -> None:
    """Note which engine and name each parameter of ``engine.module`` belongs to."""
    ref = weakref.ref(engine)
    for key in [k for k, (p, e, _) in _OWNERS.items() if p() is None or e() is None]:
        del _OWNERS[key]
    for name, p in engine.module.named_parameters():
        _OWNERS[id(p)] = (weakref.ref(p), ref, name)


def owned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a parameter of a live engine's module."""
    found = _OWNERS.get(id(param))
    engine = found[1]() if found and found[0]() is param else None
    return engine is not None and engine._state is not None


def owner_of(param: torch.Tensor) -> tuple[Any, str]:
    """The engine wrapping ``param`` and its name there."""
    found = _OWNERS.get(id(param))
    engine = found[1]() if found and found[0]() is param else None
    if engine is None or engine._state is None:
        raise ValueError("the tensor is not a parameter of a live zfunc engine's module (engine.module); pass one "
                         "of engine.module.parameters()")
    return engine, found[2]


class _Place:
    """Where a trained parameter lives in a rank's arena: its unit, slot, the unit's start in the
    full buffers (stage 0) and the ``[a, b)`` of the unit's flat buffer this rank owns of it."""

    def __init__(self, state: Any, name: str):
        lay = state.layout
        self.state, self.unit, self.slot = state, None, None
        for i, u in enumerate(lay.units):
            for s in u.slots:
                if s.name == name:
                    self.unit, self.slot = u, s
                    self.start = lay.full_starts[i]
        if self.slot is not None:
            lo, hi = (0, self.unit.padded) if state.stage == 0 else lay.owned(self.unit)
            self.lo, self.a, self.b = lo, max(lo, self.slot.offset), min(hi, self.slot.offset + self.slot.numel)

    def unit_of(self, arena: torch.Tensor) -> torch.Tensor:
        """This rank's part of the unit in ``arena`` (shaped like ``state.params``)."""
        if self.state.stage == 0:
            return arena.narrow(0, self.start, self.unit.padded)
        return self.state.layout.arena_slice(arena, self.unit)

    def mine(self, arena: torch.Tensor) -> torch.Tensor:
        """This rank's part of the parameter in ``arena``, flat (a view; empty if it owns none)."""
        if self.a >= self.b:
            return arena.new_empty(0)
        return self.unit_of(arena).narrow(0, self.a - self.lo, self.b - self.a)


def _where(state: Any, name: str) -> _Place | None:
    """The place of a trained parameter, None for a frozen one."""
    place = _Place(state, name)
    return place if place.slot is not None else None


def _full(state: Any, arena: torch.Tensor, name: str) -> torch.Tensor | None:
    """Parameter ``name`` of ``arena`` (shaped like ``state.params``) in full."""
    place = _where(state, name)
    if place is None:
        return None
    flat = place.unit_of(arena)
    if state.stage > 0:
        flat = comm.all_gather(flat.to(state.device), state.mesh.shard)
    return flat.narrow(0, place.slot.offset, place.slot.numel).view(place.slot.shape).clone()


def _local(state: Any, arena: torch.Tensor, name: str) -> torch.Tensor | None:
    """This rank's part of parameter ``name`` in ``arena`` (flat; all of it at stage 0)."""
    place = _where(state, name)
    return None if place is None else place.mine(arena).clone()


def _write(state: Any, arena: torch.Tensor, name: str, value: torch.Tensor, what: str = "value") -> None:
    """Write the full ``value`` of parameter ``name`` into this rank's part of ``arena``.

    Raises:
        ValueError: ``value`` is not shaped like the parameter (both shapes named)."""
    place = _where(state, name)
    _check_shape(name, value, place.slot.shape, what)
    flat = value.detach().reshape(-1).to(arena.device, arena.dtype)
    if place.a < place.b:
        place.mine(arena).copy_(flat.narrow(0, place.a - place.slot.offset, place.b - place.a))


def _check_shape(name: str, value: Any, shape: tuple[int, ...], what: str) -> None:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{what} for parameter {name!r}: shape {got}, but the parameter's full shape is "
                         f"{list(shape)}; pass a tensor of that shape. Nothing was changed")


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The full master weight of ``param`` (fp32 unless the config's master dtype says otherwise).

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={"train_batch_size": 1})
        >>> w = engine.module.weight
        >>> torch.equal(zfunc.utils.safe_get_full_fp32_param(w), w.detach())
        True
    """
    engine, name = owner_of(param)
    return _full(engine.state, engine.state.params, name)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the master weight of ``param`` (and its compute copy) to ``value`` (every rank passes
    the same value). A no-op for a frozen parameter, as DeepSpeed's.

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={"train_batch_size": 1})
        >>> zfunc.utils.safe_set_full_fp32_param(engine.module.weight, torch.ones(1, 2))
        >>> engine.module.weight.tolist()
        [[1.0, 1.0]]
    """
    engine, name = owner_of(param)
    st = engine.state
    if _where(st, name) is None:
        return
    _check_shape(name, value, _where(st, name).slot.shape, "safe_set_full_fp32_param")
    _write(st, st.params, name, value)
    if st.stage in (1, 2):  # every rank holds the whole compute buffer (one unit): all of it
        slot = _where(st, name).slot
        st.compute.narrow(0, slot.offset, slot.numel).copy_(value.detach().reshape(-1).to(st.compute.dtype))
    elif st.compute.untyped_storage().data_ptr() != st.params.untyped_storage().data_ptr():
        _write(st, st.compute, name, value)


def _grad_arena(engine: Any) -> torch.Tensor | None:
    """The gradient accumulated since the last step, reduced over the ranks and unscaled, shaped
    like ``state.params`` (None when nothing was accumulated)."""
    from zfunc.core.state import is_released

    st = engine.state
    g, lay = st.grads, st.layout
    if is_released(g):
        return None
    # The boundary micro-batch's backward reduced it already (stages 0-1), whether or not step()
    # has recorded that in the state yet.
    folded = engine._fold is not None and engine._fold.done
    if st.stage == 0:
        arena = g if st.reduced or folded else comm.all_reduce(g, "sum", st.mesh.world)
    elif st.cfg.shards_grads or st.reduced:
        arena = g
    elif folded:  # stage 1: this rank's reduced shard, still inside the full buffer
        arena = g.narrow(0, *lay.owned_start_len(lay.units[0]))
    else:  # stage 1 before the boundary: the local full buffer, reduce-scattered unit by unit
        arena = torch.cat([comm.reduce_scatter(g.narrow(0, s, u.padded), "sum", st.mesh.shard)
                           for s, u in zip(lay.full_starts, lay.units)])
    if st.stage > 0 and st.mesh.replicas.size > 1:  # as apply_step: once per step, across replicas
        arena = comm.all_reduce(arena, "sum", st.mesh.replicas)
    return arena.float() / st.scaler.scale.float()


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient of ``param`` accumulated since the last step, averaged over the ranks and
    micro-batches as the step will apply it, in fp32 (None before any backward of the step).
    Call after backward and before ``engine.step()`` at the boundary.

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1, bias=False), config={"train_batch_size": 1})
        >>> _ = engine.backward(engine(torch.ones(1, 2)).sum())
        >>> zfunc.utils.safe_get_full_grad(engine.module.weight).tolist()
        [[1.0, 1.0]]
    """
    engine, name = owner_of(param)
    arena = _grad_arena(engine)
    return None if arena is None else _full(engine.state, arena, name)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """``param``'s Adam moment ``optim_state_key`` (``"exp_avg"`` or ``"exp_avg_sq"``) in full.

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={"train_batch_size": 1})
        >>> zfunc.utils.safe_get_full_optimizer_state(engine.module.bias, "exp_avg").tolist()
        [0.0]
    """
    engine, name = owner_of(param)
    return _full(engine.state, _moment(engine.state, optim_state_key, name), name)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set ``param``'s Adam moment ``optim_state_key`` to the full ``value``.

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={"train_batch_size": 1})
        >>> zfunc.utils.safe_set_full_optimizer_state(engine.module.bias, torch.tensor([0.5]), "exp_avg_sq")
        >>> zfunc.utils.safe_get_full_optimizer_state(engine.module.bias, "exp_avg_sq").tolist()
        [0.5]
    """
    engine, name = owner_of(param)
    if _where(engine.state, name) is not None:
        state = engine.state
        _check_shape(name, value, _where(state, name).slot.shape, f"safe_set_full_optimizer_state({optim_state_key!r})")
        arena = _moment(state, optim_state_key, name)
        _write(state, arena, name, value)
        _store_moment(state, name, optim_state_key, arena)


def _store_moment(state: Any, name: str, key: str, arena: torch.Tensor) -> None:
    """Write an edited moment arena (from `_moment`) back when the optimizer's moments are packed."""
    k = opt_state.optimizer_of(state.cfg)[state.layout.group_of[name]]
    packed = getattr(opt_state.records(state)[k], _KEYS[key])
    if packed is not arena:
        packed.copy_(opt_state.pack(arena, opt_state.runs(state.cfg, state.layout)[k]))


def moment_keys(state: Any, name: str) -> list[str]:
    """DeepSpeed's names of the moments the optimizer stepping parameter ``name`` keeps."""
    opt = opt_state.optimizers(state.cfg)[opt_state.optimizer_of(state.cfg)[state.layout.group_of[name]]]
    return [k for k, ours in _KEYS.items() if ours in opt.moments]


def _moment(state: Any, key: str, name: str) -> torch.Tensor:
    """The moment ``key`` (DeepSpeed's name) of the optimizer stepping ``name``, laid out like the master."""
    k = opt_state.optimizer_of(state.cfg)[state.layout.group_of[name]]
    if key not in moment_keys(state, name):
        raise ValueError(f"optim_state_key: {key!r} is not a moment of {opt_state.optimizers(state.cfg)[k].name}, "
                         f"which steps {name!r} (it keeps {moment_keys(state, name)})")
    ours = _KEYS[key]
    runs = opt_state.runs(state.cfg, state.layout)[k]
    return opt_state.spread(getattr(opt_state.records(state)[k], ours), runs, state.params.numel())


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of ``param``'s master weight, flat (empty if it owns none of it).

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={"train_batch_size": 1})
        >>> zfunc.utils.safe_get_local_fp32_param(engine.module.weight).shape  # one rank: all of it
        torch.Size([2])
    """
    engine, name = owner_of(param)
    return _local(engine.state, engine.state.params, name)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of ``param``'s reduced, unscaled gradient, flat (see `safe_get_full_grad`).

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={"train_batch_size": 1})
        >>> _ = engine.backward(engine(torch.ones(1, 2)).sum())
        >>> zfunc.utils.safe_get_local_grad(engine.module.bias).tolist()
        [1.0]
    """
    engine, name = owner_of(param)
    arena = _grad_arena(engine)
    return None if arena is None else _local(engine.state, arena, name)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's part of ``param``'s Adam moment ``optim_state_key``, flat.

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={"train_batch_size": 1})
        >>> zfunc.utils.safe_get_local_optimizer_state(engine.module.weight, "exp_avg").tolist()
        [0.0, 0.0]
    """
    engine, name = owner_of(param)
    return _local(engine.state, _moment(engine.state, optim_state_key, name), name)


def _write_local(state: Any, arena: torch.Tensor, name: str, value: torch.Tensor) -> None:
    """Write ``value`` (this rank's part of parameter ``name``, flat) into ``arena``."""
    place = _where(state, name)
    if place is None:
        return
    mine = place.mine(arena)
    if value.numel() != mine.numel():
        raise ValueError(f"value: this rank holds {mine.numel()} elements of {name!r}, got {value.numel()} (read "
                         "the part with the matching safe_get_local_* first)")
    mine.copy_(value.detach().reshape(-1).to(arena.device, arena.dtype))


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's part of ``param``'s master weight (flat, as `safe_get_local_fp32_param` gives
    it). The compute copy follows at the next step, as in DeepSpeed.

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={"train_batch_size": 1})
        >>> zfunc.utils.safe_set_local_fp32_param(engine.module.weight, torch.tensor([0.5, 0.25]))
        >>> zfunc.utils.safe_get_local_fp32_param(engine.module.weight).tolist()
        [0.5, 0.25]
    """
    engine, name = owner_of(param)
    _write_local(engine.state, engine.state.params, name, value)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's part of ``param``'s moment ``optim_state_key`` (flat).

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={"train_batch_size": 1})
        >>> zfunc.utils.safe_set_local_optimizer_state(engine.module.bias, torch.tensor([2.0]), "exp_avg")
        >>> zfunc.utils.safe_get_full_optimizer_state(engine.module.bias, "exp_avg").tolist()
        [2.0]
    """
    engine, name = owner_of(param)
    state = engine.state
    if _where(state, name) is None:
        return
    arena = _moment(state, optim_state_key, name)
    _write_local(state, arena, name, value)
    _store_moment(state, name, optim_state_key, arena)
