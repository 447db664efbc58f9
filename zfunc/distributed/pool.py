"""Large flat buffers kept between steps for reuse, in host memory.

A step allocates the same large buffers every time: the gradient accumulator, the staging
buffers of the bucket reduces, the reduced shard. On the CPU glibc maps every allocation of
32 MiB or more afresh and unmaps it when freed, and returns the top of its heap to the system
once enough is free there, so each such buffer costs a page fault per 4 KiB page, every step
(about 40k faults a step for a 17M-parameter model: 2-5% of the step). DDP keeps its buckets for
the life of the wrapper; the `Pool` of a binding keeps zfunc's the same way, for the life of the
states that share the binding. On a GPU the caching allocator already keeps freed blocks, so
the pool keeps nothing there: `Pool.take` allocates and `Pool.give` lets go.

A buffer is given back only when nothing else can read or write it: a staging buffer once its
reduces are in, the accumulator of a state donated to `zfunc.apply_step` (whose tensors the
donation took away from the caller).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["Pool", "whole", "buffer"]

_MIN_BYTES = 1 << 20  # below this the allocator's own free lists do as well
_LENT = 256  # buffers out on loan remembered at most


class Pool:
    """Flat buffers by dtype and device, each handed to one user at a time.

    `take` returns ``numel`` uninitialised elements over the smallest free buffer that holds them
    (else a new one): a tensor of its own, not a view, so nothing keeps the buffer alive but the
    tensors over it. `give` takes back the whole buffer under any tensor `take` returned. A
    buffer the pool did not hand out is let go rather than kept: its memory may be shared with
    tensors the pool knows nothing of.

    Examples:
        >>> pool = Pool()
        >>> a = pool.take(1 << 19, torch.float32, "cpu")
        >>> pool.give(a)
        >>> b = pool.take(1 << 18, torch.float32, "cpu")
        >>> b.data_ptr() == a.data_ptr(), b.numel(), b._base is None, pool.held_bytes()
        (True, 262144, True, 0)
        >>> pool.give(b); pool.held_bytes()
        2097152
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        # (address, bytes) of the buffers handed out and not given back; those never given back
        # (the accumulator of a state not donated) are forgotten after a while
        self._lent: dict[tuple[int, int], None] = {}
        self._lock = threading.Lock()  # states sharing a binding may step in two threads

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """``numel`` elements, flat, over a buffer of the pool's."""
        with self._lock:
            free = self._free.get((dtype, torch.device(device)))
            fits = [k for k, t in enumerate(free or ()) if t.numel() >= numel]
            if fits:
                buf = free.pop(min(fits, key=lambda k: free[k].numel()))
                self._lend(buf)
                return torch.empty(0, dtype=dtype, device=buf.device).set_(buf.untyped_storage(), 0, (numel,))
        buf = torch.empty(numel, dtype=dtype, device=device)
        with self._lock:
            return self._lend(buf)

    def _lend(self, buf: torch.Tensor) -> torch.Tensor:
        if buf.device.type == "cpu":
            self._lent[_key(buf)] = None
            while len(self._lent) > _LENT:
                del self._lent[next(iter(self._lent))]
        return buf

    def give(self, t: torch.Tensor) -> None:
        """Keep the buffer under ``t`` (one `take` handed out, that no tensor reads any more but
        those the caller lets go) for a later `take`; on a GPU, or when it is small, it is
        simply let go."""
        key = _key(t)
        with self._lock:
            if t.device.type != "cpu" or key not in self._lent:
                return  # not one of ours (or on a GPU)
            del self._lent[key]
            if key[1] >= _MIN_BYTES:
                self._free.setdefault((t.dtype, t.device), []).append(whole(t))

    def lent(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in a buffer this pool handed out (and `give` would keep it)."""
        with self._lock:
            return t.device.type == "cpu" and _key(t) in self._lent

    def held_bytes(self) -> int:
        """Bytes kept for reuse now."""
        with self._lock:
            return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)

    def clear(self) -> None:
        """Let every kept buffer go."""
        with self._lock:
            self._free.clear()


def _key(buf: torch.Tensor) -> tuple[int, int]:
    return buf.untyped_storage().data_ptr(), buf.untyped_storage().nbytes()


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole flat buffer ``t`` lies in (its storage, as ``t``'s dtype).

    Examples:
        >>> buf = torch.arange(6.0)
        >>> whole(buf.narrow(0, 2, 3)).tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """
    storage = t.untyped_storage()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (storage.nbytes() // t.element_size(),))


def buffer(pool: Pool | None, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``numel`` uninitialised elements: from ``pool`` when there is one, else newly allocated.

    Examples:
        >>> buffer(None, 3, torch.float32, "cpu").shape
        torch.Size([3])
    """
    return torch.empty(numel, dtype=dtype, device=device) if pool is None else pool.take(numel, dtype, device)
