"""Errors a user can cause.

Every error a user can fix is a :class:`CptuneError`. The CLI prints its message
without a traceback and exits non-zero; anything else is a bug in cptune and keeps
its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


class CptuneError(Exception):
    """An error caused by the user's recipe, data, launch or environment."""

    exit_code = 2


@dataclass(frozen=True)
class RecipeProblem:
    """One problem of a recipe: where (a dotted key path) and what."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


class RecipeError(CptuneError):
    """A recipe failed validation; carries every problem found, not just the first."""

    def __init__(self, problems: list[RecipeProblem], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" ({source})" if source else ""
        count = len(self.problems)
        header = f"The recipe{where} has {count} problem{'s' if count != 1 else ''}:"
        super().__init__("\n".join([header, *(f"  - {p}" for p in self.problems)]))


class DataError(CptuneError):
    """A dataset or one of its rows cannot be used."""


class LaunchError(CptuneError):
    """The processes, devices or world size do not fit the recipe."""


class BackendUnavailableError(CptuneError):
    """A context-parallel backend or one of its dependencies cannot be used here."""


class PatchError(CptuneError):
    """Installed library versions do not match what a cptune patch was written for."""
