"""The GPU-side scripts import only what the GPU machine's image holds, plus the carried wheels.

The lent GPU machine has no pydantic, datasets or deepspeed, and no network: a GPU-side module
that reaches one of them fails on every rank there (issue 27: ``multirank_cases`` reached
pydantic through ``cptune.data.collator``). CI cannot install the image's torch beside the
suite's, so it walks the imports instead (:mod:`benchmarks.gpu.image`); ``bash
benchmarks/gpu/lease.sh --dry-run`` runs the scripts in an image-like environment.
"""

from __future__ import annotations

import ast
from pathlib import Path

from benchmarks.gpu import image

ROOT = Path(__file__).resolve().parents[2]


def test_every_gpu_side_module_imports_only_what_the_image_has():
    assert image.outside_image() == []


def test_the_walk_finds_pydantic_behind_the_collator_as_in_the_bug_it_guards_against():
    found = image.outside_image(("cptune.data.collator",))
    assert {m.package for m in found} == {"pydantic"}
    recipe = next(m for m in found if m.module == "cptune.config.recipe")
    assert recipe.chain == ("cptune.data.collator", "cptune.config.recipe")
    assert "pydantic (imported by cptune.config.recipe:" in str(recipe)


def test_what_counts_as_an_import():
    source = """
from typing import TYPE_CHECKING
import pydantic
if TYPE_CHECKING:
    import datasets
try:
    import flash_attn
except ImportError:
    flash_attn = None

def later():
    import wandb
    import deepspeed
    from deepspeed.runtime import zero

import deepspeed.comm
"""
    found = [name for name, _ in image._imports(ast.parse(source), "cptune.x")]
    assert "pydantic" in found and "wandb" in found and "deepspeed.comm" in found
    assert "datasets" not in found and "flash_attn" not in found
    assert "deepspeed" not in found and "deepspeed.runtime" not in found  # inside a function: another path


def test_entry_points_are_the_modules_lease_sh_runs():
    script = (ROOT / "benchmarks" / "gpu" / "lease.sh").read_text()
    run = {word for word in script.split() if word.startswith("benchmarks.gpu.")}
    assert run <= set(image.GPU_ENTRY_POINTS), run - set(image.GPU_ENTRY_POINTS)
    for module in image.GPU_ENTRY_POINTS:
        assert image._source(module) is not None, module
