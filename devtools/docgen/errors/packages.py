"""Troubleshooting entries of the section "Installed packages and devices"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "Installed packages and devices"
NOTE: str | None = None
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "optimizer-needs-other-hardware",
        SECTION,
        "An optimizer for other hardware (adamw_torch_xla, adamw_torch_npu_fused)",
        "optimizer: adamw_torch_xla runs on TPUs (torch_xla) only; use adamw_torch (or adamw_torch_fused) here.",
        "Use `adamw_torch` or `adamw_torch_fused` (or an 8-bit one from bitsandbytes).",
    ),
    Entry(
        "optimizer-package-missing",
        SECTION,
        "An optimizer whose package is not installed",
        "optimizer: schedule_free_adamw needs the schedulefree package, which is not installed",
        "Install the package the message names, or use another optimizer (`adamw_torch`, `adamw_bnb_8bit`, ...). "
        "Checked before any process starts.",
    ),
)

DOCUMENTED: tuple[Documented, ...] = (
    Documented(
        "deepspeed-not-installed",
        SECTION,
        "cp_backend: deepspeed without DeepSpeed installed",
        "cp_backend: deepspeed needs DeepSpeed, which cannot be imported here",
        "Install it as the message says (`DS_BUILD_OPS=0 pip install 'deepspeed>=0.19,<0.20'`, or the "
        "`cptune[deepspeed]` extra), or use another `cp_backend`. Checked before any process starts.",
        raised_in="src/cptune/parallel/backends/deepspeed_ulysses/sharding.py",
        why_not_in_catalogue="the catalogue runs where DeepSpeed is installed; the test shadows it with a "
        "package that fails to import",
        tested_by="tests/run/test_cli_errors.py::test_deepspeed_not_installed",
    ),
    Documented(
        "zstandard-not-installed",
        SECTION,
        "A .zst data file without the zstandard package",
        "is zstd-compressed and the zstandard package is not installed",
        "cptune depends on zstandard, so this means a broken install: `pip install zstandard`, or decompress "
        "the file (`zstd -d rows.jsonl.zst`) and point the dataset at the plain file.",
        raised_in="src/cptune/data/compression.py",
        why_not_in_catalogue="zstandard is installed wherever cptune is; the test hides it from the import",
        tested_by="tests/data/test_sources.py::test_zstd_without_zstandard_says_how_to_decompress",
    ),
    Documented(
        "ring-flash-attn-not-installed",
        SECTION,
        "cp_backend: ring-flash-attn without ring-flash-attn installed",
        "cp_backend: ring-flash-attn needs the ring-flash-attn package, which cannot be imported here",
        "Install it as the message says (`pip install ring-flash-attn==0.1.8`; flash-attn itself is optional "
        "on CPU), or use another `cp_backend`. Checked before any process starts.",
        raised_in="src/cptune/parallel/backends/ring_flash_attn/sharding.py",
        why_not_in_catalogue="the catalogue runs where ring-flash-attn is installed; the test shadows it with "
        "a package that fails to import",
        tested_by="tests/run/test_cli_errors.py::test_ring_flash_attn_not_importable",
    ),
    Documented(
        "ring-flash-attn-fp32-on-gpu",
        SECTION,
        "cp_backend: ring-flash-attn in fp32 on a GPU with flash-attn",
        "cp_backend: ring-flash-attn runs flash-attn's CUDA kernels, which support bf16 and fp16 only",
        "Set `bf16: true` (or `fp16: true`). cptune's CPU kernels take fp32, so the same recipe dry-runs "
        "on a laptop. Checked before any process starts.",
        raised_in="src/cptune/parallel/backends/ring_flash_attn/kernel_choice.py",
        why_not_in_catalogue="only on a machine with a CUDA GPU and flash-attn",
        tested_by="tests/run/test_preflight.py::test_fp32_ring_flash_attn_on_a_gpu_is_refused_before_launching",
    ),
    Documented(
        "patch-version-mismatch",
        SECTION,
        "Library versions that cptune's patches were not written for",
        "cptune cannot patch the installed libraries (",
        "Each problem line names the library, the versions the patch was written for and the installed one. "
        "Install the versions cptune pins (`pip install -e .` in a fresh environment), or use a cptune "
        "release made for your versions; `cptune validate` lists the problems without training. Raised when "
        "training starts, in every process, before any step.",
        raised_in="src/cptune/patches/core.py",
        why_not_in_catalogue="it needs installed libraries of other versions",
        tested_by="tests/patches/test_core.py::test_all_problems_reported_at_once_before_touching_anything",
    ),
    Documented(
        "bitsandbytes-not-installed",
        SECTION,
        "load_in_4bit or load_in_8bit without bitsandbytes",
        "quantizing the base model needs bitsandbytes, which is not installed",
        "Install it: `pip install 'cptune[quantization]'` (bitsandbytes 0.50 has CPU kernels too, so a QLoRA "
        "recipe dry-runs on a laptop). Checked before any process starts.",
        raised_in="src/cptune/models/quantization.py",
        why_not_in_catalogue="the catalogue runs where bitsandbytes is installed; the test hides it",
        tested_by="tests/models/test_quantization.py::test_missing_bitsandbytes_is_refused_before_launching",
    ),
    Documented(
        "wandb-not-installed",
        SECTION,
        "W&B keys without the wandb package",
        "logging to Weights & Biases needs the wandb package, which is not installed",
        "Install it (`pip install 'cptune[wandb]'`), or remove `wandb_project` / `use_wandb`. Checked before "
        "any process starts.",
        raised_in="src/cptune/run/training/tracking.py",
        why_not_in_catalogue="the catalogue runs where wandb is installed; the test hides it",
        tested_by="tests/run/test_tracking.py::test_wandb_missing_is_refused",
    ),
)
