"""``deepspeed.comm``: torch.distributed's functions under DeepSpeed's module name, with
zfunc's ``init_distributed`` (a run without a CUDA device gets gloo)."""

from torch.distributed import *  # noqa: F401,F403  (deepspeed.comm mirrors torch.distributed)
from torch.distributed import get_rank, get_world_size, is_initialized

from zfunc import init_distributed

__all__ = ["get_local_rank", "get_rank", "get_world_size", "init_distributed", "is_initialized"]


def get_local_rank() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", 0))
