"""``python -m zfunc.convert CHECKPOINT OUT``: consolidated safetensors weights from a checkpoint
(`zfunc.io.convert`)."""

from zfunc.io.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
