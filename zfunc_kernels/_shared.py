"""Functions written once for every kernel target, and the primitives that cannot be.

:func:`shared` registers a plain Python function as its own numba overload, so the same
source is

* compiled by ``numba.njit`` when a CPU kernel calls it,
* compiled by ``numba.cuda.jit`` when a CUDA kernel calls it,
* run as ordinary Python by numba's CUDA simulator.

Three primitives cannot be written portably: reinterpreting float32 bits (:func:`f32_to_bits`,
:func:`bits_to_f32`) and the fused multiply-add (:func:`fma32`). Their Python bodies here are
what the simulator runs; ``_cpu.py`` and ``_cuda.py`` register target-specific overloads.
Integer bit manipulation uses 64-bit (Python) integers and masks, so it behaves the same in
compiled code and in the simulator. Float arithmetic is float32 (``np.float32`` operands only:
a Python float literal would turn numba arithmetic into float64), no fast-math.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, TypeVar

import numpy as np
from numba.core.extending import overload

F = TypeVar("F", bound=Callable[..., Any])

_OVERLOADS: list[tuple[Callable[..., Any], Callable[..., Any], dict[str, Any]]] = []


def shared_overload(func: Callable[..., Any], **options: Any) -> Callable[[F], F]:
    """``numba.core.extending.overload`` (generic target) that also records the overload, so
    :func:`register_with` can repeat it for another extension API.

    Args:
        func: The plain Python function being given a numba implementation.
        **options: ``overload`` options, such as ``inline``.

    Returns:
        A decorator for the typing function.

    Examples:
        >>> def half(x):
        ...     return x / 2
        >>> typer = shared_overload(half)(lambda x: half)
        >>> half(3.0)
        1.5
    """

    def decorate(typer: F) -> F:
        _OVERLOADS.append((func, typer, options))
        overload(func, strict=False, **options)(typer)
        return typer

    return decorate


def register_with(overload_api: Callable[..., Any]) -> None:
    """Registers every :func:`shared_overload` so far with another numba extension API.

    NVIDIA's ``numba-cuda`` types kernels with its own registry, so ``_cuda.py`` passes its
    ``numba.cuda.extending.overload`` here; numba's built-in targets need nothing.

    Args:
        overload_api: An ``overload(func, strict=..., inline=...)`` decorator factory.

    Examples:
        >>> seen = []
        >>> register_with(lambda func, **kw: (lambda typer: seen.append(func.__name__)))
        >>> "sqrt32" in seen
        True
    """
    for func, typer, options in _OVERLOADS:
        overload_api(func, strict=False, **options)(typer)


def shared(fn: F | None = None, *, inline: str = "never") -> Any:
    """Registers ``fn`` as its own numba implementation on every target.

    Args:
        fn: A plain Python function using only numba-supported constructs.
        inline: numba's IR inlining (``"always"``), or (default) a call that LLVM inlines;
            IR inlining compiles slower and makes numba warn on functions with branches.

    Returns:
        ``fn`` itself, now also callable from ``njit`` and ``cuda.jit`` code.

    Examples:
        >>> @shared
        ... def twice(x):
        ...     return x + x
        >>> twice(np.float32(1.5))
        np.float32(3.0)
    """
    if fn is None:
        return lambda f: shared(f, inline=inline)

    def typer(*args: Any) -> Any:
        return fn

    typer.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    shared_overload(fn, inline=inline)(typer)
    return fn


# --------------------------------------------------------------------------- primitives


def f32_to_bits(x: Any) -> int:
    """Returns the IEEE-754 bit pattern of ``float32(x)`` as a non-negative integer.

    Args:
        x: A float.

    Returns:
        The 32-bit pattern, in ``[0, 2**32)``.

    Examples:
        >>> hex(f32_to_bits(np.float32(1.0)))
        '0x3f800000'
    """
    return int(np.float32(x).view(np.uint32))


def bits_to_f32(u: int) -> Any:
    """Returns the float32 whose bit pattern is ``u`` (only the low 32 bits are used).

    Args:
        u: An integer bit pattern.

    Returns:
        A float32.

    Examples:
        >>> float(bits_to_f32(0xC0000000))
        -2.0
    """
    return np.uint32(u & 0xFFFFFFFF).view(np.float32)


def fma32(a: Any, b: Any, c: Any) -> Any:
    """Returns ``a * b + c`` for float32 operands with a single rounding to float32.

    The simulator body computes the exact product in float64, adds with round-to-odd
    (exact error by TwoSum), then rounds once to float32, which is correctly rounded.

    Args:
        a: float32 factor.
        b: float32 factor.
        c: float32 addend.

    Returns:
        The fused result as float32.

    Examples:
        >>> a = np.float32(1 + 2**-12)
        >>> float(fma32(a, a, np.float32(-1))) == 2**-11 + 2**-24
        True
    """
    p = float(a) * float(b)  # exact: 24-bit by 24-bit significands
    cc = float(c)
    s = p + cc
    if not math.isfinite(s):
        return np.float32(s)
    bv = s - p
    err = (p - (s - bv)) + (cc - bv)
    if err != 0.0 and int(np.float64(s).view(np.uint64)) & 1 == 0:
        s = math.nextafter(s, math.inf if err > 0.0 else -math.inf)
    return np.float32(s)


def sqrt32(x: Any) -> Any:
    """Returns the correctly rounded float32 square root.

    Args:
        x: A float32.

    Returns:
        ``sqrt(x)`` as float32.

    Examples:
        >>> float(sqrt32(np.float32(2.25)))
        1.5
    """
    return np.sqrt(np.float32(x))


@shared_overload(sqrt32, inline="never")
def _sqrt32_impl(x: Any) -> Callable[[Any], Any]:
    def impl(x: Any) -> Any:
        return math.sqrt(np.float32(x))

    return impl
