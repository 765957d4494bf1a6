#!/usr/bin/env bash
# Set up, then run the whole test suite, every tier (CPU only, offline; CI runs this). Extra
# arguments go to pytest: `-m distributed` runs one tier. Plain `pytest` runs the fast tier only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --deepspeed  # the deepspeed backend's tests run too
. .venv/bin/activate
exec python -m pytest -q --full "$@"
