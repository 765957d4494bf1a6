"""Every generated documentation page, rendered from the code and the committed results.

- ``docs/reference/recipe.md``: the pydantic :class:`~cptune.config.recipe.Recipe`, its cross-key
  rules and the Axolotl keys cptune refuses (:mod:`.recipe_reference`);
- ``docs/reference/patches.md``: the :class:`~cptune.patches.core.Patch` objects of the registry
  (:mod:`.patch_list`);
- ``docs/migrating-from-axolotl.md`` (:mod:`.axolotl_migration`);
- ``docs/troubleshooting.md``: every user-facing error with its fix (:mod:`.troubleshooting`);
- ``docs/benchmarks.md`` and its charts, re-rendered from ``docs/benchmarks/results.json`` without
  running anything (running them is ``python -m benchmarks``).

``python -m devtools.docgen`` (from the repository root) writes them all; with ``--check`` (and in
the test suite) it fails when a committed file differs from what is rendered.
"""

from __future__ import annotations

import json
from pathlib import Path

from devtools.docgen.axolotl_migration import render_axolotl_migration
from devtools.docgen.patch_list import render_patch_list
from devtools.docgen.recipe_reference import render_recipe_reference
from devtools.docgen.troubleshooting import render_troubleshooting

REGENERATE_COMMAND = "python -m devtools.docgen"
"""The command that rewrites every generated page (run it from the repository root)."""

REPO = Path(__file__).resolve().parents[2]
BENCHMARK_RESULTS = "docs/benchmarks/results.json"


def reference_pages() -> dict[str, str]:
    """The pages rendered from the code alone: relative path (from the repository root) → text."""
    return {
        "docs/reference/recipe.md": render_recipe_reference(),
        "docs/reference/patches.md": render_patch_list(),
        "docs/migrating-from-axolotl.md": render_axolotl_migration(),
        "docs/troubleshooting.md": render_troubleshooting(),
    }


def benchmark_pages() -> dict[str, str]:
    """``docs/benchmarks.md`` and its charts, rendered from the committed results (runs nothing)."""
    from benchmarks.__main__ import render_results_page

    results = json.loads((REPO / BENCHMARK_RESULTS).read_text(encoding="utf-8"))
    page, charts = render_results_page(results)
    return {"docs/benchmarks.md": page, **{f"docs/benchmarks/{name}": svg for name, svg in charts.items()}}


def generated_pages() -> dict[str, str]:
    """Every generated file: relative path (from the repository root) → its full text."""
    return {**reference_pages(), **benchmark_pages()}


__all__ = [
    "REGENERATE_COMMAND",
    "benchmark_pages",
    "generated_pages",
    "reference_pages",
    "render_axolotl_migration",
    "render_patch_list",
    "render_recipe_reference",
    "render_troubleshooting",
]
