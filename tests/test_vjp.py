"""Custom gradient flows: model A feeds model B; A's pullback takes B's non-scalar input cotangent."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zfunc
from tests.helpers import run_ranks


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 6))  # the "vision encoder"
    b = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))  # the "language model"
    return a, b


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, 4, generator=g), torch.randn(3, 3, generator=g)


def _flow(rank: int, stage_a: int, stage_b: int) -> float:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    a, b = _models()
    cfg = dict(optimizer=zfunc.adamw(lr=1e-2))
    sa = zfunc.init(a, zfunc.Config(stage=stage_a, **cfg))
    # B trains on its own process group (same ranks here, a different communicator).
    sb = zfunc.init(b, zfunc.Config(stage=stage_b, **cfg), group=zfunc.comm.Group.of_ranks(list(range(world))))
    ref_a, ref_b = _models()
    opt = torch.optim.AdamW([*ref_a.parameters(), *ref_b.parameters()], lr=1e-2)
    for step in range(3):
        x, y = _data(step, rank)
        h, pull_a = zfunc.vjp(sa, lambda m, x: m(x), x)                     # A forward
        loss_b = lambda m, h: ((m(h) - y) ** 2).mean()                       # noqa: E731
        _, pull_b = zfunc.vjp(sb, loss_b, h, argnums=(0,))                   # B forward
        sb, (dh,) = pull_b(torch.ones(()))                                   # B backward
        sa = pull_a(dh)                                                      # A backward, non-scalar
        sa, sb = zfunc.apply_step(sa), zfunc.apply_step(sb)
        # Reference: one joint backward of the mean loss over all ranks' data.
        opt.zero_grad()
        for r in range(world):
            xr, yr = _data(step, r)
            (((ref_b(ref_a(xr)) - yr) ** 2).mean() / world).backward()
        opt.step()
    pa, pb = zfunc.full_params(sa), zfunc.full_params(sb)
    diffs = [(pa[n] - p).abs().max().item() for n, p in ref_a.named_parameters()]
    diffs += [(pb[n] - p).abs().max().item() for n, p in ref_b.named_parameters()]
    return max(diffs)


def test_two_models_chained_by_vjp_match_one_joint_backward():
    for world in (1, 2, 3):
        for stage_a, stage_b in ((0, 2), (2, 1), (3, 3)):
            for rank, diff in enumerate(run_ranks(_flow, world, stage_a, stage_b)):
                assert diff < 2e-6, f"world {world} stages {stage_a}/{stage_b} rank {rank}: {diff:.3g}"


def test_pullback_checks_the_cotangent():
    state = zfunc.init(nn.Linear(2, 3), zfunc.Config())
    out, pullback = zfunc.vjp(state, lambda m, x: m(x), torch.ones(4, 2))
    try:
        pullback(torch.ones(4, 2))
    except ValueError as e:
        assert "cotangent shape [4, 2] differs from output shape [4, 3]" in str(e)
    else:
        raise AssertionError("a mis-shaped cotangent was accepted")


@zfunc.tree.dataclasses.dataclass
class _Out:
    y: torch.Tensor


def test_vjp_takes_outputs_as_torch_func_vjp_does():
    """Outputs as torch's pytrees read them (a Hugging Face ``ModelOutput`` is one: returned
    detached, its cotangent of the same form), an output that needs no gradient beside one that
    does (its cotangent ignored, as torch.func.vjp does), a None passed over, and a non-tensor
    output refused naming it; the parameter gradient is torch's (one SGD step of lr 1)."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    def run(fn, cot):
        torch.manual_seed(0)
        state = zfunc.init(nn.Linear(2, 3), zfunc.Config(optimizer=zfunc.sgd(lr=1.0)))
        out, pullback = zfunc.vjp(state, fn, torch.ones(4, 2))
        new = zfunc.apply_step(pullback(cot(out)))
        before, after = zfunc.full_params(state), zfunc.full_params(new)
        return out, before["weight"] - after["weight"]

    torch.manual_seed(0)
    ref = nn.Linear(2, 3)
    (ref(torch.ones(4, 2)) * 2).sum().backward()
    out, g = run(lambda m, x: SequenceClassifierOutput(logits=m(x)),
                 lambda o: SequenceClassifierOutput(logits=torch.full_like(o.logits, 2.0)))
    assert isinstance(out, SequenceClassifierOutput) and not out.logits.requires_grad
    assert torch.allclose(g, ref.weight.grad)
    out, g = run(lambda m, x: (m(x), m(x).detach()), lambda o: (torch.full_like(o[0], 2.0), torch.ones_like(o[1])))
    assert torch.allclose(g, ref.weight.grad)
    out, g = run(lambda m, x: (m(x), None), lambda o: (torch.full_like(o[0], 2.0), None))  # None: no leaf to take
    assert out[1] is None and torch.allclose(g, ref.weight.grad)
    out, g = run(lambda m, x: _Out(y=m(x)), lambda o: _Out(y=torch.full_like(o.y, 2.0)))  # a zfunc dataclass
    assert isinstance(out, _Out) and not out.y.requires_grad and torch.allclose(g, ref.weight.grad)
    state = zfunc.init(nn.Linear(2, 3), zfunc.Config())
    with pytest.raises(TypeError, match=r"every output of the function must be a tensor .*\['int'\]"):
        zfunc.vjp(state, lambda m, x: {"y": m(x), "n": 3}, torch.ones(4, 2))
