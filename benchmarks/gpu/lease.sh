#!/usr/bin/env bash
# cptune's GPU checks for one lent single-GPU machine (benchmarks/gpu/LEASE.md says how to run it).
#
#   bash benchmarks/gpu/lease.sh setup kernels multirank   # device call 1, ~6 min
#   bash benchmarks/gpu/lease.sh setup paths               # device call 2, ~8 min
#   bash benchmarks/gpu/lease.sh --dry-run all             # on CPU here: every phase, tiny sizes
#
# Phases run in the order given; a failing phase is reported and the next one still runs (exit 1
# at the end). Results: $OUT/{env,kernels,multirank,paths}.json and a log per phase.
set -uo pipefail

OUT=${OUT:-outputs/gpu-lease}
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
PHASES=("$@")
if [ "${PHASES[*]:-}" = "all" ] || [ ${#PHASES[@]} -eq 0 ]; then PHASES=(setup kernels multirank paths report); fi
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && [ "$DRY" = 1 ] && echo .venv/bin/python || echo python3)}
SITE=${SITE:-/tmp/cptune-site}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

setup() {
    # transformers 5.23 / peft 0.21 / ring-flash-attn 0.1.8 as wheels (benchmarks/gpu/wheels.sh); the
    # image's torch, accelerate and the rest stay as they are (env.json records every version).
    if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || return 1
        export PYTHONPATH="$PYTHONPATH:$SITE"
    fi
    "$PYTHON" - "$OUT/env.json" <<'PY'
import datetime, json, sys
from importlib import metadata
import torch
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
env = {
    "date": datetime.date.today().isoformat(),
    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)",
    "gpus": torch.cuda.device_count(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    **{name: version(name) for name in ("transformers", "accelerate", "peft", "ring-flash-attn")},
    "flash_attn": version("flash-attn"),
}
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(env)
PY
}

kernels() {
    if [ "$DRY" = 1 ]; then "$PYTHON" -m benchmarks.gpu.check_kernels --dry-run --out "$OUT/kernels.json"
    else "$PYTHON" -m benchmarks.gpu.check_kernels --time --out "$OUT/kernels.json"; fi
}

multirank() {
    if [ "$DRY" = 1 ]; then "$PYTHON" -m benchmarks.gpu.multirank --device cpu --tiny --cp-sizes 2,4 --out "$OUT/multirank.json"
    else "$PYTHON" -m benchmarks.gpu.multirank --cp-sizes 2,4 --out "$OUT/multirank.json"; fi
}

paths() {
    if [ "$DRY" = 1 ]; then "$PYTHON" -m benchmarks.gpu.attention_paths --dry-run --out "$OUT/paths.json"
    else "$PYTHON" -m benchmarks.gpu.attention_paths --lengths 8192,16384,32768,65536 --out "$OUT/paths.json"; fi
}

report() {
    "$PYTHON" -m benchmarks.gpu.lease_report "$OUT" > "$OUT/entry.json" && echo "entry: $OUT/entry.json"
}

failed=()
for phase in "${PHASES[@]}"; do
    case "$phase" in setup|kernels|multirank|paths|report) ;; *) echo "unknown phase: $phase" >&2; exit 2 ;; esac
    started=$SECONDS
    echo "=== $phase"
    if [ "$phase" = setup ]; then setup 2>&1 | tee "$OUT/$phase.log"; status=${PIPESTATUS[0]}
        [ -d "$SITE" ] && export PYTHONPATH="$PYTHONPATH:$SITE"
    else "$phase" 2>&1 | tee "$OUT/$phase.log"; status=${PIPESTATUS[0]}; fi
    echo "=== $phase: exit $status after $((SECONDS - started)) s"
    [ "$status" = 0 ] || failed+=("$phase")
done
if [ ${#failed[@]} -gt 0 ]; then echo "failed phases: ${failed[*]}"; exit 1; fi
echo "all phases passed"
