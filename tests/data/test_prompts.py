"""Inference prompts are token for token what training puts before an answer; scores count the trained tokens."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from cptune.config.data import DatasetConfig
from cptune.data.formats import build_formatter
from cptune.data.prompts import Prompter
from cptune.errors import DataError
from devtools.tiny import EOS_TOKEN_ID, IM_END_TOKEN_ID

ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "The sum is 5."},
    {"instruction": "Say hello.", "input": "", "output": "Hello! How are you?"},
]
CHAT = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 plus 2?"},
            {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "Are you sure?"},
            {"role": "assistant", "content": "Yes."},
        ]
    }
]


def _trained_start(labels: list[int]) -> int:
    """Where the last answer starts: the first of the last run of labels that are not -100."""
    end = max(i for i, label in enumerate(labels) if label != -100)
    while end > 0 and labels[end - 1] != -100:
        end -= 1
    return end


@pytest.mark.parametrize("chat_template", [None, "chatml"])
def test_alpaca_and_chat_prompts_are_the_training_prefix_of_the_answer(
    chat_template: str | None, tokenizer: PreTrainedTokenizerFast
) -> None:
    for config, rows, strip in (
        (
            DatasetConfig(path="a.jsonl", type="alpaca"),
            ALPACA,
            lambda row: {k: v for k, v in row.items() if k != "output"},
        ),
        (
            DatasetConfig(path="c.jsonl", type="chat_template"),
            CHAT,
            lambda row: {"messages": row["messages"][:-1]},
        ),
    ):
        prompter = Prompter(config, tokenizer, chat_template)
        formatter = build_formatter(
            config, tokenizer, train_on_inputs=False, chat_template=chat_template, label="t"
        )
        for row in rows:
            sample = formatter(row)
            start = _trained_start(sample.labels)
            assert prompter.prompt_ids(strip(row)) == sample.input_ids[:start]
            answer = row["output"] if config.type == "alpaca" else row["messages"][-1]["content"]
            scored = prompter.with_completion(strip(row), answer)
            assert scored.input_ids == sample.input_ids
            assert scored.scored == [i for i in range(start, len(sample.labels)) if sample.labels[i] != -100]


def test_text_prompts_use_the_instruction_or_a_user_message(tokenizer: PreTrainedTokenizerFast) -> None:
    alpaca = Prompter(DatasetConfig(path="a.jsonl", type="alpaca"), tokenizer, None)
    text = tokenizer.decode(alpaca.prompt_ids(alpaca.row("Say hello.")))
    assert text == (
        "<s>Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nSay hello.\n\n### Response:\n"
    )
    chat = Prompter(
        DatasetConfig(path="c.jsonl", type="chat_template"), tokenizer, "chatml", None, ("<|im_end|>",)
    )
    text = tokenizer.decode(chat.prompt_ids(chat.row("Hi")))
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # Axolotl's chatml: no bos
    # Generation stops where training taught the answer to end.
    assert alpaca.stop_token_ids() == [EOS_TOKEN_ID]
    assert chat.stop_token_ids() == [EOS_TOKEN_ID, IM_END_TOKEN_ID]


@pytest.mark.parametrize("kind", ["completion", "pretokenized"])
def test_completion_prompts_are_the_text_after_bos_and_the_completion_is_scored_alone(
    kind: str, tokenizer: PreTrainedTokenizerFast
) -> None:
    prompter = Prompter(DatasetConfig(path="t.jsonl", type=kind), tokenizer, None)
    prompt = prompter.prompt_ids(prompter.row("Hello! How"))
    assert prompt == tokenizer("Hello! How")["input_ids"]  # bos + text, no eos
    scored = prompter.with_completion(prompter.row("Hello! How"), " are you?")
    completion = tokenizer(" are you?", add_special_tokens=False)["input_ids"]
    assert scored.input_ids == prompt + completion
    assert scored.scored == list(range(len(prompt), len(prompt) + len(completion)))


def test_a_row_the_format_cannot_use_is_a_data_error(tokenizer: PreTrainedTokenizerFast) -> None:
    prompter = Prompter(DatasetConfig(path="a.jsonl", type="alpaca"), tokenizer, None)
    row: dict[str, Any] = {"input": "no instruction"}
    with pytest.raises(DataError, match=r"^field 'instruction' is missing\.$"):
        prompter.prompt_ids(row)
