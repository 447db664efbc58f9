"""The per-element Adam/AdamW and sum-of-squares math, written once for every backend.

The update follows the operation order of torch's fused CPU Adam (``torch.optim.Adam(W)``
with ``fused=True``), including where it fuses multiply-adds, so float32 results are bitwise
equal to torch's vectorised loop; see :func:`adam_element`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zfunc_kernels._shared import fma32, shared, sqrt32


@shared
def adam_constants(
    step: int, lr: Any, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool
) -> tuple:
    """Per-step float32 constants of the Adam update, derived in float64 like torch does.

    ``t = step + 1``; ``bias_correction1 = 1 - beta1**t``, ``step_size = lr /
    bias_correction1``, ``bias_correction2_sqrt = sqrt(1 - beta2**t)``, all in float64 and
    cast to float32 where used, as in torch's CPU fused Adam.

    Args:
        step: Updates applied so far.
        lr: Learning rate (a float32 device value, widened to float64).
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Denominator epsilon.
        weight_decay: Weight decay.
        decoupled: AdamW (``True``) or L2-coupled Adam (``False``).

    Returns:
        ``(decay, l2, lerp_w, lerp_small, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step)``:
        ``decay`` multiplies the parameter (AdamW, else 1), ``l2`` is the coupled decay
        coefficient (0 for AdamW), the rest feed :func:`adam_element`.

    Examples:
        >>> c = adam_constants(0, np.float32(0.5), 0.9, 0.999, 1e-8, 0.1, True)
        >>> [round(float(v), 4) for v in (c[0], c[2], c[6], c[8])]
        [0.95, 0.1, 0.0316, -5.0]
    """
    t = float(step) + 1.0
    lr64 = float(lr)
    bias_correction1 = 1.0 - beta1**t
    bias_correction2 = 1.0 - beta2**t
    decay = np.float32(1.0)
    l2 = np.float32(0.0)
    if weight_decay != 0.0:
        if decoupled:
            decay = np.float32(1.0 - lr64 * weight_decay)
        else:
            l2 = np.float32(weight_decay)
    w = np.float32(1.0 - beta1)
    small = abs(w) < np.float32(0.5)
    lerp_w = w if small else w - np.float32(1.0)
    return (
        decay,
        l2,
        lerp_w,
        small,
        np.float32(beta2),
        np.float32(1.0 - beta2),
        np.float32(math.sqrt(bias_correction2)),
        np.float32(eps),
        np.float32(-(lr64 / bias_correction1)),
    )


@shared
def adam_element(
    p: Any,
    g: Any,
    m: Any,
    v: Any,
    constants: tuple,
) -> tuple:
    """One Adam/AdamW update of one element, in float32, in torch's CPU fused order.

    .. code-block:: text

        g  = g + l2 * p                        (Adam, weight_decay != 0)
        p  = p * (1 - lr * wd)                 (AdamW)
        m  = lerp(m, g, 1 - beta1)             (fma, as torch's vectorised lerp)
        v  = v * beta2 + (1 - beta2) * g * g
        p  = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

    Args:
        p: Parameter (float32).
        g: Unscaled, clipped gradient (float32).
        m: First moment (float32).
        v: Second moment (float32).
        constants: the tuple of :func:`adam_constants`, unpacked here and nowhere else:
            ``decay`` (``float32(1 - lr * wd)`` for AdamW, else 1), ``l2`` (``float32(wd)``
            for coupled Adam, else 0), ``lerp_w`` (``1 - beta1``, or ``-beta1`` when
            ``1 - beta1 >= 0.5``), ``lerp_small`` (whether ``1 - beta1 < 0.5``: the lerp base),
            ``beta2``, ``one_minus_beta2``, ``bc2_sqrt`` (``sqrt(1 - beta2**t)``), ``eps`` and
            ``neg_step`` (``-lr / (1 - beta1**t)``), all float32.

    Returns:
        ``(p, m, v)`` updated, float32.

    Examples:
        >>> f = np.float32
        >>> c = adam_constants(0, f(0.1), 0.9, 0.999, 1e-8, 0.0, True)
        >>> p, m, v = adam_element(f(1.0), f(2.0), f(0.0), f(0.0), c)
        >>> round(float(p), 6), round(float(m), 6), round(float(v), 6)
        (0.9, 0.2, 0.004)
    """
    decay, l2, lerp_w, lerp_small, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step = constants
    if l2 != np.float32(0.0):
        gd = fma32(p, l2, g)
    else:
        gd = g
    if lerp_small:
        base = m
    else:
        base = gd
    m_new = fma32(lerp_w, gd - m, base)
    v_new = fma32(one_minus_beta2 * gd, gd, v * beta2)
    denom = sqrt32(v_new) / bc2_sqrt + eps
    p_new = p * decay + neg_step * m_new / denom
    return p_new, m_new, v_new


@shared
def square64(x: Any) -> Any:
    """Returns ``float64(x)**2`` (exact for float32 ``x``; finite iff ``x`` is finite).

    Args:
        x: A float32.

    Returns:
        The square as float64.

    Examples:
        >>> float(square64(np.float32(-3.0)))
        9.0
    """
    d = np.float64(x)
    return d * d


# --------------------------------------------------------------------------- SGD, Lion, Adagrad
# Each optimizer is a pair: ``*_constants(step, lr, hyper) -> tuple`` (per step, float64 derived
# like torch, cast to float32 where used) and ``*_element(p, g, s1, s2, constants) -> (p, s1, s2)``
# (one element, float32). ``s1``/``s2`` are the optimizer's moments; an optimizer with one
# slot passes its second through. ``hyper`` is a tuple of float64 in the order of the
# optimizer's record in ``zfunc_kernels._records``.


@shared
def sgd_constants(step: int, lr: Any, hyper: tuple) -> tuple:
    """``(lr, momentum, 1 - dampening, weight_decay, first, nesterov)`` for :func:`sgd_element`.

    Examples:
        >>> c = sgd_constants(0, np.float32(0.1), (0.9, 0.0, 0.01, 0.0))
        >>> [round(float(v), 4) for v in c[:4]], bool(c[4]), bool(c[5])
        ([0.1, 0.9, 1.0, 0.01], True, False)
    """
    momentum, dampening, weight_decay, nesterov = hyper
    return (np.float32(lr), np.float32(momentum), np.float32(1.0 - dampening), np.float32(weight_decay),
            step == 0, nesterov != 0.0)


@shared
def sgd_element(p: Any, g: Any, b: Any, unused: Any, constants: tuple) -> tuple:
    """One ``torch.optim.SGD`` update of one element (``b``: the momentum buffer).

    .. code-block:: text

        d = g + wd * p
        b = d (first step) | b * momentum + (1 - dampening) * d      (momentum != 0)
        d = d + momentum * b (nesterov) | b
        p = p - lr * d

    Examples:
        >>> f = np.float32
        >>> c = sgd_constants(1, f(0.1), (0.9, 0.0, 0.0, 0.0))
        >>> [round(float(v), 4) for v in sgd_element(f(1.0), f(2.0), f(1.0), f(0.0), c)[:2]]
        [0.71, 2.9]
    """
    lr, momentum, keep, weight_decay, first, nesterov = constants
    d = g
    if weight_decay != np.float32(0.0):
        d = g + weight_decay * p
    b_new = b
    if momentum != np.float32(0.0):
        if first:
            b_new = d
        else:
            b_new = b * momentum + keep * d
        if nesterov:
            d = d + momentum * b_new
        else:
            d = b_new
    return p - lr * d, b_new, unused


@shared
def lion_constants(step: int, lr: Any, hyper: tuple) -> tuple:
    """``(lr, 1 - lr * wd, beta1, 1 - beta1, beta2, 1 - beta2)`` for :func:`lion_element`.

    Examples:
        >>> [round(float(v), 4) for v in lion_constants(0, np.float32(0.1), (0.9, 0.99, 0.5))]
        [0.1, 0.95, 0.9, 0.1, 0.99, 0.01]
    """
    beta1, beta2, weight_decay = hyper
    lr64 = float(lr)
    return (np.float32(lr64), np.float32(1.0 - lr64 * weight_decay), np.float32(beta1), np.float32(1.0 - beta1),
            np.float32(beta2), np.float32(1.0 - beta2))


@shared
def lion_element(p: Any, g: Any, m: Any, unused: Any, constants: tuple) -> tuple:
    """One Lion update (Chen et al., 2023) of one element (``m``: the momentum).

    .. code-block:: text

        u = sign(beta1 * m + (1 - beta1) * g)
        p = p * (1 - lr * wd) - lr * u
        m = beta2 * m + (1 - beta2) * g

    Examples:
        >>> f = np.float32
        >>> c = lion_constants(0, f(0.1), (0.9, 0.99, 0.0))
        >>> [round(float(v), 4) for v in lion_element(f(1.0), f(-2.0), f(0.0), f(0.0), c)[:2]]
        [1.1, -0.02]
    """
    lr, decay, beta1, one_minus_beta1, beta2, one_minus_beta2 = constants
    c = beta1 * m + one_minus_beta1 * g
    u = np.float32(0.0)
    if c > np.float32(0.0):
        u = np.float32(1.0)
    elif c < np.float32(0.0):
        u = np.float32(-1.0)
    return p * decay - lr * u, beta2 * m + one_minus_beta2 * g, unused


@shared
def adagrad_constants(step: int, lr: Any, hyper: tuple) -> tuple:
    """``(clr, weight_decay, eps)`` for :func:`adagrad_element`, ``clr = lr / (1 + step * lr_decay)``.

    Examples:
        >>> [round(float(v), 4) for v in adagrad_constants(2, np.float32(0.1), (0.5, 0.0, 1e-10))[:2]]
        [0.05, 0.0]
    """
    lr_decay, weight_decay, eps = hyper
    return np.float32(float(lr) / (1.0 + float(step) * lr_decay)), np.float32(weight_decay), np.float32(eps)


@shared
def adagrad_element(p: Any, g: Any, s: Any, unused: Any, constants: tuple) -> tuple:
    """One ``torch.optim.Adagrad`` update of one element (``s``: the sum of squares).

    .. code-block:: text

        d = g + wd * p
        s = s + d * d
        p = p - clr * d / (sqrt(s) + eps)

    Examples:
        >>> f = np.float32
        >>> c = adagrad_constants(0, f(0.1), (0.0, 0.0, 1e-10))
        >>> [round(float(v), 4) for v in adagrad_element(f(1.0), f(2.0), f(0.0), f(0.0), c)[:2]]
        [0.9, 4.0]
    """
    clr, weight_decay, eps = constants
    d = g
    if weight_decay != np.float32(0.0):
        d = g + weight_decay * p
    s_new = s + d * d
    return p - clr * (d / (sqrt32(s_new) + eps)), s_new, unused


# --------------------------------------------------------------------------- Muon's two element passes
# Muon (``torch.optim.Muon``) orthogonalizes each matrix's momentum between two element passes:
# ``muon_momentum`` turns the gradient into the matrix to orthogonalize, ``muon_apply`` applies
# the orthogonalized update. Both lerps follow torch's CPU lerp (fma, base by ``|weight| < 0.5``).


@shared
def lerp32(a: Any, b: Any, w: Any, w_minus_one: Any, small: Any) -> Any:
    """``torch.lerp(a, b, w)`` of one float32 element: ``a + w (b - a)`` when ``|w| < 0.5``, else
    ``b + (w - 1) (b - a)``, each with one rounding (torch's vectorised CPU lerp).

    Examples:
        >>> f = np.float32
        >>> float(lerp32(f(1.0), f(3.0), f(0.25), f(-0.75), True)), float(lerp32(f(1.0), f(3.0), f(0.75), f(-0.25), False))
        (1.5, 2.5)
    """
    if small:
        return fma32(w, b - a, a)
    return fma32(w_minus_one, b - a, b)


@shared
def muon_momentum_constants(step: int, lr: Any, hyper: tuple) -> tuple:
    """``(1 - momentum, -momentum, |1 - momentum| < 0.5, momentum, momentum - 1, |momentum| < 0.5,
    nesterov)`` (float32 where numbers) for :func:`muon_momentum_element`.

    Examples:
        >>> c = muon_momentum_constants(0, np.float32(0.1), (0.95, 1.0))
        >>> round(float(c[0]), 4), bool(c[2]), bool(c[5]), bool(c[6])
        (0.05, True, False, True)
    """
    momentum, nesterov = hyper
    w = np.float32(1.0 - momentum)
    mu = np.float32(momentum)
    return (w, w - np.float32(1.0), abs(w) < np.float32(0.5), mu, mu - np.float32(1.0), abs(mu) < np.float32(0.5),
            nesterov != 0.0)


@shared
def muon_momentum_element(unused_in: Any, g: Any, b: Any, unused: Any, constants: tuple) -> tuple:
    """Muon's momentum of one element, as ``torch.optim.Muon``: returns ``(u, b, unused)``.

    .. code-block:: text

        b = lerp(b, g, 1 - momentum)
        u = lerp(g, b, momentum) (nesterov) | b

    Examples:
        >>> f = np.float32
        >>> c = muon_momentum_constants(0, f(0.1), (0.5, 1.0))
        >>> [float(v) for v in muon_momentum_element(f(0.0), f(2.0), f(0.0), f(0.0), c)[:2]]
        [1.5, 1.0]
    """
    w, w1, small, mu, mu1, mu_small, nesterov = constants
    b_new = lerp32(b, g, w, w1, small)
    u = b_new
    if nesterov:
        u = lerp32(g, b_new, mu, mu1, mu_small)
    return u, b_new, unused


@shared
def muon_apply_constants(step: int, lr: Any, hyper: tuple) -> tuple:
    """``(-lr, 1 - lr * weight_decay)`` (float32; the product in float64) for :func:`muon_apply_element`.

    Examples:
        >>> [round(float(v), 4) for v in muon_apply_constants(0, np.float32(0.1), (0.5,))]
        [-0.1, 0.95]
    """
    (weight_decay,) = hyper
    lr64 = float(lr)
    return np.float32(-lr64), np.float32(1.0 - lr64 * weight_decay)


@shared
def muon_apply_element(p: Any, o: Any, s: Any, unused: Any, constants: tuple) -> tuple:
    """Muon's update of one element (``o``: the orthogonalized, shape-scaled update):
    ``p = p (1 - lr wd) - lr o``; ``s`` passes through.

    Examples:
        >>> f = np.float32
        >>> c = muon_apply_constants(0, f(0.1), (0.0,))
        >>> round(float(muon_apply_element(f(1.0), f(2.0), f(0.0), f(0.0), c)[0]), 4)
        0.8
    """
    neg_lr, decay = constants
    return fma32(neg_lr, o, p * decay), s, unused


SLOT_MATH = {"sgd": (sgd_element, sgd_constants), "lion": (lion_element, lion_constants),
             "adagrad": (adagrad_element, adagrad_constants),
             "muon_momentum": (muon_momentum_element, muon_momentum_constants),
             "muon_apply": (muon_apply_element, muon_apply_constants)}
"""Each one-slot pass by name: ``(element, constants)``; every backend's slot kernel wraps these."""
