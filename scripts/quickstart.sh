#!/usr/bin/env bash
# Set up, then fine-tune the shipped tiny model with context parallelism on 2 CPU
# processes (offline, a few minutes). Extra arguments go to `cptune train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec cptune train examples/quickstart.yaml "$@"
