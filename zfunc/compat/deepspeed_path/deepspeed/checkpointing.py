"""``deepspeed.checkpointing``: zfunc's (`zfunc.compat.checkpointing`)."""

from zfunc.compat.checkpointing import checkpoint, configure, is_configured

__all__ = ["checkpoint", "configure", "is_configured"]
