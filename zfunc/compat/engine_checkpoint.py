"""The engine's checkpoints: DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` over
`zfunc.save` and `zfunc.load` (a DeepSpeed ZeRO checkpoint directory loads too), with DeepSpeed's
keywords, tags and ``latest`` file (`Engine` inherits them)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch

from zfunc.core.config import Config
from zfunc.core.state import accumulator_numel, host_flag, released_grads
from zfunc.distributed import comm
from zfunc.errors import CheckpointError, ConfigError
from zfunc.io.checkpoint import agree, exists, load, read_extra, save
from zfunc.io.deepspeed_checkpoint import is_deepspeed_checkpoint, read_deepspeed

if TYPE_CHECKING:
    from zfunc.core.state import TrainState

__all__ = ["Checkpoints"]


class Checkpoints:
    """Saving and loading the engine's state, as DeepSpeed's engine does."""

    cfg: Config
    _state: TrainState
    micro_steps: int
    global_samples: int
    lr_scheduler: Any
    optimizer: Any
    _live: Any  # the engine's: its state, or the error that says it was destroyed
    _with_group_edits: Any  # the engine's: the state with the optimizer groups' edits in it
    global_steps: int
    gradient_accumulation_steps: Any
    state: Any

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save to ``save_dir/tag`` (default tag ``global_step<N>``) and point ``latest`` at it.

        Every rank writes its own pieces (`zfunc.save`); ``client_state`` is stored as is. Inside
        an accumulation window, as DeepSpeed, the window's gradients are not saved: the checkpoint
        holds the weights and optimizer state of the last step (and the buffers as they are now),
        loading it starts a window afresh, and this engine goes on with its window.
        ``exclude_frozen_parameters`` (DeepSpeed's; Lightning passes it): False only.

        Raises:
            NotImplementedError: ``exclude_frozen_parameters=True``.
        """
        if exclude_frozen_parameters is not False:
            raise NotImplementedError(
                "save_checkpoint(exclude_frozen_parameters=True): zfunc's checkpoints always hold the frozen "
                "parameters (they are part of the state a load checks). Save with exclude_frozen_parameters=False "
                "(the default)")
        tag = _check_tag(tag if tag is not None else f"global_step{self.global_steps}")
        self._state = self._with_group_edits(self._state)  # the groups' lr as the optimizer shows it
        st, micro_steps = self._state, self.micro_steps
        window = int(st.micro_step.item())
        if window:
            st = st.replace(grads=released_grads(accumulator_numel(st.cfg, st.layout), st.grads.dtype, st.device),
                            micro_step=torch.zeros_like(st.micro_step), loss_sum=torch.zeros_like(st.loss_sum),
                            reduced=host_flag(False))
            micro_steps -= window
        sched = self._torch_scheduler_state()
        extra = {"client_state": client_state, "micro_steps": micro_steps, "global_samples": self.global_samples,
                 "lr_scheduler": sched, "lr_scheduler_type": type(self.lr_scheduler).__name__ if sched else None}
        save(st, os.path.join(os.fspath(save_dir), tag), extra=extra)
        problem = None
        if save_latest and self._state.group.rank == 0:
            try:
                tmp = os.path.join(os.fspath(save_dir), f".latest-{os.getpid()}")
                with open(tmp, "w") as f:
                    f.write(tag)
                os.replace(tmp, os.path.join(os.fspath(save_dir), "latest"))
            except OSError as e:
                problem = (f"save_checkpoint: {tag} is saved, but pointing {save_dir}/latest at it failed ({e}); "
                           "latest still names the previous checkpoint")
        agree(problem, self._state.group)  # `latest` is in place, on every rank's word
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, Any]:
        """Load ``load_dir/tag`` (default: the tag in ``load_dir/latest``) into the engine.

        Returns ``(path, client_state)``, or ``(None, None)`` when there is no ``latest``. A
        DeepSpeed ZeRO checkpoint directory loads as well (its master weights, Adam moments, step
        counts and client state; `zfunc.io.deepspeed_checkpoint`).
        The world size and ZeRO stage may differ from the saving run's. DeepSpeed's keywords
        keep their meaning: ``load_module_only=True`` loads the weights (master, compute copy,
        frozen parameters, buffers) and nothing else; ``load_optimizer_states=False`` keeps the
        engine's optimizer state (moments, step count, hyperparameters, loss scale) and loads the
        rest; ``load_lr_scheduler_states=False`` keeps the engine's torch scheduler. A config
        ``scheduler`` follows the optimizer's step count, so it comes with the optimizer state:
        asking for one without the other is refused. Refused as well (with what to do
        instead): ``load_module_strict=False`` and ``custom_load_fn``. Nothing is changed when a
        load is refused or fails.
        """
        self._live()
        self._check_load_keywords(load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                                  load_module_only, custom_load_fn)
        if tag is None:
            latest = os.path.join(os.fspath(load_dir), "latest")
            if not os.path.isfile(latest):
                return None, None
            with open(latest) as f:
                tag = f.read().strip()
        path = os.path.join(os.fspath(load_dir), _check_tag(tag))
        extra, problem = None, None
        try:
            if not exists(path) and is_deepspeed_checkpoint(path):  # a run moved over from DeepSpeed
                ck = read_deepspeed(path)
                extra = {"micro_steps": ck.global_steps * self.gradient_accumulation_steps(),
                         "global_samples": ck.global_samples, "lr_scheduler": ck.lr_scheduler,
                         "client_state": ck.client_state}
            else:
                extra = read_extra(path)
            if not load_module_only:
                _check_engine_extra(extra, path)
        except CheckpointError as e:
            problem = str(e)
        agree(problem, self._state.group)  # a rank that cannot read it stops every rank, now
        loaded = load(path, like=self._state, weights_only=load_module_only)
        current = self._with_group_edits(self._state)
        if load_module_only:  # the weights alone: counters, optimizer and scaler stay the engine's
            loaded = loaded.replace(step=current.step, opt=current.opt, group_opts=current.group_opts,
                                    hyper=current.hyper, scaler=current.scaler)
        elif not load_optimizer_states:  # DeepSpeed keeps its skipped-step counter apart from the scaler
            loaded = loaded.replace(opt=current.opt, group_opts=current.group_opts, hyper=current.hyper,
                                    scaler=dataclasses.replace(current.scaler, skipped=loaded.scaler.skipped))
        _check_hyper_everywhere(loaded)
        stored = None if load_module_only else extra.get("lr_scheduler")
        if load_lr_scheduler_states and stored is not None and hasattr(self.lr_scheduler, "load_state_dict"):
            _load_scheduler(self.lr_scheduler, stored, extra.get("lr_scheduler_type"), path,
                            self._state.group)  # (whole, or not at all)
        client = extra.get("client_state") if isinstance(extra, dict) else None  # (zfunc.save's extra: any value)
        self.state = loaded
        self.optimizer.write_back()  # the loaded hyperparameters (e.g. a hand-set lr) in the groups
        if not load_module_only:  # micro_steps stays the engine's own, as DeepSpeed's (it does not restore it)
            self.global_samples = extra["global_samples"]
        return path, client

    def _check_load_keywords(self, strict: bool, optimizer_states: bool, scheduler_states: bool,
                             module_only: bool, custom_load_fn: Any) -> None:
        """Refuse the `load_checkpoint` keywords zfunc cannot honour, naming what to do instead."""
        if not strict:
            raise ValueError("load_checkpoint(load_module_strict=False): zfunc loads only a checkpoint of this "
                             "model (every parameter and buffer, same shapes). To start from part of one, export "
                             "its weights (zfunc.export(path, file)), load them into the module, then initialize")
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...): not supported; load with "
                             "zfunc.load(path, like=engine.state), change the state, and assign engine.state")
        if (self.cfg.lr_schedule is not None and not module_only
                and bool(optimizer_states) != bool(scheduler_states)):
            raise ValueError(
                f"load_checkpoint(load_optimizer_states={optimizer_states}, load_lr_scheduler_states="
                f"{scheduler_states}): the config's 'scheduler' follows the optimizer's step count, so its state "
                "comes and stays with the optimizer's; pass the same value for both")

    def _torch_scheduler_state(self) -> dict[str, Any] | None:
        """The state of a torch scheduler passed to `initialize` (a config schedule has none)."""
        sched = self.lr_scheduler
        stateful = hasattr(sched, "state_dict") and hasattr(sched, "load_state_dict")
        return sched.state_dict() if stateful else None


