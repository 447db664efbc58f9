"""CUDA backend: the shared math compiled by ``numba.cuda.jit``, or run by the CUDA simulator.

Imported only when a ``"cuda"`` or ``"sim"`` backend is used. With
``NUMBA_ENABLE_CUDASIM=1`` (set before numba is imported) the same kernels run in numba's
simulator on numpy views of CPU tensors: the primitives of :mod:`zfunc_kernels._shared` then
run their Python bodies, there are no streams, and each element costs about 0.1 ms, so keep
simulated inputs small. On a GPU, tensors are imported through ``__cuda_array_interface__``
and kernels are queued on torch's current stream; scalars (``lr``, ``step``, ``found_inf``...)
stay in device memory and are never read by the host.

Only plain ``numba.cuda`` API is used (``jit``, ``grid``, ``shared.array``, ``syncthreads``,
``fma``, ``libdevice``). Both numba's built-in CUDA target and NVIDIA's ``numba-cuda`` (which
types CUDA code with its own registry, so the shared overloads are registered there too)
compile these kernels.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import numba
import numpy as np
import torch
from numba import cuda
from zfunc_kernels import _adapt, _shared
from zfunc_kernels._cache import track_shared_math
from zfunc_kernels._codec import load, quantize, store
from zfunc_kernels._math import SLOT_MATH, adam_constants, adam_element, square64
from zfunc_kernels._records import AdamHyper, AdamVectors, SlotVectors, StepScalars

SIM = bool(numba.config.ENABLE_CUDASIM)
THREADS = 8 if SIM else 256
"""Threads per block (a power of two; the simulator runs one Python thread per CUDA thread)."""
MAX_BLOCKS = 4 if SIM else 1024
"""Grid cap for the grid-stride loops; the grid depends only on the length."""

if not SIM:
    from numba.core.extending import overload as _core_overload
    from numba.cuda import libdevice

    # NVIDIA's numba-cuda types CUDA code with its own registry and extension API.
    try:
        from numba.cuda.extending import overload as _cuda_overload
    except ImportError:  # numba's built-in CUDA target uses numba.core's registry
        _cuda_overload = None
    if _cuda_overload is None or _cuda_overload is _core_overload:
        _cuda_overload = functools.partial(_core_overload, target="cuda")
    else:
        _shared.register_with(_cuda_overload)
        import numba.cuda.core.caching as _cuda_caching

        _CUDA_CACHE_TRACKED = track_shared_math(_cuda_caching)

    @_cuda_overload(_shared.f32_to_bits, strict=False)
    def _f32_to_bits_cuda(x: Any) -> Any:
        return lambda x: np.int64(libdevice.float_as_int(np.float32(x))) & 0xFFFFFFFF

    @_cuda_overload(_shared.bits_to_f32, strict=False)
    def _bits_to_f32_cuda(u: Any) -> Any:
        return lambda u: libdevice.int_as_float(np.int32(u & 0xFFFFFFFF))

    @_cuda_overload(_shared.fma32, strict=False)
    def _fma32_cuda(a: Any, b: Any, c: Any) -> Any:
        return lambda a, b, c: cuda.fma(np.float32(a), np.float32(b), np.float32(c))


CACHED = track_shared_math() and globals().get("_CUDA_CACHE_TRACKED", True)
"""Whether compiled kernels are cached on disk (only when the cache key covers the shared math)."""

_JIT: dict[str, Any] = {} if SIM else {"cache": CACHED}


@cuda.jit(**_JIT)
def adam_kernel(
    master: Any,
    grad: Any,
    mu: Any,
    nu: Any,
    compute: Any,
    has_compute: bool,
    step: Any,
    lr: Any,
    inv_scale: Any,
    clip_coef: Any,
    found_inf: Any,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
) -> None:  # pragma: no cover - compiled
    """Fused unscale + clip + Adam/AdamW + compute cast, one grid-stride loop, in place."""
    if found_inf[0] != np.float32(0.0):
        return
    c = adam_constants(step[0], lr[0], beta1, beta2, eps, weight_decay, decoupled)
    inv = np.float32(inv_scale[0])
    clip = np.float32(clip_coef[0])
    for i in range(cuda.grid(1), master.size, cuda.gridsize(1)):
        g = load(grad, i) * inv * clip
        p, m, v = adam_element(load(master, i), g, load(mu, i), load(nu, i), c)
        store(master, i, p)
        store(mu, i, m)
        store(nu, i, v)
        if has_compute:
            store(compute, i, quantize(master, p))


def _slot_kernel(element: Any, constants: Any) -> Any:
    """A grid-stride kernel for a one-slot optimizer around ``element`` (as :func:`adam_kernel`)."""

    @cuda.jit
    def kernel(master: Any, grad: Any, slot: Any, compute: Any, has_compute: bool, step: Any, lr: Any,
               inv_scale: Any, clip_coef: Any, found_inf: Any, hyper: tuple) -> None:  # pragma: no cover
        if found_inf[0] != np.float32(0.0):
            return
        c = constants(step[0], lr[0], hyper)
        inv = np.float32(inv_scale[0])
        clip = np.float32(clip_coef[0])
        for i in range(cuda.grid(1), master.size, cuda.gridsize(1)):
            g = load(grad, i) * inv * clip
            p, s, _ = element(load(master, i), g, load(slot, i), np.float32(0.0), c)
            store(master, i, p)
            store(slot, i, s)
            if has_compute:
                store(compute, i, quantize(master, p))

    return kernel


_SLOT_KERNELS: dict[str, Any] = {}


@cuda.jit(**_JIT)
def bump_step_kernel(step: Any, found_inf: Any) -> None:  # pragma: no cover - compiled
    """``step += 1`` unless ``found_inf``; queued after :func:`adam_kernel` (one thread)."""
    if cuda.grid(1) == 0 and found_inf[0] == np.float32(0.0):
        step[0] += 1


@cuda.jit(**_JIT)
def sumsq_partial_kernel(x: Any, partial: Any) -> None:  # pragma: no cover - compiled
    """Per-block float64 sum of squares: fixed strided assignment, then a fixed tree."""
    buf = cuda.shared.array(256, np.float64)
    tid = cuda.threadIdx.x
    acc = 0.0
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        acc += square64(load(x, i))
    buf[tid] = acc
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if tid < half:
            buf[tid] += buf[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        partial[cuda.blockIdx.x] = buf[0]


@cuda.jit(**_JIT)
def sumsq_final_kernel(partial: Any, out: Any) -> None:  # pragma: no cover - compiled
    """One block: reduces the partials in a fixed tree, writes ``[found_inf, sumsq]``."""
    buf = cuda.shared.array(256, np.float64)
    tid = cuda.threadIdx.x
    acc = 0.0
    for i in range(tid, partial.size, cuda.blockDim.x):
        acc += partial[i]
    buf[tid] = acc
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if tid < half:
            buf[tid] += buf[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        total = buf[0]
        # float64 squares of float32 values cannot overflow: finite sum <=> finite input.
        out[0] = np.float32(0.0) if math.isfinite(total) else np.float32(1.0)
        out[1] = np.float32(total)


# --------------------------------------------------------------------------- torch entry points


def _grid(n: int) -> int:
    return max(1, min(MAX_BLOCKS, -(-n // THREADS)))


def _launch(kernel: Any, blocks: int, device: torch.device) -> Any:
    """``kernel[blocks, THREADS, torch's stream]``, without numba's low-occupancy warning.

    The one-block kernels (step bump, final reduction) and small tensors are small grids on
    purpose; numba warns on any grid under 128 blocks, and warnings are errors in zfunc's tests.
    """
    if SIM:
        return kernel[blocks, THREADS]
    stream = _adapt.torch_stream(device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Grid size .* under-utilization")
        return kernel[blocks, THREADS, stream]


def _arrays(*tensors: torch.Tensor | None) -> list[Any]:
    convert = _adapt.as_numpy if SIM else _adapt.as_device_array
    return [None if t is None else convert(t) for t in tensors]


def _check_device(t: torch.Tensor) -> None:
    if SIM and t.device.type != "cpu":
        raise ValueError("the CUDA simulator backend takes CPU tensors")
    if not SIM and t.device.type != "cuda":
        raise ValueError("the cuda backend takes CUDA tensors")


def fused_adam(vectors: AdamVectors, scalars: StepScalars, hyper: AdamHyper) -> None:
    """Queues :func:`adam_kernel` and :func:`bump_step_kernel` (see ``zfunc_kernels``)."""
    master = vectors.master
    _check_device(master)
    m_, g_, mu_, nu_, c_ = _arrays(*vectors)
    step_, lr_, inv_, clip_, inf_ = _arrays(*scalars)
    if c_ is None:
        c_ = m_[:0]
    with _device(master):
        _launch(adam_kernel, _grid(master.numel()), master.device)(
            m_, g_, mu_, nu_, c_, vectors.compute is not None, step_, lr_, inv_, clip_, inf_, *hyper
        )
        _launch(bump_step_kernel, 1, master.device)(step_, inf_)


def fused_slot_update(kind: str, vectors: SlotVectors, scalars: StepScalars, hyper: tuple) -> None:
    """Queues the one-slot optimizer ``kind`` and :func:`bump_step_kernel` (see ``zfunc_kernels``)."""
    master = vectors.master
    _check_device(master)
    kernel = _SLOT_KERNELS.get(kind)
    if kernel is None:
        kernel = _SLOT_KERNELS[kind] = _slot_kernel(*SLOT_MATH[kind])
    m_, g_, s_, c_ = _arrays(*vectors)
    step_, lr_, inv_, clip_, inf_ = _arrays(*scalars)
    if c_ is None:
        c_ = m_[:0]
    with _device(master):
        _launch(kernel, _grid(master.numel()), master.device)(
            m_, g_, s_, c_, vectors.compute is not None, step_, lr_, inv_, clip_, inf_, tuple(float(h) for h in hyper)
        )
        _launch(bump_step_kernel, 1, master.device)(step_, inf_)


def overflow_sumsq(x: torch.Tensor, out: torch.Tensor) -> None:
    """Queues the two-stage deterministic reduction, writing ``[found_inf, sumsq]``."""
    _check_device(x)
    blocks = _grid(x.numel())
    partial = torch.empty(blocks, dtype=torch.float64, device=x.device)
    x_, p_, out_ = _arrays(x, partial, out)
    with _device(x):
        _launch(sumsq_partial_kernel, blocks, x.device)(x_, p_)
        _launch(sumsq_final_kernel, 1, x.device)(p_, out_)


class _device:
    """Makes numba's current device that of a CUDA tensor (a no-op in the simulator)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._ctx = None if SIM or t.device.index is None else cuda.gpus[t.device.index]

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
