"""Every catalogue entry is on docs/troubleshooting.md (that the page is up to date: tests/docs)."""

from __future__ import annotations

from tests.conftest import REPO
from tests.reliability.catalogue import CASES, DOCUMENTED


def test_every_case_and_documented_entry_is_on_the_page():
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    for entry in (*CASES, *DOCUMENTED):
        assert f"### {entry.title}\n" in page and entry.fragment in page, entry.id
    for entry in DOCUMENTED:
        assert f"Raised in `{entry.raised_in}`" in page, entry.id
