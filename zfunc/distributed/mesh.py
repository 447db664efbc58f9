"""Hybrid sharding: which ranks share one copy of the state, and which hold the same shard.

A world of ``n`` ranks with ``shard_size=k`` is ``n / k`` *replicas* of ``k`` consecutive ranks
(FSDP2's HSDP mesh ``(replicate, shard)``, DeepSpeed's MiCS): parameters, gradients and optimizer
state are sharded over the ``k`` ranks of a replica (the *shard group*), and a gradient shard is
averaged over the ``n / k`` ranks that own the same shard (the *replica group*, ranks ``r``,
``r + k``, ``r + 2k``, ...). ``k = n`` is flat ZeRO over the world.

On a cluster of nodes with ``k`` ranks each, every all-gather and reduce-scatter stays inside a
node; only one all-reduce of a shard per step crosses nodes.
"""

from __future__ import annotations

import atexit
import dataclasses
from typing import Any

import torch.distributed as dist

from zfunc.distributed.comm import Group
from zfunc.distributed.comm import world as default_world
from zfunc.errors import ConfigError

__all__ = ["Mesh", "make_mesh", "resolve", "shard_ranks", "global_ranks"]

_CACHE: dict[tuple[Any, ...], tuple[Any, Mesh]] = {}  # by world: (the default group, its mesh)
# The process groups a cached mesh made are let go of before the interpreter tears down: a gloo
# group destroyed that late (after `destroy_process_group`, during module cleanup) can abort the
# process on its way out ("terminate called without an active exception", about 1 run in 12).
atexit.register(_CACHE.clear)


@dataclasses.dataclass(frozen=True, eq=False)
class Mesh:
    """The three groups a training state talks over.

    Attributes:
        world: every rank (losses, buffers, checks at init).
        shard: the ranks one copy of the state is sharded over (the ZeRO collectives).
        replicas: the ranks holding the same shard (gradients averaged across them).

    Examples:
        >>> import zfunc
        >>> m = make_mesh(zfunc.comm.world(), None)
        >>> m.shard.size, m.replicas.size
        (1, 1)
    """

    world: Group
    shard: Group
    replicas: Group

    def __deepcopy__(self, memo: dict[int, Any]) -> Mesh:
        return self  # it names process groups: a copied state talks over the same ones

    def key(self) -> tuple[tuple[int, ...], int, int]:
        """What the mesh is, by value: the world's global ranks, this rank's place among them,
        and the shard size. Two meshes with one key talk over the same ranks the same way."""
        return tuple(global_ranks(self.world)), self.world.rank, self.shard.size

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Mesh) and self.key() == other.key())

    def __hash__(self) -> int:
        return hash(self.key())

    def __reduce__(self) -> tuple:
        """Pickled by ranks, never by process group: unpickling finds the groups again in the
        process's world (`resolve`)."""
        return resolve, self.key()

    @property
    def shard_size(self) -> int:
        return self.shard.size

    def __repr__(self) -> str:
        return f"Mesh(world={self.world.size}, shard={self.shard.size}, replicas={self.replicas.size})"


def global_ranks(world: Group) -> list[int]:
    """The global ranks of ``world``, in group-rank order.

    Examples:
        >>> import zfunc
        >>> global_ranks(zfunc.comm.world())
        [0]
    """
    if world.size == 1:
        return [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0]
    if world.pg is None:
        return list(range(world.size))
    return dist.get_process_group_ranks(world.pg)


def shard_ranks(shard_size: int | None, world_size: int) -> int:
    """How many ranks one copy of the state is sharded over (``None``: all of them).

    Raises:
        ConfigError: ``shard_size`` does not divide ``world_size``, or exceeds it.

    Examples:
        >>> shard_ranks(None, 8), shard_ranks(4, 8)
        (8, 4)
    """
    n, k = world_size, world_size if shard_size is None else shard_size
    if k > n or n % k:
        raise ConfigError(f"shard_size: {k} {'is larger than' if k > n else 'does not divide'} the world size {n}; "
                          f"use a divisor of {n} (e.g. the ranks per node), or None to shard over the whole world")
    return k


