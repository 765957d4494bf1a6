"""What the troubleshooting page says about one error: :class:`Entry` and :class:`Documented`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """A user-facing error that tests/reliability/catalogue/ reproduces through the real CLI.

    The catalogue's :class:`Case` with the same ``id`` builds the bad input; its test checks that the
    command prints ``fragment``. ``title`` and ``fix`` are what the page says about it.
    """

    id: str
    section: str
    title: str
    fragment: str
    fix: str


@dataclass(frozen=True)
class Documented:
    """A user-facing error shown on the troubleshooting page but not reproduced by the catalogue.

    For errors that only happen after the processes started (at the first batch), only on a
    GPU, or only without an optional package. ``fragment`` must be literal text of a message
    raised in ``raised_in`` (checked by test_error_coverage.py), and ``tested_by`` names the
    test that proves the error, as ``path::function``, when there is one.
    """

    id: str
    section: str
    title: str
    fragment: str
    fix: str
    raised_in: str
    why_not_in_catalogue: str
    tested_by: str | None = None
