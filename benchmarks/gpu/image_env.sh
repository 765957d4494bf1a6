#!/usr/bin/env bash
# An environment like the GPU machine's image, on CPU, for the dry run of a lease
# (bash benchmarks/gpu/lease.sh --dry-run uses it, never .venv).
#
#   bash benchmarks/gpu/image_env.sh [DIR]      # default /tmp/cptune-image-env; ~3 GB, minutes
#
# The image (the device tool's KINDS.md): Python 3.12, torch 2.11.0, transformers 5.17.0,
# accelerate 1.15.0, peft, numpy, pyyaml, safetensors, tokenizers, typer; no pydantic, datasets,
# deepspeed or flash-attn. PyPI's torch 2.11.0 for Linux is a CUDA build: it runs on the CPU here
# (torch.cuda.is_available() is False), as the image's does without a GPU. What a lease carries
# (.whl/: transformers 5.23, peft 0.21.2, ring-flash-attn) is installed by lease.sh into a
# --target folder, exactly as on the GPU machine, not into this environment.
set -euo pipefail
DIR=${1:-/tmp/cptune-image-env}
if [ ! -x "$DIR/bin/python" ]; then
    PY=$(command -v python3.12 || true)
    # pyenv's shim is on PATH even when 3.12 is not the active version; it fails when run
    if [ -n "$PY" ] && ! "$PY" -c '' 2>/dev/null; then PY=; fi
    if [ -z "$PY" ] && command -v pyenv >/dev/null; then PY=$(PYENV_VERSION=$(pyenv versions --bare | grep '^3\.12' | tail -1) pyenv which python); fi
    [ -n "$PY" ] || { echo "image_env: no Python 3.12 found (the GPU image's Python)" >&2; exit 1; }
    "$PY" -m venv "$DIR"
fi
"$DIR/bin/python" -m pip install -q --disable-pip-version-check \
    torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 peft numpy pyyaml safetensors tokenizers typer
# typer pulls pydantic on PyPI; the image has none: take it out so an import of it fails here too.
"$DIR/bin/python" -m pip uninstall -q -y pydantic pydantic_core datasets deepspeed flash-attn 2>/dev/null || true
"$DIR/bin/python" - <<'PY'
import importlib.util, sys, torch, transformers, accelerate
absent = [m for m in ("pydantic", "datasets", "deepspeed", "flash_attn") if importlib.util.find_spec(m)]
assert not absent, f"the image has none of {absent}"
print(f"image-like env: Python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, accelerate {accelerate.__version__}")
PY
