"""Gradients into the state: `backward_step`, `vjp` and `accumulate`, and the one micro-batch record.

Forward runs the module bound to the state (`zfunc.autograd.binding.BoundModel`): each unit's full
parameters come from `zfunc.comm.unit_params`, whose backward delivers the unit's gradient to a
*sink* leaf whose ``.grad`` is the state's gradient buffer (full at stages 0-1, this rank's
reduce-scattered shard at stages 2-3). So any way of running backward gives the same gradients.

Nothing touches what the model returns: the loss scale multiplies the loss (`backward_step`) or
the cotangent (`vjp`), as ``GradScaler`` does, and the mean over ranks and micro-batches,
``1 / (grad_accum * world)``, multiplies each parameter gradient where it enters the state
(`zfunc.autograd.average`). A gradient through the model with respect to anything else (an input
gradient, a penalty, ``jvp``) is torch's.

Every way of adding a micro-batch ends in `record_micro`: the micro-step count, the loss sum
(NaN for a micro-batch whose loss zfunc was not given) and the new buffers, in one place.

At stages 0-1 the step's last micro-batch (``micro_step == grad_accum - 1``) reduces the whole
accumulated gradient during its backward, bucket by bucket (`boundary_fold`,
`zfunc.autograd.buckets.Fold`), where the other micro-batches only accumulate locally; `accumulate`
leaves the reduce to `zfunc.apply_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from zfunc.distributed import comm
from zfunc._tree import tree
from zfunc.autograd.average import Average, ranks_averaged
from zfunc.autograd.bound import BoundModel
from zfunc.autograd.buckets import Fold, reduce_group
from zfunc.core.donation import check_live, check_not_giving, donate_, giving, is_donated
from zfunc.core.state import TrainState, accumulator, host_flag

__all__ = ["backward_step", "vjp", "accumulate", "record_micro", "check_room", "sinks_into", "point_sinks",
           "grad_views", "bind", "boundary_fold", "check_sinks", "loss_scaled"]


def check_room(state: TrainState, what: str) -> None:
    """Refuse a micro-batch beyond ``grad_accum`` (it would silently enlarge the gradient).

    ``micro_step`` lives on the host, so this check never waits for a device.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(1, 1), zfunc.Config(grad_accum=1))
        >>> state = zfunc.accumulate(state, {}, strict=False)
        >>> try:
        ...     check_room(state, "backward_step")
        ... except RuntimeError as e:
        ...     print(str(e)[:74])
        backward_step: grad_accum=1 micro-batches are accumulated already; call ap
    """
    check_live(state, what)
    check_not_giving(state, what)
    n, ga = int(state.micro_step), state.cfg.grad_accum
    if n >= ga:
        raise RuntimeError(
            f"{what}: grad_accum={ga} micro-batches are accumulated already; call apply_step before the next "
            f"one (or make grad_accum larger). A further micro-batch would add {n + 1}/{ga} of a gradient.")


def record_micro(state: TrainState, grads: torch.Tensor, *, loss: torch.Tensor | None = None,
                 buffers: dict[str, torch.Tensor] | None = None, fold: Fold | None = None,
                 forward: bool = False, micro_batches: int = 1) -> TrainState:
    """The state after ``micro_batches`` more micro-batches (one, unless the engine ran several
    backwards since its last ``step()``): their gradients in ``grads``, their summed loss (or NaN
    when not known) added to ``loss_sum``, ``micro_step + micro_batches``, and the buffers their
    forward left.
    With ``forward`` (the micro-batch ran the bound model, which gathers what a step left
    ungathered, `zfunc.autograd.forward_gather`) the state is ``gathered``.

    With ``fold`` (the micro-batch's backward reduced the accumulator, `boundary_fold`) the
    state holds the reduced gradient (``reduced``): at stage 1 this rank's shard of ``grads``.

    Raises:
        RuntimeError: ``fold`` reduced some buckets but not all (a backward that raised part
            way): the accumulator is neither local nor reduced.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(1, 1), zfunc.Config())
        >>> later = record_micro(state, state.grads, loss=torch.tensor(2.0))
        >>> later.micro_step.item(), later.loss_sum.item(), state.micro_step.item()
        (1, 2.0, 0)
    """
    value = (torch.full((), float("nan"), device=state.device) if loss is None
             else loss.detach().reshape(()).to(torch.float32))
    reduced = fold is not None and fold.done
    if fold is not None and fold.started and not reduced:
        raise RuntimeError("the backward of the step's last micro-batch stopped part way through reducing the "
                           "gradient (see the error it raised); the accumulated gradient is lost: restart the step "
                           "from a state saved before it")
    if reduced and state.stage == 1:
        grads = grads.narrow(0, *state.layout.owned_start_len(state.layout.units[0]))
    return state.replace(grads=grads, micro_step=state.micro_step + micro_batches, loss_sum=state.loss_sum + value,
                         buffers=state.buffers if buffers is None else buffers, reduced=host_flag(reduced),
                         gathered=host_flag(True) if forward else state.gathered)


def boundary_fold(state: TrainState) -> Fold | None:
    """A `zfunc.autograd.buckets.Fold` for a micro-batch that ends the step, where its backward can reduce
    the accumulated gradient (stages 0-1 without `Config.shards_grads`, more than one rank to
    reduce over, the accumulator in the reduce dtype); else None (`zfunc.apply_step` reduces).

    Examples:
        >>> import torch, zfunc
        >>> boundary_fold(zfunc.init(torch.nn.Linear(1, 1), zfunc.Config(stage=0))) is None  # one rank
        True
    """
    cfg = state.cfg
    if cfg.shards_grads or reduce_group(state).size == 1 or cfg.reduce_dtype != cfg.grad_accum_dtype:
        return None
    return Fold(len(state.binding.buckets(state)))


def _ends_step(state: TrainState) -> Fold | None:
    """`boundary_fold` for the micro-batch about to run, if it is the step's last."""
    return boundary_fold(state) if int(state.micro_step) == state.cfg.grad_accum - 1 else None


