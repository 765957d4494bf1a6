"""Catalogue cases of the section "The recipe file" (their text: devtools/docgen/errors/recipe_file.py)."""

from __future__ import annotations

from tests.reliability.catalogue.framework import Case

CASES: tuple[Case, ...] = (
    Case(
        "yaml-malformed",
        recipe_text="base_model: tiny\nsequence_len: 128: 64\n",
        subprocess=True,
    ),
    Case(
        "yaml-python-tag",
        recipe_text='base_model: !!python/object/apply:os.system ["echo pwned"]\n',
    ),
    Case(
        "yaml-not-a-mapping",
        recipe_text="- base_model: tiny\n",
    ),
    Case(
        "recipe-not-utf8",
        recipe_text=b"base_model: \xff\xfe\n",
    ),
    Case(
        "recipe-missing",
        recipe_at="no-such-recipe.yaml",
    ),
    Case(
        "recipe-is-folder",
        recipe_at="data",
    ),
    Case(
        "recipe-empty",
        recipe_text="# a recipe that was never filled in\n",
    ),
    Case(
        "yaml-duplicate-key",
        extra_yaml="sequence_len: 64\n",
    ),
)
