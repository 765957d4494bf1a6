"""Row formats: exact token ids and label masks for alpaca, chat_template, completion, pretokenized.

What is trained follows Axolotl 0.21.0 (its prompt strategies; the whole shipped data is compared with
Axolotl's own output in tests/axolotl/test_axolotl_parity.py): the alpaca prompt opens with Axolotl's
system preamble, and a chat message trains its content (not the template's headers) plus the end
tokens that follow it.
"""

from __future__ import annotations

import copy
import logging
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
    eot_tokens: tuple[str, ...] | None = None,
    **config: Any,
):
    return build_formatter(
        DatasetConfig(path="data.jsonl", **config),
        tokenizer,
        train_on_inputs=train_on_inputs,
        chat_template=chat_template,
        label=LABEL,
        eot_tokens=eot_tokens,
    )


def ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- alpaca -------------------------------------------------------------------


# Axolotl's alpaca preambles (src/axolotl/prompters.py, AlpacaPrompter.system_prompt and
# system_no_input_prompt, axolotl 0.21.0), followed by a blank line in the instruct style.
PREAMBLE = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
)
PREAMBLE_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"


def test_alpaca_opens_with_axolotls_preamble_masks_the_prompt_and_ends_with_eos(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    row = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "The sum is 5."}
    sample = formatter(tokenizer, type="alpaca")(row)
    prompt = [
        BOS_TOKEN_ID,
        *ids(
            tokenizer,
            PREAMBLE + "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n",
        ),
    ]
    response = [*ids(tokenizer, "The sum is 5."), EOS_TOKEN_ID]
    assert sample == Sample(prompt + response, [IGNORE] * len(prompt) + response)


@pytest.mark.parametrize("extra", [{}, {"input": ""}, {"input": None}])
def test_alpaca_without_input_has_the_no_input_preamble_and_no_input_block(
    tokenizer: PreTrainedTokenizerFast, extra: dict[str, Any]
) -> None:
    row = {"instruction": "Say hi.", "output": "Hi.", **extra}
    sample = formatter(tokenizer, type="alpaca")(row)
    prompt = [
        BOS_TOKEN_ID,
        *ids(tokenizer, PREAMBLE_NO_INPUT + "### Instruction:\nSay hi.\n\n### Response:\n"),
    ]
    assert sample.input_ids == [*prompt, *ids(tokenizer, "Hi."), EOS_TOKEN_ID]


def test_alpaca_input_of_spaces_is_an_input_as_in_axolotl(tokenizer: PreTrainedTokenizerFast) -> None:
    # Axolotl tests the input's truth (`if input_text:`), so "  " renders the input block.
    sample = formatter(tokenizer, type="alpaca")({"instruction": "Say hi.", "input": "  ", "output": "Hi."})
    text = tokenizer.decode(sample.input_ids)
    assert text.startswith(
        "<s>" + PREAMBLE + "### Instruction:\nSay hi.\n\n### Input:\n  \n\n### Response:\n"
    )


@pytest.mark.parametrize(
    ("dataset_type", "with_input", "without_input"),
    [
        # Axolotl's prompt styles (AlpacaPrompter.match_prompt_style) and loaders (alpaca_instruct.py,
        # alpaca_chat.py: load_no_prompt leaves the preamble out), axolotl 0.21.0.
        (
            "alpaca:chat",
            "SYSTEM: " + PREAMBLE.strip() + "\nUSER: Do.\nIt\nASSISTANT:",
            "SYSTEM: " + PREAMBLE_NO_INPUT.strip() + "\nUSER: Do.\nASSISTANT:",
        ),
        (
            "alpaca:chatml",
            "<|im_start|>system\n" + PREAMBLE.strip() + "<|im_end|>\n<|im_start|>user\nDo.\nIt<|im_end|>\n"
            "<|im_start|>assistant\n",
            "<|im_start|>system\n"
            + PREAMBLE_NO_INPUT.strip()
            + "<|im_end|>\n<|im_start|>user\nDo.<|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        (
            "alpaca:phi",
            "<|system|>\n" + PREAMBLE.strip() + "<|end|>\n<|user|>\nDo.<|end|>It<|assistant|>",
            "<|system|>\n" + PREAMBLE_NO_INPUT.strip() + "<|end|>\n<|user|>\nDo.<|end|>\n<|assistant|>\n",
        ),
        (
            "alpaca_instruct",
            PREAMBLE + "### Instruction:\nDo.\n\n### Input:\nIt\n\n### Response:\n",
            PREAMBLE_NO_INPUT + "### Instruction:\nDo.\n\n### Response:\n",
        ),
        (
            "alpaca_instruct.load_no_prompt",
            "### Instruction:\nDo.\n\n### Input:\nIt\n\n### Response:\n",
            "### Instruction:\nDo.\n\n### Response:\n",
        ),
        (
            "alpaca_chat",
            "SYSTEM: " + PREAMBLE.strip() + "\nUSER: Do.\nIt\nASSISTANT:",
            "SYSTEM: " + PREAMBLE_NO_INPUT.strip() + "\nUSER: Do.\nASSISTANT:",
        ),
        ("alpaca_chat.load_no_prompt", "USER: Do.\nIt\nASSISTANT:", "USER: Do.\nASSISTANT:"),
    ],
)
def test_alpaca_prompt_styles(
    tokenizer: PreTrainedTokenizerFast, dataset_type: str, with_input: str, without_input: str
) -> None:
    fmt = formatter(tokenizer, type=dataset_type)
    for extra, prompt in (("It", with_input), ("", without_input)):
        sample = fmt({"instruction": "Do.", "input": extra, "output": "Done."})
        expected = [BOS_TOKEN_ID, *ids(tokenizer, prompt)]
        assert sample.input_ids == [*expected, *ids(tokenizer, "Done."), EOS_TOKEN_ID]
        assert sample.labels[: len(expected)] == [IGNORE] * len(expected)


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


