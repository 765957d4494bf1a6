#!/usr/bin/env bash
# Set up, then run the whole test suite, every tier (CPU only, offline; CI runs this). Extra
# arguments go to pytest: `-m distributed` runs one tier. Plain `pytest` runs the fast tier only.
#
# The suite runs in CPTUNE_TEST_WORKERS pytest workers (default 2; 1 runs it in this process), each
# test file on one of them (tests/workers.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --deepspeed  # the deepspeed backend's tests run too
. .venv/bin/activate
workers=${CPTUNE_TEST_WORKERS:-2}
if [ "$workers" -gt 1 ]; then
  # A worker that dies (a crash in torch or gloo) fails the run: xdist 3.8 would start another and hand it
  # the crashed test again, and wait for ever.
  exec python -m pytest -q --full --numprocesses "$workers" --dist loadgroup --max-worker-restart 0 "$@"
fi
exec python -m pytest -q --full "$@"