def bind(state: TrainState, sinks: Sequence[torch.Tensor], *, donate: bool = False,
         fold: Fold | None = None, avg: Average | None = None, own: bool = False) -> BoundModel:
    """The module as a function of its inputs on ``state``'s parameters, gradients to ``sinks``
    (reducing the accumulator in backward with ``fold``, `boundary_fold`), each multiplied by
    ``avg.factor`` as it enters (default ``1 / (grad_accum * world)``).

    Buffers are cloned for the call (the new values are the bound model's ``new_buffers``), or
    updated in place with ``donate``. ``own``: the model of a call that runs its own backward
    (`backward_step`, `vjp`), a call of its own even when a gradient hook makes it during a
    backward.
    """
    buffers = dict(state.buffers) if donate else {n: b.clone() for n, b in state.buffers.items()}
    return state.binding.bind(state, sinks, buffers, fold, avg, own)


USED_UP = "failed part way"
"""In the note `used_up_on_failure` adds to the error (`zfunc.train_step` replaces it for the
state it keeps whole)."""


@contextlib.contextmanager
def used_up_on_failure(state: TrainState, donate: bool, by: str) -> Iterator[None]:
    """With ``donate``, a failure inside the block (a ``loss_fn`` that raises, a backward that
    fails) marks ``state`` as given away: its gradient buffer and buffers (BatchNorm's
    statistics, updated in place) may hold part of the call, so it must not be used again, and
    the error says so. Without ``donate`` nothing of ``state`` is written, and a failure leaves it
    whole."""
    try:
        yield
    except BaseException as e:
        if donate and not is_donated(state):  # (not twice: a pullback after its forward)
            donate_(state, by)
            e.add_note(f"{by}(..., donate=True) {USED_UP}, and the state given to it is used up (its gradient "
                       "buffer and buffers may hold part of this call): continue from an earlier state. Without "
                       "donate=True a call that fails leaves the state whole")
        raise


def loss_scaled(state: TrainState, t: torch.Tensor) -> torch.Tensor:
    """``t`` times the loss scale (``t`` itself without loss scaling). A float16 ``t`` is
    multiplied in float32 and rounded once (a cotangent; a float16 loss seeded with a scale of
    ``2**16`` is inf, as with DeepSpeed and ``GradScaler``).

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(1, 1), zfunc.Config(precision="fp16"))
        >>> loss_scaled(state, torch.ones(1)).item() == state.scaler.scale.item()
        True
    """
    if state.cfg.loss_scale is None:
        return t
    scale = state.scaler.scale
    if t.dtype == torch.float16:
        return (t.float() * scale).to(torch.float16)
    return t * scale.to(t.dtype)


