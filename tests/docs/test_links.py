"""Relative links in README.md and docs/ point at files that exist, and anchors at headings that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, spaces to '-', punctuation other than '-' and '_' dropped."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.M):
        text = heading.strip().lower().replace("`", "")
        anchors.add("".join(ch for ch in text if ch.isalnum() or ch in "-_ ").replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"
