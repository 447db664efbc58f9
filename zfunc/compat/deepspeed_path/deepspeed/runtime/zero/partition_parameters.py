"""``deepspeed.runtime.zero.partition_parameters``: the names code built on DeepSpeed patches
around ``zero.Init`` (Transformers keeps ``torch.arange``'s dtype with them). zfunc's ``Init``
wraps no tensor constructor, so patching these changes nothing."""

import torch

from deepspeed.zero import GatheredParameters, Init

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device=None):  # noqa: ANN001, ANN201
    """DeepSpeed's constructor wrapper; zfunc's ``Init`` does not call it: ``fn`` unchanged."""
    return fn


__all__ = ["GatheredParameters", "Init", "zero_wrapper_for_fp_tensor_constructor"]
