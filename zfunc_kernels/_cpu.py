"""CPU backend: the shared math compiled by ``numba.njit(parallel=True)``.

torch CPU tensors reach the kernels as zero-copy numpy views: float32 as ``float32``,
bfloat16 as ``int16`` bits and float16 as ``uint16`` bits (the tag convention of
:mod:`zfunc_kernels._codec`). Work is split into fixed blocks of :data:`BLOCK` elements handed
to ``prange``; the block grid depends on the length only, never on the thread count, which
makes the sum-of-squares partials (and so its result) identical for any number of threads.
"""

from __future__ import annotations

import contextlib
import math
import platform
from collections.abc import Iterator
from typing import Any

import numba
import numpy as np
import torch
import llvmlite.binding as llvm
from llvmlite import ir
from numba import prange
from numba.core import types
from numba.core.extending import intrinsic, overload

from zfunc_kernels import _codec, _shared
from zfunc_kernels._adapt import as_numpy
from zfunc_kernels._cache import track_shared_math
from zfunc_kernels._codec import load, quantize, store
from zfunc_kernels._math import SLOT_MATH, adam_constants, adam_element, square64
from zfunc_kernels._records import AdamHyper, AdamVectors, SlotVectors, StepScalars

BLOCK = 1 << 14
"""Elements per parallel work item: 64 KiB of each float32 stream, sized for L2."""
LANES = 256
"""Independent float64 accumulators per block in the sum of squares. Lane ``j`` adds the
elements ``j, j + LANES, ...`` in order; the lanes are then combined pairwise. This order is
fixed by the code, not by the compiler or the machine, and the lane loop vectorises (numba
leaves LLVM's SLP vectoriser off, so a few hand-unrolled accumulators would stay scalar)."""

CACHED = track_shared_math()
"""Whether compiled kernels are cached on disk: only when the cache key covers the shared math
(else every process compiles afresh rather than load stale machine code)."""

_BLOCK_OPTS = dict(fastmath=False, error_model="numpy")
_NJIT = dict(parallel=True, cache=CACHED, nogil=True, **_BLOCK_OPTS)

# --------------------------------------------------------------------------- primitives


