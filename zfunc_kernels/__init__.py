"""Fused kernels for zfunc: the sharded optimizer passes and one-pass overflow detection.

Eight public kernels (`fused_adam`, `fused_sgd`, `fused_lion`, `fused_adagrad`,
`fused_muon_momentum`, `fused_muon_apply`, `accumulate`, `overflow_sumsq`), each with four
implementations of the same math
(:mod:`zfunc_kernels._math`, written once, with the 16-bit codecs of
:mod:`zfunc_kernels._codec`):

* ``"cpu"``: ``numba.njit(parallel=True)`` over torch's CPU threads,
* ``"cuda"``: ``numba.cuda`` on torch's current stream,
* ``"sim"``: the CUDA kernels in numba's simulator (``NUMBA_ENABLE_CUDASIM=1``; tests only),
* ``"torch"``: a plain-torch reference, always available.

With ``backend=None`` the tensors' device decides: CPU tensors use ``"cpu"``, CUDA tensors
use ``"cuda"`` when :func:`backend` found numba's CUDA target working, else ``"torch"``.
"""

from __future__ import annotations

import functools
import os

import torch

from zfunc_kernels import _reference
from zfunc_kernels._records import (AdagradHyper, AdamHyper, AdamVectors, Backend, LionHyper, MuonApplyHyper,
                                    MuonMomentumHyper, SGDHyper, SlotVectors, StepScalars)

__all__ = [
    "AdagradHyper",
    "AdamHyper",
    "LionHyper",
    "MuonApplyHyper",
    "MuonMomentumHyper",
    "SGDHyper",
    "StepScalars",
    "accumulate",
    "backend",
    "fused_adagrad",
    "fused_adam",
    "fused_lion",
    "fused_muon_apply",
    "fused_muon_momentum",
    "fused_sgd",
    "overflow_sumsq",
]

__version__ = "0.1.0"

_MASTER = (torch.float32, torch.bfloat16, torch.float16)
_MOMENT = (torch.float32, torch.bfloat16)
_BACKENDS = ("torch", "cpu", "cuda", "sim")


@functools.cache
def backend() -> str:
    """Names the accelerator backend of this process; probed once, then cached.

    Returns:
        ``"sim"`` when ``NUMBA_ENABLE_CUDASIM=1`` (numba's CUDA target is then the simulator),
        ``"cuda"`` when torch sees a GPU and ``numba.cuda`` can use it, else ``"cpu"``.

    Examples:
        >>> backend() in ("cpu", "cuda", "sim")
        True
    """
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
        return "sim"
    if torch.cuda.is_available():
        try:
            from numba import cuda

            if cuda.is_available():
                return "cuda"
        except Exception:  # noqa: BLE001 - any failure means "no usable numba.cuda"
            pass
    return "cpu"


def _resolve(name: str | None, t: torch.Tensor) -> str:
    if name is None:
        if t.device.type == "cpu":
            return "cpu"
        if t.device.type == "cuda" and backend() == "cuda":
            return "cuda"
        return "torch"
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None, got {name!r}")
    return name


def _impl(name: str) -> Backend:
    if name == "torch":
        return _reference
    if name == "cpu":
        from zfunc_kernels import _cpu

        return _cpu
    if backend() != name:
        raise RuntimeError(
            f"backend {name!r} is not available here (backend() == {backend()!r}); the "
            "simulator needs NUMBA_ENABLE_CUDASIM=1 in the environment before numba is imported"
        )
    from zfunc_kernels import _cuda

    return _cuda


