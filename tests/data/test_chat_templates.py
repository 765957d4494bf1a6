"""Chat templates by name: each family's documented format, trained tokens, roles and end-of-turn tokens.

What is trained follows Axolotl 0.21.0's chat_template strategy: a message's content, then the
end-of-turn token (``eot_tokens``; by default the tokenizer's eos) within three tokens after it.
"""

from __future__ import annotations

import copy
import logging

import pytest
from transformers import PreTrainedTokenizerFast

from cptune.config.data import DatasetConfig
from cptune.data.chat_templates import TEMPLATES, template_text
from cptune.data.formats import build_formatter
from cptune.errors import DataError
from tests.data.test_formats import CHAT, trained_text

CONVERSATION = [
    {"role": "system", "content": "SYS"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
    {"role": "assistant", "content": "A2"},
]

# The formats as the model families document them, rendered with bos <s> and eos </s>. Mistral and
# Gemma have no system turn: cptune puts the system message before the first user message. ChatML has
# no bos, as in Axolotl's chatml template (src/axolotl/utils/chat_templates/templates/chatml.jinja).
DOCUMENTED = {
    "chatml": "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1"
    "<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n",
    "qwen_25": "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1"
    "<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n",
    "falcon_h1": "<s><|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1"
    "<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n",
    # Qwen3: the last turn opens an (empty) thinking block; earlier assistant turns show their answer only.
    "qwen3": "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1"
    "<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n",
    "qwen3_5": "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1"
    "<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nSYS<|eot_id|><|start_header_id|>user"
    "<|end_header_id|>\n\nU1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
    "\n\nA2<|eot_id|>",
    "mistral_v1": "<s> [INST] SYS\n\nU1 [/INST] A1</s> [INST] U2 [/INST] A2</s>",
    "mistral_v2v3": "<s>[INST] SYS\n\nU1[/INST] A1</s>[INST] U2[/INST] A2</s>",
    "mistral_v3_tekken": "<s>[INST]SYS\n\nU1[/INST]A1</s>[INST]U2[/INST]A2</s>",
    "gemma": "<s><start_of_turn>user\nSYS\n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
    "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\nA2<end_of_turn>\n",
    "gemma3": "<s><start_of_turn>user\nSYS\n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
    "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\nA2<end_of_turn>\n",
    "phi_3": "<s><|system|>\nSYS<|end|>\n<|user|>\nU1<|end|>\n<|assistant|>\nA1<|end|>\n<|user|>\nU2<|end|>\n"
    "<|assistant|>\nA2<|end|>\n",
}
GENERATION_PROMPT = {
    "chatml": "<|im_start|>assistant\n",
    "qwen_25": "<|im_start|>assistant\n",
    "falcon_h1": "<|im_start|>assistant\n",
    "qwen3": "<|im_start|>assistant\n",
    "qwen3_5": "<|im_start|>assistant\n<think>\n\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral_v1": " [/INST]",
    "mistral_v2v3": "[/INST]",
    "mistral_v3_tekken": "[/INST]",
    "gemma": "<start_of_turn>model\n",
    "gemma3": "<start_of_turn>model\n",
    "phi_3": "<|assistant|>\n",
}
# Each family's end-of-turn token, for eot_tokens (Mistral's turns end with eos, the default).
END_OF_TURN = {
    "chatml": "<|im_end|>",
    "qwen_25": "<|im_end|>",
    "falcon_h1": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "qwen3_5": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "gemma": "<end_of_turn>",
    "gemma3": "<end_of_turn>",
    "phi_3": "<|end|>",
}
# What each template trains of CHAT with the family's marker tokens added as special tokens and its
# end-of-turn token in eot_tokens: each assistant message's content, then its end token (the tiny
# tokenizer keeps the space Mistral writes before the content apart from it, so it is not trained).
# Qwen3's empty thinking block is the same with any content, so it is not trained either.
TRAINED = {
    "chatml": ["It is 4.<|im_end|>", "Yes, I am.<|im_end|>"],
    "qwen_25": ["It is 4.<|im_end|>", "Yes, I am.<|im_end|>"],
    "falcon_h1": ["It is 4.<|im_end|>", "Yes, I am.<|im_end|>"],
    "qwen3": ["It is 4.<|im_end|>", "Yes, I am.<|im_end|>"],
    "qwen3_5": ["It is 4.<|im_end|>", "Yes, I am.<|im_end|>"],
    "llama3": ["It is 4.<|eot_id|>", "Yes, I am.<|eot_id|>"],
    "mistral_v1": ["It is 4.</s>", "Yes, I am.</s>"],
    "mistral_v2v3": ["It is 4.</s>", "Yes, I am.</s>"],
    "mistral_v3_tekken": ["It is 4.</s>", "Yes, I am.</s>"],
    "gemma": ["It is 4.<end_of_turn>", "Yes, I am.<end_of_turn>"],
    "gemma3": ["It is 4.<end_of_turn>", "Yes, I am.<end_of_turn>"],
    "phi_3": ["It is 4.<|end|>", "Yes, I am.<|end|>"],
}


def build(
    tokenizer,
    chat_template: str | None = "chatml",
    jinja: str | None = None,
    eot_tokens: tuple[str, ...] | None = ("<|im_end|>",),
    **config,
):
    return build_formatter(
        DatasetConfig(path="data.jsonl", type="chat_template", **config),
        tokenizer,
        train_on_inputs=False,
        chat_template=chat_template,
        label="datasets[0] (data.jsonl)",
        chat_template_jinja=jinja,
        eot_tokens=eot_tokens,
    )


def with_markers(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with every family's marker tokens, as the families' own tokenizers have them."""
    from cptune.data.chat_templates import MARKERS

    marked = copy.deepcopy(tokenizer)
    markers = sorted({m for names in MARKERS.values() for m in names})
    marked.add_tokens(markers, special_tokens=True)
    return marked


def test_every_axolotl_name_cptune_accepts_has_a_template():
    from cptune.config.data import BUILT_IN_CHAT_TEMPLATES

    assert set(BUILT_IN_CHAT_TEMPLATES) == set(TEMPLATES) == set(DOCUMENTED)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_renders_the_documented_format(tokenizer: PreTrainedTokenizerFast, name: str):
    rendered = tokenizer.apply_chat_template(CONVERSATION, chat_template=TEMPLATES[name], tokenize=False)
    assert rendered == DOCUMENTED[name]
    prompt = tokenizer.apply_chat_template(
        CONVERSATION[:2], chat_template=TEMPLATES[name], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith(GENERATION_PROMPT[name])


def test_gemma3_keeps_the_system_message_as_written_and_trims_each_content(
    tokenizer: PreTrainedTokenizerFast,
):
    """Gemma 3's own template (and Axolotl's gemma3): the system message and its blank line go before the first
    turn's content untrimmed, the content itself is trimmed. cptune's gemma trims the two together."""
    spaced = [
        {"role": "system", "content": " SYS "},
        {"role": "user", "content": "  U1\n"},
        {"role": "assistant", "content": " A1 "},
    ]
    gemma3 = tokenizer.apply_chat_template(spaced, chat_template=TEMPLATES["gemma3"], tokenize=False)
    assert (
        gemma3 == "<s><start_of_turn>user\n SYS \n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
    )
    gemma = tokenizer.apply_chat_template(spaced, chat_template=TEMPLATES["gemma"], tokenize=False)
    assert gemma.startswith("<s><start_of_turn>user\nSYS \n\n  U1<end_of_turn>")


def test_falcon_h1_renders_a_system_message_only_first(tokenizer: PreTrainedTokenizerFast):
    """Falcon-H1's own template (and Axolotl's falcon_h1) writes the first message when it is a system message and
    leaves every later system message out."""
    chat = [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "U1"},
        {"role": "system", "content": "LATER"},
        {"role": "assistant", "content": "A1"},
    ]
    text = tokenizer.apply_chat_template(chat, chat_template=TEMPLATES["falcon_h1"], tokenize=False)
    assert text == (
        "<s><|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
    )


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_trains_the_assistant_turns_and_their_end_token(
    tokenizer: PreTrainedTokenizerFast, name: str
):
    marked = with_markers(tokenizer)
    end = END_OF_TURN.get(name)
    sample = build(marked, name, eot_tokens=None if end is None else (end,))({"messages": CHAT})
    assert trained_text(marked, sample) == TRAINED[name]


def test_missing_marker_tokens_are_reported_not_refused(tokenizer: PreTrainedTokenizerFast, caplog):
    with caplog.at_level(logging.WARNING, logger="cptune.data.chat_templates"):
        sample = build(tokenizer, "llama3", eot_tokens=None)({"messages": CHAT})
    assert "chat_template llama3 writes <|start_header_id|>, <|end_header_id|>, <|eot_id|>" in caplog.text
    # Written as text, the end-of-turn marker is no token to train: the content is trained (as Axolotl does).
    assert trained_text(tokenizer, sample) == ["It is 4.", "Yes, I am."]


def test_sharegpt_rows_through_message_property_mappings(tokenizer: PreTrainedTokenizerFast):
    """Axolotl's `field_messages: conversations` + `{role: from, content: value}` with human/gpt roles."""
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    row = {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in CHAT]}
    mapped = build(
        tokenizer,
        field_messages="conversations",
        message_property_mappings={"role": "from", "content": "value"},
    )(row)
    assert mapped == build(tokenizer)({"messages": CHAT})
    # A mapping of the data's own role names replaces the default one.
    row = {"messages": [{"role": "asker" if m["role"] == "user" else m["role"], **m} for m in CHAT]}
    row["messages"] = [{**m, "role": "asker"} if m["role"] == "user" else m for m in CHAT]
    custom = build(tokenizer, roles={"user": ["asker"], "assistant": ["assistant"], "system": ["system"]})(
        row
    )
    assert custom == mapped


