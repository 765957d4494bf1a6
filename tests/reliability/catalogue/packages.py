"""Catalogue cases of the section "Installed packages and devices" (their text: devtools/docgen/errors/packages.py)."""

from __future__ import annotations

from tests.reliability.catalogue.framework import Case
from tests.reliability.catalogue.setups import _with_package

CASES: tuple[Case, ...] = (
    Case(
        "optimizer-needs-other-hardware",
        keys={"optimizer": "adamw_torch_xla"},
    ),
    Case(
        "optimizer-package-missing",
        keys={"optimizer": "schedule_free_adamw"},
        skip_if=_with_package("schedulefree"),
    ),
)
