"""``python -m devtools.docgen [--check] [--root DIR]``: write or check every generated documentation page."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from devtools.docgen import REGENERATE_COMMAND, generated_pages


def stale_pages(root: Path) -> list[str]:
    """The generated pages under ``root`` that are missing or differ from what the code renders."""
    stale = []
    for relative, text in generated_pages().items():
        path = root / relative
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(relative)
    return stale


def write_pages(root: Path) -> list[str]:
    """Write every generated page under ``root``; returns the pages that changed."""
    changed = []
    for relative, text in generated_pages().items():
        path = root / relative
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        changed.append(relative)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=REGENERATE_COMMAND, description="Write (or check) every generated page under docs/."
    )
    parser.add_argument("--check", action="store_true", help="Change nothing; exit 1 if a page is stale.")
    parser.add_argument(
        "--root", type=Path, default=Path.cwd(), help="Repository root (default: the current folder)."
    )
    args = parser.parse_args(argv)
    if not (args.root / "docs").is_dir():
        print(
            f"{args.root.resolve()} has no docs/ folder: run this from the repository root, or pass --root."
        )
        return 2
    if args.check:
        stale = stale_pages(args.root)
        for relative in stale:
            print(f"{relative} is out of date with the code; regenerate it with `{REGENERATE_COMMAND}`.")
        return 1 if stale else 0
    for relative in write_pages(args.root):
        print(f"wrote {relative}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
