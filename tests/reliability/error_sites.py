"""Find the user-facing error messages in cptune's source, and match message fragments to them.

A *site* is one place in ``src/cptune`` that produces a message a user reads:

- ``raise X(...)`` where ``X`` is :class:`~cptune.errors.CptuneError` or a subclass of it, or
  ``RowProblem`` (a bad data row; ``cptune.data.rows`` turns it into a ``DataError``), or a
  function whose return annotation is one of those (a message factory such as
  ``_field_problem``, whose own text is added to the call's);
- any ``raise`` in ``cptune.config``: the loader turns every error raised while reading and
  validating a recipe (pydantic validators' ``ValueError`` included) into a recipe problem;
- ``yield key, message`` in a cross-key rule of ``cptune.config`` (:mod:`cptune.config.rules`).

The literal text of a site is the string constants in its arguments (for f-strings, the parts
between the ``{...}`` fields): what every message from there contains whatever the values are.
The module reads the source with :mod:`ast` and imports nothing of cptune.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Exceptions a user sees although they do not derive from CptuneError.
EXTRA_USER_FACING = frozenset({"RowProblem"})

# The shortest common text that can tie a fragment to a site. Shorter overlaps ("; remove it.",
# "' is a ") are phrases many messages share, not evidence that a fragment comes from a site.
MIN_OVERLAP = 20


@dataclass(frozen=True)
class Site:
    """One place in the source that produces a user-facing message."""

    path: str  # relative to the repository root
    line: int
    texts: tuple[str, ...]  # the literal parts of its message

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def needed(self) -> int:
        """How long an overlap with a fragment must be to count (less for sites with only short text)."""
        return min(MIN_OVERLAP, max((len(t.strip()) for t in self.texts), default=0))

    def overlap(self, fragment: str) -> int:
        """Length of the longest piece of ``fragment`` that is literal text of this site."""
        return max((_longest_common_substring(text, fragment) for text in self.texts), default=0)


def _longest_common_substring(a: str, b: str) -> int:
    match = difflib.SequenceMatcher(None, a, b, autojunk=False).find_longest_match(0, len(a), 0, len(b))
    return match.size


def _strings(node: ast.AST) -> Iterator[str]:
    """The string constants in an expression, f-string parts included, in source order."""
    for child in ast.walk(node):
        if isinstance(child, ast.Constant) and isinstance(child.value, str):
            yield child.value


def _callee(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _message_texts(call: ast.Call) -> list[str]:
    # Positional arguments hold the message; keywords are context (source=, from_=).
    texts = [text for arg in call.args for text in _strings(arg)]
    return [t for t in texts if t.strip()]


def user_facing_names(trees: Iterable[ast.Module]) -> set[str]:
    """CptuneError, its subclasses (to any depth) and EXTRA_USER_FACING, found in the source."""
    bases: dict[str, set[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {name for b in node.bases if (name := _callee(b))}
    names = {"CptuneError", *EXTRA_USER_FACING}
    while True:
        more = {cls for cls, parents in bases.items() if parents & names} - names
        if not more:
            return names
        names |= more


def _factories(tree: ast.Module, exceptions: set[str]) -> dict[str, list[str]]:
    """Functions annotated to return a user-facing exception, with the literal text they add."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        returns = node.returns if isinstance(node, ast.FunctionDef) else None
        if returns is not None and (
            _callee(returns) in exceptions or getattr(returns, "value", None) in exceptions
        ):
            returned = [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and n.value]
            found[node.name] = [
                t for value in returned if isinstance(value, ast.Call) for t in _message_texts(value)
            ]
    return found


def find_sites(src: Path, repo: Path) -> list[Site]:
    """Every user-facing error site under ``src`` (a ``cptune`` package folder)."""
    modules = {path: ast.parse(path.read_text(), filename=str(path)) for path in sorted(src.rglob("*.py"))}
    exceptions = user_facing_names(modules.values())
    sites = []
    for path, tree in modules.items():
        relative = path.relative_to(repo).as_posix()
        in_config = path.relative_to(src).parts[0] == "config"
        factories = _factories(tree, exceptions)
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = _callee(node.exc)
                if name in exceptions or name in factories or in_config:
                    texts = _message_texts(node.exc) + factories.get(name or "", [])
                    sites.append(Site(relative, node.lineno, tuple(texts)))
            elif in_config and isinstance(node, ast.Yield) and isinstance(node.value, ast.Tuple):
                texts = [t for t in _strings(node.value.elts[-1]) if t.strip()]
                if len(node.value.elts) == 2 and texts:
                    sites.append(Site(relative, node.lineno, tuple(texts)))
    return sites


# A site whose longest literal text is shorter than this only wraps a message made elsewhere
# (``raise RecipeError(problems)``, ``f"{label}, row {index}: {problem.detail}"``).
CARRIER_TEXT = 8


def is_carrier(site: Site) -> bool:
    """A site that only passes on a message made elsewhere; the places that make it are sites too."""
    return site.needed < CARRIER_TEXT


def _pieces(texts: Iterable[str]) -> set[str]:
    return {text[i : i + CARRIER_TEXT] for text in texts for i in range(len(text) - CARRIER_TEXT + 1)}


def covered_sites(sites: list[Site], fragments: Iterable[str]) -> set[Site]:
    """The sites each fragment most likely comes from: those sharing its longest literal overlap.

    A fragment counts for the site(s) whose literal text it overlaps most (ties count for all of
    them: two places that raise the same words need only one entry), and only when that overlap is
    at least the site's :attr:`Site.needed`. So one entry does not cover a sibling message that
    shares a phrase with it, and a fragment made only of values (paths, numbers) covers nothing.
    """
    covered: set[Site] = set()
    # Only sites sharing a CARRIER_TEXT-long piece with a fragment can reach their `needed`
    # overlap with it; comparing the pieces first keeps the exact comparison to a few sites.
    pieces = {site: _pieces(site.texts) for site in sites if not is_carrier(site)}
    for fragment in fragments:
        mine = _pieces([fragment])
        scores = {site: site.overlap(fragment) for site, theirs in pieces.items() if mine & theirs}
        best = max(scores.values(), default=0)
        covered |= {site for site, score in scores.items() if score == best and score >= site.needed}
    return covered
