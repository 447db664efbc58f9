"""The optimizer side of the DeepSpeed shim.

`plan_groups` turns what ``deepspeed.initialize`` accepts (a torch optimizer with any number of
parameter groups, a list of them such as ``[Muon(matrices), AdamW(rest)]``, or
``model_parameters`` as parameters or group dicts) into zfunc's optimizer,
`zfunc.ParamGroup`s and the parameters left frozen. `OptimizerView` is the optimizer
``initialize`` returns: a ``torch.optim.Optimizer`` whose ``param_groups`` are live (setting
``lr``, ``weight_decay``, ``betas`` or ``eps`` takes effect at the next step and is kept in the
state), so torch's ``LRScheduler``s can drive it.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from zfunc.core import opt_state
from zfunc.errors import ConfigError, DeepSpeedAssertion
from zfunc.core.optim import OPTIMIZERS, AdagradConfig, AdamConfig, MuonConfig, ParamGroup, SGDConfig

if TYPE_CHECKING:
    from zfunc.compat.engine import Engine

__all__ = ["GroupPlan", "plan_groups", "OptimizerView", "HYPER_KEYS"]

HYPER_KEYS = ("lr", "weight_decay", "betas", "eps", "momentum", "dampening", "lr_decay")
# torch optimizer group keys that change nothing at these values (or are bookkeeping).
_NEUTRAL = {"bias_correction": (True,), "amsgrad": (False,), "maximize": (False,), "foreach": (None, False, True),
            "capturable": (False,), "differentiable": (False,), "fused": (None, False, True)}
_BOOKKEEPING = {"initial_lr", "name", "decoupled_weight_decay", "nesterov", "initial_accumulator_value",
                "ns_coefficients", "ns_steps", "adjust_lr_fn"}
# The torch optimizers zfunc maps, and the keys that must agree across their groups.
_TORCH = {torch.optim.Adam: ("adam", ()), torch.optim.AdamW: ("adam", ()), torch.optim.SGD: ("sgd", ("nesterov",)),
          torch.optim.Adagrad: ("adagrad", ("initial_accumulator_value",)),
          torch.optim.Muon: ("muon", ("nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn"))}
# DeepSpeed's own Adam classes (deepspeed.ops.adam, or the switch's: `zfunc.compat.deepspeed_adam`),
# known by name: AdamW when ``adam_w_mode``.
_DEEPSPEED_ADAM = ("FusedAdam", "DeepSpeedCPUAdam")


def _kind(optimizer: Any) -> tuple[str, tuple[str, ...]] | None:
    """``(zfunc kind, keys that must agree across groups)`` of a client optimizer zfunc maps, else None."""
    if type(optimizer) in _TORCH:
        return _TORCH[type(optimizer)]
    cls = type(optimizer)
    if cls.__name__ in _DEEPSPEED_ADAM and cls.__module__.startswith(("deepspeed.ops.adam", "zfunc.compat.deepspeed_adam")):
        return "adam", ()
    return None


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """The optimizer, groups and frozen parameters `initialize` trains with."""

    optimizer: Any
    groups: tuple[ParamGroup, ...]
    freeze: tuple[str, ...]
    dicts: list[dict[str, Any]] | None  # the torch-style group dicts the view shows (None: make them)


def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _check_keys(group: dict[str, Any], i: int, where: str, torch_defaults: bool, base: Any) -> None:
    reads = _reads(base)
    for key, value in group.items():
        if key == "params" or key in reads or key in _BOOKKEEPING:
            continue
        if torch_defaults and key in _NEUTRAL and value in _NEUTRAL[key]:
            continue
        raise ConfigError(
            f"{where}[{i}].{key}: zfunc cannot honour {key}={value!r} ({base.name} reads "
            f"{', '.join(sorted(reads))} per group); remove the key or use its default")


def plan_groups(model: torch.nn.Module, base: Any, *, optimizer: Any = None,
                model_parameters: Iterable[Any] | None = None) -> GroupPlan:
    """The zfunc form of a DeepSpeed optimizer setup; raises `ConfigError` before anything changes.

    Examples:
        >>> import torch, zfunc
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1},
        ...                          {"params": [model.bias], "weight_decay": 0.0}], lr=0.01)
        >>> plan = plan_groups(model, zfunc.adamw(), optimizer=opt)
        >>> [g.params for g in plan.groups], [g.weight_decay for g in plan.groups], plan.freeze
        ([('weight',), ('bias',)], [0.1, 0.0], ())
    """
    names = _names(model)
    if optimizer is not None and model_parameters is not None and not isinstance(optimizer, OPTIMIZERS):
        model_parameters = None  # as DeepSpeed: a client optimizer brings its own parameters
    if isinstance(optimizer, OPTIMIZERS):
        base, optimizer = optimizer, None
    own: list[Any] = []  # each dict's own optimizer (None: the base)
    if optimizer is not None:
        several = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        odd = [type(o).__name__ for o in several if _kind(o) is None]
        if odd or not several:
            raise DeepSpeedAssertion(
                f"optimizer: zfunc maps torch.optim.Adam, AdamW, SGD, Adagrad and Muon and DeepSpeed's FusedAdam and "
                f"DeepSpeedCPUAdam (one, or a list of them, e.g. [Muon(matrices), AdamW(rest)]), or a zfunc optimizer "
                f"record; got {odd or 'an empty list'} (zfunc runs the update math itself, so an optimizer it does not "
                "know cannot be sharded)")
        base = _from_torch(several[0])
        dicts = [d for o in several for d in o.param_groups]
        own = [None if j == 0 else _from_torch(o) for j, o in enumerate(several) for _ in o.param_groups]
        where, torch_defaults = "optimizer.param_groups", True
    elif model_parameters is not None:
        given = list(model_parameters)
        if given and all(isinstance(g, dict) for g in given):
            dicts = given
        elif all(isinstance(p, torch.Tensor) for p in given):
            dicts = [{"params": given}]
        else:
            raise ConfigError("model_parameters: expected parameters, or dicts with a 'params' key (parameter "
                              "groups), not a mix")
        where, torch_defaults = "model_parameters", False
    else:
        return GroupPlan(base, (), (), None)
    groups, seen = [], {}
    for i, g in enumerate(dicts):
        opt = (own[i] if own else None) or base
        _check_keys(g, i, where, torch_defaults, opt)
        params = g.get("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        chosen = []
        for p in params:
            if id(p) not in names:
                raise ConfigError(f"{where}[{i}].params: a parameter of shape {list(p.shape)} is not in the model")
            if id(p) in seen and seen[id(p)] != i:
                raise ConfigError(f"{where}: {names[id(p)]!r} is in groups {seen[id(p)]} and {i}; put each "
                                  "parameter in one group")
            seen[id(p)] = i
            if not p.requires_grad:  # frozen stays frozen (DeepSpeed keeps only trainable ones too)
                continue
            if names[id(p)] not in chosen:
                chosen.append(names[id(p)])
        values = {k: (tuple(g[k]) if k == "betas" else g[k]) for k in HYPER_KEYS if k in g and k in _reads(opt)}
        groups.append(ParamGroup(tuple(chosen), **values, optimizer=own[i] if own else None))
    listed = {names[i] for i in seen}
    freeze = tuple(n for n, p in model.named_parameters() if p.requires_grad and n not in listed)
    if optimizer is None:  # group dicts from model_parameters: show torch-style dicts with every key
        dicts = [{**_torch_values(base.values()), **g} for g in dicts]
    return GroupPlan(base, tuple(groups), freeze, dicts)


def _reads(opt: Any) -> set[str]:
    """The torch-style group keys ``opt`` reads (``betas`` for beta1/beta2)."""
    return {"betas" if n.startswith("beta") else n for n in opt.live}


def _torch_values(values: dict[str, float]) -> dict[str, Any]:
    """zfunc's per-group names (beta1, beta2) as torch's group keys (betas)."""
    out = {k: v for k, v in values.items() if not k.startswith("beta")}
    if "beta1" in values:
        out["betas"] = (values["beta1"], values["beta2"])
    return out


def _from_torch(optimizer: torch.optim.Optimizer) -> Any:
    """The zfunc optimizer record of a torch (or DeepSpeed Adam) optimizer, from its first group."""
    kind, same = _kind(optimizer)
    groups = optimizer.param_groups
    for key in same:
        if len({g.get(key) for g in groups}) > 1:
            raise ConfigError(f"optimizer.param_groups: {key} differs between groups; zfunc uses one value for all")
    g0 = groups[0]
    if kind == "adam":
        decoupled = {isinstance(optimizer, torch.optim.AdamW) or bool(g.get("decoupled_weight_decay"))
                     or bool(getattr(optimizer, "adam_w_mode", False)) for g in groups}
        if len(decoupled) > 1:
            raise ConfigError("optimizer.param_groups: decoupled_weight_decay differs between groups; zfunc applies "
                              "one kind of weight decay to all of them")
        return AdamConfig(lr=float(g0["lr"]), betas=tuple(g0["betas"]), eps=g0["eps"],
                          weight_decay=g0["weight_decay"], decoupled=decoupled.pop())
    if kind == "sgd":
        return SGDConfig(lr=float(g0["lr"]), momentum=g0["momentum"], dampening=g0["dampening"],
                         weight_decay=g0["weight_decay"], nesterov=bool(g0["nesterov"]))
    if kind == "muon":
        return MuonConfig(lr=float(g0["lr"]), weight_decay=g0["weight_decay"], momentum=g0["momentum"],
                          nesterov=bool(g0["nesterov"]), ns_coefficients=tuple(g0["ns_coefficients"]), eps=g0["eps"],
                          ns_steps=g0["ns_steps"], adjust_lr_fn=g0["adjust_lr_fn"])
    return AdagradConfig(lr=float(g0["lr"]), lr_decay=g0["lr_decay"], weight_decay=g0["weight_decay"], eps=g0["eps"],
                         initial_accumulator_value=g0["initial_accumulator_value"])


class _LocalState(Mapping):
    """``optimizer.state``: for each trained parameter, this rank's part of its optimizer's moments,
    flat, under DeepSpeed's keys (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``); read-only copies
    (write with `zfunc.utils.safe_set_full_optimizer_state`). No collective: every rank reads its own."""

    def __init__(self, engine: Engine):
        from zfunc.compat.utils import moment_keys

        named, state = dict(engine.module.named_parameters()), engine.state
        self._params = [named[n] for n in state.layout.names if n in named]
        self._keys = {id(named[n]): moment_keys(state, n) for n in state.layout.names if n in named}

    def __getitem__(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        from zfunc.compat.utils import safe_get_local_optimizer_state

        if id(param) not in self._keys:
            raise KeyError("optimizer.state: not a parameter this engine trains")
        return {k: safe_get_local_optimizer_state(param, k) for k in self._keys[id(param)]}

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def engine_of(ref: weakref.ref, what: str) -> Engine:
    """The engine behind a weak reference a view of it holds (the optimizer and scheduler that
    `zfunc.initialize` returns), or an error saying it was dropped."""
    engine = ref()
    if engine is None:
        raise RuntimeError(f"{what}: the engine it belongs to was dropped (nothing held it any more); keep the engine "
                           "that zfunc.initialize returned while its optimizer and scheduler are used")
    return engine


class OptimizerView(torch.optim.Optimizer):
    """The optimizer `zfunc.initialize` returns: live ``param_groups`` over the engine's state.

    ``param_groups[i]`` is zfunc's parameter group ``i + 1`` (or group 0 when the run has no
    groups). The engine reads the groups' ``lr``, ``weight_decay``, ``betas`` and ``eps`` at each
    optimizer step into the state (`zfunc.set_hyperparams`), and writes the state's values back
    after a checkpoint is loaded. Call ``engine.step()``, not ``optimizer.step()``.

    What code written for DeepSpeed's ZeRO optimizers reads answers the same: ``overflow`` (the
    last step was skipped for a non-finite gradient; Hugging Face Accelerate's
    ``step_was_skipped`` reads it), ``loss_scale`` and ``cur_scale``. ``state[param]`` holds this
    rank's part of the parameter's moments (``exp_avg``, ``exp_avg_sq``). ``state_dict()`` and
    ``load_state_dict()`` raise and name `Engine.save_checkpoint`/`Engine.load_checkpoint`: the
    moments live sharded in the engine's state, and an empty dict would save nothing silently.

    Examples:
        >>> import torch, zfunc
        >>> engine, optimizer, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={
        ...     "train_batch_size": 1, "fp16": {"enabled": True, "initial_scale_power": 4}})
        >>> _ = engine.backward(engine(torch.full((1, 2), float("inf"), dtype=torch.float16)).float().sum())
        >>> engine.step()
        >>> optimizer.overflow, optimizer.cur_scale, engine.was_step_applied()  # hysteresis 2: scale kept once
        (True, 16.0, False)
    """

    def __init__(self, engine: Engine, dicts: list[dict[str, Any]] | None):
        self._of = weakref.ref(engine)  # the engine holds this view, not the other way round
        hyper = engine.state.hyper
        if dicts is None:  # a dict per zfunc group holding parameters (one unless the config made groups)
            named, lay = dict(engine.module.named_parameters()), engine.state.layout
            self.index = list(lay.groups)
            dicts = [{"params": [named[n] for n in lay.names if lay.group_of[n] == g]} for g in self.index]
        else:
            self.index = list(range(1, hyper.lr.numel()))
        self._shared = dicts  # the user's torch optimizer's dicts, when one was given (its schedulers write there)
        super().__init__([{"params": list(d["params"])} for d in dicts], {})
        self.param_groups = dicts
        self.write_back()

    @property
    def _engine(self) -> Engine:
        return engine_of(self._of, "optimizer")

    def write_back(self) -> None:
        """Show the state's hyperparameters (and the learning rates a schedule computed) in the dicts."""
        from zfunc.core.update import learning_rates

        h = self._engine.state.hyper
        scheduled = self._engine.cfg.lr_schedule is not None
        lrs = learning_rates(self._engine.state).tolist() if scheduled else h.lr.tolist()
        for d, g in zip(self.param_groups, self.index):
            d.update(_torch_values({n: getattr(h, n)[g].item() for n in self._optimizer(g).live}), lr=lrs[g])
        self._written = [d["lr"] for d in self.param_groups]

    def changes(self) -> list[tuple[int, dict[str, Any]]]:
        """``(zfunc group, values)`` for each group whose dict differs from the state."""
        h, out = self._engine.state.hyper, []
        for k, (d, g) in enumerate(zip(self.param_groups, self.index)):
            have = _torch_values({n: getattr(h, n)[g].item() for n in self._optimizer(g).live})
            now = {key: (tuple(d[key]) if key == "betas" else d[key]) for key in have}
            if self._engine.cfg.lr_schedule is not None:
                if d["lr"] != self._written[k]:
                    raise ConfigError(f"optimizer.param_groups[{k}]['lr']: the config's scheduler sets the learning "
                                      "rate; remove the 'scheduler' section to set it by hand")
                now["lr"] = have["lr"]
            diff = {key: v for key, v in now.items() if v != have[key]}
            if diff:
                out.append((g, diff))
        return out

    def _optimizer(self, group: int) -> Any:
        """The zfunc optimizer stepping ``group``."""
        cfg = self._engine.cfg
        return opt_state.optimizers(cfg)[opt_state.optimizer_of(cfg)[group]]

    def step(self, closure: Any = None) -> None:  # noqa: D102 - see the class docstring
        raise RuntimeError("optimizer.step(): call engine.step(); it applies the optimizer step at the "
                           "gradient accumulation boundary")

    @property
    def state(self) -> Mapping[torch.Tensor, dict[str, torch.Tensor]]:  # type: ignore[override]
        """Each trained parameter's optimizer moments on this rank (DeepSpeed's keys), read-only."""
        return _LocalState(self._engine)

    @state.setter
    def state(self, value: Any) -> None:  # torch.optim.Optimizer.__init__ assigns an empty dict: not used
        del value

    def state_dict(self) -> dict[str, Any]:
        """What this rank holds, in torch's format, as DeepSpeed's ZeRO optimizer gives its own
        partition: each trained parameter's moments under DeepSpeed's keys (`state`: at stages
        1-3 the flat slice of it this rank owns, empty where it owns none), and the groups. Not a
        checkpoint: `load_state_dict` refuses it (save with ``engine.save_checkpoint(dir)`` or
        ``zfunc.save``; read a parameter's whole moment with
        ``zfunc.utils.safe_get_full_optimizer_state(param, key)``). Lightning asks for it at every
        checkpoint and drops it, as it does DeepSpeed's."""
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102 - see the message
        raise RuntimeError("optimizer.load_state_dict(): load the optimizer with engine.load_checkpoint(dir) (it "
                           "reads zfunc's and DeepSpeed's checkpoints), not through this view")

    @property
    def overflow(self) -> bool:
        """Whether the last step was skipped for a non-finite gradient (DeepSpeed's name)."""
        return bool(self._engine.state.metrics.skipped.item())

    @property
    def loss_scale(self) -> float:
        """The loss scale of the next step (1.0 without fp16 scaling)."""
        return self._engine.state.scaler.scale.item()

    cur_scale = loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DeepSpeed's ZeRO optimizer's: drops the gradients accumulated since the last step, but
        at stage 2, where each backward has reduced them into the ranks' shards already and
        DeepSpeed's ZeRO-2 optimizer keeps them there (a ``zero_grad()`` at the start of an
        accumulation cycle that falls inside the engine's window, as Lightning's at an epoch of
        a length ``accumulate_grad_batches`` does not divide, leaves the window whole)."""
        del set_to_none
        if self._engine.cfg.stage != 2:
            self._engine._empty_grads()
