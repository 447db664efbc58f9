"""``deepspeed.launcher``: the runner's environment file name."""

from deepspeed.launcher import runner

__all__ = ["runner"]
