"""Every error has its troubleshooting text, and the page shows it (that the page is up to date: tests/docs)."""

from __future__ import annotations

import ast

from devtools.docgen import errors
from tests.conftest import REPO
from tests.reliability.catalogue import CASES, DOCUMENTED


def test_every_case_has_its_entry_and_every_entry_its_case():
    cases = [case.id for case in CASES]
    entries = [entry.id for module in errors.SECTION_MODULES for entry in module.ENTRIES]
    assert len(entries) == len(set(entries)) == len(errors.ENTRIES)
    assert sorted(set(cases) - set(entries)) == [], "cases without text in devtools/docgen/errors/"
    assert sorted(set(entries) - set(cases)) == [], (
        "entries that no case in tests/reliability/catalogue/ meets"
    )
    for module in errors.SECTION_MODULES:
        assert {e.section for e in (*module.ENTRIES, *module.DOCUMENTED)} <= {module.SECTION}, module.__name__
    for entry in (*errors.ENTRIES.values(), *errors.DOCUMENTED):
        assert entry.title.strip() and entry.fragment.strip() and entry.fix.strip(), entry.id


def test_each_case_module_matches_its_section():
    from tests.reliability import catalogue

    for module in errors.SECTION_MODULES:
        name = module.__name__.rsplit(".", 1)[1]
        cases = getattr(catalogue, name).CASES if hasattr(catalogue, name) else ()
        assert [case.id for case in cases] == [entry.id for entry in module.ENTRIES], name


def test_every_case_and_documented_entry_is_on_the_page():
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    for entry in (*CASES, *DOCUMENTED):
        assert f"### {entry.title}\n" in page and entry.fragment in page, entry.id
    for entry in DOCUMENTED:
        assert f"Raised in `{entry.raised_in}`" in page, entry.id


def test_the_doc_generators_do_not_import_the_test_tree_nor_the_package_devtools():
    def imported(folder: str) -> dict[str, set[str]]:
        found = {}
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = {
                alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
            }
            names |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
            found[path.relative_to(REPO).as_posix()] = {name.split(".")[0] for name in names}
        return found

    assert {path for path, names in imported("devtools").items() if "tests" in names} == set()
    assert {path for path, names in imported("src/cptune").items() if names & {"tests", "devtools"}} == set()
