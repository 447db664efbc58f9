"""Full weights out, for inference: `export` writes a state's or a checkpoint directory's
trainable parameters (their master weights), frozen parameters and buffers as one safetensors
file."""

from __future__ import annotations

import os

import torch

from zfunc.core.donation import check_live
from zfunc.core.full_weights import iter_full_params
from zfunc.core.state import TrainState
from zfunc.io.checkpoint import _replicated, locate, read_checked, read_meta, stored_pieces

__all__ = ["export"]


def export(source: TrainState | str | os.PathLike, file: str | os.PathLike) -> str:
    """Full weights as safetensors, for inference: trainable parameters, frozen ones and buffers.

    A tied weight is stored once under its first name; ``model.load_state_dict(weights,
    strict=False)`` restores it (its aliases share the tensor). From a state this gathers to rank 0
    a unit at a time (`zfunc.iter_full_params`; call on every rank; rank 0 writes, and only it
    holds the whole model); from a checkpoint directory it runs in one process. For Hugging Face's
    sharded layout, `zfunc.save_pretrained`.

    Examples:
        >>> import tempfile, torch, zfunc
        >>> from safetensors.torch import load_file
        >>> state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=3))
        >>> f = zfunc.export(state, tempfile.mkdtemp() + "/model.safetensors")
        >>> sorted(load_file(f))
        ['bias', 'weight']
    """
    from safetensors.torch import save_file

    if isinstance(source, TrainState):
        check_live(source, "export")
        # a unit at a time to rank 0 alone: no other rank holds the whole model
        trained = iter_full_params(source, dtype=source.params.dtype, dst=0)
        weights = {n: t for n, t in trained if n not in source.frozen}
        weights.update(_replicated(source))
        rank = source.group.rank
    else:
        weights, rank = _weights_from(os.fspath(source)), 0
    if rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, os.fspath(file),
                  metadata={"format": "zfunc"})
    return os.fspath(file)


def _weights_from(path: str) -> dict[str, torch.Tensor]:
    path = locate(path)
    meta = read_meta(path)
    stored = stored_pieces(path)
    want = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in stored.items()
            if (k.startswith("p/") and k.rsplit("/", 2)[1] == "master") or k.startswith("f/")}
    read_checked(want, path, meta)
    out = {}
    for name, shape in meta["params"].items():
        flat = torch.empty(int(torch.Size(shape).numel()), dtype=getattr(torch, meta["master_dtype"].split(".")[1]))
        for k, v in want.items():
            if k.startswith(f"p/{name}/master/"):
                start = int(k.rsplit("/", 1)[1])
                flat.narrow(0, start, v.numel()).copy_(v)
        out[name] = flat.view(shape)
    out.update({k[2:]: v for k, v in want.items() if k.startswith("f/")})
    return out