def grad_views(state: TrainState, grads: torch.Tensor) -> list[torch.Tensor]:
    """Each unit's part of a gradient buffer: its full flat buffer (stages 0-1) or its shard."""
    lay = state.layout
    return [lay.arena_slice(grads, u) if state.cfg.shards_grads else grads.narrow(0, 0, u.padded) for u in lay.units]


def point_sinks(sinks: list[torch.Tensor], state: TrainState, grads: torch.Tensor) -> None:
    """Make ``sinks`` (from `sinks_into`) deliver into ``grads`` from now on."""
    for sink, part in zip(sinks, grad_views(state, grads)):
        sink.grad = part


def check_sinks(sinks: list[torch.Tensor], state: TrainState, grads: torch.Tensor) -> None:
    """After a backward: every sink's ``.grad`` is still its part of ``grads``. The gradient path
    relies on autograd adding into a leaf's existing ``.grad`` in place; had anything replaced
    it, that micro-batch's gradient would be lost silently, so this raises instead.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config())
        >>> grads = torch.zeros(state.layout.full_numel)
        >>> sinks = sinks_into(state, grads)
        >>> check_sinks(sinks, state, grads)
        >>> sinks[0].grad = torch.zeros_like(grads)
        >>> try:
        ...     check_sinks(sinks, state, grads)
        ... except RuntimeError as e:
        ...     print(str(e)[:58])
        zfunc: a unit's gradient went into a new tensor instead of
    """
    for k, (sink, part) in enumerate(zip(sinks, grad_views(state, grads))):
        g = sink.grad
        if g is None or g.data_ptr() != part.data_ptr() or g.shape != part.shape:
            raise RuntimeError(
                f"zfunc: a unit's gradient went into a new tensor instead of the state's accumulator (unit {k}); "
                "the micro-batch's gradient would be lost. Something replaced the sink's .grad during backward "
                "(a hook on it, or backward(create_graph=True) outside zfunc's check); run plain backward")


def sinks_into(state: TrainState, grads: torch.Tensor) -> list[torch.Tensor]:
    """One zero-memory leaf per unit whose ``.grad`` is that unit's part of ``grads``.

    Backward accumulates each unit's gradient (full at stages 0-1, this rank's reduce-scattered
    shard at stages 2-3) straight into ``grads``, in place.
    """
    dt = state.cfg.grad_accum_dtype
    sinks = []
    for part in grad_views(state, grads):
        sink = torch.zeros((), dtype=dt, device=state.device).expand(part.numel()).requires_grad_()
        sink.grad = part
        sinks.append(sink)
    return sinks