def _check_vector(name: str, t: torch.Tensor, dtypes: tuple, n: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {dtypes}")
    if t.numel() != n or t.device != device:
        raise ValueError(f"{name} must have {n} elements on {device}")


def _check_scalar(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 0 or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must be a 0-dim {dtype} tensor on {device}")


def fused_adam(
    master: torch.Tensor,
    grad: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    scalars: StepScalars,
    hyper: AdamHyper,
    *,
    compute: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    r"""Unscales, clips and applies one Adam/AdamW step in a single in-place pass.

    With ``t = step + 1`` and all arithmetic in float32 (the bias corrections in float64):

    .. math::

        g &= \mathrm{grad} \cdot \mathrm{inv\_scale} \cdot \mathrm{clip\_coef}
             \;(+\,\mathrm{wd}\cdot p \text{ if not decoupled}) \\
        m &\leftarrow \mathrm{lerp}(m, g, 1-\beta_1), \quad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        p &\leftarrow p\,(1 - \mathrm{lr}\cdot\mathrm{wd} \text{ if decoupled})
             - \frac{\mathrm{lr}}{1-\beta_1^t}\,\frac{m}{\sqrt{v}/\sqrt{1-\beta_2^t} + \epsilon}

    in the operation order of ``torch.optim.AdamW(fused=True)`` on CPU (fp32 results are
    bitwise equal to its vectorised loop). ``master``, ``mu``, ``nu`` (and ``compute``, which
    receives the new ``master`` cast to its dtype) are rounded to nearest even on store, and
    ``step`` is incremented. If ``found_inf != 0`` nothing is written and ``step`` is left
    alone, like ``torch.optim.Adam(fused=True)`` under a ``GradScaler``. Scalars stay on the
    device: on a GPU nothing waits for the host. The vectors must not overlap in memory.

    Args:
        master: 1-D contiguous master weights (float32, bfloat16 or float16), updated.
        grad: Gradient, same length and device (float32, bfloat16 or float16); read only.
        mu: First moment (float32 or bfloat16), updated.
        nu: Second moment (float32 or bfloat16), updated.
        scalars: `StepScalars`: ``step`` (0-dim int64, incremented unless ``found_inf``),
            ``lr``, ``inv_scale``, ``clip_coef``, ``found_inf`` (0-dim float32, on the device).
        hyper: `AdamHyper`: ``beta1``, ``beta2``, ``eps``, ``weight_decay``, ``decoupled``
            (``True`` for AdamW, ``p *= 1 - lr * wd``; ``False`` for Adam, ``g += wd * p``).
        compute: Optional 1-D float32/bfloat16/float16 tensor receiving the updated
            ``master`` in its dtype. Defaults to ``None``.
        backend: ``None`` (by device), ``"cpu"``, ``"cuda"``, ``"sim"`` or ``"torch"``.

    Raises:
        TypeError: A vector has an unsupported dtype.
        ValueError: A wrong shape, length, device or scalar, or an unknown backend.
        RuntimeError: The requested backend is not available in this process.

    Examples:
        >>> import torch, zfunc_kernels
        >>> p = torch.tensor([1.0, -1.0]); g = torch.tensor([0.5, 0.5])
        >>> mu, nu = torch.zeros(2), torch.zeros(2)
        >>> step, bf = torch.tensor(0), torch.empty(2, dtype=torch.bfloat16)
        >>> hyper = zfunc_kernels.AdamHyper(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        >>> scalars = zfunc_kernels.StepScalars(step=step, lr=torch.tensor(0.1), inv_scale=torch.tensor(0.5),
        ...                                     clip_coef=torch.tensor(1.0), found_inf=torch.tensor(0.0))
        >>> for _ in range(3):
        ...     zfunc_kernels.fused_adam(p, g, mu, nu, scalars, hyper, compute=bf)
        >>> [round(x, 4) for x in p.tolist()], bf.tolist(), int(step)
        ([0.7, -1.3], [0.69921875, -1.296875], 3)
        >>> skip = scalars._replace(found_inf=torch.tensor(1.0))
        >>> zfunc_kernels.fused_adam(p, g, mu, nu, skip, hyper, compute=bf)
        >>> [round(x, 4) for x in p.tolist()], int(step)
        ([0.7, -1.3], 3)

    References:
        Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
    """
    h = AdamHyper(*hyper)
    hyper = AdamHyper(float(h.beta1), float(h.beta2), float(h.eps), float(h.weight_decay), bool(h.decoupled))
    impl, scalars = _checked(master, grad, {"mu": mu, "nu": nu}, compute, scalars, backend)
    impl.fused_adam(AdamVectors(master, grad, mu, nu, compute), scalars, hyper)
    _written(impl, master, mu, nu, scalars.step, compute)


def _checked(master: torch.Tensor, grad: torch.Tensor, slots: dict[str, torch.Tensor], compute: torch.Tensor | None,
             scalars: StepScalars, backend: str | None) -> tuple[Backend, StepScalars]:
    """Check one pass's vectors and scalars (dtypes, lengths, device); pick the backend."""
    n, dev = master.numel(), master.device
    _check_vector("master", master, _MASTER, n, dev)
    _check_vector("grad", grad, _MASTER, n, dev)
    for name, t in slots.items():
        _check_vector(name, t, _MOMENT, n, dev)
    if compute is not None:
        _check_vector("compute", compute, _MASTER, n, dev)
    scalars = StepScalars(*scalars)
    for name, t in scalars._asdict().items():
        _check_scalar(name, t, torch.int64 if name == "step" else torch.float32, dev)
    return _impl(_resolve(backend, master)), scalars


def _written(impl: Backend, *tensors: torch.Tensor | None) -> None:
    """Kernels write behind autograd's back: tell it, as torch's in-place ops do."""
    if impl is not _reference:
        for t in tensors:
            if t is not None:
                torch.autograd.graph.increment_version(t)


def _fused_slot(kind: str, master: torch.Tensor, grad: torch.Tensor, slot: torch.Tensor, scalars: StepScalars,
                hyper: tuple, compute: torch.Tensor | None, backend: str | None) -> None:
    impl, scalars = _checked(master, grad, {"slot": slot}, compute, scalars, backend)
    impl.fused_slot_update(kind, SlotVectors(master, grad, slot, compute), scalars, tuple(float(h) for h in hyper))
    _written(impl, master, slot, scalars.step, compute)


def fused_sgd(master: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor, scalars: StepScalars,
              hyper: SGDHyper, *, compute: torch.Tensor | None = None, backend: str | None = None) -> None:
    r"""One ``torch.optim.SGD`` step (momentum, dampening, nesterov, weight decay) in one pass.

    With ``g`` the unscaled, clipped gradient: ``d = g + wd p``; with momentum the buffer is
    ``d`` on the first step (``scalars.step == 0``) and ``momentum b + (1 - dampening) d``
    after; ``d = d + momentum b`` (nesterov) or ``b``; ``p -= lr d``. Unscale, clip, the skip on
    ``found_inf`` (``step`` not advanced) and the compute copy are as in `fused_adam`.

    Args:
        master: 1-D master weights (float32, bfloat16 or float16), updated.
        grad: the gradient, same length (read only).
        momentum_buffer: the momentum (float32 or bfloat16), updated.
        scalars: `StepScalars` on the device.
        hyper: `SGDHyper`.
        compute: optional compute-dtype copy of ``master`` to write.
        backend: ``None`` (by device), ``"cpu"``, ``"cuda"``, ``"sim"`` or ``"torch"``.

    Examples:
        >>> import torch, zfunc_kernels
        >>> p, g, b, step = torch.ones(2), torch.tensor([1.0, -1.0]), torch.zeros(2), torch.tensor(0)
        >>> s = zfunc_kernels.StepScalars(step, torch.tensor(0.1), torch.tensor(1.0), torch.tensor(1.0),
        ...                               torch.tensor(0.0))
        >>> for _ in range(2):
        ...     zfunc_kernels.fused_sgd(p, g, b, s, zfunc_kernels.SGDHyper(momentum=0.9))
        >>> [round(x, 4) for x in p.tolist()], [round(x, 4) for x in b.tolist()], int(step)
        ([0.71, 1.29], [1.9, -1.9], 2)
    """
    _fused_slot("sgd", master, grad, momentum_buffer, scalars, SGDHyper(*hyper), compute, backend)


def fused_lion(master: torch.Tensor, grad: torch.Tensor, mu: torch.Tensor, scalars: StepScalars,
               hyper: LionHyper, *, compute: torch.Tensor | None = None, backend: str | None = None) -> None:
    r"""One Lion step (Chen et al., 2023) in one pass.

    ``p = p (1 - lr wd) - lr sign(beta1 m + (1 - beta1) g)``, then
    ``m = beta2 m + (1 - beta2) g``; unscale, clip, skip and compute copy as in `fused_adam`.

    Examples:
        >>> import torch, zfunc_kernels
        >>> p, g, m, step = torch.ones(2), torch.tensor([3.0, -0.5]), torch.zeros(2), torch.tensor(0)
        >>> s = zfunc_kernels.StepScalars(step, torch.tensor(0.1), torch.tensor(1.0), torch.tensor(1.0),
        ...                               torch.tensor(0.0))
        >>> zfunc_kernels.fused_lion(p, g, m, s, zfunc_kernels.LionHyper())
        >>> [round(x, 4) for x in p.tolist()], [round(x, 4) for x in m.tolist()]
        ([0.9, 1.1], [0.03, -0.005])

    References:
        Chen et al., "Symbolic Discovery of Optimization Algorithms", NeurIPS 2023.
    """
    _fused_slot("lion", master, grad, mu, scalars, LionHyper(*hyper), compute, backend)


def fused_adagrad(master: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, scalars: StepScalars,
                  hyper: AdagradHyper, *, compute: torch.Tensor | None = None, backend: str | None = None) -> None:
    r"""One ``torch.optim.Adagrad`` step in one pass.

    ``d = g + wd p``, ``s += d^2``, ``p -= clr d / (sqrt(s) + eps)`` with
    ``clr = lr / (1 + step * lr_decay)`` (``step``: updates before this one); unscale, clip, skip
    and compute copy as in `fused_adam`.

    Examples:
        >>> import torch, zfunc_kernels
        >>> p, g, acc, step = torch.ones(2), torch.tensor([2.0, -2.0]), torch.zeros(2), torch.tensor(0)
        >>> s = zfunc_kernels.StepScalars(step, torch.tensor(0.1), torch.tensor(1.0), torch.tensor(1.0),
        ...                               torch.tensor(0.0))
        >>> zfunc_kernels.fused_adagrad(p, g, acc, s, zfunc_kernels.AdagradHyper())
        >>> [round(x, 4) for x in p.tolist()], acc.tolist()
        ([0.9, 1.1], [4.0, 4.0])
    """
    _fused_slot("adagrad", master, grad, state_sum, scalars, AdagradHyper(*hyper), compute, backend)


def fused_muon_momentum(out: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor, scalars: StepScalars,
                        hyper: MuonMomentumHyper, *, backend: str | None = None) -> None:
    r"""Muon's momentum (``torch.optim.Muon``) in one pass: ``b = lerp(b, g, 1 - momentum)``, and
    ``out = lerp(g, b, momentum)`` (nesterov) or ``b``, the matrix Newton-Schulz orthogonalizes.

    ``g`` is the unscaled, clipped gradient; on ``found_inf`` nothing is written. ``scalars.step``
    is incremented (pass a scratch copy: `fused_muon_apply` advances the real count).

    Examples:
        >>> import torch, zfunc_kernels
        >>> u, g, b = torch.zeros(2), torch.tensor([2.0, -2.0]), torch.zeros(2)
        >>> s = zfunc_kernels.StepScalars(torch.tensor(0), torch.tensor(0.1), torch.tensor(1.0), torch.tensor(1.0),
        ...                               torch.tensor(0.0))
        >>> zfunc_kernels.fused_muon_momentum(u, g, b, s, zfunc_kernels.MuonMomentumHyper(momentum=0.5))
        >>> u.tolist(), b.tolist()
        ([1.5, -1.5], [1.0, -1.0])
    """
    _fused_slot("muon_momentum", out, grad, momentum_buffer, scalars, MuonMomentumHyper(*hyper), None, backend)


def fused_muon_apply(master: torch.Tensor, update: torch.Tensor, scalars: StepScalars, hyper: MuonApplyHyper, *,
                     compute: torch.Tensor | None = None, backend: str | None = None) -> None:
    r"""Muon's update in one pass: ``p = p (1 - lr wd) - lr o`` with ``o`` the orthogonalized
    update (already scaled by the matrix's lr adjustment), the compute copy written; skipped on
    ``found_inf``. Pass ``scalars.inv_scale`` and ``clip_coef`` as 1 (``o`` is not a gradient).

    Examples:
        >>> import torch, zfunc_kernels
        >>> p, o = torch.ones(2), torch.tensor([1.0, -1.0])
        >>> one = torch.tensor(1.0)
        >>> s = zfunc_kernels.StepScalars(torch.tensor(0), torch.tensor(0.1), one, one, torch.tensor(0.0))
        >>> zfunc_kernels.fused_muon_apply(p, o, s, zfunc_kernels.MuonApplyHyper(weight_decay=0.0))
        >>> [round(x, 4) for x in p.tolist()], int(s.step)
        ([0.9, 1.1], 1)
    """
    _fused_slot("muon_apply", master, update, update, scalars, MuonApplyHyper(*hyper), compute, backend)


def accumulate(out: torch.Tensor, x: torch.Tensor, *, overwrite: bool = False, scale: float = 1.0,
               backend: str | None = None) -> torch.Tensor:
    """Adds ``x * scale`` to the float32 ``out`` in place (writes it there with ``overwrite``),
    reading ``x`` in its own format: a 16-bit gradient widened while it is added, with no float32
    copy of it. Each element is widened without rounding, multiplied by ``scale`` (a float32;
    exact for powers of two) and added once.

    On the CPU this is one numba pass (torch widens bfloat16 several times slower than it
    adds); elsewhere torch's ``add_``/``copy_``, which are bandwidth-bound on a GPU already.

    Args:
        out: 1-D contiguous float32 tensor.
        x: 1-D contiguous float32, bfloat16 or float16 tensor with as many elements, on
            ``out``'s device.
        overwrite: ``out = x * scale`` instead of ``out += x * scale``.
        scale: the factor (`zfunc.autograd.average`: the data-parallel mean), default 1.
        backend: ``None`` (by device: ``"cpu"`` for CPU tensors, else torch), ``"cpu"`` or
            ``"torch"``.

    Returns:
        ``out``.

    Examples:
        >>> import torch, zfunc_kernels
        >>> out = torch.ones(3)
        >>> zfunc_kernels.accumulate(out, torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16)).tolist()
        [1.5, 0.0, 3.0]
        >>> zfunc_kernels.accumulate(out, torch.tensor([2.0, 4.0, 1.0]), scale=0.5).tolist()
        [2.5, 2.0, 3.5]
    """
    _check_vector("out", out, (torch.float32,), out.numel(), out.device)
    _check_vector("x", x, _MASTER, out.numel(), out.device)
    name = _resolve(backend, x)
    (_impl("cpu") if name == "cpu" else _reference).accumulate(out, x, overwrite, float(scale))
    return out


def overflow_sumsq(
    x: torch.Tensor, *, out: torch.Tensor | None = None, backend: str | None = None
) -> torch.Tensor:
    """Detects NaN/Inf and sums squares in one read-only pass.

    Deterministic: fixed blocks accumulate in float64 and the block partials are added in a
    fixed order, so equal inputs give equal bytes whatever the thread count or scheduling. No
    floating-point atomics and no parameter-sized temporaries. Squares of float32 values
    cannot overflow float64, so the float64 total is finite exactly when every element is;
    that is the overflow test. ``sumsq`` is rounded to float32 (it may round to ``inf`` for
    huge finite inputs; it is ``inf``/``nan`` when ``found_inf`` is set).

    Args:
        x: 1-D contiguous float32, bfloat16 or float16 tensor.
        out: Optional float32 tensor of shape ``(2,)`` on ``x``'s device to write into.
        backend: ``None`` (by device), ``"cpu"``, ``"cuda"``, ``"sim"`` or ``"torch"``.

    Returns:
        ``out`` (or a new tensor): ``[found_inf, sumsq]``, ``found_inf`` being 1.0 if any
        element is NaN or infinite else 0.0. Summing it across ranks keeps both meanings.

    Examples:
        >>> import torch, zfunc_kernels
        >>> zfunc_kernels.overflow_sumsq(torch.tensor([3.0, 4.0])).tolist()
        [0.0, 25.0]
        >>> zfunc_kernels.overflow_sumsq(torch.tensor([1.0, float("nan")]))[0].item()
        1.0
    """
    _check_vector("x", x, _MASTER, x.numel(), x.device)
    if out is None:
        out = torch.empty(2, dtype=torch.float32, device=x.device)
    elif out.shape != (2,) or out.dtype != torch.float32 or out.device != x.device:
        raise ValueError(f"out must be a float32 tensor of shape (2,) on {x.device}")
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    _impl(_resolve(backend, x)).overflow_sumsq(x, out)
    return out
