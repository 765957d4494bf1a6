#!/usr/bin/env bash
# cptune's GPU checks in one device call (benchmarks/gpu/LEASE.md says how to run it).
#
#   bash benchmarks/gpu/lease.sh              # on the GPU machine: every phase, <= LEASE_SECONDS (560)
#   bash benchmarks/gpu/lease.sh --dry-run    # here, on CPU, in the image-like environment
#   bash benchmarks/gpu/lease.sh --check-b    # check B instead: the longest sequence, every feature on
#
# Phases, in order of value, each under a hard limit (timeout -k 10 ends its whole process
# group, spawned ranks included) that is also cut to the time the lease has left:
#   setup     <=  30 s  carried wheels into $SITE, env.json (GPU, driver, CUDA, versions, commit)
#   kernels   <=  90 s  torch's FlashAttention-2 through cptune's adapter vs float64, bf16/fp16;
#                       kernel time vs fused SDPA at 16K (JSON written before the timing)
#   multirank <= 150 s  cp=2 (then cp=4 if time is left) of the real multi-rank code on one GPU
#                       against cp=1, attention and LoRA models (JSON after each cp size)
#   paths     <= 220 s  tokens/s, 8B-shaped LoRA at cp=1: ring-flash-attn on torch's kernels vs
#                       SDPA at 8K, 16K, 32K (JSON after each length)
#   features  the rest  (if >= 90 s are left) tokens/s and peak at 64K, today's settings vs every
#                       memory feature (JSON after each setting)
# Files in $OUT: env.json kernels.json multirank.json paths.json features.json lease.log (6).
#
# --check-b (issue 27's check B, one call): setup, then feature_speed with every memory feature at
# 32K and 96K (one step each: the peaks give a line), then one step at the longest length the line
# allows within an H100's memory (--gpu-gib 79.6 caps an H200 to it) and the host RAM (~350 s by the
# FLOP count), then one step at the next length (+16K), which should run out of memory at its first
# layer backward (~100 s in); longest.json records that it started before it starts, so a step cut
# by the time limit still says how far it got (lease.log has when its forward ended).
# Files: env.json longest.json lease.log.
#
# --two-level (issue 30, one call): setup, kernels and multirank as above (their newer cases: the document
# attention a KV head at a time, sliding windows, sinks on the zigzag ring), then Llama-3.1-8B's layers
# cut to 8 (the step's time a quarter, each layer's working set the same) under every memory feature
# with recompute_norms: one-level vs two-level offloading at 32K and 96K, then one two-level step at
# 524,288 tokens within 69.4 GiB (an H100's 79.6 less the 10.2 GiB of states of the 24 layers left out),
# each row with its peak at full depth (measured + those states) and the pinned host memory it took.
# Files: env.json kernels.json multirank.json two_level.json half_million.json lease.log.
# A failing phase is logged and the next one still runs; exit 1 if any failed.
set -uo pipefail

DRY=0
CHECK_B=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        --check-b) CHECK_B=1 ;;
        --trainer) CHECK_B=2 ;;
        --two-level) CHECK_B=3 ;;
        *) echo "lease.sh: unknown option $arg (known: --dry-run, --check-b, --trainer, --two-level)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-outputs/gpu-lease}
LEASE_SECONDS=${LEASE_SECONDS:-560}
SITE=${SITE:-/tmp/cptune-site}
IMAGE_ENV=${IMAGE_ENV:-/tmp/cptune-image-env}
if [ "$DRY" = 1 ]; then
    PYTHON=${PYTHON:-$IMAGE_ENV/bin/python}
    if [ ! -x "$PYTHON" ]; then
        echo "lease.sh --dry-run: no image-like environment at $IMAGE_ENV; run bash benchmarks/gpu/image_env.sh first" >&2
        exit 2
    fi
else
    PYTHON=${PYTHON:-python3}
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/lease.log
: > "$LOG"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export CPTUNE_COMMIT=${CPTUNE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
START=$SECONDS
failed=()

say() { echo "$*" | tee -a "$LOG"; }

# phase NAME CAP_SECONDS MIN_SECONDS COMMAND...: run under min(cap, time left - 5 s), if MIN is left.
phase() {
    local name=$1 cap=$2 need=$3; shift 3
    local left=$((LEASE_SECONDS - (SECONDS - START) - 5))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt "$need" ]; then
        say "=== $name: skipped (${left} s left of the lease, needs ${need} s)"
        return
    fi
    say "=== $name (limit ${limit} s, $((SECONDS - START)) s into the lease)"
    local began=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    [ "$status" = 124 ] || [ "$status" = 137 ] && say "=== $name: stopped at its ${limit} s limit"
    say "=== $name: exit $status after $((SECONDS - began)) s"
    [ "$status" = 0 ] || failed+=("$name")
}

setup() {
    if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || return 1
    fi
    PYTHONPATH="$PYTHONPATH:$SITE" "$PYTHON" -m benchmarks.gpu.lease_env "$OUT/env.json"
}
export -f setup  # timeout runs it in a child bash
export PYTHON SITE OUT

if [ "$DRY" = 1 ]; then
    phase setup 120 5 bash -c setup   # pip on 2 cores is slower than on the GPU machine
