"""How a pattern of ``unfrozen_parameters`` reads a parameter name, as Axolotl reads it.

Facts about Axolotl's interface (``src/axolotl/utils/freeze.py`` of axolotl-ai-cloud/axolotl at commit
067b021c8b87a9e5e380b9173c704cf7340e30f5, Apache-2.0), so that a recipe brought over trains the same
parameters:

- a pattern is a regular expression that must match at the *start* of the name (Python's ``re.match``):
  ``lm_head`` trains ``lm_head.weight`` but not ``model.lm_head.weight``; it need not match to the end
  unless it ends in ``$``;
- a dot is a literal dot, except in ``.+``: ``model.layers.1.`` means the text ``model.layers.1.``, and
  ``model.layers.+.mlp`` lets ``.+`` stand for any text. (``.*`` is therefore "any number of dots": a
  trailing ``.*`` changes nothing, as the match need not reach the end.) A dot the user escaped (``\\.``)
  stays a literal dot here; Axolotl turns it into a literal backslash, which no parameter name holds;
- Axolotl's ``[start:end]`` suffix (train only those rows, by zeroing the other rows' gradients) is not
  supported: :func:`row_range` finds it so the recipe can be refused.
"""

from __future__ import annotations

import re

# Axolotl's range suffix: digits, optionally a colon and digits, in brackets at the very end.
_ROW_RANGE = re.compile(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$")

# An unescaped dot that does not start ``.+``.
_LITERAL_DOT = re.compile(r"(?<!\\)\.(?!\+)")


def row_range(pattern: str) -> str | None:
    """The ``[start:end]`` suffix Axolotl reads as a range of rows, or None when the pattern has none."""
    found = _ROW_RANGE.match(pattern)
    return pattern[len(found.group(1)) :] if found else None


def name_regex(pattern: str) -> re.Pattern[str]:
    """The compiled regular expression of one pattern (dots literal but in ``.+``).

    Raises:
        re.error: the pattern is not a regular expression.
    """
    return re.compile(_LITERAL_DOT.sub(r"\\.", pattern))


def matches(regex: re.Pattern[str], name: str) -> bool:
    """Whether ``regex`` (:func:`name_regex`) selects the parameter ``name``: a match at its start."""
    return regex.match(name) is not None
