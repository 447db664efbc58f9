"""The one adapter between torch tensors and kernel arrays.

Kernels see 1-D arrays in the storage convention of :mod:`zfunc_kernels._codec`: float32 and
int64 as themselves, bfloat16 as ``int16`` bits, float16 as ``uint16`` bits; 0-dim tensors
become 1-element arrays. CPU tensors (the CPU kernels and the CUDA simulator) become zero-copy
numpy views; CUDA tensors become numba device arrays through ``__cuda_array_interface__``,
imported without a host synchronisation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_BITS = {torch.bfloat16: np.int16, torch.float16: np.uint16}


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.reshape(1) if t.dim() == 0 else t


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Returns a zero-copy numpy view of a CPU tensor in the kernel storage convention.

    Args:
        t: A contiguous CPU tensor.

    Returns:
        The view; writes to it change ``t``.

    Examples:
        >>> as_numpy(torch.tensor([1.5], dtype=torch.bfloat16)).tolist()
        [16320]
        >>> as_numpy(torch.tensor([1.5], dtype=torch.float16)).tolist()
        [15872]
        >>> as_numpy(torch.tensor(3)).tolist()
        [3]
    """
    t = _flat(t)
    bits = _BITS.get(t.dtype)
    if bits is None:
        return t.numpy()
    return t.view(torch.int16).numpy().view(bits)


def as_device_array(t: torch.Tensor) -> Any:
    """Returns a numba device array viewing a CUDA tensor in the kernel storage convention.

    The import passes ``sync=False``: kernels run on torch's current stream (see
    :func:`torch_stream`), so no host synchronisation is needed.

    Args:
        t: A contiguous CUDA tensor.

    Returns:
        A ``numba.cuda`` device array sharing ``t``'s memory.
    """
    from numba import cuda

    t = _flat(t)
    bits = _BITS.get(t.dtype)
    if bits is None:
        return cuda.as_cuda_array(t, sync=False)
    return cuda.as_cuda_array(t.view(torch.int16), sync=False).view(bits)


def torch_stream(device: torch.device) -> Any:
    """Returns torch's current stream on ``device`` wrapped as a numba stream.

    Args:
        device: A CUDA device.

    Returns:
        ``numba.cuda.external_stream`` of ``torch.cuda.current_stream(device)``.
    """
    from numba import cuda

    return cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
