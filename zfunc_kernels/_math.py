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
