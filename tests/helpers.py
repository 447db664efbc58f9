"""The fixture zoo and the multi-rank runner shared by the tests.

Models here break naive ZeRO code: parameter sizes that do not divide the world size, a tied
weight, a frozen parameter, a parameter unused on one rank, and a tiny transformer (with a tied
embedding). `run_ranks` runs a module-level function on a persistent local gloo world.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import zfunc
from zfunc.tools.launch import World
from zfunc.models import GPT, GPTConfig, lm_loss

_WORLDS: dict[int, World] = {}


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """``fn(rank, *args)`` on every rank of a reused world of ``world_size`` gloo ranks."""
    w = _WORLDS.get(world_size)
    if w is None or not w.alive:
        w = _WORLDS[world_size] = World(world_size, timeout=timeout)
    return w.run(fn, *args, timeout=timeout)


def close_worlds() -> None:
    for w in _WORLDS.values():
        if w.alive:
            w.close()
    _WORLDS.clear()


class ZooNet(nn.Module):
    """An MLP with an odd-sized parameter, a tied weight, a frozen layer and a branch some
    ranks do not use (``batch["side"]`` is False there)."""

    def __init__(self, d_in: int = 5, d: int = 7):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.odd = nn.Parameter(torch.randn(d) * 0.1)  # 7 elements: divides no world size > 1
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.b.weight = self.a.weight  # tied
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.side = nn.Linear(d, d)  # unused on ranks whose batch has side=False
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x) + self.odd)
        h = torch.tanh(self.a(h)) + torch.tanh(self.b(h * 0.5))
        h = h + self.frozen(h)
        if bool(side):
            h = h + torch.tanh(self.side(h))
        return self.out(h)


def zoo_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"], batch["side"]) - batch["y"]) ** 2).mean()


def zoo_batch(step: int, rank: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"x": torch.randn(n, 5, generator=g), "y": torch.randn(n, 3, generator=g),
            "side": torch.tensor(rank == 0)}


TINY_GPT = GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, d_model=6)


def gpt_batch(step: int, rank: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, TINY_GPT.vocab_size, (n, TINY_GPT.block_size + 1), generator=g)
    return {"x": x[:, :-1], "y": x[:, 1:]}


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., Any], Callable[..., Any]]] = {
    "zoo": (ZooNet, zoo_loss, zoo_batch),
    "gpt": (lambda: GPT(TINY_GPT), lm_loss, gpt_batch),
}


def split(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    return zfunc.core.train.split_micro_batches(batch, n)


def reference_run(name: str, world: int, steps: int, *, grad_accum: int, clip: float | None,
                  micro: int = 2, lr: float = 1e-2, weight_decay: float = 0.01
                  ) -> tuple[nn.Module, list[float]]:
    """Single-process torch.optim.AdamW (+ clip_grad_norm_) on every rank's data, averaged.

    Each optimizer step sees the mean loss over all ranks' micro-batches: the same objective as
    data-parallel training. Returns the trained model and the grad norm of each step.
    """
    make, loss_fn, batch_fn = MODELS[name]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=weight_decay)
    norms = []
    for i in range(steps):
        opt.zero_grad()
        for r in range(world):
            for mb in split(batch_fn(i, r, micro * grad_accum), grad_accum):
                (loss_fn(model, mb) / (world * grad_accum)).backward()
        params = [p for p in model.parameters() if p.requires_grad]
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip or float("inf")).item())
        opt.step()
    return model, norms


def zfunc_run(rank: int, name: str, steps: int, cfg: zfunc.Config, micro: int = 2
              ) -> tuple[zfunc.TrainState, list[float]]:
    """The same training with zfunc on this rank; returns the state and each step's grad norm."""
    make, loss_fn, batch_fn = MODELS[name]
    torch.manual_seed(0)
    state = zfunc.init(make(), cfg)
    step = zfunc.train_step(loss_fn)
    norms = []
    for i in range(steps):
        state = step(state, batch_fn(i, rank, micro * cfg.grad_accum))
        norms.append(state.metrics.grad_norm.item())
    return state, norms


def autocast_losses(rank: int, cfg: zfunc.Config, steps: int = 5) -> tuple[list[float], list[float]]:
    """zfunc's step losses on the tiny GPT under ``cfg`` (autocast, grad_accum 2, AdamW lr 1e-2),
    and single-process torch's: autocast forward, ``GradScaler`` at 2**16 when fp16, clipping
    as ``cfg.clip``, every rank's micro-batches (4 samples per rank and step)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    make, loss_fn, batch_fn = MODELS["gpt"]
    fp16 = cfg.autocast == torch.float16
    torch.manual_seed(0)
    state = zfunc.init(make(), cfg)
    step = zfunc.train_step(loss_fn)
    torch.manual_seed(0)
    ref = make()
    opt = torch.optim.AdamW(ref.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2000, enabled=fp16)
    ours, theirs = [], []
    for i in range(steps):
        state = step(state, batch_fn(i, rank, 4))
        ours.append(state.metrics.loss.item())
        opt.zero_grad()
        total = 0.0
        for r in range(world):
            for mb in split(batch_fn(i, r, 4), cfg.grad_accum):
                with torch.autocast("cpu", dtype=cfg.autocast):
                    loss = loss_fn(ref, mb) / (cfg.grad_accum * world)
                scaler.scale(loss).backward()
                total += loss.item()
        if cfg.clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip)
        scaler.step(opt)
        scaler.update()
        theirs.append(total)
    return ours, theirs


def max_param_diff(state: zfunc.TrainState, model: nn.Module) -> float:
    full = zfunc.full_params(state)
    ref = dict(model.named_parameters())
    assert set(full) == {n for n, p in ref.items() if p.requires_grad}, (sorted(full), sorted(ref))
    return max((full[n] - ref[n].detach()).abs().max().item() for n in full)


def between_steps(plan: dict[str, int]) -> dict[str, int]:
    """What `zfunc.memory_report` shows between steps for a `zfunc.memory_plan`: the gradient
    accumulator is released, the rest is held."""
    return {**plan, "grads": 0, "total": plan["total"] - plan["grads"], "device": plan["device"] - plan["grads"]}


def snapshot(tree: Any) -> list[torch.Tensor]:
    """Copies of every tensor leaf of a zfunc pytree."""
    return [t.clone() for t in zfunc.tree.leaves(tree)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal dtypes and bytes (so NaN equals NaN, and -0.0 differs from 0.0)."""
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(_bytes(x), _bytes(y))
                                    for x, y in zip(a, b))


def side_by_side(engine: Any, ref: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` updates of ``engine`` and of ``ref`` with torch's ``opt``, on the same inputs
    (``randn(1, 3)`` seeded by the step) and loss (the output's sum of squares)."""
    for i in range(steps):
        x = torch.randn(1, 3, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).square().sum())
        engine.step()
        ref(x).square().sum().backward()
        opt.step()
        opt.zero_grad()


@contextlib.contextmanager
def paused_in_thread(fn: Callable[[Callable[[], None]], Any]) -> Iterator[None]:
    """Run ``fn(pause)`` in another thread and, once it calls ``pause()``, the block in this one
    while that thread waits there (in flight); it goes on after the block. Fails if ``fn``
    raised or its thread did not end."""
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def pause() -> None:
        inside.set()
        release.wait(30)

    def run() -> None:
        try:
            fn(pause)
        except BaseException as e:  # reported below
            errors.append(e)
            inside.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert inside.wait(30)
        yield
    finally:
        release.set()
        thread.join(30)
    assert not thread.is_alive() and not errors, errors
