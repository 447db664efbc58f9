"""DeepSpeed's device helpers, as the libraries built on it call them: ``get_accelerator()``
(which device this process computes on), ``move_to_device`` and
``clone_tensors_for_torch_save``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Accelerator", "clone_tensors_for_torch_save", "get_accelerator", "move_to_device"]


class Accelerator:
    """The part of DeepSpeed's accelerator interface that is about this process's device: CUDA
    when torch sees one, else the CPU.

    Examples:
        >>> from zfunc.compat.accelerator import get_accelerator
        >>> acc = get_accelerator()
        >>> acc.device_name() in ("cpu", "cuda"), acc.communication_backend_name() in ("gloo", "nccl")
        (True, True)
    """

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return self._name == "cuda"


def get_accelerator() -> Accelerator:
    """DeepSpeed's ``get_accelerator()``."""
    return Accelerator()


def move_to_device(item: Any, device: torch.device | str) -> Any:
    """Tensors anywhere in lists, tuples and dicts moved to ``device``; other values as they are.

    Examples:
        >>> import torch
        >>> move_to_device({"a": [torch.ones(1)], "b": 3}, "cpu")["a"][0].device
        device(type='cpu')
    """
    if torch.is_tensor(item):
        return item.to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device) for k, v in item.items()}
    return item


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """Tensors anywhere in lists, tuples and dicts cloned onto ``device`` (so a saved tensor holds
    only its own elements, not the buffer it views).

    Examples:
        >>> import torch
        >>> w = torch.arange(4.0)
        >>> out = clone_tensors_for_torch_save({"a": w[:2], "b": w[:2]})
        >>> out["a"].untyped_storage().nbytes(), out["a"] is out["b"]
        (8, False)
    """
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
