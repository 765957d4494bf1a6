"""Generated documentation: the recipe reference, the list of patches, and the Axolotl migration table.

Both pages are rendered from the code itself (the pydantic :class:`~cptune.config.recipe.Recipe`
with its cross-key rules and the Axolotl keys cptune refuses; the :class:`~cptune.patches.core.Patch`
objects of the registry), so they cannot drift from what cptune does. Write them with
``python -m cptune.docs``; ``python -m cptune.docs --check`` (and the test suite) fails when a
committed page differs from what the code renders.
"""

from __future__ import annotations

from cptune.docs.axolotl_migration import render_axolotl_migration
from cptune.docs.patch_list import render_patch_list
from cptune.docs.recipe_reference import render_recipe_reference

REGENERATE_COMMAND = "python -m cptune.docs"
"""The command that rewrites the generated pages (run it from the repository root)."""


def generated_pages() -> dict[str, str]:
    """Relative path (from the repository root) → the page's full text."""
    return {
        "docs/reference/recipe.md": render_recipe_reference(),
        "docs/reference/patches.md": render_patch_list(),
        "docs/migrating-from-axolotl.md": render_axolotl_migration(),
    }


__all__ = [
    "REGENERATE_COMMAND",
    "generated_pages",
    "render_axolotl_migration",
    "render_patch_list",
    "render_recipe_reference",
]
