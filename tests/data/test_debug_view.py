"""``preprocess --debug``: the marked tokens are exactly the ones the collator's labels train.

Checked three ways on packed rows of alpaca, chat_template (with roles_to_train) and completion
data: against the stored labels and positions (token i is trained when its label is not -100
and it does not start a document), against the collator's own tensors in the JSON form, and in
the text form against the source data itself (what is marked is the answer, and nothing else).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from cptune.config.recipe import Recipe
from cptune.data.collator import PackedCollator
from cptune.data.debug_view import debug_rows, format_rows, rows_json
from cptune.data.prepare import prepare_datasets

ALPACA = [
    {
        "instruction": f"Add {i} and {i + 1}.",
        "input": "" if i % 2 else f"Numbers: {i}",
        "output": f"The sum is {2 * i + 1}.",
    }
    for i in range(12)
]
CHAT = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"It is {2 * i}."},
            {"role": "user", "content": "Are you sure?"},
            {"role": "assistant", "content": "Yes." * (1 + i % 3)},
        ]
    }
    for i in range(10)
]
COMPLETION = [{"text": f"Hello! How are you? I am fine, thank you {i} times."} for i in range(10)]


def _write(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _prepared(
    tmp_path: Path,
    make_recipe: Callable[..., Recipe],
    tokenizer,
    rows,
    recipe_keys: dict[str, Any] | None = None,
    **dataset: Any,
):
    path = _write(tmp_path / "data.jsonl", rows)
    recipe = make_recipe(
        [{"path": path, **dataset}],
        sample_packing=True,
        sequence_len=256,
        chat_template="chatml",
        **(recipe_keys or {}),
    )
    prepared = prepare_datasets(recipe, tokenizer, log=lambda _: None)
    return recipe, prepared


def _all_rows(recipe, prepared, tokenizer):
    collator = PackedCollator.for_recipe(recipe, tokenizer.pad_token_id)
    return debug_rows(prepared.train, collator, range(len(prepared.train))), collator


def _marked_per_document(text: str) -> list[tuple[str, ...]]:
    blocks = re.split(r"^── document \d+ of \d+: .*──$", text, flags=re.M)[1:]
    # The last block of a row runs into the next row's heading; cut it there.
    blocks = [re.split(r"^=== ", block, flags=re.M)[0] for block in blocks]
    return [tuple(re.findall(r"\[\[(.*?)\]\]", block, flags=re.S)) for block in blocks]


# (rows, dataset keys, the trained text of each row, recipe keys). Chat rows train as Axolotl trains them:
# the assistant's text, and its end-of-turn token only when eot_tokens names it (ChatML never writes eos).
CASES = {
    "alpaca": (ALPACA, {"type": "alpaca"}, lambda row: (row["output"] + "</s>",), {}),
    "chat-assistant": (
        CHAT,
        {"type": "chat_template", "roles_to_train": ["assistant"]},
        lambda row: tuple(m["content"] for m in row["messages"] if m["role"] == "assistant"),
        {},
    ),
    "chat-assistant-eot-tokens": (
        CHAT,
        {"type": "chat_template", "roles_to_train": ["assistant"]},
        lambda row: tuple(m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"),
        {"eot_tokens": ["<|im_end|>"]},
    ),
    "completion": (COMPLETION, {"type": "completion"}, lambda row: (row["text"] + "</s>",), {}),
}


@pytest.mark.parametrize("case", CASES)
def test_marks_exactly_the_trained_tokens_and_nothing_but_the_answers(
    case: str, tmp_path: Path, make_recipe, tokenizer: PreTrainedTokenizerFast
) -> None:
    source, dataset, answers, recipe_keys = CASES[case]
    recipe, prepared = _prepared(tmp_path, make_recipe, tokenizer, source, recipe_keys, **dataset)
    rows, collator = _all_rows(recipe, prepared, tokenizer)
    assert len(prepared.train) < len(source), "rows are packed"
    for row, stored in zip(rows, prepared.train, strict=True):
        # From the stored row alone: a label that is not -100, on a token that does not start a document.
        expected = [
            label != -100 and i > 0 and stored["position_ids"][i] != 0
            for i, label in enumerate(stored["labels"])
        ]
        assert row.trained == expected
        batch = collator([stored])
        assert row.labels == batch["labels"][0].tolist() and row.targets == batch["shift_labels"][0].tolist()
    assert sum(sum(row.trained) for row in rows) == prepared.stats.train.trained_tokens
    text = format_rows(rows, tokenizer, split="train", total=len(rows), colour=False)
    # What is marked, document by document, is each source row's answer (its eos or end-of-turn token
    # included): for completion data the whole text but the bos, whose label is set but which nothing predicts.
    assert Counter(_marked_per_document(text)) == Counter(answers(row) for row in source)


def test_chat_with_user_turns_trained_marks_the_labels_of_both_roles(
    tmp_path: Path, make_recipe, tokenizer: PreTrainedTokenizerFast
) -> None:
    recipe, prepared = _prepared(
        tmp_path, make_recipe, tokenizer, CHAT, type="chat_template", roles_to_train=["user", "assistant"]
    )
    rows, _ = _all_rows(recipe, prepared, tokenizer)
    for row, stored in zip(rows, prepared.train, strict=True):
        assert row.trained == [
            label != -100 and i > 0 and stored["position_ids"][i] != 0
            for i, label in enumerate(stored["labels"])
        ]
    text = format_rows(rows, tokenizer, split="train", total=len(rows), colour=False)
    marked = [m for doc in _marked_per_document(text) for m in doc]
    assert any("Are you sure?" in m for m in marked) and any("It is 0." in m for m in marked)
    assert not any("Be brief." in m for m in marked)


def test_json_form_has_the_collators_labels_per_token_and_colour_marks_the_same_spans(
    tmp_path: Path, make_recipe, tokenizer: PreTrainedTokenizerFast
) -> None:
    recipe, prepared = _prepared(tmp_path, make_recipe, tokenizer, ALPACA, type="alpaca")
    recipe = recipe.model_copy(update={"pad_to_sequence_len": True})
    rows, collator = _all_rows(recipe, prepared, tokenizer)
    data = json.loads(json.dumps(rows_json(rows[:2], tokenizer, split="train", total=len(rows))))
    for shown, stored in zip(data["rows"], prepared.train, strict=False):
        batch = collator([stored])
        assert len(shown["input_ids"]) == recipe.sequence_len  # padded as training pads
        assert shown["labels"] == batch["labels"][0].tolist()
        assert shown["targets"] == batch["shift_labels"][0].tolist()
        assert shown["position_ids"] == batch["position_ids"][0].tolist()
        assert shown["padding"] == recipe.sequence_len - len(stored["input_ids"])
        assert len(shown["pieces"]) == len(shown["input_ids"]) and shown["pieces"][0] == "<s>"
        # Padding is a document of its own, never trained.
        assert not any(shown["trained"][shown["real_tokens"] :])
        assert shown["document"][shown["real_tokens"]] == shown["document"][shown["real_tokens"] - 1] + 1
    plain = format_rows(rows, tokenizer, split="train", total=len(rows), colour=False)
    coloured = format_rows(rows, tokenizer, split="train", total=len(rows), colour=True)
    assert "── padding: " in plain and "[[" not in coloured
    as_plain = re.sub(r"\x1b\[1;32m(.*?)\x1b\[0m", r"[[\1]]", coloured, flags=re.S)
    assert re.sub(r"\x1b\[[0-9;]*m", "", as_plain) == plain


def test_alpaca_rows_show_axolotls_preamble_unmarked_and_the_answer_marked(
    tmp_path: Path, make_recipe, tokenizer: PreTrainedTokenizerFast
) -> None:
    recipe, prepared = _prepared(tmp_path, make_recipe, tokenizer, ALPACA[:2], type="alpaca")
    rows, _ = _all_rows(recipe, prepared, tokenizer)
    text = format_rows(rows, tokenizer, split="train", total=len(rows), colour=False)
    # Row 0 has an input, row 1 none: each opens with its own preamble of Axolotl's, never trained.
    assert (
        "<s>Below is an instruction that describes a task, paired with an input that provides further "
        in text
    )
    assert "<s>Below is an instruction that describes a task. Write a response that appropriately " in text
    assert sorted(_marked_per_document(text)) == [("The sum is 1.</s>",), ("The sum is 3.</s>",)]
