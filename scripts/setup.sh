#!/usr/bin/env bash
# Create (or update) .venv with torch and cptune installed for development.
# Safe to run again: what is already installed is kept.
#
# torch goes in first and on its own, pinned, from the configured package index:
# which build that is depends on the index (plain PyPI gives Linux the multi-GB
# CUDA build). For the CPU build, install it into .venv first (e.g. from PyTorch's
# CPU index, https://download.pytorch.org/whl/cpu) and this script keeps it.
#
#   --deepspeed  also install the deepspeed extra (cp_backend: deepspeed), as the
#                test suite does (scripts/test.sh); the quickstart does without it.
#
# The quantization (bitsandbytes: QLoRA, 8-bit optimizers) and wandb extras are always
# installed: the tests of Axolotl's QLoRA recipes and of W&B offline logging need them.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="test,quantization,wandb"
for arg in "$@"; do
  case "$arg" in
    --deepspeed) extras="test,quantization,wandb,deepspeed" ;;
    *) echo "cptune setup: unknown option $arg (known: --deepspeed)" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

log=$(mktemp)
trap 'rm -f "$log"' EXIT
pip_install() {
  # Quiet on success; the whole log on failure.
  if ! python -m pip install "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "cptune setup: pip install $* failed" >&2
    exit 1
  fi
}

if ! python -c "import torch" >/dev/null 2>&1; then
  echo "cptune setup: installing torch==2.13.0 from the configured package index (plain PyPI gives Linux" \
    "the CUDA build; for the CPU build, install torch from https://download.pytorch.org/whl/cpu into .venv" \
    "first, and this script keeps it)"
  pip_install "torch==2.13.0"
fi
# What the install below depends on: the package's metadata and the tested versions. A run that
# finds them unchanged since its last install, with every extra asked for installed then and
# cptune importable from this checkout, installs nothing (pip would spend most of a minute
# finding that out).
stamp=.venv/.cptune-setup
inputs=$(python -c 'import hashlib, sys; print(hashlib.sha256(b"".join(open(f, "rb").read() for f in sys.argv[1:])).hexdigest())' \
  pyproject.toml constraints/tested.txt)
up_to_date() {
  [ -f "$stamp" ] || return 1
  read -r stamped_inputs stamped_extras <"$stamp" || return 1
  [ "$stamped_inputs" = "$inputs" ] || return 1
  for extra in ${extras//,/ }; do
    case ",$stamped_extras," in *",$extra,"*) ;; *) return 1 ;; esac
  done
  python -c "import cptune, sys; sys.exit(not cptune.__file__.startswith('$PWD/src/'))" >/dev/null 2>&1
}
if up_to_date; then
  echo "cptune setup: cptune and its dependencies are installed and unchanged (extras: $extras); nothing to install"
else
  echo "cptune setup: installing cptune and its dependencies (extras: $extras)"
  # DeepSpeed builds its C++/CUDA ops at install time unless told not to; cptune needs
  # none of them (DeepSpeed compiles what it uses on first use).
  export DS_BUILD_OPS=0
  rm -f "$stamp"
  pip_install -c constraints/tested.txt -e ".[$extras]"
  echo "$inputs $extras" >"$stamp"
fi
python -c "import cptune, torch, transformers; print(f'cptune setup: ok (torch {torch.__version__}, transformers {transformers.__version__})')"
