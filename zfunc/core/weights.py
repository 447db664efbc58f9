"""Pretrained weights read straight into the shards: safetensors (one file or a Hugging Face index
of shards) and torch state-dict files.

`zfunc.init(model, cfg, weights=path)` reads, for each parameter, only the elements this rank
keeps (`read_range`): a safetensors file opens lazily and a range of a parameter reads only the
rows that hold it; a torch file is memory-mapped. Nothing larger than one parameter's rows is
ever read at once.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from zfunc.errors import ConfigError

__all__ = ["Weights", "open_weights"]

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE = ("model.safetensors", "pytorch_model.bin", "model.pt")


class Weights:
    """Named tensors in one or more files, read piece by piece. ``rename`` maps a model's
    parameter name to its name in the files (a dict, or a function; names it leaves out are
    looked up as they are)."""

    def __init__(self, files: dict[str, Path], rename: Mapping[str, str] | Callable[[str], str] | None = None):
        self.files = files  # tensor name in the files -> the file holding it
        self._rename = rename
        self._open: dict[Path, Any] = {}

    def key(self, name: str) -> str:
        """The files' name for the model's parameter ``name``."""
        if self._rename is None:
            return name
        if callable(self._rename):
            return self._rename(name)
        return self._rename.get(name, name)

    def __contains__(self, name: str) -> bool:
        return self.key(name) in self.files

    def _handle(self, path: Path) -> Any:
        if path not in self._open:
            self._open[path] = _opened(path)
        return self._open[path]

    def shape(self, name: str) -> tuple[int, ...]:
        key = self.key(name)
        handle = self._handle(self.files[key])
        if isinstance(handle, dict):
            return tuple(handle[key].shape)
        return tuple(handle.get_slice(key).get_shape())

    def read_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the parameter ``name`` flattened, reading only the rows
        (first-dimension entries) that hold them.

        Examples:
            >>> import tempfile, torch
            >>> from safetensors.torch import save_file
            >>> d = tempfile.mkdtemp()
            >>> save_file({"w": torch.arange(12.0).reshape(4, 3)}, f"{d}/model.safetensors")
            >>> open_weights(d).read_range("w", 4, 8).tolist()
            [4.0, 5.0, 6.0, 7.0]
        """
        key = self.key(name)
        handle = self._handle(self.files[key])
        shape = self.shape(name)
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        if not shape:  # a scalar
            whole = handle[key] if isinstance(handle, dict) else handle.get_tensor(key)
            return whole.reshape(1)[start:stop]
        first, last = start // row, -(-stop // row)
        try:
            rows = handle[key][first:last] if isinstance(handle, dict) else handle.get_slice(key)[first:last]
        except Exception as e:  # noqa: BLE001 - a damaged file, whatever its reader raises
            raise ConfigError(f"weights: {str(self.files[key])!r}: reading {key!r} failed ({e}); the file is damaged "
                              "or truncated") from e
        flat = rows.reshape(-1)
        return flat[start - first * row:stop - first * row]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""
        return self.read_range(name, 0, math.prod(self.shape(name))).reshape(self.shape(name))

    def names(self) -> list[str]:
        return list(self.files)


def _opened(path: Path) -> Any:
    """A lazily read safetensors file, or a memory-mapped torch state dict."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            return safe_open(str(path), framework="pt")
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file, whatever its reader raises
        raise ConfigError(f"weights: {str(path)!r} is unreadable ({type(e).__name__}: {str(e)[:200]}); the file is "
                          "damaged or truncated, or not a safetensors/torch file") from e


def open_weights(path: str | os.PathLike, rename: Mapping[str, str] | Callable[[str], str] | None = None) -> Weights:
    """The weights at ``path``: a ``.safetensors`` file, a torch file (``.bin``, ``.pt``,
    ``.pth``), a Hugging Face index (``*.index.json``) naming shard files, or a directory holding
    one of ``model.safetensors.index.json``, ``model.safetensors``, ``pytorch_model.bin.index.json``,
    ``pytorch_model.bin``, ``model.pt``.

    Raises:
        ConfigError: nothing readable at ``path`` (naming what was looked for).

    Examples:
        >>> import tempfile, torch
        >>> from safetensors.torch import save_file
        >>> d = tempfile.mkdtemp()
        >>> save_file({"a": torch.zeros(2)}, f"{d}/one.safetensors")
        >>> save_file({"b": torch.ones(3)}, f"{d}/two.safetensors")
        >>> import json, pathlib
        >>> _ = pathlib.Path(f"{d}/model.safetensors.index.json").write_text(
        ...     json.dumps({"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}))
        >>> w = open_weights(d)
        >>> sorted(w.names()), w.read("b").tolist()
        (['a', 'b'], [1.0, 1.0, 1.0])
    """
    p = Path(path)
    if p.is_dir():
        found = next((p / n for n in (*_INDEXES, *_SINGLE) if (p / n).exists()), None)
        if found is None:
            raise ConfigError(f"weights: {str(p)!r} holds none of {[*_INDEXES, *_SINGLE]}; pass the file itself")
        p = found
    if not p.exists():
        raise ConfigError(f"weights: {str(p)!r} does not exist")
    if p.name.endswith(".index.json"):
        index = json.loads(p.read_text())
        if "weight_map" not in index:
            raise ConfigError(f"weights: {str(p)!r} has no 'weight_map' (not a Hugging Face shard index)")
        files = {k: p.parent / v for k, v in index["weight_map"].items()}
        w = Weights(files, rename)
        for f in sorted(set(files.values())):
            if not f.exists():
                raise ConfigError(f"weights: {str(f)!r}, a shard {p.name} names, does not exist")
            w._open[f] = _opened(f)  # every shard readable before anything is loaded
        return w
    if p.suffix == ".safetensors":
        w = Weights({}, rename)
        w._open[p] = _opened(p)
        w.files = dict.fromkeys(w._open[p].keys(), p)
        return w
    if p.suffix in (".bin", ".pt", ".pth"):
        sd = _opened(p)
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise ConfigError(f"weights: {str(p)!r} is not a state dict of tensors (a zfunc or DeepSpeed "
                              "checkpoint loads with zfunc.load)")
        w = Weights(dict.fromkeys(sd, p), rename)
        w._open[p] = sd
        return w
    raise ConfigError(f"weights: {str(p)!r}: expected .safetensors, .bin, .pt, .pth, an *.index.json or a directory")
