"""Process groups: which ranks a collective runs over (`Group`), and the world of all of them
(`world`, initialised from torchrun's variables when they are set). The collectives over them
are `zfunc.distributed.comm`'s, which also names these (``zfunc.comm.Group``, ``zfunc.comm.world``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Group", "world", "init_from_env"]


@dataclasses.dataclass(frozen=True, eq=False)
class Group:
    """The ranks a collective runs over.

    ``pg=None`` with ``size == 1`` is a world of one (no process group needed);
    ``pg=None`` with ``size > 1`` means the default process group. ``p2p``: a second gloo
    process group over the same ranks that carries zfunc's point-to-point sums (`reduce_`,
    `reduce_scatter`); `zfunc.distributed.mesh.make_mesh` gives the groups ZeRO reduces over one. Their
    messages stay off ``pg``, so its collectives keep the same sequence on every rank, which
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks. Without it (None) they are the backend's own.

    Examples:
        >>> import zfunc
        >>> g = zfunc.comm.world()
        >>> g.rank, g.size
        (0, 1)
    """

    rank: int
    size: int
    pg: Any = None
    p2p: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Group:
        return self  # it names process groups: a copied state talks over the same ones

    @classmethod
    def of_ranks(cls, ranks: list[int]) -> Group:
        """A new process group over ``ranks`` of the default world (call on every rank).

        On a rank outside ``ranks`` the result has ``rank == -1`` and must not be used.
        """
        ranks = sorted(ranks)
        if not (dist.is_available() and dist.is_initialized()):
            if ranks != [0]:
                raise ValueError(f"ranks {ranks}: no process group is initialised, only [0] exists")
            return cls(rank=0, size=1, pg=None)
        pg = dist.new_group(ranks)
        me = dist.get_rank()
        return cls(rank=ranks.index(me) if me in ranks else -1, size=len(ranks), pg=pg)

    @property
    def process_group(self) -> Any:
        """The ``torch.distributed`` group to pass to collectives (None: the default group)."""
        return self.pg

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, size={self.size})"


def init_from_env(backend: str | None = None, timeout: Any = None, init_method: str | None = None) -> bool:
    """Initialise the default process group from torchrun's variables if they are set
    (``timeout``: a ``datetime.timedelta``, torch's default when ``None``).

    Returns whether a process group is initialised afterwards. Never initialises twice.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        extra = {k: v for k, v in (("timeout", timeout), ("init_method", init_method)) if v is not None}
        dist.init_process_group(backend=backend, **extra)
        return True
    return False


def world() -> Group:
    """The group of all ranks: the default process group if initialised, else a world of one.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) the default group is
    initialised from the environment first.

    Examples:
        >>> import zfunc
        >>> zfunc.comm.world().size
        1
    """
    if init_from_env():
        return Group(rank=dist.get_rank(), size=dist.get_world_size(), pg=None)
    return Group(rank=0, size=1, pg=None)