def backward_step(state: TrainState, loss_fn: Callable[..., Any], batch: Any, *,
                  has_aux: bool = False, donate: bool = False) -> tuple[TrainState, Any]:
    """Run ``loss_fn(model, batch)`` and accumulate its gradient into the state.

    One micro-batch: stage 2-3 gradients are reduce-scattered to their owners during backward;
    stages 0-1 accumulate the full local gradient and reduce it during the backward of the
    step's last micro-batch. Buffers the forward updates
    (BatchNorm's running statistics) come back in the new state's ``buffers``.

    Raises:
        RuntimeError: ``grad_accum`` micro-batches are accumulated already (call `apply_step`).

    Args:
        state: the `TrainState`.
        loss_fn: ``(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), where
            ``model`` is the module bound to the state's parameters.
        batch: anything ``loss_fn`` takes.
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
        donate: reuse ``state``'s gradient buffer and buffers (``state`` must not be used again).

    Returns:
        ``(new_state, loss)``, or ``(new_state, (loss, aux))`` with ``has_aux``; ``loss`` is
        detached and unscaled.

    Examples:
        >>> import torch, zfunc
        >>> torch.manual_seed(0) and None
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config(stage=2))
        >>> def loss_fn(model, batch):
        ...     return ((model(batch["x"]) - batch["y"]) ** 2).mean()
        >>> batch = {"x": torch.ones(4, 2), "y": torch.zeros(4, 1)}
        >>> state, loss = zfunc.backward_step(state, loss_fn, batch)
        >>> round(loss.item(), 4), state.micro_step.item()
        (0.0432, 1)
    """
    check_room(state, "backward_step")
    fold = _ends_step(state)
    with used_up_on_failure(state, donate, "backward_step"):
        grads = accumulator(state.grads, donate, state.binding.pool)
        sinks = sinks_into(state, grads)
        model = bind(state, sinks, donate=donate, fold=fold, own=True)
        out = loss_fn(model, batch)
        loss, aux = out if has_aux else (out, None)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise TypeError(f"loss_fn must return a scalar tensor{' first' if has_aux else ''}; "
                            f"got {type(loss).__name__}" + (f" of shape {list(loss.shape)}"
                                                            if isinstance(loss, torch.Tensor) else ""))
        if not (loss.is_floating_point() and loss.requires_grad):
            raise TypeError(f"loss_fn must return a floating-point loss computed with the model's parameters; got "
                            f"a {loss.dtype} tensor{'' if loss.requires_grad else ' that needs no gradient'} (computed "
                            "under torch.no_grad(), detached, or not from the model the loss_fn receives?)")
        seed = None if state.cfg.loss_scale is None else loss_scaled(state, torch.ones_like(loss))
        with state.binding.flight.running([loss]), giving(state, "backward_step", donate):
            loss.backward(seed)  # into `grads` through the sinks (plain backward: reentrant checkpointing works)
        check_sinks(sinks, state, grads)
    loss = loss.detach().reshape(())
    new = record_micro(state, grads, loss=loss, buffers=model.new_buffers, fold=fold, forward=True)
    if donate:
        new = donate_(state, "backward_step", new, ("grads", "buffers"))
    return new, ((loss, aux) if has_aux else loss)