@pytest.mark.parametrize(
    ("policy", "trained"),
    [
        ("turn", ["It is 4.<|im_end|>", "Yes, I am.<|im_end|>"]),
        ("none", ["It is 4.", "Yes, I am."]),
        ("last", ["It is 4.", "Yes, I am.<|im_end|>"]),
        # every turn's end token: system, user, and the assistant turns with their text
        ("all", ["<|im_end|>", "<|im_end|>", "It is 4.<|im_end|>", "<|im_end|>", "Yes, I am.<|im_end|>"]),
    ],
)
def test_train_on_eos(tokenizer: PreTrainedTokenizerFast, policy: str, trained: list[str]):
    sample = build(tokenizer, train_on_eos=policy)({"messages": CHAT})
    assert trained_text(tokenizer, sample) == trained


def test_chat_template_jinja_as_text_or_file(tokenizer: PreTrainedTokenizerFast, tmp_path):
    jinja = TEMPLATES["phi_3"]
    (tmp_path / "phi.jinja").write_text(jinja)
    by_text = build(tokenizer, None, jinja=jinja)({"messages": CHAT})
    by_file = build(tokenizer, "jinja", jinja=str(tmp_path / "phi.jinja"))({"messages": CHAT})
    assert by_text == by_file == build(tokenizer, "phi_3")({"messages": CHAT})
    assert template_text("jinja", "{{ messages }}") == "{{ messages }}"
    with pytest.raises(DataError, match="chat_template_jinja: cannot read the template file"):
        template_text("jinja", str(tmp_path / "missing.jinja"))