def _check_engine_extra(extra: Any, path: str) -> None:
    """An engine checkpoint's own record (``extra.pt``: counters, scheduler, client state).

    Raises:
        CheckpointError: it is not one (a checkpoint `zfunc.save` wrote without it)."""
    missing = [k for k in ("micro_steps", "global_samples", "client_state") if not isinstance(extra, dict) or k not in extra]
    if missing:
        raise CheckpointError(
            f"{path}: not a checkpoint engine.save_checkpoint wrote (its extra.pt lacks {missing}: zfunc.save wrote "
            "it?). Load its weights with load_module_only=True, or the whole state with zfunc.load(path, "
            "like=engine.state) and assign engine.state. Nothing was loaded")


def _load_scheduler(scheduler: Any, stored: Any, kind: str | None, path: str, group: Any) -> None:
    """``scheduler.load_state_dict(stored)`` on every rank, or on none: the state of a scheduler
    of another class (``kind``, as the saving engine's was named; torch's ``load_state_dict``
    takes any dict into the object's attributes), or one that fails to load, is refused on every
    rank, the scheduler put back as it was.

    Raises:
        CheckpointError: naming the scheduler and the cause."""
    before, problem = scheduler.state_dict(), None
    fix = "Pass load_lr_scheduler_states=False to keep this one's. Nothing was loaded"
    if kind is not None and kind != type(scheduler).__name__:
        problem = f"{path}: the lr scheduler's state is a {kind}'s, and the engine's scheduler is a " \
                  f"{type(scheduler).__name__}. {fix}"
    else:
        try:
            scheduler.load_state_dict(stored)
        except Exception as e:  # noqa: BLE001 - whatever another scheduler's state makes of this one
            problem = (f"{path}: the lr scheduler's state does not fit {type(scheduler).__name__} "
                       f"({type(e).__name__}: {e}): a checkpoint of another scheduler? {fix}")
    try:
        agree(problem, group)
    except CheckpointError:
        scheduler.load_state_dict(before)
        raise


