"""``deepspeed.ops``: the Adam classes only (`zfunc.compat.deepspeed_adam`)."""
