"""The machine a lease ran on, as ``env.json``: GPU, driver, CUDA, versions, commit, kernels.

Usage: ``python -m benchmarks.gpu.lease_env OUT/env.json`` (lease.sh's setup phase).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_smi(query: str) -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def environment() -> dict[str, Any]:
    import torch
    import transformers

    from cptune.parallel.kernels import torch_flash

    cuda = torch.cuda.is_available()
    return {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
        "gpus": torch.cuda.device_count(),
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        if cuda
        else None,
        "driver": _nvidia_smi("driver_version"),
        "clocks": _nvidia_smi("clocks.sm,clocks.max.sm,power.limit"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        **{name: _version(name) for name in ("accelerate", "peft", "ring-flash-attn", "flash-attn")},
        "commit": os.environ.get("CPTUNE_COMMIT", "unknown"),
        "kernels": torch_flash.KERNELS,
        "flash_unavailable_reason": torch_flash.unavailable_reason() if cuda else "no CUDA (dry run)",
    }


def main(argv: list[str] | None = None) -> int:
    out = Path((sys.argv[1:] if argv is None else argv)[0])
    env = environment()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(env, indent=1))
    print(json.dumps(env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
