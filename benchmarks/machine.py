"""The CPU a benchmark ran on, for the header of its output: model name and the vector flags
that decide kernel speed (AVX2, AVX-512, native bf16, AMX).

    >>> isinstance(cpu_line(), str)
    True
"""

from __future__ import annotations

import os

_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")


def cpu_line() -> str:
    """``"<model>; flags avx2 fma ... (no avx512f ...)"`` from ``/proc/cpuinfo`` (Linux)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        return f"{model} ({os.cpu_count()} CPUs)"
    have = [f for f in _FLAGS if f in flags]
    lack = [f for f in _FLAGS if f not in flags]
    return f"{model}; {' '.join(have) or 'none of ' + ' '.join(_FLAGS)}" + (f" (no {' '.join(lack)})" if lack else "")