# --- qwen3: reasoning ------------------------------------------------------------------------------------

THINKING = [
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\nIt is 4."},
    {"role": "user", "content": "Are you sure?"},
    {"role": "assistant", "content": "Yes, I am.", "reasoning_content": "Check again."},
]
# Qwen3's documented rendering: the reasoning of a turn before the last user query is not shown; the turns
# after it show theirs in a <think> block (reasoning_content, or a <think>...</think> written in the content).
QWEN3_THINKING = (
    "<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n"
    "<|im_start|>user\nAre you sure?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nCheck again.\n</think>\n\nYes, I am.<|im_end|>\n"
)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_qwen3_shows_reasoning_after_the_last_user_query_only(tokenizer: PreTrainedTokenizerFast, name: str):
    """Qwen3.5 writes the turns of a text chat as Qwen3 does (Axolotl's qwen3_5 template too)."""
    qwen3 = TEMPLATES[name]
    assert tokenizer.apply_chat_template(THINKING, chat_template=qwen3, tokenize=False) == QWEN3_THINKING
    # Alone, the first exchange ends the conversation, so its reasoning is shown: Qwen3's format is not
    # prefix-stable. With the whole conversation in view the part renders as it does in the whole.
    alone = tokenizer.apply_chat_template(THINKING[:2], chat_template=qwen3, tokenize=False)
    assert alone == (
        "<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo and two.\n</think>\n\nIt is 4.<|im_end|>\n"
    )
    part = tokenizer.apply_chat_template(
        THINKING[:2], chat_template=qwen3, tokenize=False, all_messages=THINKING
    )
    assert not QWEN3_THINKING.startswith(alone) and QWEN3_THINKING.startswith(part)
    prompt = tokenizer.apply_chat_template(
        THINKING[:1], chat_template=qwen3, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_qwen3_trains_every_assistant_turn_as_the_whole_conversation_renders_it(
    tokenizer: PreTrainedTokenizerFast, name: str
):
    marked = with_markers(tokenizer)
    sample = build(marked, name)({"messages": THINKING})
    assert marked.decode(sample.input_ids) == QWEN3_THINKING
    # The content is what differs from the message rendered with a placeholder content and no reasoning
    # (Axolotl's rule): the last turn opens a thinking block either way, so its "<think>\n" is not trained.
    assert trained_text(marked, sample) == [
        "It is 4.<|im_end|>",
        "Check again.\n</think>\n\nYes, I am.<|im_end|>",
    ]
    # After the last query every assistant turn shows its reasoning; tool responses share one user turn.
    tools = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Call the tool."},
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "12 C"},
        {"role": "assistant", "content": "Rain, 12 C.", "reasoning_content": "Both came back."},
    ]
    sample = build(marked, name)({"messages": tools})
    assert marked.decode(sample.input_ids) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nCall the tool.\n</think>\n\nLet me look.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\n12 C\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\nBoth came back.\n</think>\n\nRain, 12 C.<|im_end|>\n"
    )
    # A turn before the last shows a thinking block only when it has reasoning: all of it is trained.
    assert trained_text(marked, sample) == [
        "<think>\nCall the tool.\n</think>\n\nLet me look.<|im_end|>",
        "Both came back.\n</think>\n\nRain, 12 C.<|im_end|>",
    ]


