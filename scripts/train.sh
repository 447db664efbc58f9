#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: a character-level GPT trained with ZeRO-2 on a
# local world of 2 gloo ranks. Flags go to examples/train_gpt.py (--help lists them).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python examples/train_gpt.py "$@"
