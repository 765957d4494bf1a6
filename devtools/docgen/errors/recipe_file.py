"""Troubleshooting entries of the section "The recipe file"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "The recipe file"
NOTE: str | None = None
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "yaml-malformed",
        SECTION,
        "The recipe is not valid YAML",
        "not valid YAML at line 2, column 18: mapping values are not allowed here",
        "A bracket, quote or indentation is off at the line and column shown. Fix the YAML there; "
        "`python -c 'import yaml,sys; yaml.safe_load(open(sys.argv[1]))' recipe.yaml` shows the same.",
    ),
    Entry(
        "yaml-python-tag",
        SECTION,
        "The recipe uses a Python tag (`!!python/object...`)",
        "the YAML tag '!!python/object/apply:os.system' at line 1, column 13 is not allowed",
        "cptune reads recipes with YAML's safe loader, which never builds Python objects (a recipe cannot "
        "run code). Write the value as plain text, a number, a list or a mapping.",
    ),
    Entry(
        "yaml-not-a-mapping",
        SECTION,
        "The recipe is a list or a single value",
        "the recipe must be a mapping of keys to values, got list",
        "A recipe is a mapping (`key: value` lines at the top level). Remove the leading `- `.",
    ),
    Entry(
        "recipe-not-utf8",
        SECTION,
        "The recipe is not UTF-8 text",
        "the file is not UTF-8 text",
        "Save the recipe as UTF-8 (most editors have an encoding setting).",
    ),
    Entry(
        "recipe-missing",
        SECTION,
        "The recipe file does not exist",
        "recipe file not found:",
        "Check the path given to `cptune train`; relative paths are read from the current folder.",
    ),
    Entry(
        "recipe-is-folder",
        SECTION,
        "The recipe path is a folder",
        "is a folder, not a recipe file; give the path of the YAML file",
        "Give the path of the recipe's YAML file itself, not the folder it is in.",
    ),
    Entry(
        "recipe-empty",
        SECTION,
        "The recipe file is empty",
        "has 2 problems:\n  - base_model: is required but missing.\n  - datasets: is required but missing.",
        "An empty file (or one with only comments) is an empty recipe. Check that the file was saved; "
        "a recipe needs at least `base_model` and `datasets`.",
    ),
    Entry(
        "yaml-duplicate-key",
        SECTION,
        "A key written twice",
        "the key 'sequence_len' appears twice in one mapping (first at line",
        "YAML parsers keep the last of two equal keys without a word, so the first value would be "
        "silently ignored. cptune refuses instead: keep one of them.",
    ),
)

DOCUMENTED: tuple[Documented, ...] = ()
