#!/usr/bin/env bash
# Set up a virtual environment in .venv for zfunc, reusing an installed torch.
# Sourced by scripts/train.sh and scripts/test.sh; safe to run again (it only adds what is missing).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    # --system-site-packages: a torch installed on the machine is reused, never downloaded again.
    "$py" -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        pip install -q "torch>=2.4"
    else
        # A CPU machine: the pinned CPU build, never the multi-GB CUDA wheels.
        pip install -q "torch==2.13.0"
    fi
fi
extras="test,docs,progress,plot,hf${ZFUNC_EXTRAS:+,$ZFUNC_EXTRAS}"
if [ ! -f .venv/.zfunc-installed ] || [ pyproject.toml -nt .venv/.zfunc-installed ] \
   || ! python -c "import zfunc, pytest, sybil, hypothesis, pytest_timeout, mkdocs, tqdm, matplotlib, transformers, accelerate, lightning" >/dev/null 2>&1; then
    pip install -q -e ".[${extras}]"
    touch .venv/.zfunc-installed
fi
