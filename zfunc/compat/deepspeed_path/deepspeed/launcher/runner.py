"""``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME``: the file of environment variables
DeepSpeed's launcher exports to every node (zfunc runs under torchrun and reads none)."""

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]