def test_reasoning_key_by_field_thinking_or_mapping(tokenizer: PreTrainedTokenizerFast, caplog):
    expected = build(tokenizer, "qwen3")({"messages": THINKING})
    renamed = [{k.replace("reasoning_content", "thought"): v for k, v in m.items()} for m in THINKING]
    assert build(tokenizer, "qwen3", field_thinking="thought")({"messages": renamed}) == expected
    mapped = build(tokenizer, "qwen3", message_property_mappings={"reasoning_content": "thought"})
    assert mapped({"messages": renamed}) == expected
    # A template that does not show reasoning says so instead of dropping it unseen.
    with caplog.at_level(logging.WARNING, logger="cptune.data.chat_format"):
        sample = build(tokenizer, "chatml")({"messages": THINKING})
    assert (
        "messages carry reasoning ('reasoning_content') that the chat template does not show" in caplog.text
    )
    assert trained_text(tokenizer, sample)[-1] == "Yes, I am.<|im_end|>"


def test_template_thinking_key_hands_the_reasoning_to_a_template_that_reads_another_key(
    tokenizer: PreTrainedTokenizerFast, caplog
):
    """Axolotl's template_thinking_key: a template that reads a message's reasoning under another key renders
    and trains it as qwen3's template does under reasoning_content; left at its default, that template never
    sees it, and a warning names the key. transformers itself hands reasoning_content to a template that reads
    thinking (gpt-oss's), which cptune's check of the template knows."""
    expected = build(tokenizer, "qwen3")({"messages": THINKING})
    own_key = TEMPLATES["qwen3"].replace("reasoning_content", "thought_text")
    got = build(tokenizer, None, jinja=own_key, template_thinking_key="thought_text")({"messages": THINKING})
    assert got == expected
    assert "Check again." in tokenizer.decode(got.input_ids)
    with caplog.at_level(logging.WARNING, logger="cptune.data.chat_format"):
        unseen = build(tokenizer, None, jinja=own_key)({"messages": THINKING})
    assert "Check again." not in tokenizer.decode(unseen.input_ids)
    assert "the template never reads 'reasoning_content' (template_thinking_key)" in caplog.text
    caplog.clear()
    gpt_oss_key = TEMPLATES["qwen3"].replace("reasoning_content", "thinking")
    with caplog.at_level(logging.WARNING, logger="cptune.data.chat_format"):
        assert build(tokenizer, None, jinja=gpt_oss_key)({"messages": THINKING}) == expected
    assert "does not show" not in caplog.text
