"""The catalogue of bad inputs: what a user can get wrong, and what cptune must say.

Each :class:`Case` builds one bad input in a fresh workspace (a recipe, data
files, an output folder) and names the command line that meets it; the
:class:`~devtools.docgen.errors.base.Entry` with the same id (devtools/docgen/errors/,
module of the same name as the case's) holds the exact fragment of the message the
user must see, a title and the fix. ``test_catalogue.py`` runs every case through the
real CLI and checks the fragment; ``python -m devtools.docgen`` renders the entries as
``docs/troubleshooting.md``, so the page cannot drift from what the code says.

Layout: :mod:`.framework` (:class:`Workspace`, :class:`Case`), :mod:`.setups` (what
cases build), and one module of ``CASES`` per section of the page.

A few user-facing errors cannot be met cheaply through the CLI before a run starts (they
happen at the first batch, only on a GPU, or only when a package is missing). They are
:class:`Documented` entries (in devtools/docgen/errors/): the page shows them too, with the
file that raises them and the test that proves them, and ``test_error_coverage.py`` checks
that their fragment is still literal text of that file and that every user-facing error in
``src/`` has an entry.

Workspace layout (see :class:`Workspace`): ``recipe.yaml``, ``data/train.jsonl``
(the quickstart rows), a ``prepared/`` cache holding an earlier build, and an
``out/`` output folder holding a file that is not a run. A case changes only
what its bad input needs.
"""

from __future__ import annotations

from devtools.docgen.errors import DOCUMENTED, SECTION_NOTES, SECTIONS, Documented
from tests.reliability.catalogue import (
    contradictions,
    data,
    deepspeed,
    evaluate,
    inference,
    model,
    output,
    packages,
    preference,
    recipe_file,
    recipe_keys,
)
from tests.reliability.catalogue.framework import DELETE, Case, Workspace, base_keys, make_workspace

CASES: tuple[Case, ...] = (
    *recipe_file.CASES,
    *recipe_keys.CASES,
    *contradictions.CASES,
    *preference.CASES,
    *model.CASES,
    *deepspeed.CASES,
    *data.CASES,
    *output.CASES,
    *evaluate.CASES,
    *inference.CASES,
    *packages.CASES,
)

__all__ = [
    "CASES",
    "DELETE",
    "DOCUMENTED",
    "SECTIONS",
    "SECTION_NOTES",
    "Case",
    "Documented",
    "Workspace",
    "base_keys",
    "make_workspace",
]
