"""``deepspeed.zero`` names: `Init`, DeepSpeed's way of building a model too big for one rank, and
`GatheredParameters`, its way of reading and writing full parameters at stage 3.

Under `Init` a model is built on the ``meta`` device (no memory, no values); `zfunc.init` and
`zfunc.initialize` then materialize it one unit at a time, each rank keeping only its shard
(`zfunc.core.materialize`). FSDP2 users write ``with torch.device("meta"):`` for the same.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from zfunc.autograd.swap import set_data
from zfunc.errors import ConfigError

__all__ = ["Init", "GatheredParameters", "WholeInit", "register_external_parameter"]

# DeepSpeed's keywords that zfunc takes as they are (their values change nothing here), with the
# values it can honour; anything else is refused by name.
_ACCEPTED = {"module": (None,), "data_parallel_group": None, "mem_efficient_linear": (True, False),
             "remote_device": (None, "cuda", "cpu_no_offload"), "pin_memory": (False, True),
             "config_dict_or_path": None, "config": None, "enabled": (True, False), "dtype": (None,), "mpu": (None,)}


class Init(contextlib.AbstractContextManager):
    """Build the model inside on the ``meta`` device, as ``deepspeed.zero.Init()`` partitions it
    at construction.

    ``enabled=False`` builds normally. DeepSpeed's other keywords are accepted where they change
    nothing here (``config_dict_or_path``, ``data_parallel_group``, ``mem_efficient_linear``,
    ``pin_memory``); ``dtype``, ``module`` (converting a built model) and a ``remote_device`` of
    ``"cpu"`` or ``"nvme"`` are refused with what to do instead.

    Examples:
        >>> import torch, zfunc
        >>> with zfunc.zero.Init():
        ...     model = torch.nn.Linear(4, 2)
        >>> model.weight.is_meta
        True
        >>> state = zfunc.init(model, zfunc.Config(stage=3))
        >>> state.params.shape, model.weight.is_meta
        (torch.Size([12]), True)
    """

    def __init__(self, **kwargs: Any):
        for key, value in kwargs.items():
            if key not in _ACCEPTED:
                raise ConfigError(f"zero.Init: {key!r} is not a keyword zfunc takes (it takes {sorted(_ACCEPTED)})")
            allowed = _ACCEPTED[key]
            if allowed is not None and value not in allowed:
                hint = {"dtype": "build the model in its own dtype and set the config's precision",
                        "module": "build the model inside the context instead",
                        "remote_device": "use offload_optimizer in the config; parameters are not offloaded"}[key]
                raise ConfigError(f"zero.Init: {key}={value!r} is not supported: {hint}")
        self.enabled = kwargs.get("enabled", True)
        self._device: Any = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._device = torch.device("meta")
            self._device.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._device is not None:
            self._device.__exit__(*exc)
            self._device = None


class WholeInit(Init):
    """``deepspeed.zero.Init`` as `zfunc.as_deepspeed` serves it, for libraries that initialise or
    load weights inside it (Transformers' ``from_config`` and ``from_pretrained`` at stage 3):
    the model is built as without it, whole, in host memory on every rank, so those writes
    (inside `GatheredParameters` with ``modifier_rank``, which broadcasts that rank's values)
    land; `zfunc.initialize` then keeps each rank's shard and frees the rest. DeepSpeed's
    partitions each parameter as it is built; for a model larger than one host's memory use
    `Init` (the ``meta`` device) and zfunc's own loop.

    Examples:
        >>> import torch, zfunc
        >>> from zfunc.compat.zero import WholeInit
        >>> with WholeInit(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        ...     model = torch.nn.Linear(4, 2)
        >>> model.weight.is_meta
        False
    """

    def __enter__(self) -> WholeInit:
        return self


class GatheredParameters(contextlib.AbstractContextManager):
    """Full parameters inside the block, as ``deepspeed.zero.GatheredParameters``: ``params`` (one
    parameter of an engine's module, or several) hold their full current weights while the block
    runs (at stage 3 they are empty otherwise; at stages 0-2 they are full already). With
    ``modifier_rank``, what that rank writes into them is broadcast and becomes the master weight
    (and compute copy) on every rank when the block ends: the elements it wrote, where the master
    has another dtype than the compute copy (bf16 compute, fp32 masters: the others keep their
    masters, not rounded through bf16). A collective at stage 3 and with
    ``modifier_rank``: enter it on every rank. ``enabled=False`` does nothing.

    Parameters of a model no engine holds yet (built, not yet passed to `zfunc.initialize`) are
    whole already; with ``modifier_rank`` that rank's values are broadcast into them on exit
    (the default process group), as DeepSpeed's do for a model built under ``zero.Init``. Such a
    parameter on the ``meta`` device has no values to gather or write: an error says so.

    Examples:
        >>> import torch, zfunc
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={
        ...     "train_batch_size": 1, "zero_optimization": {"stage": 3}})
        >>> w = engine.module.weight
        >>> with zfunc.zero.GatheredParameters(w, modifier_rank=0):
        ...     full = w.shape
        ...     with torch.no_grad():
        ...         _ = w.fill_(0.5)
        >>> full, w.numel(), zfunc.utils.safe_get_full_fp32_param(w).tolist()
        (torch.Size([1, 2]), 0, [[0.5, 0.5]])
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if p is not None] if enabled else []
        self.modifier_rank = modifier_rank
        self._restore: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (param, its data, its version)
        self._before: dict[int, torch.Tensor] = {}  # with modifier_rank over masters of another dtype: values at entry

    def __enter__(self) -> GatheredParameters:
        from zfunc.compat.utils import _full, owned, owner_of

        meta = [p for p in self.params if not owned(p) and p.is_meta]
        if meta:  # checked before any parameter changes
            raise ConfigError(
                f"GatheredParameters: a parameter of shape {tuple(meta[0].shape)} is on the meta device (built "
                "under zfunc.zero.Init) and no engine holds it yet, so it has no values; pass the model to "
                "zfunc.initialize first, or build it without zero.Init (zfunc.as_deepspeed's deepspeed.zero.Init "
                "builds it whole)")
        for p in self.params:
            if not owned(p):  # whole already
                continue
            engine, name = owner_of(p)
            st = engine.state
            if st.stage == 3:
                full = _full(st, st.compute, name)
                if full is None:  # frozen: replicated already (a copy: a write lands on exit, on every rank)
                    full = st.frozen[name].clone()
                data = p.data
                set_data([(p, full.to(p.dtype))])
                self._restore.append((p, data, p._version))
            if (self.modifier_rank is not None and name not in st.frozen
                    and st.cfg.compute_dtype != st.cfg.master_dtype):
                self._before[id(p)] = p.data.detach().clone()  # what the block did not write keeps its master
        return self

    def __exit__(self, *exc: Any) -> None:
        """On every path (an exception inside included, as DeepSpeed's): with ``modifier_rank``,
        that rank's values are broadcast and written on every rank, trained, tied and frozen
        parameters alike; without it, a write at stage 3 is refused (it would be dropped)."""
        from zfunc.compat.utils import owned, owner_of, safe_get_full_fp32_param, safe_set_full_fp32_param
        from zfunc.distributed import comm

        try:
            if self.modifier_rank is not None:
                for p in self.params:
                    if not owned(p):  # a model no engine holds yet: whole on every rank
                        if comm.world().size > 1:
                            _broadcast_host(p.data, self.modifier_rank)
                        continue
                    engine, name = owner_of(p)
                    st = engine.state
                    value = comm.broadcast(p.data.detach(), self.modifier_rank, st.group)
                    if name in st.frozen:  # replicated in the state: every rank takes the modifier's
                        with torch.no_grad():
                            st.frozen[name].copy_(value.to(st.frozen[name].dtype))
                    else:
                        before = self._before.get(id(p))
                        if before is not None:  # the elements written take the new value, the rest keep their master
                            master = safe_get_full_fp32_param(p)
                            value = torch.where(value != before, value.to(master.dtype), master)
                        safe_set_full_fp32_param(p, value)
            elif exc[0] is None:
                written = [owner_of(p)[1] for p, _, version in self._restore if p._version != version]
                if written:
                    raise RuntimeError(
                        f"GatheredParameters: {written[:3]} were written inside the block without modifier_rank; "
                        "at ZeRO stage 3 such a write is dropped when the block ends. Pass modifier_rank=<the rank "
                        "whose values to keep> (as DeepSpeed requires), or write with "
                        "zfunc.utils.safe_set_full_fp32_param")
        finally:
            set_data([(p, data) for p, data, _ in self._restore])
            self._restore = []
            self._before = {}


def _broadcast_host(t: torch.Tensor, src: int) -> None:
    """Rank ``src``'s ``t`` into ``t`` on every rank of the world; a host tensor under NCCL
    travels through the current CUDA device (NCCL moves device memory only)."""
    from zfunc.distributed import comm

    if t.device.type == "cpu" and torch.distributed.get_backend() == "nccl":
        on_device = t.to(torch.cuda.current_device())
        comm.broadcast_(on_device, src)
        t.copy_(on_device)
    else:
        comm.broadcast_(t, src)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's way of telling stage 3 that ``module``'s forward reads ``parameter``, which
    another module owns. zfunc gathers a stage-3 unit's parameters for that unit's own modules
    only, and has no way to add another unit's parameter to them: this is refused.

    Raises:
        ConfigError: always, naming what to do instead.

    Examples:
        >>> import torch, zfunc
        >>> m = torch.nn.Linear(2, 2)
        >>> zfunc.zero.register_external_parameter(m, m.weight)
        Traceback (most recent call last):
        ...
        zfunc.errors.ConfigError: zero.register_external_parameter: ...
    """
    raise ConfigError(
        f"zero.register_external_parameter: zfunc cannot gather a parameter ({tuple(parameter.shape)}) for "
        f"{type(module).__name__}, which does not own it, at ZeRO stage 3; train this model at stage 2, or at "
        "stage 3 with Config(units=...) naming a unit that holds both the module and the parameter's owner")
