"""docs/troubleshooting.md is generated from the catalogue and up to date."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO
from tests.reliability.catalogue import CASES


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


def test_every_case_is_on_the_page():
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    for case in CASES:
        assert f"### {case.title}\n" in page and case.fragment in page, case.id
