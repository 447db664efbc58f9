"""DeepSpeed's top-level names, served by zfunc (``zfunc.as_deepspeed``): ``initialize``,
``init_distributed``, ``add_config_arguments``, ``DeepSpeedEngine``, ``zero``, ``comm``,
``utils``, ``moe``. This is not DeepSpeed: a name DeepSpeed has and zfunc does not is absent."""

from zfunc import add_config_arguments, init_distributed, initialize
from zfunc.compat.engine import Engine as DeepSpeedEngine

from deepspeed import accelerator, checkpoint, checkpointing, comm, launcher, moe, runtime, utils, zero

__version__ = "0.19.8"
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
__all__ = ["DeepSpeedEngine", "accelerator", "add_config_arguments", "checkpoint", "checkpointing", "comm",
           "init_distributed", "initialize", "launcher", "moe", "runtime", "utils", "zero"]
