"""Local worlds of ranks for examples and tests; under ``torchrun``, the environment's world.

`launch` runs ``fn(rank, *args)`` on every rank of a fresh local gloo world and returns the
results in rank order. `World` keeps such a world alive so that many calls share it (starting a
process that imports torch costs seconds). Both have a hard timeout, and a failing rank's
traceback is raised in the caller: never a silent hang.

Beyond one machine, run under ``torchrun`` (multi-node, elastic); zfunc ships no launcher.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["launch", "World", "WorldError"]


class WorldError(RuntimeError):
    """A rank of a local world failed, died or timed out; the message carries its traceback."""


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ)


def _worker(rank: int, size: int, backend: str, store: str, threads: int, timeout: float,
            tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - reported to the caller
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, *args)))
        except BaseException:  # noqa: BLE001 - reported to the caller
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class World:
    """A persistent local world: ``size`` processes joined in one process group.

    Args:
        size: number of ranks.
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        threads: torch threads per rank.
        timeout: seconds a call may take before the world is torn down.

    Examples:
        >>> from zfunc.tools.launch import World
        >>> with World(1) as w:
        ...     w.run(max, 5)
        [5]
    """

    def __init__(self, size: int, *, backend: str = "gloo", threads: int = 1, timeout: float = 300.0):
        if size < 1:
            raise ValueError(f"world_size: expected a positive integer, got {size}")
        self.size, self.timeout = size, timeout
        self._dir = tempfile.TemporaryDirectory(prefix="zfunc-world-")
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(size)]
        self._results = ctx.Queue()
        store = os.path.join(self._dir.name, "store")
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, size, backend, store, threads, timeout, self._tasks[r], self._results))
                       for r in range(size)]
        for p in self._procs:
            p.start()
        self.alive = True

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """``fn(rank, *args)`` on every rank; the results in rank order.

        Raises:
            WorldError: a rank raised (its traceback is in the message), died, or the call took
                longer than ``timeout`` seconds. The world is closed then.
        """
        if not self.alive:
            raise WorldError("this world was closed after an earlier failure; start a new one")
        try:  # a queue pickles in a background thread: a failure there would only reach stderr
            task = pickle.dumps((fn, args))
        except Exception as e:  # noqa: BLE001 - whatever pickle raises
            raise TypeError(f"launch: {getattr(fn, '__qualname__', fn)!r} or its arguments cannot be sent to the "
                            f"rank processes ({type(e).__name__}: {e}); define the function at module level "
                            "(not a lambda or a nested function) and pass picklable arguments") from e
        del task
        for q in self._tasks:
            q.put((fn, args))
        start = time.monotonic()
        deadline = start + (timeout or self.timeout)
        got: dict[int, Any] = {}
        failures: list[str] = []
        failed: set[int] = set()
        grace = float("inf")
        while len(got) + len(failures) < self.size:
            try:
                rank, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                late = time.monotonic() > deadline
                if dead or late or time.monotonic() > grace:
                    why = (f"rank(s) {dead} died (exit codes {[self._procs[r].exitcode for r in dead]})"
                           if dead else f"no answer from rank(s) {sorted(set(range(self.size)) - set(got) - failed)} "
                                        f"after {time.monotonic() - start:.0f} s"
                                        + (" (another rank failed)" if failures else ""))
                    self.close(force=True)
                    raise WorldError("\n".join([*failures, why])) from None
                continue
            if ok:
                got[rank] = value
            else:
                failures.append(f"rank {rank} failed:\n{value}")
                failed.add(rank)
                grace = time.monotonic() + 5.0  # let the other ranks report, then tear down
        if failures:
            self.close(force=True)
            raise WorldError("\n".join(failures))
        return [got[r] for r in range(self.size)]

    def close(self, force: bool = False) -> None:
        """Stop every rank (``force``: kill them, for a world left in an unknown state)."""
        if self.alive and not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.alive = False
        self._dir.cleanup()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def launch(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), backend: str = "gloo", *,
           threads: int = 1, timeout: float = 600.0) -> list[Any]:
    """Run ``fn(rank, *args)`` on a fresh local world of ``world_size`` ranks.

    Under ``torchrun`` (its variables are set) this process is one rank of the environment's
    world: the process group is initialised from the environment and ``[fn(rank, *args)]`` is
    returned for this rank alone. ``fn`` must be picklable (a module-level function).

    Examples:
        >>> import zfunc
        >>> zfunc.launch(max, world_size=1, args=(7,))
        [7]
    """
    if _under_torchrun():
        import torch.distributed as dist

        from zfunc.distributed import comm
        created = not (dist.is_available() and dist.is_initialized())
        comm.init_from_env(backend)
        try:
            return [fn(int(os.environ["RANK"]), *args)]
        finally:
            if created and dist.is_initialized():  # exiting with a live gloo group can abort
                dist.destroy_process_group()
    with World(world_size, backend=backend, threads=threads, timeout=timeout) as w:
        return w.run(fn, *args)