def vjp(state: TrainState, fn: Callable[..., Any], *args: Any,
        argnums: Sequence[int] = (), donate: bool = False) -> tuple[Any, Callable[..., Any]]:
    """Run ``fn(model, *args)`` now; accumulate ``d<out, cotangent>/d params`` later.

    For custom gradient flows: two models on two process groups, one model's output feeding the
    other. The cotangent may be any pytree of tensors shaped like ``out`` (non-scalar too).

    Args:
        state: the `TrainState`.
        fn: ``(model, *args) -> out``, a tensor or a pytree of tensors.
        *args: inputs of ``fn``.
        argnums: positions in ``args`` whose cotangents the pullback also returns (they must be
            floating-point tensors), as `torch.func.vjp` would.
        donate: the pullback may reuse ``state``'s gradient buffer and buffers.

    Returns:
        ``(out, pullback)``: ``out`` detached; ``pullback(cotangent, retain_graph=False,
        loss=None)`` returns the new state, or ``(new_state, arg_cotangents)`` when ``argnums``
        is given. ``loss`` (optional) is the micro-batch's loss for ``metrics.loss`` (NaN
        otherwise). Each call returns a state of its own, built from ``state``: calling a
        pullback again (after ``retain_graph=True``) never changes an earlier result.

    Raises:
        RuntimeError: ``grad_accum`` micro-batches are accumulated already; or, from the
            pullback, a second call after the graph was freed or with ``donate=True``.

    Examples:
        >>> import torch, zfunc
        >>> torch.manual_seed(0) and None
        >>> state = zfunc.init(torch.nn.Linear(2, 3), zfunc.Config(stage=1))
        >>> x = torch.ones(4, 2)
        >>> out, pullback = zfunc.vjp(state, lambda model, x: model(x), x, argnums=(0,))
        >>> state, (dx,) = pullback(torch.ones_like(out))
        >>> out.shape, dx.shape, state.micro_step.item()
        (torch.Size([4, 3]), torch.Size([4, 2]), 1)
    """
    check_room(state, "vjp")
    fold = _ends_step(state)
    first = accumulator(state.grads, donate, state.binding.pool)
    sinks = sinks_into(state, first)
    args = list(args)
    wrt = []
    for i in argnums:
        a = args[i]
        if not (isinstance(a, torch.Tensor) and a.is_floating_point()):
            raise TypeError(f"argnums: argument {i} must be a floating-point tensor")
        args[i] = a.detach().requires_grad_()
        wrt.append(args[i])
    with used_up_on_failure(state, donate, "vjp"):
        model = bind(state, sinks, donate=donate, fold=fold, own=True)
        out = fn(model, *args)
        outs, spec = _flat_out(out)
        odd = [type(o).__name__ for o in outs if not isinstance(o, torch.Tensor) and o is not None]
        if odd:
            raise TypeError(f"vjp: every output of the function must be a tensor (a pytree of them, as "
                            f"torch.func.vjp takes); got {odd[:3]}. Return the others through a closure, or from a "
                            "second call")
    calls = {"n": 0, "retained": True}

    def pullback(cotangent: Any, *, retain_graph: bool = False, loss: torch.Tensor | None = None) -> Any:
        if calls["n"] and not calls["retained"]:
            raise RuntimeError("pullback: called a second time, but the first call freed the graph; pass "
                               "retain_graph=True to every call but the last to call a pullback again")
        if calls["n"] and donate:
            raise RuntimeError("pullback: a pullback of vjp(..., donate=True) may be called once (its "
                               "gradient buffer is the donated state's); use donate=False to call it again")
        cots, cspec = _flat_out(cotangent)
        if cspec != spec:
            raise ValueError(f"pullback: the cotangent's structure {cspec} differs from the output's {spec}")
        for o, c in zip(outs, cots):
            if o is not None and o.shape != c.shape:
                raise ValueError(f"pullback: cotangent shape {list(c.shape)} differs from output shape "
                                 f"{list(o.shape)}")
        if calls["n"]:  # an independent result: fresh gradient buffers behind the same sinks
            grads = accumulator(state.grads, False, state.binding.pool)
            point_sinks(sinks, state, grads)
            if fold is not None:
                fold.reset()
        else:
            grads = first
        for a in wrt:
            a.grad = None
        calls["n"] += 1
        calls["retained"] = retain_graph
        pairs = [(o, c) for o, c in zip(outs, cots) if o is not None and o.requires_grad]  # (others give nothing)
        if not pairs:
            raise RuntimeError("pullback: no output of the function requires grad (all detached or computed "
                               "without grad); nothing reaches the parameters")
        with used_up_on_failure(state, donate, "vjp"):
            with state.binding.flight.running([o for o, _ in pairs]), giving(state, "vjp", donate):
                torch.autograd.backward([o for o, _ in pairs], [loss_scaled(state, c) for _, c in pairs],
                                        retain_graph=retain_graph)
            check_sinks(sinks, state, grads)
        # Kept for another call: this result's buffers are a copy (a recomputation in the next
        # call's backward updates the call's buffers, BatchNorm's statistics, in place).
        buffers = {n: b.clone() for n, b in model.new_buffers.items()} if retain_graph else model.new_buffers
        new = record_micro(state, grads, loss=loss, buffers=buffers, fold=fold, forward=True)
        if donate:
            new = donate_(state, "vjp", new, ("grads", "buffers"))
        if not argnums:
            return new
        return new, tuple(torch.zeros_like(a) if a.grad is None else _unscaled(state, a.grad) for a in wrt)

    return pytree.tree_map(_detached, out), pullback


def _flat_out(x: Any) -> tuple[list[Any], Any]:
    """The leaves of a function's outputs and their structure, as torch.func.vjp reads them
    (torch's pytrees: a Hugging Face ``ModelOutput`` is one there), a leaf of those that is a
    zfunc pytree (a ``zfunc.tree.dataclasses.dataclass``) read by zfunc's."""
    top, spec = pytree.tree_flatten(x)
    leaves, inner = [], []
    for leaf in top:
        if isinstance(leaf, torch.Tensor) or leaf is None:
            leaves.append(leaf)
            inner.append(None)
        else:
            sub, sub_spec = tree.flatten(leaf)
            leaves.extend(sub)
            inner.append(sub_spec)
    return leaves, (spec, tuple(inner))


