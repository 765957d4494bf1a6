"""What docs/troubleshooting.md says about every user-facing error, one module per section.

Each section module holds the section's title (``SECTION``), an optional paragraph (``NOTE``),
its :class:`~devtools.docgen.errors.base.Entry` items (errors that tests/reliability/catalogue/
reproduces through the real CLI: one ``Case`` per entry, same id, and the test checks that the
command prints the entry's ``fragment``) and its :class:`~devtools.docgen.errors.base.Documented`
items (errors the catalogue cannot meet before a run starts, with the file that raises them and
the test that proves them; tests/reliability/test_error_coverage.py checks both kinds).
``python -m devtools.docgen`` renders the page from here alone.

To add an error: an ``Entry`` (id, ``SECTION``, title, message fragment, fix) in its section's
module here, and a ``Case`` with the same id (how to meet it) in the catalogue's module of the
same name; or a ``Documented`` entry here.
"""

from __future__ import annotations

from devtools.docgen.errors import (
    contradictions,
    data,
    deepspeed,
    during_run,
    evaluate,
    inference,
    library,
    model,
    output,
    packages,
    preference,
    recipe_file,
    recipe_keys,
)
from devtools.docgen.errors.base import Documented, Entry

SECTION_MODULES = (
    recipe_file,
    recipe_keys,
    contradictions,
    preference,
    model,
    deepspeed,
    data,
    output,
    evaluate,
    inference,
    packages,
    during_run,
    library,
)
"""The sections in page order."""

SECTIONS: tuple[str, ...] = tuple(module.SECTION for module in SECTION_MODULES)
SECTION_NOTES: dict[str, str] = {module.SECTION: module.NOTE for module in SECTION_MODULES if module.NOTE}
ENTRIES: dict[str, Entry] = {entry.id: entry for module in SECTION_MODULES for entry in module.ENTRIES}
DOCUMENTED: tuple[Documented, ...] = tuple(entry for module in SECTION_MODULES for entry in module.DOCUMENTED)

__all__ = ["DOCUMENTED", "ENTRIES", "SECTIONS", "SECTION_MODULES", "SECTION_NOTES", "Documented", "Entry"]
