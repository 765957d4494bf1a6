"""Row formats: exact token ids and label masks for alpaca, chat_template, completion, pretokenized."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from cptune.config.data import DatasetConfig
from cptune.data.formats import CHATML_TEMPLATE, RowProblem, Sample, build_formatter
from cptune.errors import DataError
from devtools.tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, IM_END_TOKEN_ID

IGNORE = -100
LABEL = "datasets[0] (data.jsonl)"


def formatter(
    tokenizer: PreTrainedTokenizerFast,
    train_on_inputs: bool = False,
    chat_template: str | None = None,
    **config: Any,
):
    return build_formatter(
        DatasetConfig(path="data.jsonl", **config),
        tokenizer,
        train_on_inputs=train_on_inputs,
        chat_template=chat_template,
        label=LABEL,
    )


def ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- alpaca -------------------------------------------------------------------


def test_alpaca_masks_the_prompt_and_ends_with_eos(tokenizer: PreTrainedTokenizerFast) -> None:
    row = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "The sum is 5."}
    sample = formatter(tokenizer, type="alpaca")(row)
    prompt = [
        BOS_TOKEN_ID,
        *ids(tokenizer, "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n"),
    ]
    response = [*ids(tokenizer, "The sum is 5."), EOS_TOKEN_ID]
    assert sample == Sample(prompt + response, [IGNORE] * len(prompt) + response)


@pytest.mark.parametrize("extra", [{}, {"input": ""}, {"input": None}, {"input": "  "}])
def test_alpaca_without_input_omits_the_input_block(
    tokenizer: PreTrainedTokenizerFast, extra: dict[str, Any]
) -> None:
    row = {"instruction": "Say hi.", "output": "Hi.", **extra}
    sample = formatter(tokenizer, type="alpaca")(row)
    prompt = [BOS_TOKEN_ID, *ids(tokenizer, "### Instruction:\nSay hi.\n\n### Response:\n")]
    assert sample.input_ids == [*prompt, *ids(tokenizer, "Hi."), EOS_TOKEN_ID]


def test_alpaca_train_on_inputs_and_custom_fields(tokenizer: PreTrainedTokenizerFast) -> None:
    row = {"q": "Say hi.", "a": "Hi."}
    sample = formatter(tokenizer, True, type="alpaca", field_instruction="q", field_output="a")(row)
    assert sample.labels == sample.input_ids
    assert sample.input_ids[-1] == EOS_TOKEN_ID


def test_alpaca_keeps_eos_out_of_the_prompt_when_the_tokenizer_appends_one(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    # A tokenizer whose encodings are "<s> ... </s>": only the leading <s> may
    # precede the prompt, or every sample would hold an eos before the answer.
    appending = copy.deepcopy(tokenizer)
    appending.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", BOS_TOKEN_ID), ("</s>", EOS_TOKEN_ID)]
    )
    assert appending("x")["input_ids"][-1] == EOS_TOKEN_ID
    sample = formatter(appending, type="alpaca")({"instruction": "Say hi.", "output": "Hi."})
    assert sample.input_ids.count(EOS_TOKEN_ID) == 1
    assert sample.input_ids[0] == BOS_TOKEN_ID


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"output": "x"}, "field 'instruction' is missing"),
        ({"instruction": "x", "output": None}, "field 'output' is missing"),
        ({"instruction": "x", "output": ""}, "field 'output' is empty"),
        ({"instruction": "x", "output": 5}, "field 'output' is a int, not text"),
        ({"instruction": "x", "input": ["a"], "output": "y"}, "field 'input' is a list, not text"),
    ],
)
def test_alpaca_rejects_malformed_rows(
    tokenizer: PreTrainedTokenizerFast, row: dict[str, Any], reason: str
) -> None:
    with pytest.raises(RowProblem) as problem:
        formatter(tokenizer, type="alpaca")(row)
    assert problem.value.reason == reason
    assert problem.value.skippable


# --- completion and pretokenized -------------------------------------------------


def test_completion_trains_every_token(tokenizer: PreTrainedTokenizerFast) -> None:
    sample = formatter(tokenizer, type="completion", field="body")({"body": "The river runs."})
    expected = [BOS_TOKEN_ID, *ids(tokenizer, "The river runs."), EOS_TOKEN_ID]
    assert sample == Sample(expected, expected)
    with pytest.raises(RowProblem, match="field 'body' is empty"):
        formatter(tokenizer, type="completion", field="body")({"body": ""})


def test_pretokenized_labels_default_to_input_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    fmt = formatter(tokenizer, type="pretokenized")
    assert fmt({"input_ids": [1, 7, 9]}) == Sample([1, 7, 9], [1, 7, 9])
    assert fmt({"input_ids": [1, 7, 9], "labels": None}) == Sample([1, 7, 9], [1, 7, 9])
    assert fmt({"input_ids": [1, 7, 9], "labels": [-100, 7, -100]}) == Sample([1, 7, 9], [-100, 7, -100])


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"input_ids": []}, "field 'input_ids' is empty"),
        ({"input_ids": "1 2"}, "field 'input_ids' is a str, not a list of token ids"),
        ({"input_ids": [1, 2.5]}, "field 'input_ids' holds a float at position 1, not an int"),
        ({"input_ids": [1, True]}, "field 'input_ids' holds a bool at position 1, not an int"),
        ({"input_ids": [1, 10_000]}, "field 'input_ids' holds 10000 at position 1; token ids must be in 0.."),
        ({"input_ids": [1, 2], "labels": [1]}, "field 'labels' has 1 entries but input_ids has 2"),
        (
            {"input_ids": [1, 2], "labels": [1, -5]},
            "field 'labels' holds -5 at position 1; labels must be -100 or in",
        ),
    ],
)
def test_pretokenized_rejects_malformed_rows(
    tokenizer: PreTrainedTokenizerFast, row: dict[str, Any], reason: str
) -> None:
    with pytest.raises(RowProblem) as problem:
        formatter(tokenizer, type="pretokenized")(row)
    assert problem.value.reason.startswith(reason)


# --- chat_template ---------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "Are you sure?"},
    {"role": "assistant", "content": "Yes, I am."},
]


def trained_text(tokenizer: PreTrainedTokenizerFast, sample: Sample) -> list[str]:
    """Decoded runs of consecutive trained tokens."""
    runs: list[list[int]] = []
    previous = IGNORE
    for token, label in zip(sample.input_ids, sample.labels, strict=True):
        if label != IGNORE:
            assert label == token
            if previous == IGNORE:
                runs.append([])
            runs[-1].append(token)
        previous = label
    return [tokenizer.decode(run) for run in runs]


def test_chat_trains_every_assistant_turn_and_its_end_token(tokenizer: PreTrainedTokenizerFast) -> None:
    sample = formatter(tokenizer, type="chat_template")({"messages": CHAT})
    expected = tokenizer.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    assert sample.input_ids == expected["input_ids"]
    # The tiny template marks assistant content + <|im_end|> with {% generation %}:
    # the prefix-rendering method must find exactly those tokens.
    assert sample.labels == [
        t if m else IGNORE for t, m in zip(expected["input_ids"], expected["assistant_masks"], strict=True)
    ]
    assert trained_text(tokenizer, sample) == ["It is 4.<|im_end|>", "Yes, I am.<|im_end|>"]
    assert sample.labels.count(IM_END_TOKEN_ID) == 2


def test_chat_custom_fields_roles_to_train_and_train_on_inputs(tokenizer: PreTrainedTokenizerFast) -> None:
    row = {"conv": [{"from": m["role"], "value": m["content"]} for m in CHAT]}
    fields = {"field_messages": "conv", "message_field_role": "from", "message_field_content": "value"}
    sample = formatter(tokenizer, type="chat_template", roles_to_train=("user",), **fields)(row)
    assert trained_text(tokenizer, sample) == [
        "<|im_start|>user\nWhat is 2 plus 2?<|im_end|>",
        "<|im_start|>user\nAre you sure?<|im_end|>",
    ]
    everything = formatter(tokenizer, True, type="chat_template", **fields)(row)
    assert everything.labels == everything.input_ids == sample.input_ids


def test_builtin_chatml_template_is_used_when_asked(tokenizer: PreTrainedTokenizerFast) -> None:
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DataError, match="chat_template: chatml") as error:
        formatter(bare, type="chat_template")
    assert LABEL in str(error.value)
    sample = formatter(bare, chat_template="chatml", type="chat_template")({"messages": CHAT})
    # cptune's ChatML renders like the tiny tokenizer's own ChatML template.
    assert sample == formatter(tokenizer, type="chat_template")({"messages": CHAT})
    assert bare.apply_chat_template(CHAT, chat_template=CHATML_TEMPLATE, tokenize=False).startswith(
        "<s><|im_start|>"
    )


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        (CHAT[:2], "no message with a role in roles_to_train ['assistant']"),
        ("hello", "field 'messages' is not a non-empty list of messages"),
        ([], "field 'messages' is not a non-empty list of messages"),
        ([{"role": "user"}], "field 'messages' message 0 has no text 'content'"),
        (
            [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}],
            "the chat template rejected the messages",
        ),
    ],
)
def test_chat_rejects_malformed_rows(tokenizer: PreTrainedTokenizerFast, messages: Any, reason: str) -> None:
    with pytest.raises(RowProblem) as problem:
        formatter(tokenizer, type="chat_template")({"messages": messages})
    assert problem.value.reason.startswith(reason)
    assert problem.value.skippable


def test_chat_template_that_is_not_prefix_stable_is_refused(tokenizer: PreTrainedTokenizerFast) -> None:
    unstable = copy.deepcopy(tokenizer)
    # Marks the last message, so earlier renderings are not prefixes of later ones.
    unstable.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last %} (last){% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(RowProblem, match="not prefix-stable") as problem:
        formatter(unstable, type="chat_template")({"messages": CHAT})
    assert not problem.value.skippable
