"""`TrainState`: the whole training run as one immutable pytree (records only).

Leaves are tensors; what never changes during training (the module binding, the config, the
layout, the group) is static metadata. Reading a device leaf is the only thing that syncs with
the host. `zfunc.core.create.init` makes a state; the step functions transform it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from zfunc._tree import dataclass, field, tree

if TYPE_CHECKING:
    from zfunc.autograd.binding import ModuleBinding
    from zfunc.distributed.pool import Pool
    from zfunc.distributed.comm import Group
    from zfunc.core.config import Config
    from zfunc.distributed.layout import Layout
    from zfunc.distributed.mesh import Mesh
    from zfunc.core.scaler import ScalerState

__all__ = ["TrainState", "AdamState", "SGDState", "LionState", "AdagradState", "MuonState", "GroupHyper", "Metrics",
           "released_grads", "is_released", "accumulator", "accumulator_numel", "host_flag"]


def released_grads(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A flat gradient accumulator of ``numel`` elements that holds no memory: zeros, as a
    broadcast scalar. The state holds one between optimizer steps (after `zfunc.init`,
    `zfunc.apply_step` and `zfunc.load`), as torch's ``zero_grad(set_to_none=True)``, DeepSpeed
    and FSDP2 free gradients after the step; the first micro-batch of a step allocates a real one.

    Examples:
        >>> import torch
        >>> g = released_grads(4, torch.float32, "cpu")
        >>> g.tolist(), g.untyped_storage().nbytes(), is_released(g)
        ([0.0, 0.0, 0.0, 0.0], 4, True)
    """
    return torch.zeros((), dtype=dtype, device=device).expand(numel)


def accumulator_numel(cfg: Config, layout: Layout) -> int:
    """Elements of the gradient accumulator: this rank's arena where backward reduces to the
    owners (`Config.shards_grads`), else every unit's full flat buffer.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(3, 1), zfunc.Config(stage=1, grad_accum=2))
        >>> accumulator_numel(state.cfg, state.layout) == state.grads.numel()
        True
    """
    return layout.arena_numel if cfg.shards_grads else layout.full_numel


def is_released(grads: torch.Tensor) -> bool:
    """Whether ``grads`` is a released accumulator (see `released_grads`)."""
    return grads.dim() == 1 and grads.stride(0) == 0


def accumulator(grads: torch.Tensor, donate: bool, pool: Pool | None = None) -> torch.Tensor:
    """A gradient buffer to accumulate into, holding ``grads``' values: zeros for a released one
    (in a buffer of ``pool``'s when it has one, else newly allocated), else ``grads`` itself when
    donated, else a copy.

    Examples:
        >>> import torch
        >>> acc = accumulator(released_grads(3, torch.float32, "cpu"), donate=True)
        >>> acc.tolist(), is_released(acc)
        ([0.0, 0.0, 0.0], False)
    """
    if is_released(grads):
        if pool is None:
            return torch.zeros(grads.shape, dtype=grads.dtype, device=grads.device)
        return pool.take(grads.numel(), grads.dtype, grads.device).zero_()
    return grads if donate else grads.clone()


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
class SGDState:
    """SGD's momentum buffer over this rank's arena, and the number of updates applied.

    Examples:
        >>> import torch, zfunc
        >>> opt = zfunc.init(torch.nn.Linear(3, 1), zfunc.Config(stage=0, optimizer=zfunc.sgd(momentum=0.9))).opt
        >>> opt.momentum_buffer.shape, opt.count.item()
        (torch.Size([4]), 0)
    """

    momentum_buffer: torch.Tensor
    count: torch.Tensor


@dataclass(frozen=True)
class LionState:
    """Lion's momentum over this rank's arena, and the number of updates applied.

    Examples:
        >>> import torch, zfunc
        >>> zfunc.init(torch.nn.Linear(3, 1), zfunc.Config(stage=0, optimizer=zfunc.lion())).opt.mu.shape
        torch.Size([4])
    """

    mu: torch.Tensor
    count: torch.Tensor