def make_mesh(world: Group, shard_size: int | None) -> Mesh:
    """The `Mesh` of ``world`` split into replicas of ``shard_size`` consecutive ranks (built once
    per world and size, then cached; call on every rank of ``world``).

    ``None`` (or ``world.size``) shards over the whole world.

    Raises:
        ConfigError: ``shard_size`` does not divide the world size, or exceeds it.

    Examples:
        >>> import zfunc
        >>> make_mesh(zfunc.comm.world(), 1)
        Mesh(world=1, shard=1, replicas=1)
    """
    n, k = world.size, shard_ranks(shard_size, world.size)
    if n == 1:
        return Mesh(world=world, shard=world, replicas=Group(rank=0, size=1))
    ranks = global_ranks(world)
    key = (id(dist.group.WORLD), id(world.pg), tuple(ranks), k)
    cached = _CACHE.get(key)
    if cached is not None and cached[0] is dist.group.WORLD:
        return cached[1]
    me = world.rank
    start, index = me - me % k, me % k
    if k == n:
        p2p = _p2p_groups(world, ranks, k)
        shard = Group(rank=me, size=n, pg=world.pg, p2p=p2p[0] if p2p else None)
        mesh = Mesh(world=world, shard=shard, replicas=Group(rank=0, size=1))
    else:
        # Every member of a group creates it (local synchronisation): all ranks first their shard
        # group, then their replica group, so no two ranks wait on each other in opposite order.
        shard = dist.new_group(ranks[start:start + k], use_local_synchronization=True)
        column = ranks[index::k]
        replicas = dist.new_group(column, use_local_synchronization=True)
        p2p = _p2p_groups(world, ranks, k)
        mesh = Mesh(world=world, shard=Group(rank=index, size=k, pg=shard, p2p=p2p[start // k] if p2p else None),
                    replicas=Group(rank=me // k, size=n // k, pg=replicas))
    _CACHE[key] = (dist.group.WORLD, mesh)
    return mesh


def resolve(ranks: tuple[int, ...], rank: int, shard_size: int) -> Mesh:
    """The mesh over the global ``ranks`` of this process's world, sharded by ``shard_size``, as
    the rank at place ``rank`` among them sees it (what an unpickled state talks over).

    Raises:
        RuntimeError: this process is not that rank of such a world (a state pickled in another
            world, or on another rank): it names both, and what to do instead.

    Examples:
        >>> resolve((0,), 0, 1)
        Mesh(world=1, shard=1, replicas=1)
    """
    if len(ranks) == 1:
        return make_mesh(Group(rank=0, size=1), 1)
    here = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    world = dist.get_world_size() if here is not None else 1
    if here == ranks[rank]:
        if tuple(range(world)) == tuple(ranks):
            return make_mesh(default_world(), shard_size)
        for _, mesh in _CACHE.values():  # a state over part of the world: a group made already
            if mesh.key() == (tuple(ranks), rank, shard_size):
                return mesh
    where = f"global rank {here} of a world of {world}" if here is not None else "a process with no process group"
    raise RuntimeError(
        f"this state was sharded over global ranks {list(ranks)} (its rank {ranks[rank]}, shard size {shard_size}); "
        f"it is unpickled in {where}. Unpickle each rank's state on that rank of a world with those ranks "
        "(under torchrun, after torch.distributed is initialised; a state over part of the world after zfunc.init "
        "made its groups), or save with zfunc.save and load with zfunc.load to reshard onto another world")


def _p2p_groups(world: Group, ranks: list[int], k: int) -> list[Any]:
    """For a gloo default world: a second process group over each shard group's ranks (every
    rank creates all of them, in order, as ``dist.new_group`` asks), for the point-to-point sums
    of `zfunc.comm` (see `zfunc.comm.Group`). Empty otherwise: the backend's own reduces then."""
    if world.pg is not None or k == 1 or dist.get_backend() != "gloo":
        return []
    return [dist.new_group(ranks[s:s + k]) for s in range(0, len(ranks), k)]