def _check_hyper_everywhere(state: TrainState) -> None:
    """Every rank continues with the same group hyperparameters (a rank's own edits of
    ``optimizer.param_groups`` kept by ``load_optimizer_states=False`` could differ): one small
    all-gather; a difference names the field, the group and each rank's value, on every rank."""
    if state.group.size == 1:
        return
    mine = {f.name: getattr(state.hyper, f.name).tolist() for f in dataclasses.fields(state.hyper)}
    seen = comm.all_gather_object(mine, state.group)
    for name, values in mine.items():
        for g in range(len(values)):
            per_rank = [s[name][g] for s in seen]
            if any(v != per_rank[0] for v in per_rank):
                raise ConfigError(f"param_groups[{g}].{name}: differs across ranks after load_checkpoint "
                                  f"({', '.join(f'rank {r}: {v}' for r, v in enumerate(per_rank))}); set the same "
                                  "value on every rank (optimizer.param_groups) before loading")


def _check_tag(tag: Any) -> str:
    """A checkpoint tag names one directory inside the save directory, nothing else."""
    text = str(tag)
    if not text or text in (".", "..") or "/" in text or os.sep in text or text == "latest":
        raise ValueError(f"tag: {tag!r} must name a directory inside the checkpoint directory (not empty, "
                         "'.', '..' or 'latest', no path separators)")
    return text
