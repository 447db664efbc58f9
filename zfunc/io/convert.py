"""Consolidated weights from a checkpoint, streamed: ``python -m zfunc.convert CHECKPOINT OUT``.

DeepSpeed's ``zero_to_fp32.py``, for zfunc and DeepSpeed checkpoints: the full parameters (the fp32 master
weights, or ``--dtype bf16``/``fp16``), frozen parameters and buffers, as one safetensors file or
as shards with a Hugging Face index (``--max-shard-size``). Parameters are read and written one
at a time: safetensors' header is written first from the shapes the checkpoint records, then
each tensor's bytes, so the peak memory is one parameter, not the model.

    python -m zfunc.convert runs/ckpt model.safetensors
    python -m zfunc.convert runs/ckpt out_dir --dtype bf16 --max-shard-size 2GB
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from zfunc.errors import CheckpointError
from zfunc.io.checkpoint import exists, locate, read_checked, read_meta, stored_pieces
from zfunc.io.deepspeed_checkpoint import is_deepspeed_checkpoint, read_deepspeed

__all__ = ["Entry", "checkpoint_entries", "write_safetensors", "convert", "main"]

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Entry = tuple[str, tuple[int, ...], torch.dtype]  # a tensor to write: name, shape, dtype


def write_safetensors(path: str | os.PathLike, entries: Sequence[Entry], read: Callable[[str], torch.Tensor],
                      metadata: dict[str, str] | None = None, done: Callable[[int], None] | None = None) -> str:
    """Write ``entries`` to the safetensors file ``path``, calling ``read(name)`` for one tensor
    at a time (its bytes go to the file before the next is read). ``done(nbytes)`` after each.

    Examples:
        >>> import tempfile, torch
        >>> from safetensors.torch import load_file
        >>> f = tempfile.mkdtemp() + "/w.safetensors"
        >>> values = {"a": torch.arange(3.0), "b": torch.ones(2, 2, dtype=torch.bfloat16)}
        >>> _ = write_safetensors(f, [(n, tuple(t.shape), t.dtype) for n, t in values.items()], values.get)
        >>> {n: t.tolist() for n, t in load_file(f).items()} == {n: t.tolist() for n, t in values.items()}
        True
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    at = 0
    for name, shape, dtype in entries:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, dtype in entries:
            t = read(name).detach().to("cpu", dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{name}: read shape {list(t.shape)}, the header says {list(shape)}")
            data = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""  # no copy
            f.write(data)
            if done is not None:
                done(len(data))
        f.flush()
        os.fsync(f.fileno())
    return os.fspath(path)


def checkpoint_entries(path: str | os.PathLike) -> tuple[list[Entry], Callable[[str], torch.Tensor]]:
    """The tensors of a zfunc checkpoint (trainable parameters' master weights, in the recorded
    order, then frozen parameters and buffers) and a function reading one of them in full. A
    DeepSpeed ZeRO checkpoint directory works too: its fp32 masters, assembled one parameter at
    a time from the memory-mapped rank files (`zfunc.io.deepspeed_checkpoint`)."""
    if not exists(path) and is_deepspeed_checkpoint(path):
        ck = read_deepspeed(path)
        held = {**ck.frozen, **ck.buffers}
        entries = [(n, tuple(ck.master.shapes[n]), torch.float32) for n in ck.master]
        entries += [(n, tuple(t.shape), t.dtype) for n, t in held.items()]
        return entries, lambda name: ck.master[name] if name in ck.master else held[name]
    where = locate(path)
    meta = read_meta(where)
    stored = stored_pieces(where)
    master = getattr(torch, meta["master_dtype"].split(".")[1])
    pieces: dict[str, list[tuple[int, str]]] = {}
    for key in stored:
        if key.startswith("p/") and key.rsplit("/", 2)[1] == "master":
            name = key[2:].rsplit("/", 2)[0]
            pieces.setdefault(name, []).append((int(key.rsplit("/", 1)[1]), key))
    entries: list[Entry] = [(n, tuple(s), master) for n, s in meta["params"].items()]
    entries += [(n, tuple(s), stored[f"f/{n}"].properties.dtype) for n, s in meta["replicated"].items()]
    shapes = {n: s for n, s, _ in entries}
    order = [n for n, _, _ in entries]
    size = {n: math.prod(s) * torch.empty((), dtype=d).element_size() for n, s, d in entries}
    budget = max(size.values(), default=0)  # tensors assembled at once: at most the largest one's bytes
    piece_bytes = [stored[k].size[0] * torch.empty((), dtype=master).element_size() for ks in pieces.values()
                   for _, k in ks]
    read_budget = max([32 << 20, *piece_bytes])
    ready: dict[str, torch.Tensor] = {}

    def load_batch(first: str) -> None:
        """``first`` and the tensors after it, up to ``budget`` bytes, in one read."""
        names, used = [], 0
        for n in order[order.index(first):]:
            if names and used + size[n] > budget:
                break
            names.append(n)
            used += size[n]
        want = {}  # each piece read straight into its place in the parameter's flat buffer
        for n in names:
            if n in meta["params"]:
                flat = torch.empty(math.prod(shapes[n]), dtype=master)
                covered = 0
                for start, key in pieces.get(n, []):
                    want[key] = flat.narrow(0, start, stored[key].size[0])
                    covered += stored[key].size[0]
                if covered != flat.numel():
                    raise CheckpointError(f"{where}: the pieces of {n!r} cover {covered} of its {flat.numel()} elements")
                ready[n] = flat.view(shapes[n])
            else:
                key = f"f/{n}"
                ready[n] = want[key] = torch.empty(stored[key].size, dtype=stored[key].properties.dtype)
        # In reads of at most one stored piece's bytes (or 32 MiB): what a read holds in flight
        chunk, used = {}, 0
        for key, target in want.items():
            n = target.numel() * target.element_size()
            if chunk and used + n > read_budget:
                _read(chunk)
                chunk, used = {}, 0
            chunk[key] = target
            used += n
        if chunk:
            _read(chunk)

    def _read(chunk: dict[str, torch.Tensor]) -> None:
        read_checked(chunk, where, meta)

    def read(name: str) -> torch.Tensor:
        if name not in ready:
            load_batch(name)
        return ready.pop(name)

    return entries, read


def _size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u) and t[:-len(u)].strip().replace(".", "", 1).isdigit():
            return int(float(t[:-len(u)]) * units[u])
    if t.isdigit():
        return int(t)
    raise ValueError(f"--max-shard-size: {text!r} is not a size (e.g. 2GB, 500MB, 1073741824)")


