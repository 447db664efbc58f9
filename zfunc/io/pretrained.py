"""Streamed weights into a model or onto disk: `load_weights` and `save_pretrained`.

Both take any iterable of ``(name, tensor)``: `zfunc.iter_full_params` (one gathered unit at a
time), a ``state_dict().items()``, a generator of one's own. Neither holds the whole model:
`load_weights` copies each tensor into place as it comes, `save_pretrained` holds one shard.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator

import torch

__all__ = ["load_weights", "save_pretrained"]

_EARLIER = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@contextlib.contextmanager
def _close_on_failure(weights: Iterable) -> Iterator[None]:
    """Close ``weights`` (a generator such as `zfunc.iter_full_params`) if the body raises, so a
    collective stream tells the other ranks at once, not whenever the generator is collected; the
    body's error is the one raised."""
    try:
        yield
    except BaseException:
        close = getattr(weights, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):  # the other ranks went on: they raise too
                close()
        raise


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                 strict: bool = True) -> list[str]:
    """Copy ``(name, tensor)`` pairs into ``model``'s parameters and buffers of those names, one at
    a time, in place (each converted to the target's dtype and device).

    A tied weight needs one name: the copy reaches every alias of the parameter (transformers ties
    ``lm_head.weight`` to the input embedding by sharing the parameter, as zfunc's models do).

    Args:
        model: the receiver, e.g. a Hugging Face model built from the same config, for ``generate``.
        weights: the pairs, e.g. ``zfunc.iter_full_params(state)``.
        strict: every name must be one of ``model``'s, and every parameter of ``model`` must get a
            value (through any of its names). A name it does not have raises at that name (the
            pairs before it are copied already); the check for parameters left out runs at the end.

    Returns:
        The names copied, in order.

    Raises:
        KeyError: a name ``model`` does not have (``strict``).
        ValueError: a shape that differs from the target's, or (``strict``) parameters no pair reached.

    Examples:
        >>> import torch, zfunc
        >>> torch.manual_seed(0) and None
        >>> state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=3))
        >>> receiver = torch.nn.Linear(3, 2)
        >>> zfunc.load_weights(receiver, zfunc.iter_full_params(state))
        ['weight', 'bias']
        >>> torch.equal(receiver.weight, zfunc.full_params(state)["weight"])
        True
    """
    targets = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}
    done, reached = [], set()
    with torch.no_grad(), _close_on_failure(weights):
        for name, value in weights:
            target = targets.get(name)
            if target is None:
                if strict:
                    raise KeyError(f"load_weights: {type(model).__name__} has no parameter or buffer "
                                   f"{name!r} (pass strict=False to skip names the model does not have)")
                continue
            if tuple(target.shape) != tuple(value.shape):
                raise ValueError(f"load_weights: {name!r} is {tuple(value.shape)} in the weights and "
                                 f"{tuple(target.shape)} in {type(model).__name__}")
            target.copy_(value)
            done.append(name)
            reached.add(id(target))
    if strict:
        missing = [n for n, p in model.named_parameters() if id(p) not in reached]
        if missing:
            raise ValueError(f"load_weights: no weights reached {len(missing)} parameter(s) of "
                             f"{type(model).__name__}: {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                             "(pass strict=False to leave them as they are)")
    return done


def _bytes(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B?)\s*", size.upper()) if isinstance(size, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size: expected a positive number of bytes or a size such as '5GB' "
                         f"or '500MiB', got {size!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2)])
    return n // 8 if size.rstrip().endswith("b") and not size.rstrip().lower().endswith("ib") else n  # "Gb": bits


def save_pretrained(weights: Iterable[tuple[str, torch.Tensor]], directory: str | os.PathLike, *,
                    max_shard_size: int | str = "5GB") -> list[str]:
    """Write ``(name, tensor)`` pairs as safetensors the way ``transformers``' ``save_pretrained``
    does: ``model.safetensors`` when they fit in one shard, else ``model-00001-of-0000N.safetensors``
    ... and ``model.safetensors.index.json``, so ``from_pretrained(directory)`` loads them (save
    the model's config there too).

    Pairs are copied to host memory as they come; a shard is written once full, so at most one
    shard (and whatever the iterator holds, for `zfunc.iter_full_params` one unit) is in memory.
    A tensor larger than ``max_shard_size`` gets a shard of its own. An earlier save's weight
    files in ``directory`` (``model*.safetensors`` and the index) are removed, as
    ``save_pretrained`` does, once the new shards are written. When ``weights`` yields nothing
    (`zfunc.iter_full_params` with ``dst=`` another rank) nothing is written or removed: every
    rank may call it with the same arguments, and with ``dst=`` one rank writes.

    Args:
        weights: the pairs, e.g. ``zfunc.iter_full_params(state, dst=0)``.
        directory: where to write (made if missing).
        max_shard_size: bytes per shard, an int or a string with a unit as transformers reads it
            ("5GB", "200MB", "1GiB"; a lowercase "b", as in "5Gb", counts bits).

    Returns:
        The files written (empty when nothing came).

    Examples:
        >>> import os, tempfile, torch, zfunc
        >>> from safetensors.torch import load_file
        >>> state = zfunc.init(torch.nn.Linear(3, 2), zfunc.Config(stage=3))
        >>> out = tempfile.mkdtemp()
        >>> files = zfunc.save_pretrained(zfunc.iter_full_params(state), out, max_shard_size=16)
        >>> [os.path.basename(f) for f in files]  # doctest: +NORMALIZE_WHITESPACE
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors',
         'model.safetensors.index.json']
        >>> [sorted(load_file(f)) for f in files[:2]]
        [['weight'], ['bias']]
    """
    from safetensors.torch import save_file

    limit = _bytes(max_shard_size)
    directory = os.fspath(directory)
    shards: list[str] = []  # the files written, under their temporary names
    weight_map: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    held, total = 0, 0

    def flush() -> None:
        nonlocal shard, held
        if shard:
            if not shards:
                os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f".zfunc-{os.getpid()}-shard-{len(shards) + 1:05d}.safetensors")
            save_file(shard, path, metadata={"format": "pt"})
            shards.append(path)
            shard, held = {}, 0

    try:
        with _close_on_failure(weights):
            for name, value in weights:
                if name in weight_map or name in shard:
                    raise ValueError(f"save_pretrained: the weights name {name!r} twice")
                nbytes = value.numel() * value.element_size()
                if shard and held + nbytes > limit:
                    flush()
                # its own storage: safetensors refuses tensors that share one
                shard[name] = value.detach().to("cpu", copy=True).contiguous()
                weight_map[name] = len(shards)
                held += nbytes
                total += nbytes
            flush()
    except BaseException:
        for tmp in shards:  # nothing half written is left behind
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise
    if not shards:
        return []
    if len(shards) == 1:
        final = [os.path.join(directory, "model.safetensors")]
    else:
        final = [os.path.join(directory, f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
                 for k in range(len(shards))]
    for name in os.listdir(directory):  # an earlier save's weights: from_pretrained would read them
        if _EARLIER.fullmatch(name) and os.path.join(directory, name) not in final:
            os.remove(os.path.join(directory, name))
    for tmp, path in zip(shards, final):
        os.replace(tmp, path)
    if len(shards) > 1:
        index = os.path.join(directory, "model.safetensors.index.json")
        with open(index, "w") as f:
            where = {n: os.path.basename(final[k]) for n, k in weight_map.items()}
            json.dump({"metadata": {"total_size": total}, "weight_map": where}, f, indent=2)
        final.append(index)
    return final
