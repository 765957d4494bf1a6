"""docs/troubleshooting.md is generated from the catalogue and up to date."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO
from tests.reliability.catalogue import CASES, DOCUMENTED


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_troubleshooting", REPO / "scripts" / "gen_troubleshooting.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_troubleshooting_page_is_up_to_date():
    generator = load_generator()
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    assert page == generator.render(), "run: python scripts/gen_troubleshooting.py"


def test_every_case_and_documented_entry_is_on_the_page():
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    for entry in (*CASES, *DOCUMENTED):
        assert f"### {entry.title}\n" in page and entry.fragment in page, entry.id
    for entry in DOCUMENTED:
        assert f"Raised in `{entry.raised_in}`" in page, entry.id
