"""The call-scoped runtime on a CUDA device, where autograd runs backward on a device thread of
its own (skipped without a GPU): a checkpointed forward recomputed there gets the call's
parameters, a backward that raises stops being counted, and no hook stays between calls."""

from __future__ import annotations

import pytest
import torch

import zfunc
from tests.test_checkpointing import _model
from tests.test_stage3 import _stack_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _hooks(m: torch.nn.Module) -> int:
    return sum(len(getattr(x, d)) for x in m.modules() for d in ("_forward_pre_hooks", "_forward_hooks"))


@pytest.mark.parametrize("ckpt", ["nonreentrant", "reentrant"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_checkpointed_gradients_on_cuda_are_torchs(stage, ckpt):
    """Two steps (the state's weights then differ from the module's), then one checkpointed
    micro-batch: its gradient equals plain torch's on the state's weights, and no zfunc hook
    is left on the module."""
    units = ["blocks.0"] if stage == 3 else None
    model = _model(ckpt).cuda()
    state = zfunc.init(model, zfunc.Config(stage=stage, persist_threshold=0, units=units,
                                           optimizer=zfunc.adamw(lr=1e-1)))
    g = torch.Generator().manual_seed(0)
    batch = tuple(t.cuda() for t in (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)))
    for _ in range(2):
        state = zfunc.apply_step(zfunc.backward_step(state, _stack_loss, batch)[0])
    after, _ = zfunc.backward_step(state, _stack_loss, batch)
    ref = _model(ckpt).cuda()
    full = zfunc.full_params(state)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n in full:
                p.copy_(full[n])
    _stack_loss(ref, batch).backward()
    lay = state.layout  # one rank: the accumulator is every unit's buffer, back to back
    got = {s.name: after.grads.narrow(0, u.arena_offset + s.offset, s.numel).view(s.shape)
           for u in lay.units for s in u.slots}
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert torch.allclose(got[n], p.grad, atol=1e-5, rtol=1e-4), (stage, ckpt, n)
    assert _hooks(model) == 0, (stage, ckpt)


def test_a_raised_backward_on_cuda_stops_being_counted():
    """The marker's pre-hook runs on autograd's device thread; a backward that raises after it
    is forgotten when autograd lets it go, not only by a later forward on that thread."""
    state = zfunc.init(torch.nn.Linear(3, 2).cuda(), zfunc.Config(stage=0))
    sinks = zfunc.core.backward.sinks_into(state, torch.zeros(state.layout.full_numel, device="cuda"))
    x = torch.ones(2, 3, device="cuda", requires_grad=True)
    out = zfunc.core.backward.bind(state, sinks)(x)

    def boom(grad: torch.Tensor) -> None:
        raise ValueError("boom")

    x.register_hook(boom)
    with pytest.raises(ValueError):
        out.sum().backward()
    assert state.binding.flight.backwards == 0 and not state.binding.flight.nested()