def _shards(entries: list[Entry], limit: int | None) -> list[list[Entry]]:
    if limit is None:
        return [entries]
    out: list[list[Entry]] = [[]]
    used = 0
    for e in entries:
        n = math.prod(e[1]) * torch.empty((), dtype=e[2]).element_size()
        if out[-1] and used + n > limit:
            out.append([])
            used = 0
        out[-1].append(e)
        used += n
    return out


def convert(checkpoint: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype | None = None,
            max_shard_size: int | None = None, progress: bool | None = None) -> list[str]:
    """Write the checkpoint's full weights as safetensors (see the module docstring); returns the
    files written. ``out`` is a ``.safetensors`` file (one file), or a directory: its
    ``model.safetensors``, or with ``max_shard_size`` (bytes) its ``model-0000k-of-0000n``
    shards and ``model.safetensors.index.json``. ``dtype`` casts the floating tensors.

    Examples:
        >>> import tempfile, torch, zfunc
        >>> from safetensors.torch import load_file
        >>> state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=2))
        >>> ckpt = zfunc.save(state, tempfile.mkdtemp() + "/ckpt")
        >>> files = convert(ckpt, tempfile.mkdtemp() + "/model.safetensors", dtype=torch.bfloat16, progress=False)
        >>> {n: t.dtype for n, t in load_file(files[0]).items()}
        {'weight': torch.bfloat16, 'bias': torch.bfloat16}
    """
    entries, read = checkpoint_entries(checkpoint)
    if dtype is not None:
        entries = [(n, s, dtype if d.is_floating_point else d) for n, s, d in entries]
    out = os.fspath(out)
    single = out.endswith(".safetensors")
    if single and max_shard_size is not None:
        raise ValueError("--max-shard-size writes several files: give a directory as OUT, not a .safetensors file")
    if not single:
        os.makedirs(out, exist_ok=True)
    groups = _shards(entries, max_shard_size)
    total = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for _, s, d in entries)
    bar = _bar(total, progress)
    files, index = [], {}
    for k, group in enumerate(groups):
        if single:
            f = out
        elif max_shard_size is None:
            f = os.path.join(out, "model.safetensors")
        else:
            f = os.path.join(out, f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors")
        files.append(write_safetensors(f, group, read, {"format": "pt"}, bar.update if bar else None))
        index.update({n: os.path.basename(f) for n, _, _ in group})
    if max_shard_size is not None:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": index}, fh, indent=1)
    if bar:
        bar.close()
    return files


def _bar(total: int, progress: bool | None) -> Any:
    """A byte progress bar on a terminal (tqdm, when installed), else None."""
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="convert", file=sys.stderr)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zfunc.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a zfunc checkpoint directory (zfunc.save), or DeepSpeed's")
    parser.add_argument("out", help="a .safetensors file, or a directory")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating tensors (default: as stored)")
    parser.add_argument("--max-shard-size", help="write shards of at most this size and an index (e.g. 2GB)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        limit = _size(args.max_shard_size) if args.max_shard_size else None
        files = convert(args.checkpoint, args.out, dtype=_DTYPES.get(args.dtype), max_shard_size=limit)
    except (CheckpointError, ValueError) as e:
        print(f"zfunc.convert: {e}", file=sys.stderr)
        return 2
    print("\n".join(files))
    return 0
