"""bfloat16 gradients into float32 buffers, without a float32 copy of them first.

Backward delivers gradients in the compute dtype; the accumulator and the reduce are float32
by default. torch widens bfloat16 on the CPU several times slower than it adds float32 (one
thread, 16.8M elements: 33 ms to widen, 36 ms for a mixed add, against 12 ms for
`zfunc_kernels.accumulate`), so large CPU bfloat16 buffers go through that kernel; everything
else is torch's own ``add_``/``to``.
"""

from __future__ import annotations

import torch

import zfunc_kernels

__all__ = ["add_into", "copy_into", "widened"]

_MIN = 1 << 12  # elements: below this the kernel call costs more than it saves


def _kernel(out: torch.Tensor, x: torch.Tensor) -> bool:
    return (out.dtype == torch.float32 and x.dtype == torch.bfloat16 and out.device.type == "cpu"
            and x.device.type == "cpu" and out.dim() == 1 and x.dim() == 1 and out.is_contiguous()
            and x.is_contiguous() and out.numel() == x.numel() >= _MIN)


def add_into(out: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``out += x * scale`` in place (``x`` widened to ``out``'s dtype as it is added); returns
    ``out``.

    Examples:
        >>> out = torch.ones(2)
        >>> add_into(out, torch.tensor([0.5, 2.0], dtype=torch.bfloat16)).tolist()
        [1.5, 3.0]
        >>> add_into(out, torch.tensor([1.0, 2.0]), scale=0.5).tolist()
        [2.0, 4.0]
    """
    if _kernel(out, x):
        return zfunc_kernels.accumulate(out, x, scale=scale)
    return out.add_(x) if scale == 1.0 else out.add_(x, alpha=scale)


def copy_into(out: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``out[:] = x * scale`` (``x`` widened to ``out``'s dtype first); returns ``out``.

    Examples:
        >>> out = torch.zeros(2)
        >>> copy_into(out, torch.tensor([0.5, 2.0], dtype=torch.bfloat16)).tolist()
        [0.5, 2.0]
        >>> copy_into(out, torch.tensor([0.5, 2.0]), scale=0.5).tolist()
        [0.25, 1.0]
    """
    if _kernel(out, x):
        return zfunc_kernels.accumulate(out, x, overwrite=True, scale=scale)
    if scale == 1.0:
        return out.copy_(x)
    if out.dtype == x.dtype:
        return torch.mul(x, scale, out=out)
    if out.element_size() < x.element_size():  # narrowing: scaled in x's precision, rounded once
        return out.copy_(x * scale)
    return out.copy_(x).mul_(scale)


def widened(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor holding ``x`` in ``dtype`` (a copy even when the dtype is ``x``'s).

    Examples:
        >>> x = torch.tensor([0.5, 2.0], dtype=torch.bfloat16)
        >>> y = widened(x, torch.float32)
        >>> y.dtype, y.tolist()
        (torch.float32, [0.5, 2.0])
    """
    return copy_into(torch.empty(x.shape, dtype=dtype, device=x.device), x)
