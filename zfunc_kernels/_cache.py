"""Keeps numba's on-disk kernel cache honest about the shared math.

numba keys a cached kernel on the content of the file that defines it. The kernels in
``_cpu.py`` and ``_cuda.py`` compile in functions from ``_shared.py``, ``_codec.py`` and
``_math.py``, so an edit there alone would load stale machine code. :func:`track_shared_math`
puts locators in front of numba's defaults that, for this package's files only, add a digest
of those files to the cache key. This extends numba's internal caching classes; if that API
ever changes, :func:`track_shared_math` returns False and the kernels are compiled with
``cache=False`` (slower start, never stale code). A test checks that tracking is active.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_SHARED = ("_shared.py", "_codec.py", "_math.py")


def _digest() -> str:
    h = hashlib.sha256()
    for name in _SHARED:
        with open(os.path.join(_HERE, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _tracking(base: type) -> type:
    class Locator(base):  # type: ignore[misc,valid-type]
        zfunc_tracks_math = True

        def get_source_stamp(self) -> Any:
            return (super().get_source_stamp(), _digest())

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Any:
            if os.path.dirname(os.path.abspath(py_file)) != _HERE:
                return None
            return super().from_function(py_func, py_file)

    Locator.__name__ = Locator.__qualname__ = f"ZfuncMath{base.__name__}"
    return Locator


def track_shared_math(caching: Any = None) -> bool:
    """Makes cached kernels of this package depend on the shared math files too (idempotent).

    Call before the ``cache=True`` kernels are defined.

    Args:
        caching: The caching module to extend; ``None`` for ``numba.core.caching`` (numba-cuda
            passes its own ``numba.cuda.core.caching``).

    Returns:
        Whether the tracking locators are installed.

    Examples:
        >>> track_shared_math()
        True
    """
    try:
        if caching is None:
            from numba.core import caching
        impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
        classes = impl._locator_classes
        if any(getattr(c, "zfunc_tracks_math", False) for c in classes):
            return True
        names = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
        bases = [getattr(caching, n, None) or getattr(caching, "_" + n) for n in names]
        classes[:0] = [_tracking(b) for b in bases]
        return True
    except (ImportError, AttributeError, TypeError):
        return False
