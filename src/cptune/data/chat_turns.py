"""Where a message's text lies in the tokens of its rendered conversation, located as Axolotl locates it.

Axolotl trains the tokens of a message's *content*, not the template's text around it, and finds
them by rendering the conversation again with that message's content replaced by a placeholder:
the characters that change are the content as the template wrote it (trimmed, or with a reasoning
block, where the template does so). The tokens trained are those whose characters overlap that
span. Two placeholders whose first and last characters differ are used, and the widest span kept,
so that a content starting or ending with a character the template also writes next to it is still
found whole. (Behaviour read from ``ChatTemplateStrategy.find_turn`` and its helpers in
``src/axolotl/prompt_strategies/chat_template.py`` of axolotl 0.21.0; the code here is cptune's.)

When the tokens of the rendered text cannot be mapped to characters (a slow tokenizer, or text that
re-tokenizes differently from the template's own tokenization), the span is found in tokens
instead: the conversation up to the message, rendered once as it is and once with the placeholder,
differs in the message's tokens.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import Any

__all__ = ["ContentSpans", "changed_span"]

Message = dict[str, Any]

# Placeholders with different first and last characters (see the module's docstring).
_PLACEHOLDERS = ("<<cptune placeholder>>", "~~CPTUNE PLACEHOLDER~~")


_BLOCK = 4096  # characters compared at once (in C) before a binary search narrows the difference down


def _common_prefix(a: str, b: str, limit: int) -> int:
    """How many leading characters ``a`` and ``b`` share, up to ``limit``.

    Long conversations render to hundreds of thousands of characters, rendered again for every message:
    blocks and slices are compared in C, never a character at a time in Python.
    """
    same = 0
    while same + _BLOCK <= limit and a[same : same + _BLOCK] == b[same : same + _BLOCK]:
        same += _BLOCK
    high = min(same + _BLOCK, limit)
    while same < high:  # a[:same] == b[:same] holds; the first difference is in (same, high]
        middle = (same + high + 1) // 2
        if a[same:middle] == b[same:middle]:
            same = middle
        else:
            high = middle - 1
    return same


def changed_span(full: str, other: str) -> tuple[int, int]:
    """``(start, end)``: the characters of ``full`` that differ from ``other`` (empty when end <= start).

    The common suffix is looked for only in what the common prefix leaves, so that the two never
    overlap when the template repeats itself around the change.
    """
    limit = min(len(full), len(other))
    start = _common_prefix(full, other, limit)
    suffix = _common_prefix(full[::-1], other[::-1], limit - start)
    return start, len(full) - suffix


def _with_placeholder(messages: list[Message], turn: int, placeholder: str) -> list[Message]:
    # The placeholder message keeps the role only: its other keys (reasoning) are part of what changes.
    return [*messages[:turn], {"role": messages[turn]["role"], "content": placeholder}, *messages[turn + 1 :]]


class ContentSpans:
    """The token span of each message's content in one rendered conversation.

    Args:
        messages: The conversation (role, content and optional reasoning_content per message).
        input_ids: Its tokens, as the template renders them.
        tokenizer: The tokenizer (a fast one maps tokens to characters).
        render_text: Renders a whole conversation to text.
        render_ids: Renders a conversation (messages, whole conversation) to tokens.
    """

    def __init__(
        self,
        messages: list[Message],
        input_ids: list[int],
        tokenizer: Any,
        render_text: Callable[[list[Message]], str],
        render_ids: Callable[[list[Message], list[Message]], list[int]],
    ):
        self._messages = messages
        self._input_ids = input_ids
        self._render_text = render_text
        self._render_ids = render_ids
        self._text = render_text(messages) if getattr(tokenizer, "is_fast", False) else None
        self._starts: list[int] = []
        self._ends: list[int] = []
        if self._text is not None:
            encoded = tokenizer(self._text, add_special_tokens=False, return_offsets_mapping=True)
            if list(encoded["input_ids"]) == list(input_ids):
                self._starts = [start for start, _ in encoded["offset_mapping"]]
                self._ends = [end for _, end in encoded["offset_mapping"]]
            else:
                self._text = None

    def span(self, turn: int) -> tuple[int, int] | None:
        """``(first, end)`` token indices of message ``turn``'s content; None when it renders to nothing."""
        found = self._from_text(turn) if self._text is not None else None
        if found is None:
            found = self._from_tokens(turn)
        if found is None or found[1] <= found[0]:
            return None
        return found

    def _from_text(self, turn: int) -> tuple[int, int] | None:
        assert self._text is not None
        spans = [
            changed_span(self._text, self._render_text(_with_placeholder(self._messages, turn, p)))
            for p in _PLACEHOLDERS
        ]
        start, end = min(s for s, _ in spans), max(e for _, e in spans)
        if end <= start:
            return (0, 0)  # the content renders to nothing
        # Tokens overlapping [start, end): the first that ends after start, up to the first starting at end.
        first, stop = bisect_right(self._ends, start), bisect_left(self._starts, end)
        if first >= len(self._ends) or stop > len(self._ends):
            return None
        return first, stop

    def _from_tokens(self, turn: int) -> tuple[int, int] | None:
        changed = _with_placeholder(self._messages, turn, _PLACEHOLDERS[0])
        full = self._render_ids(self._messages[: turn + 1], self._messages)
        other = self._render_ids(changed[: turn + 1], changed)
        limit = min(len(full), len(other))
        first = next((i for i in range(limit) if full[i] != other[i]), None)
        back = next((i for i in range(limit) if full[-1 - i] != other[-1 - i]), None)
        if first is None or back is None:
            return None
        return first, len(full) - back
