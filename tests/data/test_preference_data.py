"""Preference pairs as data: a pair is one sample of two documents sharing the prompt, only the responses trained.

Checked on the shipped example pairs (examples/data/preference.jsonl) through the real
preparation (tokenize, length policy, packing) and the training collator, in both layouts
(``passthrough.default``: text; ``chat_template.default``: messages rendered with the template).
"""

from __future__ import annotations

import json

import pytest
import torch

from cptune.config.data import DatasetConfig
from cptune.data.collator import PackedCollator
from cptune.data.debug_view import debug_rows, format_rows
from cptune.data.formats import RowProblem, Sample
from cptune.data.preference_formats import build_pair_formatter
from cptune.data.prepare import prepare_datasets
from cptune.labels import CHOSEN, IGNORE_INDEX, REJECTED, pair_sequence_ids
from tests.conftest import REPO

PAIRS = REPO / "examples" / "data" / "preference.jsonl"
ROWS = [json.loads(line) for line in PAIRS.read_text().splitlines()]


def formatter(tokenizer, **dataset):
    config = DatasetConfig(path="pairs.jsonl", **dataset)
    return build_pair_formatter(config, tokenizer, None, "pairs")


def sides(sample: Sample) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each document of the sample."""
    out, start = [], 0
    for length in sample.documents:
        out.append((sample.input_ids[start : start + length], sample.labels[start : start + length]))
        start += length
    return out


def split_prompt(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(prompt, response) of one side: the response is every trained token, all at the end."""
    first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    assert labels[first:] == ids[first:], "the trained tokens are the side's tail, labelled with themselves"
    assert all(label == IGNORE_INDEX for label in labels[:first])
    return ids[:first], ids[first:]


