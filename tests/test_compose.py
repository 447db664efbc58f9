"""Gradients through a zfunc model are torch's: every composition of torch autograd and torch.func
written inside ``loss_fn`` trains as the same ``loss_fn`` does on a plain torch model.

Each recipe is one ``loss_fn(model, batch)`` run twice: by zfunc (``train_step``, every ZeRO
stage, worlds 1-3, ``grad_accum`` 1 and 3) and by plain torch on one process over every rank's
micro-batches, each loss divided by ``world * grad_accum`` (data-parallel averaging), with
``torch.optim.SGD``: SGD moves the weights by the gradient itself, so a gradient scaled wrongly
anywhere (an input gradient, a penalty's second-order term, a micro-batch count) shows at once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jacrev, jvp, linearize, vmap

import zfunc
from tests.helpers import run_ranks, split

STEPS, LR = 3, 0.1


class Net(nn.Module):
    """Two blocks (stage 3's default units, with ``persist_threshold=0``) and a head; 7-wide, so no
    parameter divides a world of 2 or 3."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 7)])
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body[0](x))
        return self.head(torch.tanh(self.body[1](h)))


class MAML(nn.Module):
    """A MAML inner loop in ``forward``: one step of torch.func.grad on the module's own net."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        params = dict(self.net.named_parameters())

        def inner(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return F.mse_loss(functional_call(self.net, p, (x,)), y)

        g = grad(inner)(params)
        fast = {k: params[k] - 0.5 * g[k] for k in params}
        return functional_call(self.net, fast, (x,))


def _mse(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


def inplace(model, batch):
    """In-place ops on a non-scalar output and on the loss (HF Trainer's ``loss *= world``)."""
    out = model(batch["x"])
    out.mul_(2.0).sub_(0.5)
    loss = F.mse_loss(out, batch["y"])
    loss *= 3.0
    return loss


def penalty(model, batch):
    """A WGAN-GP-style gradient penalty: ``autograd.grad`` w.r.t. the input, ``create_graph=True``."""
    x = batch["x"].clone().requires_grad_()
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return F.mse_loss(out, batch["y"]) + 0.1 * ((g.norm(dim=1) - 1) ** 2).mean()


def fgsm(model, batch):
    """FGSM: torch.func.grad w.r.t. the input, then the loss at the perturbed input."""
    dx = grad(lambda x: F.mse_loss(model(x), batch["y"]))(batch["x"])
    return F.mse_loss(model(batch["x"] + 0.1 * dx.sign()), batch["y"])


def jacobian_penalty(model, batch):
    """``vmap(jacrev)``: each sample's input Jacobian, penalised."""
    jac = vmap(jacrev(lambda x: model(x[None])[0]))(batch["x"])
    return _mse(model, batch) + 0.01 * jac.pow(2).sum(dim=(1, 2)).mean()


def hvps(model, batch):
    """Input HVPs, reverse-over-reverse (``create_graph=True`` twice) and forward-over-reverse
    (the torch.func tutorial's ``jvp(grad(f))``), penalised."""
    v = torch.ones_like(batch["x"])
    x = batch["x"].clone().requires_grad_()
    (g,) = torch.autograd.grad(model(x).pow(2).sum(), x, create_graph=True)
    (rr,) = torch.autograd.grad((g * v).sum(), x, create_graph=True)
    _, fr = jvp(grad(lambda x: model(x).pow(2).sum()), (batch["x"],), (v,))
    return _mse(model, batch) + 0.5 * rr.pow(2).mean() + 0.5 * fr.pow(2).mean()


def forward_mode(model, batch):
    """``jvp`` and ``hessian`` (jacfwd over jacrev) w.r.t. the input."""
    _, jv = jvp(model, (batch["x"],), (torch.ones_like(batch["x"]),))
    h = hessian(lambda x: model(x[None]).sum())(batch["x"][0])
    return _mse(model, batch) + 0.01 * jv.pow(2).mean() + 0.01 * h.pow(2).sum()


def linearized(model, batch):
    """``torch.func.linearize`` (a jvp traced by make_fx) w.r.t. the input, its tangent map penalised."""
    with warnings.catch_warnings():  # torch's own make_fx constant folding warns on any module
        warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node", UserWarning)
        out, tangent = linearize(model, batch["x"])
    return F.mse_loss(out, batch["y"]) + 0.1 * tangent(torch.ones_like(batch["x"])).pow(2).mean()


def per_sample(model, batch):
    """The torch.func per-sample-gradients recipe inside ``loss_fn`` (DP-SGD's clipping): each
    sample's gradient clipped to norm 0.5, their mean put on the parameters by a surrogate loss."""
    params = dict(model.named_parameters())
    detached = {k: v.detach() for k, v in params.items()}

    def one(p, x, y):
        return F.mse_loss(functional_call(model, p, (x[None],)), y[None])

    grads = vmap(grad(one), in_dims=(None, 0, 0))(detached, batch["x"], batch["y"])
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
    clip = (0.5 / (norms + 1e-6)).clamp(max=1.0)
    mean = {k: (g * clip.view(-1, *[1] * (g.dim() - 1))).mean(0) for k, g in grads.items()}
    return sum((params[k] * mean[k]).sum() for k in params)


def maml(model, batch):
    return F.mse_loss(model(batch["x"], batch["y"]), batch["y"])


RECIPES = {"inplace": inplace, "penalty": penalty, "fgsm": fgsm, "jacobian_penalty": jacobian_penalty,
           "hvps": hvps, "forward_mode": forward_mode, "linearized": linearized, "per_sample": per_sample,
           "maml": maml}
# Recipes that need a parameter of the whole model at once: at stage 3 only with every parameter
# in the root unit (gathered for the whole call).
WHOLE_MODEL = {"per_sample", "maml"}


def _batch(step: int, rank: int, n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"x": torch.randn(n, 5, generator=g), "y": torch.randn(n, 3, generator=g)}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MAML() if name == "maml" else Net()


def _reference(name: str, world: int, ga: int) -> dict[str, torch.Tensor]:
    loss_fn, model = RECIPES[name], _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i in range(STEPS):
        opt.zero_grad()
        for r in range(world):
            for mb in split(_batch(i, r, 2 * ga), ga):
                (loss_fn(model, mb) / (world * ga)).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _zfunc(name: str, rank: int, stage: int, ga: int) -> dict[str, torch.Tensor]:
    threshold = 100_000 if name in WHOLE_MODEL else 0  # stage 3: every unit gathered as its module runs
    cfg = zfunc.Config(stage=stage, grad_accum=ga, optimizer=zfunc.sgd(lr=LR), persist_threshold=threshold)
    state = zfunc.init(_model(name), cfg)
    step = zfunc.train_step(RECIPES[name])
    for i in range(STEPS):
        state = step(state, _batch(i, rank, 2 * ga))
    return zfunc.full_params(state)


def _worst(rank: int, stage: int, ga: int, world: int) -> dict[str, float]:
    out = {}
    for name in RECIPES:
        ours, ref = _zfunc(name, rank, stage, ga), _reference(name, world, ga)
        assert sorted(ours) == sorted(ref)
        out[name] = max((ours[n] - ref[n]).abs().max().item() for n in ref)
    return out


@pytest.mark.parametrize("ga", [1, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_composition_gives_torchs_numbers(world, stage, ga):
    for out in run_ranks(_worst, world, stage, ga, world):
        bad = {k: v for k, v in out.items() if not v < 1e-6}
        assert not bad, bad


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fgsm_and_a_penalty_at_world_two_with_grad_accum_two(stage):
    for out in run_ranks(_worst, 2, stage, 2, 2):
        assert out["fgsm"] < 1e-6 and out["penalty"] < 1e-6, out


def test_recipes_move_the_weights():
    """Each recipe's extra term matters: its result differs from the plain loss's (but
    ``linearized``'s: torch's linearize traces the weights as constants, so its tangent map
    carries no gradient to them, in torch and through zfunc alike; it checks that zfunc runs it)."""
    plain = _reference_plain()
    for name in RECIPES:
        if name in ("inplace", "maml", "linearized"):
            continue
        ref = _reference(name, 1, 1)
        assert max((ref[n] - plain[n]).abs().max().item() for n in ref) > 1e-4, name


def _reference_plain() -> dict[str, torch.Tensor]:
    RECIPES["_plain"] = _mse
    try:
        return _reference("_plain", 1, 1)
    finally:
        del RECIPES["_plain"]
