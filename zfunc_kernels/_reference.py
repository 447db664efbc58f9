"""Plain-torch reference of both kernels (``backend="torch"``): always available, any device.

The reference follows the element math of :mod:`zfunc_kernels._math` operation by operation
in float32 torch ops. torch has no fused multiply-add, so each ``fma32`` is evaluated as a
float64 product (exact for float32 factors) plus a float64 add, then rounded to float32;
that differs from a true fma only when the float64 sum lands exactly on a float32 rounding
tie, which is rare. Everything stays on the tensors' device: the overflow skip is a
``torch.where`` and the step bump a device add, so nothing synchronises with the host. It
allocates parameter-sized temporaries freely; it is for checking, not for speed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zfunc_kernels._records import AdamHyper, AdamVectors, SlotVectors, StepScalars

_F32 = torch.float32
_F64 = torch.float64


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (a.to(_F64) * b.to(_F64) + c.to(_F64)).to(_F32)


def fused_adam(vectors: AdamVectors, scalars: StepScalars, hyper: AdamHyper) -> None:
    """Reference Adam/AdamW step, in place (arguments as in ``zfunc_kernels.fused_adam``).

    Examples:
        >>> p, g = torch.ones(2), torch.tensor([2.0, -2.0])
        >>> m, v, s = torch.zeros(2), torch.zeros(2), torch.tensor(0)
        >>> one, zero = torch.tensor(1.0), torch.tensor(0.0)
        >>> fused_adam(AdamVectors(p, g, m, v), StepScalars(s, torch.tensor(0.25), one, one, zero),
        ...            AdamHyper(0.9, 0.999, 1e-8, 0.0))
        >>> p.tolist(), m.tolist(), int(s)
        ([0.75, 1.25], [0.20000000298023224, -0.20000000298023224], 1)
    """
    master, grad, mu, nu, compute = vectors
    step, lr, inv_scale, clip_coef, found_inf = scalars
    beta1, beta2, eps, weight_decay, decoupled = hyper
    dev = master.device

    def f32(value: float) -> torch.Tensor:  # a float32 constant made on the device (no copy)
        return torch.full((), value, dtype=_F32, device=dev)

    skip = found_inf != 0
    t = (step + 1).to(_F64)
    lr64 = lr.to(_F64)
    neg_step = (-(lr64 / (1.0 - torch.pow(beta1, t)))).to(_F32)
    bc2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, t)).to(_F32)
    decay = f32(1.0)
    if weight_decay != 0.0 and decoupled:
        decay = (1.0 - lr64 * weight_decay).to(_F32)
    w = float(np.float32(1.0 - beta1))
    small = abs(w) < 0.5
    lerp_w = f32(w if small else float(np.float32(w) - np.float32(1.0)))

    g = grad.to(_F32) * inv_scale * clip_coef
    p = master.to(_F32)
    m = mu.to(_F32)
    v = nu.to(_F32)
    if weight_decay != 0.0 and not decoupled:
        g = _fma(p, f32(weight_decay), g)
    m_new = _fma(lerp_w, g - m, m if small else g)
    v_new = _fma(f32(1.0 - beta2) * g, g, v * f32(beta2))
    denom = torch.sqrt(v_new) / bc2_sqrt + f32(eps)
    p_new = (p * decay + neg_step * m_new / denom).to(master.dtype)

    master.copy_(torch.where(skip, master, p_new))
    mu.copy_(torch.where(skip, mu, m_new.to(mu.dtype)))
    nu.copy_(torch.where(skip, nu, v_new.to(nu.dtype)))
    if compute is not None:
        compute.copy_(torch.where(skip, compute, p_new.to(compute.dtype)))
    step.add_((~skip).to(step.dtype))


def accumulate(out: torch.Tensor, x: torch.Tensor, overwrite: bool, scale: float = 1.0) -> None:
    """Reference ``out += x * scale`` (``out = x * scale`` with ``overwrite``), ``x`` widened to
    float32 first and the product rounded once to float32.

    Examples:
        >>> out = torch.ones(2)
        >>> accumulate(out, torch.tensor([0.5, 2.0], dtype=torch.bfloat16), True); out.tolist()
        [0.5, 2.0]
    """
    wide = x.to(torch.float32)
    if scale != 1.0:
        wide = wide * torch.tensor(scale, dtype=torch.float32)
    if overwrite:
        out.copy_(wide)
    else:
        out.add_(wide)


def overflow_sumsq(x: torch.Tensor, out: torch.Tensor) -> None:
    """Reference ``[found_inf, sum(x**2)]`` written into ``out`` (float64 sum).

    Examples:
        >>> out = torch.empty(2)
        >>> overflow_sumsq(torch.tensor([3.0, float("inf")]), out); out.tolist()
        [1.0, inf]
    """
    xd = x.to(_F64)
    out[0] = (~torch.isfinite(x).all()).to(_F32)
    out[1] = (xd * xd).sum().to(_F32)


def fused_slot_update(kind: str, vectors: SlotVectors, scalars: StepScalars, hyper: tuple) -> None:
    """Reference one-slot optimizer pass (SGD, Lion, Adagrad), in place, in float32 torch ops.

    Examples:
        >>> p, g, b, s = torch.ones(2), torch.tensor([2.0, -2.0]), torch.zeros(2), torch.tensor(0)
        >>> one, zero = torch.tensor(1.0), torch.tensor(0.0)
        >>> fused_slot_update("lion", SlotVectors(p, g, b), StepScalars(s, torch.tensor(0.1), one, one, zero),
        ...                   (0.9, 0.99, 0.0))
        >>> [round(x, 4) for x in p.tolist()], int(s)
        ([0.9, 1.1], 1)
    """
    master, grad, slot, compute = vectors
    step, lr, inv_scale, clip_coef, found_inf = scalars
    dev = master.device

    def f32(value: Any) -> torch.Tensor:
        return torch.as_tensor(value, dtype=_F64).to(dev).to(_F32)

    skip = found_inf != 0
    g = grad.to(_F32) * inv_scale * clip_coef
    p, s = master.to(_F32), slot.to(_F32)
    if kind == "sgd":
        momentum, dampening, wd, nesterov = hyper
        d = g + f32(wd) * p if wd else g
        s_new = s
        if momentum:
            s_new = torch.where(step == 0, d, s * f32(momentum) + f32(1.0 - dampening) * d)
            d = d + f32(momentum) * s_new if nesterov else s_new
        p_new = p - lr.to(_F32) * d
    elif kind == "lion":
        beta1, beta2, wd = hyper
        lr64 = lr.to(_F64)
        u = torch.sign(f32(beta1) * s + f32(1.0 - beta1) * g)
        p_new = p * (1.0 - lr64 * wd).to(_F32) - lr.to(_F32) * u
        s_new = f32(beta2) * s + f32(1.0 - beta2) * g
    elif kind == "adagrad":
        lr_decay, wd, eps = hyper
        clr = (lr.to(_F64) / (1.0 + step.to(_F64) * lr_decay)).to(_F32)
        d = g + f32(wd) * p if wd else g
        s_new = s + d * d
        p_new = p - clr * (d / (torch.sqrt(s_new) + f32(eps)))
    elif kind == "muon_momentum":  # "master" receives the matrix to orthogonalize
        momentum, nesterov = hyper
        s_new = torch.lerp(s, g, f32(1.0 - momentum))
        p_new = torch.lerp(g, s_new, f32(momentum)) if nesterov else s_new
    elif kind == "muon_apply":  # "grad" is the orthogonalized update; the slot passes through
        (wd,) = hyper
        p_new = p * (1.0 - lr.to(_F64) * wd).to(_F32) - lr.to(_F32) * g
        s_new = s
    else:
        raise ValueError(f"kind must be one of 'sgd', 'lion', 'adagrad', 'muon_momentum', 'muon_apply', got {kind!r}")
    p_new = p_new.to(master.dtype)
    master.copy_(torch.where(skip, master, p_new))
    slot.copy_(torch.where(skip, slot, s_new.to(slot.dtype)))
    if compute is not None:
        compute.copy_(torch.where(skip, compute, p_new.to(compute.dtype)))
    step.add_((~skip).to(step.dtype))