else
    phase setup 30 5 bash -c setup
fi
export PYTHONPATH="$PYTHONPATH:$SITE"
# --trainer: check B again on the step as cptune's Trainer runs a bf16 recipe (autocast, cptune's
# patches; feature_speed's "trainer" setting), with the long step capped to what the lease has left:
# its time grows at most as the square of the length from check B's 281.2 s at 294,912 tokens.
step_budget() { echo $((LEASE_SECONDS - (SECONDS - START) - 150)); }
# --two-level: 8 of the 32 layers; the cap leaves room for the other 24 layers' states (10.2 GiB)
TWO_LEVEL=(--settings trainer_norms,trainer_two_level --layers 8 --steps 1 --warmup 0)
HALF_MILLION=(--settings trainer_two_level --layers 8 --steps 1 --warmup 0)
if [ "$CHECK_B" = 3 ] && [ "$DRY" = 1 ]; then
    phase kernels 90 20 "$PYTHON" -m benchmarks.gpu.check_kernels --dry-run --out "$OUT/kernels.json"
    phase multirank 150 30 "$PYTHON" -m benchmarks.gpu.multirank --device cpu --tiny --cp-sizes 2,4 --budget 140 --out "$OUT/multirank.json"
    phase two_level 120 20 "$PYTHON" -m benchmarks.gpu.feature_speed --dry-run "${TWO_LEVEL[@]}" --out "$OUT/two_level.json"
    phase half_million 120 20 "$PYTHON" -m benchmarks.gpu.feature_speed --dry-run "${HALF_MILLION[@]}" --out "$OUT/half_million.json"
elif [ "$CHECK_B" = 3 ]; then
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    phase kernels 60 20 "$PYTHON" -m benchmarks.gpu.check_kernels --out "$OUT/kernels.json"
    phase multirank 130 30 "$PYTHON" -m benchmarks.gpu.multirank --cp-sizes 2,4 --budget 120 --out "$OUT/multirank.json"
    phase two_level 80 30 "$PYTHON" -m benchmarks.gpu.feature_speed "${TWO_LEVEL[@]}" --lengths 32768,98304 \
        --gpu-gib 69.4 --out "$OUT/two_level.json"
    phase half_million 600 200 "$PYTHON" -m benchmarks.gpu.feature_speed "${HALF_MILLION[@]}" --lengths 524288 \
        --gpu-gib 69.4 --out "$OUT/half_million.json"
elif [ "$CHECK_B" = 2 ] && [ "$DRY" = 1 ]; then
    phase longest 300 30 "$PYTHON" -m benchmarks.gpu.feature_speed --dry-run --settings trainer --longest \
        --time-anchor 512:1 --step-budget 4 --out "$OUT/longest.json"
elif [ "$CHECK_B" = 2 ]; then
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    phase longest 600 300 "$PYTHON" -m benchmarks.gpu.feature_speed --settings trainer --lengths 32768,98304 \
        --steps 1 --warmup 0 --longest --gpu-gib 79.6 --time-anchor 294912:281.2 --step-budget "$(step_budget)" \
        --out "$OUT/longest.json"
elif [ "$CHECK_B" = 1 ] && [ "$DRY" = 1 ]; then
    phase longest 300 30 "$PYTHON" -m benchmarks.gpu.feature_speed --dry-run --settings everything --longest --above --out "$OUT/longest.json"
elif [ "$CHECK_B" = 1 ]; then
    # measured: the default allocator lost ~10 GiB to fragmentation at 278K tokens (LEASE.md)
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    phase longest 600 300 "$PYTHON" -m benchmarks.gpu.feature_speed --settings everything --lengths 32768,98304 \
        --steps 1 --warmup 0 --longest --above --gpu-gib 79.6 --out "$OUT/longest.json"
elif [ "$DRY" = 1 ]; then
    phase kernels 90 20 "$PYTHON" -m benchmarks.gpu.check_kernels --dry-run --time --out "$OUT/kernels.json"
    phase multirank 150 30 "$PYTHON" -m benchmarks.gpu.multirank --device cpu --tiny --cp-sizes 2,4 --budget 140 --out "$OUT/multirank.json"
    phase paths 220 30 "$PYTHON" -m benchmarks.gpu.attention_paths --dry-run --out "$OUT/paths.json"
    phase features 200 30 "$PYTHON" -m benchmarks.gpu.feature_speed --dry-run --out "$OUT/features.json"
else
    phase kernels 90 20 "$PYTHON" -m benchmarks.gpu.check_kernels --time --out "$OUT/kernels.json"
    phase multirank 150 30 "$PYTHON" -m benchmarks.gpu.multirank --cp-sizes 2,4 --budget 140 --out "$OUT/multirank.json"
    phase paths 220 60 "$PYTHON" -m benchmarks.gpu.attention_paths --lengths 8192,16384,32768 --out "$OUT/paths.json"
    phase features 600 90 "$PYTHON" -m benchmarks.gpu.feature_speed --lengths 65536 --out "$OUT/features.json"
fi
say "=== lease: $((SECONDS - START)) s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
if [ ${#failed[@]} -gt 0 ]; then say "failed phases: ${failed[*]}"; exit 1; fi
say "all phases passed"
