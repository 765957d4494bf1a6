"""Turn a GPU lease's output files into one entry of ``docs/benchmarks/gpu_results.json``.

Usage (here, after the lease; the directories are where the device tool put each call's files)::

    python -m benchmarks.gpu.lease_report DIR [DIR ...]                       # print the entry
    python -m benchmarks.gpu.lease_report DIR [DIR ...] --add docs/benchmarks/gpu_results.json
    python -m benchmarks --render-only                                       # re-render the page

Reads whatever of ``env.json``, ``kernels.json``, ``multirank.json``, ``paths.json`` and
``features.json`` the directories hold (``benchmarks/gpu/lease.sh`` writes them), and of
``strides.json`` (``attention_paths --heads-k-strides ... --profile``), ``longest.json``
(``lease.sh --check-b``), ``two_level.json``, ``half_million.json`` and ``longer.json`` (``lease.sh
--two-level`` and a call after it: feature_speed's rows, put together with features.json's) and ``cudnn.json``
(``benchmarks.gpu.cudnn_probe``), and records the machine, the versions, the commit the lease ran
(``env.json``'s, else this checkout's), the kernels behind ring-flash-attn and the numbers, as measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def _read(directories: list[Path], name: str) -> dict[str, Any] | None:
    found = [d / name for d in directories if (d / name).exists()]
    return json.loads(found[-1].read_text()) if found else None


def commit() -> str:
    """This checkout's commit (what the lease copied), marked when the tree had uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


DEPTH_FILES = ("two_level", "half_million", "longer")


def entry(directories: list[Path], label: str | None = None) -> dict[str, Any]:
    env = _read(directories, "env.json") or {}
    names = ("kernels", "multirank", "paths", "features", "strides", "cudnn", "longest")
    kernels, multirank, paths, features, strides, cudnn, longest = (
        _read(directories, f"{n}.json") for n in names
    )
    device = env.get("device", "unknown GPU")
    run: dict[str, Any] = {
        "label": label or f"one {device}: kernels, cp=2/4 on one GPU, attention paths at cp=1",
        "date": env.get("date", ""),
        "machine": {
            "device": device,
            "gpus": env.get("gpus", 1),
            "gpu_memory_gib": env.get("gpu_memory_gib"),
            "driver": env.get("driver"),
            "python": env.get("python"),
            "torch": env.get("torch"),
            "cuda": env.get("cuda"),
            "transformers": env.get("transformers"),
            "accelerate": env.get("accelerate"),
            "peft": env.get("peft"),
            "flash_attn": env.get("flash_attn") or "not installed",
        },
        "commit": env["commit"][:10] if env.get("commit", "unknown") != "unknown" else commit(),
        "command": "bash benchmarks/gpu/lease.sh (benchmarks/gpu/LEASE.md)",
        "kernels": (paths or {}).get("kernels") or ((kernels or {}).get("environment") or {}).get("kernels"),
        "notes": [],
    }
    if kernels:
        run["kernel_checks"] = kernels["checks"]
        run["kernel_timing"] = kernels.get("timing")
    if multirank:
        run["multirank"] = multirank
    if paths:
        settings = paths.get("settings", {})
        run["model"] = (
            f"Llama-3.1-8B-shaped ({settings.get('layers', 32)} layers), random bf16 weights built in memory, "
            "LoRA r=16 on every linear layer, gradient checkpointing, one causal document per step"
        )
        run["shape_layers"] = settings.get("layers")
        run["throughput"] = [
            {"path": path, "seq_len": int(length), **row}
            for length, rows in paths["lengths"].items()
            for path, row in rows.items()
        ]
    # feature_speed's files of lease.sh --two-level (and a longer step after it): one table with features.json's
    parts = [p for p in (features, *(_read(directories, f"{n}.json") for n in DEPTH_FILES)) if p]
    if parts:
        run["memory_features"] = {**parts[0], "rows": [row for part in parts for row in part["rows"]]}
    if strides:
        run["strides"] = {
            "throughput": [
                {"path": path, "seq_len": int(length), **row}
                for length, rows in strides["lengths"].items()
                for path, row in rows.items()
            ],
            "profile": strides.get("profile", {}),
            "profile_length": strides["settings"]["lengths"][0] if strides.get("profile") else None,
        }
    if cudnn:
        run["cudnn_probe"] = cudnn
    if longest:
        run["longest"] = longest
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.lease_report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("directories", type=Path, nargs="+")
    parser.add_argument("--label", help="the section title on the page")
    parser.add_argument("--add", type=Path, help="append the entry to this gpu_results.json")
    args = parser.parse_args(argv)
    run = entry(args.directories, args.label)
    print(json.dumps(run, indent=1))
    if args.add:
        results = json.loads(args.add.read_text())
        results["runs"].append(run)
        args.add.write_text(json.dumps(results, indent=1) + "\n")
        print(f"added to {args.add}; update its not_measured list, then: python -m benchmarks --render-only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
