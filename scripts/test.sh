#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite: unit, multi-rank, doctests, guides.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export OMP_NUM_THREADS=1 TORCH_DISTRIBUTED_DEBUG=DETAIL PYTHONHASHSEED=0
python -m pytest -q "$@"
