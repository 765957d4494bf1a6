#!/usr/bin/env bash
# Set up, then fine-tune the shipped tiny model with context parallelism on 2 CPU
# processes (offline, a few minutes). Extra arguments go to `cptune train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# Running the quickstart again starts afresh in outputs/quickstart (--overwrite), unless
# asked to continue the earlier run (--resume).
case " $* " in
  *" --resume "*) exec cptune train examples/quickstart.yaml "$@" ;;
  *) exec cptune train examples/quickstart.yaml --overwrite "$@" ;;
esac