@pytest.mark.parametrize("row", ROWS[:6], ids=lambda r: r["prompt"][:24])
def test_passthrough_pair_is_two_documents_with_the_prompt_shared_and_the_responses_trained(tokenizer, row):
    sample = formatter(tokenizer, type="passthrough.default")(row)
    (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = sides(sample)
    prompt, chosen = split_prompt(chosen_ids, chosen_labels)
    prompt_too, rejected = split_prompt(rejected_ids, rejected_labels)
    assert prompt == prompt_too == tokenizer(row["prompt"])["input_ids"]
    # TRL's tokenization: eos text appended, prompt + response tokenized whole.
    assert prompt + chosen == tokenizer(row["prompt"] + row["chosen"] + tokenizer.eos_token)["input_ids"]
    assert prompt + rejected == tokenizer(row["prompt"] + row["rejected"] + tokenizer.eos_token)["input_ids"]
    assert sample.position_ids == [*range(len(chosen_ids)), *range(len(rejected_ids))]


def test_chat_template_default_renders_the_prompt_messages_and_each_response_through_its_end_of_turn(
    tokenizer,
):
    row = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
        "chosen": {"role": "assistant", "content": "Hi."},
        "rejected": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Go away."}],
    }
    sample = formatter(tokenizer, type="chat_template.default")(row)
    (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = sides(sample)
    prompt, chosen = split_prompt(chosen_ids, chosen_labels)
    assert split_prompt(rejected_ids, rejected_labels)[0] == prompt
    assert prompt == tokenizer.apply_chat_template(
        row["messages"], add_generation_prompt=True, return_dict=False
    )
    assert tokenizer.decode(chosen) == "Hi.<|im_end|>"  # the "\n" after the end-of-turn token left out
    assert tokenizer.decode(split_prompt(rejected_ids, rejected_labels)[1]) == "Go away.<|im_end|>"


def test_chat_template_default_takes_a_text_prompt_as_one_user_message(tokenizer):
    row = ROWS[0]
    text = formatter(tokenizer, type="chat_template.default", field_messages="prompt")(row)
    listed = formatter(tokenizer, type="chat_template.default", field_messages="prompt")(
        {**row, "prompt": [{"role": "user", "content": row["prompt"]}]}
    )
    assert text == listed


def test_a_missing_response_is_a_row_problem_naming_the_field(tokenizer):
    with pytest.raises(RowProblem, match="'rejected' is missing"):
        formatter(tokenizer, type="passthrough.default")({"prompt": "a", "chosen": "b"})
    with pytest.raises(RowProblem, match="'rejected' is missing"):
        formatter(tokenizer, type="chat_template.default", field_messages="prompt")(
            {"prompt": "a", "chosen": "b"}
        )


def test_truncation_keeps_each_sides_start_and_gives_the_shorter_side_what_it_needs():
    pair = Sample(list(range(30)), list(range(30)), (10, 20))
    assert pair.truncated(30) is pair
    assert pair.truncated(24).documents == (10, 14)  # the chosen side fits in half: whole
    assert pair.truncated(24).input_ids == [*range(10), *range(10, 24)]
    assert Sample(list(range(30)), list(range(30)), (20, 10)).truncated(24).documents == (14, 10)
    assert pair.truncated(16).documents == (8, 8)
    assert pair.truncated(16).input_ids == [*range(8), *range(10, 18)]
    assert Sample([1, 2, 3], [1, 2, 3]).truncated(2) == Sample([1, 2], [1, 2])


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_prepared_rows_hold_whole_pairs_and_the_collator_numbers_their_sides(
    tmp_path, make_recipe, tokenizer, packing
):
    dataset = {"path": str(PAIRS), "type": "chat_template.default", "field_messages": "prompt"}
    recipe = make_recipe([dataset], sample_packing=packing, sequence_len=256, rl="dpo", adapter="lora")
    prepared = prepare_datasets(recipe, tokenizer, log=lambda _: None)
    rows = [prepared.train[i] for i in range(len(prepared.train))]
    batch = PackedCollator.for_recipe(recipe, tokenizer.pad_token_id)(rows)
    ids, sequence = batch["input_ids"], batch["sequence_ids"]
    assert int(batch["pairs"]) == len(ROWS) and sequence.max() == 2 * len(ROWS) - 1
    assert (packing and len(rows) < len(ROWS)) or (not packing and len(rows) == len(ROWS))
    assert (
        len(ids) == (len(rows) if packing else 2 * len(ROWS)) == recipe.rows_per_micro_batch * len(rows) // 1
    )
    prompts = set()
    for pair in range(len(ROWS)):
        chosen, rejected = ids[sequence == 2 * pair + CHOSEN], ids[sequence == 2 * pair + REJECTED]
        # Packed: both sides of a pair sit in one row, the chosen side first. Unpacked: each side has a row of
        # its own (Recipe.pair_sides_in_own_rows), the chosen side's row first.
        (row_c,), (row_r,) = (torch.nonzero(sequence == 2 * pair + s)[:, 0].unique().tolist() for s in (0, 1))
        assert (row_c, row_r) == ((row_c, row_c) if packing else (2 * pair, 2 * pair + 1))
        targets_c = batch["shift_labels"][sequence == 2 * pair + CHOSEN]
        n_prompt = int((targets_c == IGNORE_INDEX).sum()) - 1  # the side's last token has no target
        assert chosen[:n_prompt].tolist() == rejected[:n_prompt].tolist()
        prompts.add(tokenizer.decode(chosen[:n_prompt].tolist()))
    assert len(prompts) == len({r["prompt"] for r in ROWS})
    assert (sequence == -1).eq(batch["labels"] == IGNORE_INDEX).logical_or(sequence != -1).all()


def test_unpacked_pairs_collate_as_a_row_per_side_with_the_sides_tokens_labels_and_positions():
    pair = {"input_ids": [5, 6, 7, 5, 8], "labels": [-100, 6, 7, -100, 8], "position_ids": [0, 1, 2, 0, 1]}
    batch = PackedCollator(pad_token_id=0, preference=True, pair_sides_in_own_rows=True)([pair])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 8, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert batch["sequence_ids"].tolist() == [[0, 0, 0], [1, 1, -1]]
    assert batch["shift_labels"].tolist() == [[6, 7, -100], [8, -100, -100]]
    assert int(batch["pairs"]) == 1
    with pytest.raises(ValueError, match="holds 1 documents, not one pair"):
        PackedCollator(pad_token_id=0, preference=True, pair_sides_in_own_rows=True)(
            [{key: value[:3] for key, value in pair.items()}]
        )


def test_pair_sequence_ids_of_a_row_per_side_refuses_rows_of_two_documents_or_an_odd_count():
    positions = torch.tensor([[0, 1, 2], [0, 1, 0]])
    assert pair_sequence_ids(positions, [3, 2], one_side_per_row=True).tolist() == [[0, 0, 0], [1, 1, -1]]
    with pytest.raises(ValueError, match="not rows of one side each"):
        pair_sequence_ids(positions, [3, 3], one_side_per_row=True)  # the second row: two documents
    with pytest.raises(ValueError, match="not rows of one side each"):
        pair_sequence_ids(positions[:1], [3], one_side_per_row=True)


def test_pair_sequence_ids_refuses_a_row_that_is_not_whole_pairs():
    positions = torch.tensor([[0, 1, 0, 1, 0, 0]])
    assert pair_sequence_ids(positions, [4]).tolist() == [[0, 0, 1, 1, -1, -1]]
    with pytest.raises(ValueError, match="3 documents, not whole preference pairs"):
        pair_sequence_ids(positions, [5])


def test_debug_view_heads_each_document_with_its_pair_and_side_and_marks_the_responses(
    tmp_path, make_recipe, tokenizer
):
    dataset = {"path": str(PAIRS), "type": "passthrough.default"}
    recipe = make_recipe([dataset], sample_packing=False, sequence_len=256, rl="dpo", adapter="lora")
    prepared = prepare_datasets(recipe, tokenizer, log=lambda _: None)
    shown = debug_rows(prepared.train, PackedCollator.for_recipe(recipe, tokenizer.pad_token_id), [0])
    text = format_rows(shown, tokenizer, split="train", total=len(prepared.train), colour=False)
    assert "── document 1 of 2 (pair 1, chosen)" in text and "── document 2 of 2 (pair 1, rejected)" in text
    rows_text = text.split("\n", 1)[1]  # after the legend, which shows [[like this]]
    marked = rows_text.split("[[")[1:]
    row = ROWS[0]
    assert [m.split("]]")[0] for m in marked] == [row["chosen"] + "</s>", row["rejected"] + "</s>"]


def test_every_example_pair_has_distinct_responses():
    assert all(row["chosen"] != row["rejected"] for row in ROWS) and len(ROWS) >= 32


# Axolotl's fixed-template types: the texts each writes (prompt_strategies/dpo/chatml.py and llama3.py, Axolotl
# 0.21), tokenized as passthrough.default (the tiny tokenizer: <s> 1, </s> 2, <|im_start|> 3, <|im_end|> 4).
CHATML_USER = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
CHATML_PROMPT = "<|im_start|>system\nBe brief.<|im_end|>\n" + CHATML_USER
LLAMA3_PROMPT = "<|start_header_id|>user<|end_header_id|>\n\nSay hi.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
CONVERSATION = {
    "chosen": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}],
    "rejected": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Go away."}],
}


