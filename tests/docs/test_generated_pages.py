"""The generated reference pages match the code, and the code gives them what they need."""

from __future__ import annotations

import inspect

import pytest

from cptune.config.data import DatasetConfig
from cptune.config.recipe import Recipe
from cptune.config.rules import RULES
from cptune.parallel.backends.table import BACKENDS
from cptune.patches.registry import build_patches
from devtools.docgen import REGENERATE_COMMAND, generated_pages
from devtools.docgen.__main__ import main, stale_pages
from devtools.docgen.patch_list import import_patches, run_patches
from devtools.docgen.recipe_reference import recipe_sections
from tests.conftest import REPO

PAGES = generated_pages()


@pytest.mark.parametrize("relative", sorted(PAGES))
def test_committed_page_is_up_to_date(relative: str):
    path = REPO / relative
    committed = path.read_text(encoding="utf-8") if path.is_file() else ""
    assert committed == PAGES[relative], (
        f"{relative} is out of date with the code. Regenerate it from the repository root with "
        f"`{REGENERATE_COMMAND}` and commit the result."
    )


@pytest.mark.parametrize("model", [Recipe, DatasetConfig])
def test_every_key_has_a_description(model):
    missing = [name for name, info in model.model_fields.items() if not (info.description or "").strip()]
    assert not missing, f"{model.__name__} keys without Field(description=...): {missing}"


def test_every_recipe_key_is_in_one_section():
    names = [name for _, fields in recipe_sections() for name in fields]
    assert sorted(names) == sorted(Recipe.model_fields)
    assert len(names) == len(set(names))
    assert "other" not in dict(recipe_sections())


def test_every_cross_key_rule_documents_itself():
    for rule in RULES:
        doc = inspect.getdoc(rule) or ""
        title, _, body = doc.partition("\n")
        assert title.strip() and "\n- " in "\n" + body.strip(), (
            f"{rule.__name__} needs a title and '- ' rules"
        )


def test_reference_names_every_key_and_every_refused_axolotl_key():
    from cptune.config.axolotl.keys import UNSUPPORTED_DATASET_KEYS, UNSUPPORTED_RECIPE_KEYS

    page = PAGES["docs/reference/recipe.md"]
    keys = [
        *Recipe.model_fields,
        *DatasetConfig.model_fields,
        *UNSUPPORTED_RECIPE_KEYS,
        *UNSUPPORTED_DATASET_KEYS,
    ]
    assert [key for key in keys if f"| `{key}` |" not in page] == []


def test_patch_page_lists_every_patch_of_every_backend():
    page = PAGES["docs/reference/patches.md"]
    names = {p.name for backend in BACKENDS for p in build_patches(BACKENDS[backend], BACKENDS.values())}
    at_import = {patch.name for _, found in import_patches() for patch, _ in found}
    names |= at_import
    assert names == {p.name for p in run_patches()} | at_import
    for name in names:
        assert f"### {name}\n" in page


def test_check_command_reports_a_stale_page(tmp_path, capsys):
    assert stale_pages(REPO) == []
    for relative, text in PAGES.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text, encoding="utf-8")
    assert main(["--check", "--root", str(tmp_path)]) == 0
    (tmp_path / "docs/reference/patches.md").write_text("old\n", encoding="utf-8")
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert (
        f"docs/reference/patches.md is out of date with the code; regenerate it with `{REGENERATE_COMMAND}`"
        in (capsys.readouterr().out)
    )
    assert main(["--root", str(tmp_path)]) == 0
    assert stale_pages(tmp_path) == []
