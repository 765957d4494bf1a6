#!/usr/bin/env bash
# Set up, then run the whole test suite (CPU only, offline). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --deepspeed  # the deepspeed backend's tests run too
. .venv/bin/activate
exec python -m pytest -q "$@"