@pytest.mark.parametrize(
    ("type_", "row", "prompt", "end"),
    [
        (
            "chatml.intel",
            {"system": "Be brief.", "question": "Say hi.", "chosen": "Hi.", "rejected": "Go away."},
            CHATML_PROMPT,
            "<|im_end|>",
        ),
        (
            "chatml.icr",
            {"system": "Be brief.", "input": "Say hi.", "chosen": "Hi.", "rejected": "Go away."},
            CHATML_PROMPT,
            "<|im_end|>",
        ),
        (
            "chatml.prompt_pairs",
            {"system": "Be brief.", "prompt": "Say hi.", "chosen": "Hi.", "rejected": "Go away."},
            CHATML_PROMPT,
            "<|im_end|>",
        ),
        # argilla: the prompt in the first of prompt, input, question, instruction; the responses in
        # chosen/rejected or else chosen_response/rejected_response.
        (
            "chatml.argilla",
            {
                "system": "Be brief.",
                "instruction": "Say hi.",
                "chosen_response": "Hi.",
                "rejected_response": "Go away.",
            },
            CHATML_PROMPT,
            "<|im_end|>",
        ),
        (
            "chatml.ultra",
            {"system": "Be brief.", "prompt": "Say hi.", **CONVERSATION},
            CHATML_PROMPT,
            "<|im_end|>",
        ),
        ("chatml.argilla_chat", {"system": "ignored", **CONVERSATION}, CHATML_USER, "<|im_end|>"),
        (
            "llama3.default",
            {"question": "Say hi.", "chosen": "Hi.", "rejected": "Go away.", "system": ""},
            LLAMA3_PROMPT,
            "<|eot_id|>",
        ),
        (
            "llama3.intel",
            {"question": "Say hi.", "chosen": "Hi.", "rejected": "Go away."},
            LLAMA3_PROMPT,
            "<|eot_id|>",
        ),
        ("llama3.ultra", {"prompt": "Say hi.", **CONVERSATION}, LLAMA3_PROMPT, "<|eot_id|>"),
        ("llama3.argilla_chat", CONVERSATION, LLAMA3_PROMPT, "<|eot_id|>"),
    ],
    ids=lambda value: value if isinstance(value, str) and "." in value and "<" not in value else "",
)
def test_axolotls_fixed_template_types_write_its_texts_and_train_each_response_through_its_end(
    tokenizer, type_, row, prompt, end
):
    sample = formatter(tokenizer, type=type_)(row)
    for (ids, labels), response in zip(sides(sample), ("Hi.", "Go away."), strict=True):
        expected = tokenizer(prompt + response + end + "</s>")["input_ids"]
        n_prompt = len(tokenizer(prompt)["input_ids"])
        assert ids == expected
        assert labels == [IGNORE_INDEX] * n_prompt + expected[n_prompt:]
        assert tokenizer.decode(ids[:n_prompt]) == "<s>" + prompt
        assert tokenizer.decode(ids[n_prompt:]) == response + end + "</s>"
    if type_.startswith("chatml."):
        # The ChatML markers are the tokenizer's own special tokens: one token each, the response ending in
        # <|im_end|> then the eos TRL appends.
        (chosen_ids, _), _ = sides(sample)
        assert chosen_ids[:2] == [1, 3] and chosen_ids[-2:] == [4, 2]