@dataclass(frozen=True)
class AdagradState:
    """Adagrad's sum of squared gradients over this rank's arena, and the updates applied.

    Examples:
        >>> import torch, zfunc
        >>> cfg = zfunc.Config(stage=0, optimizer=zfunc.adagrad(initial_accumulator_value=0.1))
        >>> [round(x, 2) for x in zfunc.init(torch.nn.Linear(1, 1), cfg).opt.sum.tolist()]
        [0.1, 0.1, 0.1, 0.1]
    """

    sum: torch.Tensor
    count: torch.Tensor


@dataclass(frozen=True)
class MuonState:
    """Muon's momentum over the elements of its groups on this rank (padding included), and the
    updates applied.

    Examples:
        >>> import torch, zfunc
        >>> cfg = zfunc.Config(stage=0, optimizer=zfunc.muon())
        >>> zfunc.init(torch.nn.Linear(3, 2, bias=False), cfg).opt.momentum_buffer.shape
        torch.Size([8])
    """

    momentum_buffer: torch.Tensor
    count: torch.Tensor


@dataclass(frozen=True)
class GroupHyper:
    """Each parameter group's hyperparameters, float64 tensors of shape ``(groups,)`` on the host.

    Group 0 is the optimizer's own (parameters in no `zfunc.ParamGroup`); group ``i + 1`` is
    ``Config.param_groups[i]``. The fields cover every optimizer; each reads its own (Adam:
    lr, weight_decay, beta1, beta2, eps; SGD: lr, weight_decay, momentum, dampening; Lion: lr,
    weight_decay, beta1, beta2; Adagrad: lr, weight_decay, lr_decay, eps) and the rest are 0.
    They are state, not config, so a training loop may change them (`zfunc.set_hyperparams`, or
    ``optimizer.param_groups[i]["lr"] = ...`` in the engine) and a checkpoint keeps them. On the
    host, reading them never waits for a GPU.

    Examples:
        >>> import torch, zfunc
        >>> h = zfunc.init(torch.nn.Linear(3, 1), zfunc.Config(optimizer=zfunc.adamw(lr=0.1))).hyper
        >>> h.lr.tolist(), h.weight_decay.tolist(), h.beta2.tolist()
        ([0.1], [0.01], [0.999])
    """

    lr: torch.Tensor
    weight_decay: torch.Tensor
    beta1: torch.Tensor
    beta2: torch.Tensor
    eps: torch.Tensor
    momentum: torch.Tensor
    dampening: torch.Tensor
    lr_decay: torch.Tensor


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
        params: master parameters this rank owns (its arena; the full buffer at stage 0); in
            host memory with ``Config.offload_optimizer``, like the optimizer state.
        compute: the compute-dtype parameters forward uses: the full padded flat buffer for
            stages 0-2, this rank's arena for stage 3. Aliases ``params`` when the dtypes agree.
        grads: the gradient accumulator: this rank's arena where backward reduce-scatters
            (`Config.shards_grads`: stages 2-3, and stage 1 at ``grad_accum=1``), else full.
            Between optimizer steps it is released (`released_grads`: zeros that hold no memory).
        opt: `Config.optimizer`'s state record (`AdamState`, `SGDState`, `LionState`,
            `AdagradState`, `MuonState`), its moments shaped like ``params`` (packed over its own
            groups' elements when some `zfunc.ParamGroup` has an optimizer of its own).
        group_opts: the state record of each `zfunc.ParamGroup` with its own optimizer, in group
            order (empty without one); `zfunc.core.opt_state` says where each one's moments lie.
        hyper: `GroupHyper`: each parameter group's learning rate, weight decay, betas, eps.
        scaler: `zfunc.core.scaler.ScalerState`.
        step: optimizer steps taken (skipped ones included), int64, on the device. The loss
            scaler's window counts these too.
        micro_step: micro-batches accumulated since the last step, an int64 on the *host* (the
            host knows how many micro-batches it ran; reading it never waits for a GPU).
        loss_sum: sum of this rank's micro-batch losses since the last step; a micro-batch whose
            loss zfunc was not given (`vjp`, `accumulate` without ``loss=``, ``loss.backward()``
            in the engine) adds NaN, so the step's mean loss reads NaN, never a made-up 0.0.
        metrics: `Metrics` of the last step.
        frozen: parameters that do not train (compute dtype), replicated, by name.
        buffers: the module's buffers (floating ones in the compute dtype), replicated, by name;
            a forward that updates them (BatchNorm's running statistics) returns new ones.
        gathered: a bool on the host: ``compute`` holds every rank's slice. False only at stages
            1-2 with ``Config.units`` between `zfunc.apply_step` and the next forward, which
            gathers the other slices unit by unit as its modules run (`zfunc.autograd.forward_gather`); until
            then they hold earlier values. `zfunc.settle` gathers them at once.
        reduced: a bool on the host: ``grads`` holds the step's reduced gradient already (this
            rank's shard at stage 1, the all-reduced sum at stage 0): the step's last micro-batch
            reduced it during its backward (`zfunc.autograd.buckets.Fold`), so `zfunc.apply_step`
            does not reduce again. False except between that micro-batch and the step. A leaf, so
            the tree structure is the same at every micro-batch of a step.
        binding: the `zfunc.autograd.binding.ModuleBinding` (the module and the hooks zfunc put on it).
        mesh: the `zfunc.distributed.mesh.Mesh`: the world, the ranks the state is sharded over, and the
            replicas of each shard (``Config.shard_size``).

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
    opt: Any
    group_opts: tuple[Any, ...]
    hyper: GroupHyper
    scaler: ScalerState
    step: torch.Tensor
    micro_step: torch.Tensor
    loss_sum: torch.Tensor
    metrics: Metrics
    frozen: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    gathered: torch.Tensor
    reduced: torch.Tensor
    binding: ModuleBinding = field(pytree_node=False)
    cfg: Config = field(pytree_node=False)
    layout: Layout = field(pytree_node=False)
    mesh: Mesh = field(pytree_node=False)

    def replace(self, **changes: Any) -> TrainState:
        """A new state with ``changes``; the tensors not named are shared, not copied.

        Each tensor given must fit the field it replaces: the same structure, and for every
        tensor the same shape (``grads``: any, it is full or a shard by the step's progress),
        dtype and device.

        Raises:
            ValueError: a tensor that does not fit, naming the field, its place and both forms.

        Examples:
            >>> import torch, zfunc
            >>> state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config())
            >>> try:
            ...     state.replace(params=torch.zeros(9))
            ... except ValueError as e:
            ...     print(e)
            replace: params has shape [9], float32 on cpu; this state's layout needs [8], float32 on cpu
        """
        nodes = {f.name for f in dataclasses.fields(self) if f.metadata.get("pytree_node", True)}
        for name, value in changes.items():
            if name in nodes:
                _check_fits(name, getattr(self, name), value)
        return dataclasses.replace(self, **changes)

    def check_unspent(self, what: str) -> None:
        """Refuse ``what`` on a state whose buffers another state's donation emptied (a state and
        one made from it without donating share them; `zfunc.core.donation.donate_` notes the
        donation on each tensor it empties).

        Raises:
            RuntimeError: naming the donation and what to do instead.
        """
        for name in ("params", "compute", "grads"):
            by = getattr(self.__dict__.get(name), "zfunc_spent_by", None)
            if by is not None:
                raise RuntimeError(
                    f"{what}: this state shares its buffers with a state donated to {by} (donate=True), which "
                    f"reused them ({name} is empty now): a state and one made from it without donating (s, _ = "
                    "zfunc.backward_step(own, ...)) share their weights and moments, so donating either spends both. "
                    "Use the state the donating call returned, or call it without donate=True")

    def __reduce__(self) -> tuple:
        """Pickled field by field; ``params`` that views ``compute`` (the master weights in the
        compute dtype, stages 1-2) as where in it, so the unpickled state keeps them once (torch
        pickles each tensor's storage apart). A state whose buffers a donation emptied is refused
        (`check_unspent`), as in ``copy.deepcopy``."""
        self.check_unspent("pickle / copy.deepcopy")
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        p, c = self.params, self.compute
        view = None
        if (type(p) is torch.Tensor and type(c) is torch.Tensor and p is not c and p.device == c.device
                and p.device.type != "meta" and p.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()):
            view = (p.storage_offset(), tuple(p.shape), p.stride())
            fields["params"] = None
        return _unpickled, (fields, view)

    def combined(self, sources: Sequence[Any], in_place: bool) -> TrainState:
        """This state as `zfunc.tree`'s map functions made it from ``sources`` (the states at its
        place in each tree mapped over: an EMA of two states): ``gathered`` only where every one
        of them was (their ``compute`` holds every rank's slice), else the next forward gathers
        each rank's slice of this state's ``compute`` again (stages 1-2 with ``Config.units``,
        between a step and the next forward). In place (``map_``) the flag is cleared in place.
        ``reduced`` is left as the function made it.

        Examples:
            >>> import torch, zfunc
            >>> s = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config(stage=1))
            >>> stale = s.replace(gathered=torch.tensor(False))
            >>> ema = zfunc.tree.map(lambda a, b: a.lerp(b, 0.5) if a.is_floating_point() else a, s, stale)
            >>> bool(ema.gathered), bool(zfunc.tree.map(torch.add, s, s).gathered)
            (False, True)
        """
        if all(isinstance(s, TrainState) and bool(s.gathered) for s in sources):
            return self
        if in_place:
            self.gathered.fill_(False)
            return self
        return dataclasses.replace(self, gathered=host_flag(False))

    @property
    def module(self) -> torch.nn.Module:
        """The user's module this state trains."""
        return self.binding.module

    @property
    def group(self) -> Group:
        """Every rank of the run (``mesh.world``); ZeRO's collectives run over ``mesh.shard``."""
        return self.mesh.world

    @property
    def stage(self) -> int:
        return self.cfg.stage

    @property
    def device(self) -> torch.device:
        """The compute device (the master weights are on the host with ``Config.offload_optimizer``)."""
        return self.compute.device


def _unpickled(fields: dict[str, Any], view: tuple | None) -> TrainState:
    """A pickled `TrainState` again (`TrainState.__reduce__`)."""
    if view is not None:
        fields["params"] = fields["compute"].as_strided(view[1], view[2], view[0])
    return TrainState(**fields)


def host_flag(value: bool) -> torch.Tensor:
    """A bool scalar on the host (`TrainState.gathered`, `TrainState.reduced`): reading it never
    waits for a device."""
    return torch.tensor(value)


def _check_fits(name: str, old: Any, new: Any) -> None:
    """``new`` has ``old``'s structure, and each tensor its shape (``grads``: any), dtype, device."""
    old_leaves, old_spec = tree.flatten(old)
    if not all(isinstance(t, torch.Tensor) for t in old_leaves):  # a donated field: refused elsewhere
        return
    new_leaves, new_spec = tree.flatten(new)
    if old_spec != new_spec:
        raise ValueError(f"replace: {name} is structured as {new_spec}; this state's is {old_spec}")
    for i, (a, b) in enumerate(zip(old_leaves, new_leaves)):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        if (name != "grads" and a.shape != b.shape) or a.dtype != b.dtype or a.device != b.device:
            where = name if len(old_leaves) == 1 else f"{name} (leaf {i})"
            raise ValueError(f"replace: {where} has shape {list(b.shape)}, {_form(b)}; this state's layout needs "
                             f"{list(a.shape)}, {_form(a)}")


def _form(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} on {t.device}"