def _detached(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return t.detach()
    return t if t is None else tree.map(lambda u: u.detach() if isinstance(u, torch.Tensor) else u, t)


def _unscaled(state: TrainState, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a gradient of the loss-scaled cotangent) divided by the loss scale again."""
    if state.cfg.loss_scale is None:
        return t
    return (t.float() / state.scaler.scale).to(t.dtype)


def accumulate(state: TrainState, grads: dict[str, torch.Tensor], *, loss: torch.Tensor | None = None,
               strict: bool = True, donate: bool = False) -> TrainState:
    """Add one micro-batch's gradients, computed elsewhere, to the state.

    ``grads`` maps parameter names (as ``model.named_parameters()``) to this rank's full local
    gradient of its micro-batch loss, one entry per trainable parameter (``strict=False``: a
    missing name counts as zero, as torch's ``load_state_dict(strict=False)`` leaves it alone).
    They are treated exactly as `backward_step` treats its own: averaged over ranks and
    micro-batches, scaled by the loss scale, and at stages 2-3 reduce-scattered now. ``loss``,
    if given, is the micro-batch's loss for ``metrics.loss`` (NaN otherwise).

    Raises:
        KeyError: a name that is not a trainable parameter, or (``strict``) one missing.

    Examples:
        >>> import torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config(stage=0))
        >>> state = zfunc.accumulate(state, {"weight": torch.ones(1, 2)}, strict=False)
        >>> state.grads[:3].tolist(), state.micro_step.item()
        ([1.0, 1.0, 0.0], 1)
    """
    check_room(state, "accumulate")
    lay, cfg = state.layout, state.cfg
    unknown = set(grads) - set(lay.names)
    if unknown:
        raise KeyError(f"accumulate: {sorted(unknown)} are not trainable parameters of the model; "
                       f"expected names from {list(lay.names)[:5]}...")
    odd = [f"{n} ({type(g).__name__}{'' if not isinstance(g, torch.Tensor) else ' of ' + str(g.dtype)})"
           for n, g in grads.items() if g is not None and not (isinstance(g, torch.Tensor) and g.is_floating_point())]
    if odd:
        raise TypeError(f"accumulate: gradients must be floating-point tensors; got {odd[:5]} (a complex gradient "
                        "would lose its imaginary part: zfunc trains real parameters). Nothing was changed")
    if loss is not None and not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise TypeError(f"accumulate: loss must be a one-element tensor (the micro-batch's loss), got "
                        f"{type(loss).__name__}{' of shape ' + str(list(loss.shape)) if isinstance(loss, torch.Tensor) else ''}")
    missing = [n for n in lay.names if grads.get(n) is None]  # (a None counts as missing)
    if missing and strict:
        raise KeyError(f"accumulate: no gradient for {missing[:5]}{'...' if len(missing) > 5 else ''} "
                       f"({len(missing)} of {len(lay.names)} trainable parameters); give every one, or pass "
                       "strict=False to count the missing ones as zero. Nothing was changed")
    factor = state.scaler.scale / (cfg.grad_accum * ranks_averaged(state))  # as backward_step's gradients
    unit_grads = []
    for unit in lay.units:
        for s in unit.slots:
            g = grads.get(s.name)
            if g is not None and tuple(g.shape) != s.shape:
                raise ValueError(f"accumulate: gradient of {s.name!r} has shape {list(g.shape)}, "
                                 f"expected {list(s.shape)}")
        # scaled in float32 at least and rounded to the reduce dtype once (a 16-bit factor would
        # round 1/3, and 2**16 is past float16's range)
        wide = torch.promote_types(cfg.reduce_dtype, torch.float32)
        flat = lay.flatten_unit(unit, grads, wide, state.device).mul_(factor.to(wide)).to(cfg.reduce_dtype)
        if cfg.shards_grads:
            flat = comm.reduce_scatter(flat, "sum", state.mesh.shard)
        unit_grads.append(flat.to(cfg.grad_accum_dtype))
    grads = accumulator(state.grads, donate, state.binding.pool)
    for part, g in zip(grad_views(state, grads), unit_grads):
        part.add_(g)
    new = record_micro(state, grads, loss=loss)
    if donate:
        new = donate_(state, "accumulate", new, ("grads",))
    return new