@intrinsic
def _bitcast_f32_u32(typingctx: Any, x: Any) -> Any:
    if x != types.float32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bitcast_u32_f32(typingctx: Any, u: Any) -> Any:
    if u != types.uint32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _llvm_fma_f32(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    if not (a == b == c == types.float32):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _f32_to_f16_hw(typingctx: Any, x: Any) -> Any:
    if x != types.float32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _f16_to_f32_hw(typingctx: Any, h: Any) -> Any:
    if h != types.uint16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


def hardware_f16() -> bool:
    """Whether LLVM converts float16 natively here (x86 F16C, or ARM64) for numba's target.

    Then the CPU kernels use those conversions instead of the shared software codec (same
    bits: round to nearest even, quiet NaN keeping the payload's top bits); elsewhere LLVM
    would call a runtime helper that numba's JIT may not find.

    Examples:
        >>> isinstance(hardware_f16(), bool)
        True
    """
    if numba.config.CPU_NAME is not None:  # compiling for another CPU (e.g. a portable cache)
        return False
    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    return bool(llvm.get_host_cpu_features().get("f16c", False))


if hardware_f16():

    @overload(_codec.f32_to_f16, target="cpu", strict=False, inline="never")
    def _f32_to_f16_cpu(x: Any) -> Any:
        return lambda x: np.int64(_f32_to_f16_hw(np.float32(x)))

    @overload(_codec.f16_to_f32, target="cpu", strict=False, inline="never")
    def _f16_to_f32_cpu(h: Any) -> Any:
        return lambda h: _f16_to_f32_hw(np.uint16(h & 0xFFFF))


@overload(_shared.f32_to_bits, target="cpu", strict=False, inline="never")
def _f32_to_bits_cpu(x: Any) -> Any:
    return lambda x: np.int64(_bitcast_f32_u32(np.float32(x)))


@overload(_shared.bits_to_f32, target="cpu", strict=False, inline="never")
def _bits_to_f32_cpu(u: Any) -> Any:
    return lambda u: _bitcast_u32_f32(np.uint32(u & 0xFFFFFFFF))


@overload(_shared.fma32, target="cpu", strict=False, inline="never")
def _fma32_cpu(a: Any, b: Any, c: Any) -> Any:
    return lambda a, b, c: _llvm_fma_f32(np.float32(a), np.float32(b), np.float32(c))


# --------------------------------------------------------------------------- kernels
# Each parallel work item takes slices of one block, so the inner loops index from 0: numba
# then drops its negative-index wraparound and LLVM vectorises them.


@numba.njit(inline="never", **_BLOCK_OPTS)
def _adam_block(
    master: Any, grad: Any, mu: Any, nu: Any, compute: Any, inv: Any, clip: Any, c: tuple
) -> None:  # pragma: no cover - compiled
    for i in range(master.size):
        g = load(grad, i) * inv * clip
        p, m, v = adam_element(load(master, i), g, load(mu, i), load(nu, i), c)
        store(master, i, p)
        store(mu, i, m)
        store(nu, i, v)
        if compute is not None:
            store(compute, i, quantize(master, p))


@numba.njit(**_NJIT)
def adam_kernel(
    master: Any,
    grad: Any,
    mu: Any,
    nu: Any,
    compute: Any,
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
    """Fused unscale + clip + Adam/AdamW + compute cast over 1-D storage arrays, in place."""
    if found_inf[0] != np.float32(0.0):
        return
    c = adam_constants(step[0], lr[0], beta1, beta2, eps, weight_decay, decoupled)
    inv = np.float32(inv_scale[0])
    clip = np.float32(clip_coef[0])
    n = master.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        if compute is None:
            _adam_block(master[lo:hi], grad[lo:hi], mu[lo:hi], nu[lo:hi], None, inv, clip, c)
        else:
            _adam_block(
                master[lo:hi], grad[lo:hi], mu[lo:hi], nu[lo:hi], compute[lo:hi], inv, clip, c
            )
    step[0] += 1


def _slot_kernel(element: Any, constants: Any) -> Any:
    """A parallel kernel for a one-slot optimizer: the same block grid, unscale, clip, skip and
    compute copy as :func:`adam_kernel` around ``element``. (Closures are not cached on disk:
    compiled once per process, at first use.)"""

    @numba.njit(inline="never", **_BLOCK_OPTS)
    def block(master: Any, grad: Any, slot: Any, compute: Any, inv: Any, clip: Any, c: tuple) -> None:
        for i in range(master.size):
            g = load(grad, i) * inv * clip
            p, s, _ = element(load(master, i), g, load(slot, i), np.float32(0.0), c)
            store(master, i, p)
            store(slot, i, s)
            if compute is not None:
                store(compute, i, quantize(master, p))

    @numba.njit(parallel=True, nogil=True, **_BLOCK_OPTS)
    def kernel(master: Any, grad: Any, slot: Any, compute: Any, step: Any, lr: Any, inv_scale: Any,
               clip_coef: Any, found_inf: Any, hyper: tuple) -> None:  # pragma: no cover - compiled
        if found_inf[0] != np.float32(0.0):
            return
        c = constants(step[0], lr[0], hyper)
        inv = np.float32(inv_scale[0])
        clip = np.float32(clip_coef[0])
        n = master.size
        for b in prange((n + BLOCK - 1) // BLOCK):
            lo = b * BLOCK
            hi = min(lo + BLOCK, n)
            if compute is None:
                block(master[lo:hi], grad[lo:hi], slot[lo:hi], None, inv, clip, c)
            else:
                block(master[lo:hi], grad[lo:hi], slot[lo:hi], compute[lo:hi], inv, clip, c)
        step[0] += 1

    return kernel


_SLOT_KERNELS: dict[str, Any] = {}


@numba.njit(inline="never", **_BLOCK_OPTS)
def _sumsq_block(x: Any) -> float:  # pragma: no cover - compiled
    """Sum of squares of one block: :data:`LANES` float64 lanes (lane ``j`` takes the elements
    ``i % LANES == j`` in order), then a fixed pairwise combination."""
    acc = np.zeros(LANES, np.float64)
    n = x.size
    full = n - n % LANES
    for r in range(full // LANES):
        row = x[r * LANES : (r + 1) * LANES]
        for j in range(LANES):  # an elementwise loop over lanes: LLVM vectorises it
            acc[j] += square64(load(row, j))
    for i in range(full, n):
        acc[i - full] += square64(load(x, i))
    width = LANES // 2
    while width > 0:
        for j in range(width):
            acc[j] += acc[j + width]
        width //= 2
    return acc[0]


@numba.njit(**_NJIT)
def sumsq_kernel(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """``out[:] = [found_inf, sum(x**2)]`` with per-block float64 partials in fixed order."""
    n = x.size
    nblocks = (n + BLOCK - 1) // BLOCK
    partial = np.empty(nblocks, np.float64)
    for b in prange(nblocks):
        partial[b] = _sumsq_block(x[b * BLOCK : min(b * BLOCK + BLOCK, n)])
    total = 0.0
    for b in range(nblocks):
        total += partial[b]
    # Squares of finite float32 values cannot overflow float64, so the sum is finite
    # exactly when every element is.
    out[0] = np.float32(0.0) if math.isfinite(total) else np.float32(1.0)
    out[1] = np.float32(total)


@numba.njit(inline="never", **_BLOCK_OPTS)
def _convert_block(src: Any, dst: Any) -> None:  # pragma: no cover - compiled
    for i in range(src.size):
        store(dst, i, load(src, i))


@numba.njit(cache=CACHED, **_BLOCK_OPTS)
def convert_kernel(src: Any, dst: Any) -> None:  # pragma: no cover - compiled
    """``dst[i] = src[i]`` between storage formats (round to nearest even); serial, for tests."""
    _convert_block(src, dst)


@numba.njit(inline="never", **_BLOCK_OPTS)
def _accumulate_block(out: Any, x: Any, lo: int, hi: int, overwrite: bool,
                      scale: Any) -> None:  # pragma: no cover - compiled
    if overwrite:
        for i in range(lo, hi):
            out[i] = load(x, i) * scale
    else:
        for i in range(lo, hi):
            out[i] += load(x, i) * scale


@numba.njit(**_NJIT)
def accumulate_kernel(out: Any, x: Any, overwrite: bool, scale: Any) -> None:  # pragma: no cover - compiled
    """``out[i] += x[i] * scale`` (``=`` with ``overwrite``) into float32 ``out``, ``x`` in any
    storage format, ``scale`` a float32."""
    n = out.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        _accumulate_block(out, x, lo, min(n, lo + BLOCK), overwrite, scale)


# --------------------------------------------------------------------------- torch entry points


@contextlib.contextmanager
def torch_threads() -> Iterator[None]:
    """Runs numba with torch's intra-op thread count (capped by numba's pool), and leaves
    torch's count as it was: numba's OpenMP layer shares the OpenMP runtime with torch, and its
    first parallel region raises the process-wide thread count (which made torch's own kernels
    change their reduction order, and oversubscribed the cores, after the first optimizer step).

    Examples:
        >>> before = torch.get_num_threads()
        >>> with torch_threads():
        ...     numba.get_num_threads() <= numba.config.NUMBA_NUM_THREADS
        True
        >>> torch.get_num_threads() == before
        True
    """
    before = torch.get_num_threads()
    numba.set_num_threads(max(1, min(before, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def fused_adam(vectors: AdamVectors, scalars: StepScalars, hyper: AdamHyper) -> None:
    """Runs :func:`adam_kernel` on CPU tensors (arguments as in ``zfunc_kernels.fused_adam``).

    Examples:
        >>> p, g = torch.ones(3), torch.full((3,), 2.0)
        >>> m, v, s = torch.zeros(3), torch.zeros(3), torch.tensor(0)
        >>> one, zero = torch.tensor(1.0), torch.tensor(0.0)
        >>> fused_adam(AdamVectors(p, g, m, v), StepScalars(s, torch.tensor(0.5), one, one, zero),
        ...            AdamHyper(0.9, 0.999, 1e-8, 0.0))
        >>> p.tolist(), int(s)
        ([0.5, 0.5, 0.5], 1)
    """
    arrays = [None if t is None else as_numpy(t) for t in (*vectors, *scalars)]
    with torch_threads():
        adam_kernel(*arrays, *hyper)


def fused_slot_update(kind: str, vectors: SlotVectors, scalars: StepScalars, hyper: tuple) -> None:
    """Runs the one-slot optimizer ``kind`` on CPU tensors (see ``zfunc_kernels.fused_sgd``).

    Examples:
        >>> p, g, b, s = torch.ones(3), torch.full((3,), 2.0), torch.zeros(3), torch.tensor(0)
        >>> one, zero = torch.tensor(1.0), torch.tensor(0.0)
        >>> fused_slot_update("sgd", SlotVectors(p, g, b), StepScalars(s, torch.tensor(0.5), one, one, zero),
        ...                   (0.9, 0.0, 0.0, 0.0))
        >>> p.tolist(), b.tolist(), int(s)
        ([0.0, 0.0, 0.0], [2.0, 2.0, 2.0], 1)
    """
    kernel = _SLOT_KERNELS.get(kind)
    if kernel is None:
        kernel = _SLOT_KERNELS[kind] = _slot_kernel(*SLOT_MATH[kind])
    arrays = [None if t is None else as_numpy(t) for t in (*vectors, *scalars)]
    master, grad, slot, compute, *rest = arrays
    with torch_threads():
        kernel(master, grad, slot, compute, *rest, tuple(float(h) for h in hyper))


def accumulate(out: torch.Tensor, x: torch.Tensor, overwrite: bool, scale: float = 1.0) -> None:
    """Runs :func:`accumulate_kernel` on CPU tensors (see ``zfunc_kernels.accumulate``).

    Examples:
        >>> out = torch.ones(2)
        >>> accumulate(out, torch.tensor([0.5, 2.0], dtype=torch.bfloat16), False); out.tolist()
        [1.5, 3.0]
    """
    with torch_threads():
        accumulate_kernel(as_numpy(out), as_numpy(x), overwrite, np.float32(scale))


def overflow_sumsq(x: torch.Tensor, out: torch.Tensor) -> None:
    """Runs :func:`sumsq_kernel` on a CPU tensor, writing ``[found_inf, sumsq]`` into ``out``.

    Examples:
        >>> out = torch.empty(2)
        >>> overflow_sumsq(torch.tensor([3.0, 4.0], dtype=torch.bfloat16), out); out.tolist()
        [0.0, 25.0]
    """
    with torch_threads():
        sumsq_kernel(as_numpy(x), as_numpy(out))
