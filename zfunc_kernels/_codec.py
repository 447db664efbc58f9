"""bfloat16 and float16 storage: bit-exact codecs and typed element access.

numpy has no bfloat16 and numba's CPU target has no float16, so 16-bit arrays reach the
kernels as raw bits and the integer type tags the format: ``int16`` holds bfloat16 bits,
``uint16`` holds float16 bits, float32 arrays are used as they are. :func:`load`,
:func:`store` and :func:`quantize` dispatch on that dtype when a kernel is compiled. Encoding
rounds to nearest even; NaN stays NaN (quiet, sign and top payload bits kept). On CPUs with
hardware float16 conversion, ``_cpu.py`` swaps in LLVM's (bit-identical) conversions for the
two float16 codecs; the tests check both against torch and against each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zfunc_kernels._shared import bits_to_f32, f32_to_bits, shared, shared_overload

F16_MAGIC = np.float32(2.0**112)  # rescales float16 bits placed in a float32 exponent field
F16_HALF = np.float32(0.5)  # its float32 ulp is float16's subnormal spacing, 2**-24


@shared
def bf16_to_f32(h: int) -> Any:
    """Decodes bfloat16 bits to float32 (exact).

    Args:
        h: bfloat16 bits (any integer; the low 16 bits are used).

    Returns:
        The float32 value.

    Examples:
        >>> float(bf16_to_f32(0x3FC0))
        1.5
    """
    return bits_to_f32((h & 0xFFFF) << 16)


@shared
def f32_to_bf16(x: Any) -> int:
    """Encodes float32 to bfloat16 bits, rounding to nearest even; NaN stays NaN.

    Args:
        x: A float32.

    Returns:
        bfloat16 bits in ``[0, 2**16)``.

    Examples:
        >>> hex(f32_to_bf16(np.float32(1.0 + 2**-8)))  # a tie: rounds to even
        '0x3f80'
    """
    u = f32_to_bits(x)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return ((u >> 16) | 0x40) & 0xFFFF
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


@shared
def f16_to_f32(h: int) -> Any:
    """Decodes float16 bits to float32 (exact, subnormals included).

    The exponent and mantissa are moved into float32 position and rescaled by ``2**112``
    (exact, subnormals included); the all-ones exponent (Inf/NaN) is widened instead, and NaN
    made quiet, as hardware conversions do.

    Args:
        h: float16 bits (any integer; the low 16 bits are used).

    Returns:
        The float32 value.

    Examples:
        >>> float(f16_to_f32(0x7BFF)), float(f16_to_f32(0x0001)) == 2.0**-24
        (65504.0, True)
    """
    h = h & 0xFFFF
    u = ((h & 0x8000) << 16) | ((h & 0x7FFF) << 13)
    if (h & 0x7C00) == 0x7C00:  # Inf or NaN: widen the exponent; NaN comes out quiet
        if (h & 0x3FF) != 0:
            u = u | 0x400000
        return bits_to_f32(u | 0x7F800000)
    return bits_to_f32(u) * F16_MAGIC


@shared
def f32_to_f16(x: Any) -> int:
    """Encodes float32 to float16 bits, rounding to nearest even.

    Overflow goes to Inf, NaN to a quiet NaN keeping the top payload bits. Results below
    ``2**-14`` (float16 subnormals and zero) come from one float32 addition of ``0.5``, whose
    own rounding to a multiple of ``2**-24`` is exactly float16's subnormal rounding. Every
    case is computed and the result selected, so the compiled loop stays branch-free.

    Args:
        x: A float32.

    Returns:
        float16 bits in ``[0, 2**16)``.

    Examples:
        >>> hex(f32_to_f16(np.float32(65519.0))), hex(f32_to_f16(np.float32(65520.0)))
        ('0x7bff', '0x7c00')
        >>> hex(f32_to_f16(np.float32(2.0**-25))), hex(f32_to_f16(np.float32(-3 * 2.0**-26)))
        ('0x0', '0x8001')
    """
    u = f32_to_bits(x)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    r = a - 0x38000000  # exponent bias 127 -> 15
    normal = (r + 0xFFF + ((r >> 13) & 1)) >> 13
    tiny = a if a < 0x38800000 else 0  # (keeps NaN out of the addition)
    subnormal = f32_to_bits(bits_to_f32(tiny) + F16_HALF) - 0x3F000000
    h = normal if a >= 0x38800000 else subnormal
    h = 0x7C00 if a >= 0x477FF000 else h  # >= 65520 rounds to Inf
    h = (0x7E00 | ((a >> 13) & 0x3FF)) if a > 0x7F800000 else h
    return sign | h


# --------------------------------------------------------------------------- storage access


def _load_f32(a: Any, i: int) -> Any:
    return np.float32(a[i])


def _load_bf16(a: Any, i: int) -> Any:
    return bf16_to_f32(int(a[i]))


def _load_f16(a: Any, i: int) -> Any:
    return f16_to_f32(int(a[i]))


def _store_f32(a: Any, i: int, x: Any) -> None:
    a[i] = x


def _store_bf16(a: Any, i: int, x: Any) -> None:
    h = f32_to_bf16(x)
    a[i] = h - ((h & 0x8000) << 1)  # int16 storage: two's complement


def _store_f16(a: Any, i: int, x: Any) -> None:
    a[i] = f32_to_f16(x)


def _quantize_f32(a: Any, x: Any) -> Any:
    return x


def _quantize_bf16(a: Any, x: Any) -> Any:
    return bf16_to_f32(f32_to_bf16(x))


def _quantize_f16(a: Any, x: Any) -> Any:
    return f16_to_f32(f32_to_f16(x))


def _pick(dtype: Any, f32: Any, bf16: Any, f16: Any) -> Any:
    """Chooses the implementation for a numpy or numba dtype (tag convention above)."""
    name = str(dtype)
    return {"float32": f32, "int16": bf16, "uint16": f16}.get(name)


def load(a: Any, i: int) -> Any:
    """Reads element ``i`` of a storage array as float32.

    Args:
        a: float32 array, or int16 (bfloat16 bits) or uint16 (float16 bits) array.
        i: Index.

    Returns:
        The element as float32.

    Examples:
        >>> float(load(np.array([0x3FC0], np.int16), 0))
        1.5
    """
    return _pick(a.dtype, _load_f32, _load_bf16, _load_f16)(a, i)


def store(a: Any, i: int, x: Any) -> None:
    """Writes float32 ``x`` into element ``i`` of a storage array, rounding to its format.

    Args:
        a: float32 array, or int16 (bfloat16 bits) or uint16 (float16 bits) array.
        i: Index.
        x: float32 value.

    Examples:
        >>> a = np.zeros(1, np.uint16)
        >>> store(a, 0, np.float32(-2.0)); hex(int(a[0]))
        '0xc000'
    """
    _pick(a.dtype, _store_f32, _store_bf16, _store_f16)(a, i, x)


def quantize(a: Any, x: Any) -> Any:
    """Returns float32 ``x`` rounded to the storage format of array ``a`` (as float32).

    Args:
        a: Storage array whose dtype selects the format.
        x: float32 value.

    Returns:
        The value :func:`store` would write, read back.

    Examples:
        >>> float(quantize(np.zeros(1, np.int16), np.float32(1.0 + 2**-7 + 2**-9)))
        1.0078125
    """
    return _pick(a.dtype, _quantize_f32, _quantize_bf16, _quantize_f16)(a, x)


@shared_overload(load, inline="never")
def _load_impl(a: Any, i: Any) -> Any:
    return _pick(a.dtype, _load_f32, _load_bf16, _load_f16)


@shared_overload(store, inline="never")
def _store_impl(a: Any, i: Any, x: Any) -> Any:
    return _pick(a.dtype, _store_f32, _store_bf16, _store_f16)


@shared_overload(quantize, inline="never")
def _quantize_impl(a: Any, x: Any) -> Any:
    return _pick(a.dtype, _quantize_f32, _quantize_bf16, _quantize_f16)