def test_chatml_prompt_with_a_system_turn_starts_with_it():
    from cptune.data.preference_templates import templated_pair_texts

    row = {"question": "Say hi.", "chosen": "Hi.", "rejected": "Go away."}
    assert templated_pair_texts("chatml.intel", row)[0] == CHATML_USER
    assert templated_pair_texts("chatml.intel", {**row, "system": "Be brief."}) == (
        CHATML_PROMPT,
        "Hi.<|im_end|>",
        "Go away.<|im_end|>",
    )


def test_chat_template_argilla_chat_takes_the_prompt_from_the_chosen_conversation(tokenizer):
    argilla = formatter(tokenizer, type="chat_template.argilla_chat")(CONVERSATION)
    default = formatter(tokenizer, type="chat_template.default")(
        {"messages": CONVERSATION["chosen"][:1], "chosen": "Hi.", "rejected": "Go away."}
    )
    assert argilla == default
    (ids, labels), _ = sides(argilla)
    prompt, chosen = split_prompt(ids, labels)
    assert tokenizer.decode(prompt) == "<s><|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(chosen) == "Hi.<|im_end|>"


@pytest.mark.parametrize(
    ("type_", "row", "says"),
    [
        (
            "chatml.intel",
            {"prompt": "Say hi.", "chosen": "Hi.", "rejected": "No."},
            "field 'question' is missing",
        ),
        ("llama3.default", {"prompt": "Say hi.", "chosen": "Hi."}, "field 'rejected_response' is missing"),
        (
            "chatml.ultra",
            {"prompt": "Say hi.", "chosen": "Hi.", "rejected": "No."},
            "field 'chosen' is not a conversation",
        ),
        (
            "chat_template.argilla_chat",
            {"chosen": "Hi.", "rejected": "No."},
            "field 'chosen' is not a conversation",
        ),
    ],
)
def test_a_row_without_the_columns_of_its_type_is_a_row_problem_naming_the_column(
    tokenizer, type_, row, says
):
    with pytest.raises(RowProblem, match=says):
        formatter(tokenizer, type=type_)(row)


def test_a_fixed_template_type_prepares_and_a_file_without_its_columns_is_refused_naming_them(
    tmp_path, make_recipe, tokenizer
):
    from cptune.errors import CptuneError

    path = tmp_path / "intel.jsonl"
    rows = [{"question": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in ROWS[:4]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = make_recipe(
        [{"path": str(path), "type": "chatml.intel"}], sequence_len=256, rl="dpo", adapter="lora"
    )
    prepared = prepare_datasets(recipe, tokenizer, log=lambda _: None)
    assert len(prepared.train) == 4  # unpacked: a pair per row

    other = tmp_path / "prompts.jsonl"
    other.write_text(
        "".join(json.dumps({"prompt": r["question"], "chosen": "a", "rejected": "b"}) + "\n" for r in rows)
    )
    recipe = make_recipe(
        [{"path": str(other), "type": "chatml.intel"}], sequence_len=256, rl="dpo", adapter="lora"
    )
    with pytest.raises(CptuneError, match="'question'") as refused:
        prepare_datasets(recipe, tokenizer, log=lambda _: None)
    assert "chatml.intel reads the columns its type names" in str(refused.value)
