"""The imperative shim's engine: DeepSpeed's engine over the pure functions (`zfunc.initialize`
in `zfunc.compat.initialize` makes one).

The engine holds one `TrainState` and calls the same functions a functional loop calls. Forward
binds the module to the state through sink leaves whose ``.grad`` *is* the state's gradient
buffer, so every way of running backward (``engine.backward(loss)``, ``loss.backward()``,
``out.backward(grad)``, one loss over several engines, ``retain_graph``) accumulates straight
into the state; ``step()`` records the micro-batches (`zfunc.core.backward.record_micro`, the
record every functional step uses) and, at the boundary, runs `apply_step` donating the state.

Micro-batches are counted as DeepSpeed counts them: each backward that reaches the model is
``1 / gradient_accumulation_steps`` of a step (``engine.backward`` divides its seed by it; a plain
``loss.backward()`` gets the factor where the parameter gradients enter), and the boundary comes
by ``step()`` count or `set_gradient_accumulation_boundary`. So Accelerate's loop (the boundary
flag, N backwards, one ``step()``) and DeepSpeed's (a ``step()`` per backward) give the same
mean. The backwards are told apart by autograd's graph task, read in the sinks' post-accumulate
hook, which also refuses a plain backward under fp16 loss scaling, as DeepSpeed does.

The engine takes the module over: at stage 3 `zfunc.init` is called with ``donate=True`` (the
module's own parameter storage is freed, as DeepSpeed's ZeRO-3 does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from zfunc.distributed import comm
from zfunc.core.backward import bind, boundary_fold, loss_scaled, point_sinks, record_micro, sinks_into
from zfunc.autograd import average, calls
from zfunc.autograd.swap import set_data, swap_in, swap_tensor
from zfunc.autograd.average import Average, ranks_averaged
from zfunc.autograd.buckets import Fold
from zfunc.core.config import Config
from zfunc.compat.engine_config import ConfigAccessors
from zfunc.compat.engine_checkpoint import Checkpoints
from zfunc.compat.engine_weights import WeightsOut
from zfunc.core.create import init, masters_from_compute
from zfunc.core.deepspeed_config import BatchSizes
from zfunc.errors import ConfigError, DeepSpeedAssertion
from zfunc.autograd.forward_gather import settle
from zfunc.compat.utils import register as register_params
from zfunc.compat.optimizer_view import OptimizerView, engine_of
from zfunc.core.state import TrainState, accumulator, is_released
from zfunc.core.update import apply_step, learning_rates, set_hyperparams

__all__ = ["Engine"]


class Engine(ConfigAccessors, WeightsOut, Checkpoints, torch.nn.Module):
    """A DeepSpeed-compatible engine: ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``.

    Like DeepSpeed's, the engine is an ``nn.Module`` wrapping the user's (``engine.module``):
    ``named_parameters()`` lists ``module.<name>`` (at stages 0-2 views of the current compute
    weights; at stage 3 empty, as DeepSpeed's partitioned parameters are), ``train()``/``eval()``
    set the module's mode, ``destroy()`` takes zfunc's hooks off the module and drops the state.

    Examples:
        >>> import torch, zfunc
        >>> torch.manual_seed(0) and None
        >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={
        ...     "train_batch_size": 4, "gradient_accumulation_steps": 2,
        ...     "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
        >>> for _ in range(4):
        ...     loss = engine(torch.ones(2, 2)).pow(2).mean()
        ...     loss.backward()                       # or engine.backward(loss)
        ...     engine.step()
        >>> engine.micro_steps, engine.global_steps, engine.was_step_applied()
        (4, 2, True)
    """

    def __init__(self, model: torch.nn.Module, cfg: Config, *, group: comm.Group | None = None,
                 batch: BatchSizes | None = None, optimizer_groups: list[dict[str, Any]] | None = None,
                 lr_scheduler: Any = None, managed: bool = True, deepspeed_masters: bool = False,
                 ds_config: dict[str, Any] | None = None):
        super().__init__()
        # engine.config: DeepSpeed's config dict, as DeepSpeed's engine keeps it (libraries built
        # on DeepSpeed read it); engine.cfg: the zfunc.Config the engine runs.
        self.config: dict[str, Any] | Config = ds_config if ds_config is not None else cfg
        # DeepSpeed's managed_gradient_accumulation: false makes every step() the boundary, after
        # however many backwards the caller ran (the caller owns the boundary).
        self.managed = managed
        self._stepping = False
        self._coalescing = False  # inside coalesce_grad_reduction()
        self._coalesced = False  # the next step() ends a coalesced block
        self.module = model
        self.cfg = cfg
        self.micro_steps = 0
        self.global_samples = 0
        self.sparse_tensor_module_names: set[str] = set()  # DeepSpeed's; sparse_gradients is refused: none
        self._batch = batch
        self._boundary: bool | None = None
        self._applied = False
        self._last_norm: torch.Tensor | None = None  # the last step's gradient norm (kept across loads, as DeepSpeed's)
        self._tasks: set[int] = set()  # the backwards that reached the model since the last step()
        self._losses: list[torch.Tensor] = []  # the losses engine.backward saw since then
        self._call_buffers: list[dict[str, torch.Tensor]] = []  # each call's buffers since then (`_keep_buffers`)
        self._scaled_tasks: set[int] = set()  # backwards through a loss engine.scale returned
        state = init(model, cfg, group, donate=cfg.stage == 3)
        if deepspeed_masters and cfg.master_dtype != cfg.compute_dtype:  # DeepSpeed: masters of the cast model
            state = state.replace(params=masters_from_compute(state))
        self.state = state
        # engine.module(x) is engine(x): calls of the module run on the state, gradients included.
        # The engine keeps the binding whose hooks route them (a state assigned later may have another).
        self._router = self._state.binding
        me = weakref.ref(self)
        self._router.route(lambda: None if me() is None else me()._bound())  # the engine gone: plain calls
        self._guard = model.register_state_dict_pre_hook(_no_stage3_state_dict) if cfg.stage == 3 else None
        if self._guard is not None:  # it leaves the module with the binding (dropped engine included)
            self._router.hold(self._guard)
        self.optimizer = OptimizerView(self, optimizer_groups)
        if cfg.lr_schedule is not None:
            if lr_scheduler is not None:
                raise ConfigError("lr_scheduler: the config has a 'scheduler' section too; use one of them")
            self.lr_scheduler: Any = _SchedulerView(self)
        elif lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
            self.lr_scheduler = lr_scheduler(self.optimizer)  # DeepSpeed's callable form
        else:
            self.lr_scheduler = lr_scheduler
        # The optimizer a torch scheduler was built on (the client's, or this engine's view): it
        # never steps (zfunc's optimizer does), so each step at the boundary marks it stepped, as
        # torch's step wrapper would, before the engine (or the client itself, as Lightning does)
        # steps the scheduler: no misordered-step warning.
        client = getattr(self.lr_scheduler, "optimizer", None)
        self._client = weakref.ref(client) if isinstance(client, torch.optim.Optimizer) else None

    # -- the state ---------------------------------------------------------------------------
    @property
    def state(self) -> TrainState:
        """The `TrainState`; assign one (e.g. from functional code) to hand it back."""
        return self._live()

    def _live(self) -> TrainState:
        """The state, or the error that says the engine was destroyed."""
        if self._state is None:
            raise RuntimeError(
                "engine: destroy() was called (Accelerate's free_memory() calls it), so this engine holds no "
                "state; its weights are back in engine.module: build a new engine with zfunc.initialize")
        return self._state

    @state.setter
    def state(self, state: TrainState) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"engine.state: expected a zfunc.TrainState, got {type(state).__name__}")
        now = getattr(self, "_state", None)
        if now is not None:
            _check_same_run(now, state)
        self._state = state = settle(state)  # the module's parameters show every slice
        self._sinks = sinks_into(state, state.grads)
        self._fold: Fold | None = None  # the boundary's reduce in backward (stages 0-1), per step
        self._avg = Average(state.cfg.grad_accum, ranks_averaged(state), state.binding.flight)
        for sink in self._sinks:  # notes each backward that reaches the state (`_grad_arrived`)
            sink.register_post_accumulate_grad_hook(_weakly(self, Engine._grad_arrived))
        self._tasks, self._losses = set(), []
        self._share_module_params()
        # The module's own trained parameters: a gradient in their ``.grad`` reached them outside
        # the engine's forward, and would be dropped (`_refuse_stray_grads`). One they hold now
        # (a backward on the model before `initialize`) was never the engine's to train on: cleared,
        # so one that arrives later is seen even where autograd adds into it in place.
        self._own = [(name, p) for name, p in self.module.named_parameters() if name not in state.frozen]
        for _, p in self._own:
            p.grad = None
        register_params(self)  # for zfunc.utils' accessors (DeepSpeed's deepspeed.utils)

    def _grad_arrived(self, _: torch.Tensor) -> None:
        """A backward reached the state (once per sink): count it once, by its graph task (a
        segment that reentrant checkpointing differentiates inside it is part of it); under loss
        scaling, refuse one whose seed did not carry the scale (DeepSpeed's rule): neither an
        engine's ``backward`` nor a loss from `scale`."""
        flight = self._state.binding.flight
        task = flight.task_now()
        if flight.nested():  # counted as the backward it runs inside
            around = flight.around()
            task = around if around is not None else flight.enclosing()
        if task is None or task in self._tasks:
            return
        self._tasks.add(task)
        scaled = average.seeded_now(flight) or task in self._scaled_tasks
        self._scaled_tasks.discard(task)
        if self.cfg.loss_scale is not None and not scaled:
            self._drop_window()
            raise RuntimeError(
                "Loss scaling is required: this engine scales the loss (fp16 with a loss scale), and a plain "
                "backward did not. Call engine.backward(loss), or engine.scale(loss).backward(). The gradients "
                "accumulated since the last step() were dropped")

    def _share_module_params(self) -> None:
        """Stages 0-2: the module's parameters become views of the compute buffer (no copy; in
        the compute dtype, as DeepSpeed's ``module.half()``/``bfloat16()``), its frozen
        parameters and buffers the state's, so ``engine.module.state_dict()`` and
        ``named_parameters()`` show the current weights. At stage 3 the module holds no
        parameters: its ``state_dict()`` raises and names `module_state_dict`."""
        st = self._state
        current = dict(st.buffers)
        if st.stage < 3:
            current.update(st.frozen)
            current.update(st.layout.views(st.layout.units[0], st.compute))
        replaced: dict[int, torch.Tensor] = {}  # meta-built (`zfunc.zero.Init`): new tensors, ties kept
        for name, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
            if name not in current and t.is_meta and isinstance(t, torch.nn.Parameter):
                # Stage 3, a meta-built model: an empty tensor on the state's device, as DeepSpeed's
                # partitioned parameters are (the same object: optimizer groups keep holding it).
                empty = torch.empty(0, dtype=st.cfg.compute_dtype, device=st.device)
                swap_tensor(t, torch.nn.Parameter(empty, requires_grad=t.requires_grad))
                continue
            if name not in current:
                continue
            if t.is_meta:  # a meta tensor cannot take another device's data: put a new one in its places
                value = current[name]
                replaced[id(t)] = torch.nn.Parameter(value, requires_grad=t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else value
            else:
                set_data([(t, current[name])])
        if replaced:
            swap_in([(entries, key, replaced[id(t)]) for mod in self.module.modules()  # for good
                     for entries in (mod._parameters, mod._buffers)
                     for key, t in entries.items() if t is not None and id(t) in replaced])

    # -- forward and backward ----------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward on the state's parameters (under autocast if configured).

        Buffers (BatchNorm statistics) are updated in the state in place: the engine donates."""
        return self._bound()(*args, **kwargs)

    def _bound(self) -> Any:
        """The module bound to the state (for ``engine(x)`` and ``engine.module(x)``), with a real
        gradient accumulator behind the sinks when autograd is on (none is held between steps)."""
        self._live()
        self._keep_buffers()
        st = self._state
        if not torch.is_grad_enabled():
            model = bind(st, self._sinks, donate=True, avg=self._avg)
        else:
            if is_released(st.grads):
                self._state = st = st.replace(grads=accumulator(st.grads, True, st.binding.pool))
                point_sinks(self._sinks, st, st.grads)
            if self.is_gradient_accumulation_boundary() and self._fold is None:
                self._fold = boundary_fold(st)  # every call until step() shares it
            model = bind(st, self._sinks, donate=True, fold=self._fold, avg=self._avg)
        self._call_buffers.append(model.new_buffers)
        return model

    def _keep_buffers(self) -> None:
        """The buffers the calls since the last step reassigned (``self.n = self.n + 1`` rather
        than in place; in their forward, or in a recomputation of it in backward) go into the
        state, and the module shows them, as its own buffers would in DeepSpeed: in place ones
        are the state's already (the calls run on the state's tensors, donated)."""
        st = self._state
        changed: dict[str, torch.Tensor] = {}
        for new in self._call_buffers:  # in call order: the latest value wins
            changed.update((n, t) for n, t in new.items() if t is not st.buffers.get(n))
        if not changed:
            return
        self._state = st.replace(buffers={**st.buffers, **changed})
        own = dict(self.module.named_buffers())
        set_data([(own[n], t) for n, t in changed.items() if n in own])

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward from a scalar ``loss``, seeded with ``loss_scale / grad_accum`` (DeepSpeed's
        ``engine.backward``; ``scale_wrt_gas=False`` leaves the ``1 / grad_accum`` out); returns
        the loss divided by ``grad_accum`` (or as it is)."""
        self._check_scalar(loss, "backward")
        ga = self.cfg.grad_accum
        seed = loss_scaled(self._live(), torch.full_like(loss, 1.0 / ga if scale_wrt_gas else 1.0))
        # The factor where gradients enter: 1 / world (the seed has the rest); the backward is the
        # binding's own (a reentrant checkpoint's inside it counts as it)
        with Average.seeded(loss), self._state.binding.flight.running([loss]):
            loss.backward(seed, retain_graph=retain_graph)
        detached = loss.detach().reshape(()).float()
        self._losses.append(detached)
        return detached / ga if scale_wrt_gas else detached

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's ``engine.scale(loss)``: the loss times the loss scale (itself without
        scaling), for ``engine.scale(loss).backward()`` under fp16; the ``1 / grad_accum`` is
        applied where the gradients enter, as for any plain backward."""
        self._check_scalar(loss, "scale")
        scaled = loss_scaled(self._state, loss)
        if scaled is not loss:  # a backward through it is scaled: noted as it passes
            calls.note_backwards(scaled, self._scaled_backward)
        return scaled

    def _scaled_backward(self, task: int) -> None:
        """Backward ``task`` runs through a loss `scale` returned: scaled, and the binding's own
        (a reentrant checkpoint's backward inside it counts as it, `calls.InFlight.own`)."""
        self._scaled_tasks.add(task)
        self._state.binding.flight.own(task)

    @staticmethod
    def _check_scalar(loss: Any, what: str) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise DeepSpeedAssertion(f"engine.{what}(loss): expected a scalar tensor with a grad_fn; for a "
                                     "non-scalar output call out.backward(grad) directly")

    # -- the step ----------------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step` updates: every ``grad_accum``-th call, unless overridden.
        With ``managed_gradient_accumulation: false``, True only while `step` runs."""
        if not self.managed:
            return self._stepping
        if self._coalescing:
            return False
        if self._coalesced:
            return True
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.cfg.grad_accum == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary from now on (sticky, as in DeepSpeed)."""
        if not self.managed:
            raise DeepSpeedAssertion("set_gradient_accumulation_boundary: with managed_gradient_accumulation false "
                                     "every step() is the boundary; call step() when the accumulation ends instead")
        if not isinstance(is_boundary, bool):  # ("False" would read as True)
            raise TypeError(f"set_gradient_accumulation_boundary: expected True or False, got {is_boundary!r}")
        self._boundary = is_boundary
        if self._fold is not None and not self._fold.started:  # a forward ran already: its backward decides
            self._fold.enabled = self._boundary

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """DeepSpeed's ``engine.coalesce_grad_reduction()``: the backwards inside the block are one
        optimizer step; the ``step()`` after the block applies what they accumulated (each
        backward scaled by 1/``gradient_accumulation_steps``, as always). ``step()`` inside the
        block raises; so do nesting and ``managed_gradient_accumulation: false``. DeepSpeed
        defers the gradient reduction to the block's end; zfunc reduces as usual (at stages 0-1
        once, at the step; at stages 2-3 per backward), which gives the same numbers. Unlike
        DeepSpeed, stage 0 works too.

        Examples:
            >>> import torch, zfunc
            >>> engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config={"train_batch_size": 1})
            >>> with engine.coalesce_grad_reduction():
            ...     for _ in range(3):
            ...         _ = engine.backward(engine(torch.ones(1, 2)).sum())
            >>> engine.step()
            >>> engine.global_steps
            1
        """
        if not self.managed:
            raise DeepSpeedAssertion("coalesce_grad_reduction: with managed_gradient_accumulation false the caller "
                                     "owns the boundary already; call step() after the backwards instead")
        if self._coalescing:
            raise RuntimeError("coalesce_grad_reduction: already inside one; blocks do not nest")
        self._coalescing = True
        try:
            yield
        finally:
            self._coalescing = False
        self._coalesced = True  # the next step() is the boundary of this block

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        """End a micro-step; at the accumulation boundary apply the optimizer step."""
        self._live()
        if self._coalescing:
            raise RuntimeError("engine.step(): inside coalesce_grad_reduction(); call step() after the block")
        if lr_kwargs and self.cfg.lr_schedule is not None:
            raise ConfigError(f"engine.step(lr_kwargs={lr_kwargs!r}): the config's scheduler follows the "
                              "applied-step count in the state and takes no arguments")
        if not self._tasks:
            raise RuntimeError(
                "engine.step(): no backward reached the model since the last step(); call engine.backward(loss) "
                "(or loss.backward()) on a loss computed with engine(...) first. Nothing was changed")
        self._refuse_stray_grads()
        self._router.occupy()  # the step replaces the state a routed forward runs on: one thread at a time
        try:
            self._stepping = True
            try:
                self._step(lr_kwargs)
            finally:
                self._stepping = False
        finally:
            self._router.release()

    def _refuse_stray_grads(self) -> None:
        """A gradient in the ``.grad`` of one of the module's own parameters came from outside the
        engine's forward (which runs on the state): a term computed from
        ``engine.module.parameters()``, a submodule called directly, a reentrant checkpoint whose
        segment reads a parameter outside the forward of every module whose subtree holds it. DeepSpeed would train on
        it; here it would be dropped, so it is refused, with the gradients since the last optimizer
        step (every micro-batch of the window: the next boundary applies those after this one). The
        state's frozen parameters are not checked: neither trains them."""
        stray = [name for name, p in self._own if p.grad is not None]
        if not stray:
            return
        for _, p in self._own:
            p.grad = None
        self._drop_window()
        shown = ", ".join(stray[:3]) + (f" and {len(stray) - 3} more" if len(stray) > 3 else "")
        raise RuntimeError(
            f"engine.step(): a gradient reached engine.module's own parameter(s) {shown} outside the engine's "
            "forward: a term computed from engine.module.parameters() (a penalty), a submodule called directly "
            "after engine(...) returned, or a reentrant activation checkpoint whose segment reads a parameter "
            "without calling the module that holds it. The engine trains its state, which the forward runs on, "
            "so that gradient would be dropped. Compute the term inside the model's forward (use weight_decay "
            "for an L2 penalty), or use_reentrant=False for the checkpoint. The gradients accumulated since the "
            "last optimizer step (this accumulation window's micro-batches) were dropped")

    def _drop_window(self) -> None:
        """A refusal: forget the backwards counted since the last optimizer step and empty the
        gradients they accumulated."""
        self._tasks, self._losses, self._scaled_tasks = set(), [], set()
        self._empty_grads()

    def _step(self, lr_kwargs: Mapping[str, Any] | None) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        if self._fold is not None and self._fold.started and not boundary:
            raise RuntimeError(
                "engine.step(): this micro-step's backward ran at the accumulation boundary, so it reduced the "
                "gradients, but step() is not at the boundary (set_gradient_accumulation_boundary changed in "
                "between); set the boundary before the backward. Nothing was changed")
        self._keep_buffers()
        self._call_buffers = []
        backwards, losses = len(self._tasks), self._losses
        known = torch.stack(losses).sum() if len(losses) == backwards else None  # else a plain backward ran
        st = record_micro(self._state, self._state.grads, loss=known, fold=self._fold, micro_batches=backwards)
        self._tasks, self._losses, self._fold, self._scaled_tasks = set(), [], None, set()
        self._coalesced = False
        if boundary:
            # Each backward came in as 1 / grad_accum of a step: applied as it is, however many ran.
            # Gathered before step() returns (as DeepSpeed's): the module's parameters are views
            # of the compute buffer, readable by the user at any moment (no forward to gather them).
            st = settle(apply_step(self._with_group_edits(st), donate=True, micro_batches=self.cfg.grad_accum))
            point_sinks(self._sinks, st, st.grads)  # released: the step's gradient buffer is freed
            if self._batch and self.managed:
                self.global_samples += self._batch.train_batch_size
            elif self._batch:  # the micro-batches actually run since the last step
                self.global_samples += self._batch.train_batch_size // self.cfg.grad_accum * backwards
        self._state = st  # the same parameter buffers: the module's views stay valid
        self._applied = boundary
        if boundary:
            self._share_module_params()  # the buffers may be new tensors (rank 0's)
            self._last_norm = st.metrics.grad_norm.clone()  # (no sync: read when asked)
            client = None if self._client is None else self._client()
            if client is not None:
                client._opt_called = True
        self.micro_steps += 1
        if boundary and self.cfg.lr_schedule is not None:
            self.optimizer.write_back()  # show the schedule's next learning rates, as DeepSpeed does
        elif boundary and self.lr_scheduler is not None and self.was_step_applied():
            # As DeepSpeed: a torch scheduler advances after each applied step (not a skipped one).
            self.lr_scheduler.step(**(lr_kwargs or {}))

    def _with_group_edits(self, st: TrainState) -> TrainState:
        """``st`` with the live edits of ``optimizer.param_groups`` (a hand-set or scheduled lr)."""
        for g, values in self.optimizer.changes():
            st = set_hyperparams(st, g, **values)
        return st

    def zero_grad(self) -> None:
        """DeepSpeed's: the module's parameters' gradients go. At stages 0-1 those are the
        gradients accumulated since the last step, dropped; at stages 2-3 each backward has
        reduced them into the ranks' shards already, where they stay until the step (DeepSpeed's
        ZeRO-2/3 keep them there too; ``optimizer.zero_grad()`` drops them at stage 3, where it
        makes the next backward overwrite them)."""
        if self._live().cfg.stage < 2:
            self._empty_grads()

    def _empty_grads(self) -> None:
        """Drop the gradients accumulated since the last step, at every stage."""
        if not is_released(self._live().grads):
            self._state.grads.zero_()

    def was_step_applied(self) -> bool:
        """Whether the last `step` changed the weights (a boundary without overflow)."""
        return self._applied and self._state.metrics.skipped.item() == 0

    # -- counters and readings (reading a device value syncs) --------------------------------
    @property
    def global_steps(self) -> int:
        return int(self._live().step.item())

    @property
    def skipped_steps(self) -> int:
        return int(self._live().scaler.skipped.item())

    @property
    def loss_scale(self) -> float:
        return self._live().scaler.scale.item()

    def get_lr(self) -> list[float]:
        """The learning rate each group of ``optimizer.param_groups`` uses at the next applied step."""
        if self.cfg.lr_schedule is None:
            return [float(d["lr"]) for d in self.optimizer.param_groups]
        lrs = learning_rates(self._live()).tolist()
        return [lrs[g] for g in self.optimizer.index]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of this engine's last step (unscaled, before clipping); None
        before its first, as DeepSpeed's (a `load_checkpoint` leaves it as it was)."""
        self._live()
        return None if self._last_norm is None else self._last_norm.item()

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: release the stage-3 parameters gathered and kept between uses. zfunc keeps
        none (each unit's gathered buffer is freed after its module has run, forward and backward),
        so there is nothing to release."""

    def destroy(self) -> None:
        """Release what the engine holds (DeepSpeed's ``engine.destroy()``, which Accelerate's
        ``free_memory()`` calls): the current weights go back into ``engine.module`` (at stage 3
        its parameters get storage again), zfunc's hooks leave the module and the state is
        dropped, so a new `zfunc.initialize` of the module starts from where this one was, as
        with DeepSpeed. A collective at stages 1-3 (it gathers the weights): call it on every
        rank. The engine cannot train afterwards (its methods say so); a second call does nothing."""
        if self._state is None:
            return
        self._return_weights()
        self._router.unroute()  # the engine's hooks only: a copy of its state keeps training
        self._router.take_off_now()  # and the call hooks a graph still referenced (the last loss) keeps
        if self._guard is not None:
            self._guard.remove()
        self._destroyed = True
        self._state = None  # type: ignore[assignment]
        self._sinks = []


def _check_same_run(now: TrainState, new: TrainState) -> None:
    """A state assigned to ``engine.state`` is one of this engine's model and `Config` (its
    optimizer, groups and stage are the engine's too).

    Raises:
        ValueError: naming what differs and where such a state comes from."""
    if new.binding is not now.binding:
        why = "of another model (or another zfunc.init of this one)"
    elif new.cfg != now.cfg:
        differ = [f.name for f in dataclasses.fields(now.cfg) if getattr(now.cfg, f.name) != getattr(new.cfg, f.name)]
        why = f"of another Config ({', '.join(differ)} differ)"
    else:
        return
    raise ValueError(f"engine.state: the state assigned is {why}; the engine trains its own model with its own "
                     "config. Assign a state made from engine.state (zfunc.load(path, like=engine.state), the "
                     "functional steps, zfunc.tree.map over it), or build an engine for the other one with "
                     "zfunc.initialize")


def _weakly(engine: Engine, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of ``engine`` for a hook to call, holding the engine weakly: a hook on the
    user's module or on the state's sinks never keeps a dropped engine alive."""
    ref = weakref.ref(engine)

    def call(*args: Any) -> Any:
        return method(engine_of(ref, "engine"), *args)

    return call


def _no_stage3_state_dict(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
    """A stage-3 module's ``state_dict()`` holds empty placeholders, as DeepSpeed's does (Lightning
    asks for it at every checkpoint and drops it): said, since the weights are not in it."""
    if prefix == "":
        warnings.warn("engine.module.state_dict(): at ZeRO stage 3 the module holds no parameters (each rank "
                      "holds shards): its entries are empty placeholders, as DeepSpeed's. For the weights use "
                      "engine.module_state_dict() or engine.save_16bit_model(dir) (on every rank), or "
                      "zfunc.full_params(engine.state)", stacklevel=3)


class _SchedulerView:
    """What ``initialize`` returns as the scheduler; the engine advances it with applied steps."""

    def __init__(self, engine: Engine):
        self._of = weakref.ref(engine)  # the engine holds this view, not the other way round

    @property
    def _engine(self) -> Engine:
        return engine_of(self._of, "lr_scheduler")

    def get_lr(self) -> list[float]:
        return self._engine.get_lr()

    get_last_lr = get_lr

    def step(self, *args: Any, **kwargs: Any) -> None:
        """A no-op: the schedule follows the applied-step count in the state."""
