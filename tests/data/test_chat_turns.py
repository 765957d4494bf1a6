"""Locating a message's content in its rendered conversation: the character span that a placeholder changes."""

from __future__ import annotations

import random

from cptune.data.chat_turns import changed_span


def _slow_span(full: str, other: str) -> tuple[int, int]:
    # The definition, a character at a time: common prefix, then the common suffix of what is left.
    limit = min(len(full), len(other))
    start = 0
    while start < limit and full[start] == other[start]:
        start += 1
    suffix = 0
    while suffix < limit - start and full[-1 - suffix] == other[-1 - suffix]:
        suffix += 1
    return start, len(full) - suffix


def test_changed_span_equals_the_character_by_character_definition():
    rng = random.Random(0)
    for _ in range(300):
        # Long texts (beyond one block) built from few letters, so that prefixes and suffixes repeat.
        head = "".join(rng.choice("ab\n") for _ in range(rng.choice([0, 5, 4095, 4096, 9000])))
        tail = "".join(rng.choice("ab\n") for _ in range(rng.choice([0, 3, 4097, 5000])))
        content = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        placeholder = rng.choice(["<<p>>", "~~P~~", "", "a", content])
        full, other = head + content + tail, head + placeholder + tail
        assert changed_span(full, other) == _slow_span(full, other)


def test_changed_span_of_identical_texts_is_empty_and_the_suffix_never_overlaps_the_prefix():
    assert changed_span("abcabc", "abcabc") == (6, 6)
    # "aXa" vs "aa": prefix "a", then the suffix may only use what is left ("Xa" / "a").
    assert changed_span("aXa", "aa") == (1, 2)
    assert changed_span("aa", "aXa") == (1, 1)
