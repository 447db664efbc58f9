"""The switch that runs an unchanged Hugging Face Trainer, Accelerate or Lightning script on
zfunc: ``zfunc.as_deepspeed()`` at the top of the script, or the script run through
`zfunc.compat.as_deepspeed`:

    torchrun --nproc-per-node 2 -m zfunc.compat.as_deepspeed train.py --deepspeed ds.json

It puts zfunc's ``deepspeed`` package (``zfunc/compat/deepspeed_path``) first on ``sys.path``:
``import deepspeed`` then gives zfunc's ``initialize``, ``DeepSpeedEngine``, ``zero``,
``comm``, ``utils`` and ``accelerator``, and the distribution metadata says ``deepspeed
0.19.8`` (the API zfunc follows), so those libraries take their DeepSpeed paths. DeepSpeed itself
need not be installed; when it is, it is not used.

On a machine without CUDA, Accelerate gives a DeepSpeed run no process-group backend and counts
one process (DeepSpeed's own runs need the same help there): the switch gives such a run gloo, so
the world size stays the launcher's.
"""

from __future__ import annotations

import importlib
import os
import sys

__all__ = ["as_deepspeed", "PATH"]

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_path")
_CLIENTS = ("deepspeed", "transformers", "accelerate", "lightning", "pytorch_lightning")


def as_deepspeed() -> None:
    """Serve ``import deepspeed`` from zfunc, for libraries that call DeepSpeed themselves.

    Call it before importing DeepSpeed, Transformers, Accelerate or Lightning (they decide
    whether DeepSpeed is there when imported); calling it again does nothing.

    Raises:
        RuntimeError: one of those libraries was imported first.

    Examples:
        >>> import subprocess, sys
        >>> code = "import zfunc; zfunc.as_deepspeed(); import deepspeed; print(deepspeed.initialize is zfunc.initialize)"
        >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
        'True\\n'
    """
    if PATH in sys.path:  # on already: the path is the switch
        return
    early = [m for m in _CLIENTS if m in sys.modules]
    if early:
        raise RuntimeError(
            f"zfunc.as_deepspeed(): {', '.join(early)} was imported before it; call it first thing in the script "
            "(those libraries decide whether DeepSpeed is there when they are imported), or run the script "
            "unchanged with `python -m zfunc.compat.as_deepspeed script.py` (torchrun: `-m zfunc.compat.as_deepspeed`)")
    sys.path.insert(0, PATH)
    importlib.invalidate_caches()
    _accelerate_cpu_backend()


def _accelerate_cpu_backend() -> None:
    """Accelerate, with DeepSpeed on and no CUDA, finds no backend and counts one process: give
    such a run (launched, so ``LOCAL_RANK`` is set) gloo, Accelerate's own CPU backend."""
    try:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType
    except ImportError:
        return
    prepare = PartialState._prepare_backend
    if getattr(prepare, "_zfunc", False):
        return

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):  # noqa: ANN001, ANN202
        found = prepare(self, cpu, sagemaker_dp, backend)
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if found[0] is None and deepspeed and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return backend or "gloo", DistributedType.MULTI_CPU
        return found

    _prepare_backend._zfunc = True  # type: ignore[attr-defined]
    PartialState._prepare_backend = _prepare_backend