def test_chat_with_eot_tokens_trains_every_assistant_turn_and_its_end_token(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    sample = formatter(tokenizer, type="chat_template", eot_tokens=("<|im_end|>",))({"messages": CHAT})
    expected = tokenizer.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    assert sample.input_ids == expected["input_ids"]
    # The tiny template marks assistant content + <|im_end|> with {% generation %}: an independent
    # statement of the tokens that the content spans and end tokens must give.
    assert sample.labels == [
        t if m else IGNORE for t, m in zip(expected["input_ids"], expected["assistant_masks"], strict=True)
    ]
    assert trained_text(tokenizer, sample) == ["It is 4.<|im_end|>", "Yes, I am.<|im_end|>"]
    assert sample.labels.count(IM_END_TOKEN_ID) == 2


def test_chat_by_default_trains_up_to_eos_and_warns_when_the_template_has_none(
    tokenizer: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture
) -> None:
    # Axolotl's default end-of-turn token is the tokenizer's eos (</s>), which the tiny ChatML template
    # never writes: the assistant's text is trained, its <|im_end|> is not, and Axolotl warns
    # (ChatTemplateStrategy._validate_eot_and_eos_tokens, axolotl 0.21.0). cptune's warning names the key.
    with caplog.at_level(logging.WARNING, logger="cptune.data.chat_end_tokens"):
        sample = formatter(tokenizer, type="chat_template")({"messages": CHAT})
    assert trained_text(tokenizer, sample) == ["It is 4.", "Yes, I am."]
    assert IM_END_TOKEN_ID not in [label for label in sample.labels if label != IGNORE]
    assert "never writes the tokenizer's eos token '</s>'" in caplog.text
    assert "Set eot_tokens: ['<|im_end|>'] in the recipe" in caplog.text


def test_chat_eos_set_to_the_end_of_turn_token_trains_it(tokenizer: PreTrainedTokenizerFast) -> None:
    # Axolotl's other documented fix: special_tokens: {eos_token: <|im_end|>}.
    im_end_eos = copy.deepcopy(tokenizer)
    im_end_eos.eos_token = "<|im_end|>"
    sample = formatter(im_end_eos, type="chat_template")({"messages": CHAT})
    assert sample == formatter(tokenizer, type="chat_template", eot_tokens=("<|im_end|>",))(
        {"messages": CHAT}
    )


def test_drop_system_message_leaves_out_a_first_system_message(tokenizer: PreTrainedTokenizerFast) -> None:
    """Axolotl's drop_system_message: the sample is the conversation without its system message, token for
    token; a system message that does not come first stays, and one alone is a row problem."""
    eot = ("<|im_end|>",)
    dropped = formatter(tokenizer, type="chat_template", eot_tokens=eot, drop_system_message=True)
    assert dropped({"messages": CHAT}) == formatter(tokenizer, type="chat_template", eot_tokens=eot)(
        {"messages": CHAT[1:]}
    )
    assert "Be brief." not in tokenizer.decode(dropped({"messages": CHAT}).input_ids)
    later = [*CHAT[1:3], CHAT[0], *CHAT[3:]]
    assert "Be brief." in tokenizer.decode(dropped({"messages": later}).input_ids)
    with pytest.raises(RowProblem, match="holds a system message only, which drop_system_message leaves out"):
        dropped({"messages": CHAT[:1]})


def test_chat_custom_fields_roles_to_train_and_train_on_inputs(tokenizer: PreTrainedTokenizerFast) -> None:
    row = {"conv": [{"from": m["role"], "value": m["content"]} for m in CHAT]}
    fields = {"field_messages": "conv", "message_field_role": "from", "message_field_content": "value"}
    sample = formatter(tokenizer, type="chat_template", roles_to_train=("user",), **fields)(row)
    # A message's content is trained, never the template's header around it (as in Axolotl).
    assert trained_text(tokenizer, sample) == ["What is 2 plus 2?", "Are you sure?"]
    everything = formatter(tokenizer, True, type="chat_template", eot_tokens=("<|im_end|>",), **fields)(row)
    assert everything.input_ids == sample.input_ids
    assert trained_text(tokenizer, everything) == [f"{m['content']}<|im_end|>" for m in CHAT]


def test_chat_roles_to_train_names_data_roles_too(tokenizer: PreTrainedTokenizerFast) -> None:
    # Axolotl maps roles_to_train through the role names as it maps the messages: gpt means assistant.
    gpt = formatter(tokenizer, type="chat_template", roles_to_train=("gpt",))({"messages": CHAT})
    assert gpt == formatter(tokenizer, type="chat_template")({"messages": CHAT})


def test_builtin_chatml_template_is_used_when_asked(tokenizer: PreTrainedTokenizerFast) -> None:
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DataError, match="chat_template: chatml") as error:
        formatter(bare, type="chat_template")
    assert LABEL in str(error.value)
    sample = formatter(bare, chat_template="chatml", type="chat_template")({"messages": CHAT})
    # cptune's ChatML renders like the tiny tokenizer's own ChatML template, without its <s>: Axolotl's
    # chatml has no bos (src/axolotl/utils/chat_templates/templates/chatml.jinja, axolotl 0.21.0).
    own = formatter(tokenizer, type="chat_template")({"messages": CHAT})
    assert own.input_ids[0] == BOS_TOKEN_ID
    assert sample == Sample(own.input_ids[1:], own.labels[1:])
    assert bare.apply_chat_template(CHAT, chat_template=CHATML_TEMPLATE, tokenize=False).startswith(
        "<|im_start|>system"
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


def test_chat_template_that_is_not_prefix_stable_trains_each_messages_content(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    # Marks the last message, so a conversation's first messages do not render to a prefix of the whole:
    # the content is found in the whole rendering (as Axolotl finds it), so such a template trains.
    unstable = copy.deepcopy(tokenizer)
    unstable.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last %} (last){% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    sample = formatter(unstable, type="chat_template")({"messages": CHAT})
    assert unstable.decode(sample.input_ids).endswith("assistant: Yes, I am. (last)")
    assert trained_text(unstable, sample) == ["It is 4.", "Yes, I am."]


def test_chat_content_is_found_by_token_diff_without_character_offsets(
    tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slow tokenizer has no offsets: Axolotl then compares the conversation up to the message rendered
    # with its content and with a placeholder. The same tokens come out here.
    fast = formatter(tokenizer, type="chat_template", eot_tokens=("<|im_end|>",))({"messages": CHAT})
    monkeypatch.setattr(type(tokenizer), "is_fast", property(lambda self: False))
    slow = formatter(tokenizer, type="chat_template", eot_tokens=("<|im_end|>",))({"messages": CHAT})
    assert slow == fast


def test_chat_eot_tokens_must_be_single_tokens_in_the_template(
    tokenizer: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture
) -> None:
    # "assistant" is in the template's text, but several tokens of the tiny tokenizer.
    assert len(ids(tokenizer, "assistant")) > 1
    with pytest.raises(DataError, match=r"eot_tokens: 'assistant' is \d+ tokens of the tokenizer, not one"):
        formatter(tokenizer, type="chat_template", eot_tokens=("assistant",))
    # A token the template never writes is left out, with a warning (as Axolotl does).
    with caplog.at_level(logging.WARNING, logger="cptune.data.chat_end_tokens"):
        sample = formatter(tokenizer, type="chat_template", eot_tokens=("<|eot_id|>", "<|im_end|>"))
    assert "eot_tokens: '<|eot_id|>' is not in the chat template" in caplog.text
    assert trained_text(tokenizer, sample({"messages": CHAT})) == [
        "It is 4.<|im_end|>",
        "Yes, I am.<|im_end|>",
    ]


def test_chat_eos_in_eot_tokens_needs_one_policy(tokenizer: PreTrainedTokenizerFast) -> None:
    im_end_eos = copy.deepcopy(tokenizer)
    im_end_eos.eos_token = "<|im_end|>"
    with pytest.raises(
        DataError, match=r"train_on_eos \(turn\) and train_on_eot \(none\) say different things"
    ):
        formatter(
            im_end_eos, type="chat_template", eot_tokens=("<|im_start|>", "<|im_end|>"), train_on_eot="none"
        )
