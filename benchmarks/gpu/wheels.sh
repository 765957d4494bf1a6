#!/usr/bin/env bash
# The wheels a GPU lease carries (benchmarks/gpu/LEASE.md): what cptune pins and the GPU image lacks
# or has at another version (python 3.12 there; torch 2.11, accelerate 1.15 and the rest are used as
# installed). About 14 MiB of the 64 MiB a call may carry. flash-attn is not among them: PyPI has
# only its source, whose CUDA build takes about an hour.
set -euo pipefail
exclude=$(git rev-parse --git-path info/exclude); grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
for package in transformers==5.23.0 peft==0.21.2 ring-flash-attn==0.1.8; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$package"
done
du -sh .whl
