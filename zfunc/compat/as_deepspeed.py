"""Run a script with `zfunc.as_deepspeed` on, unchanged:

    torchrun --nproc-per-node 2 -m zfunc.compat.as_deepspeed train.py --deepspeed ds.json
    python -m zfunc.compat.as_deepspeed train.py [args...]

The script runs as ``python train.py [args...]`` would run it (``__main__``, its ``sys.argv``, its
directory first on ``sys.path`` after zfunc's ``deepspeed``); see `zfunc.compat.switch`.
"""

from __future__ import annotations

import os
import runpy
import sys

from zfunc.compat.switch import PATH, as_deepspeed

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """``python -m zfunc.compat.as_deepspeed script.py [args...]``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    first = sys.path[0] if sys.path else None  # ``python -m`` put the working directory there
    as_deepspeed()
    script_dir = os.path.dirname(os.path.abspath(argv[0]))
    at = sys.path.index(PATH) + 1
    if first in ("", os.getcwd()) and at < len(sys.path) and sys.path[at] == first:
        sys.path[at] = script_dir  # where ``python script.py`` puts the script's directory
    else:
        sys.path.insert(at, script_dir)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
