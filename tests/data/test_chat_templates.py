"""Chat templates by name: each family's documented format, trained tokens, roles and end-of-turn tokens."""

from __future__ import annotations

import copy
import logging

import pytest
from transformers import PreTrainedTokenizerFast

from cptune.config.recipe import DatasetConfig
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
# Gemma have no system turn: cptune puts the system message before the first user message.
DOCUMENTED = {
    "chatml": "<s><|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1"
    "<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n",
    "qwen_25": "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1"
    "<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nSYS<|eot_id|><|start_header_id|>user"
    "<|end_header_id|>\n\nU1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
    "\n\nA2<|eot_id|>",
    "mistral_v1": "<s> [INST] SYS\n\nU1 [/INST] A1</s> [INST] U2 [/INST] A2</s>",
    "mistral_v2v3": "<s>[INST] SYS\n\nU1[/INST] A1</s>[INST] U2[/INST] A2</s>",
    "mistral_v3_tekken": "<s>[INST]SYS\n\nU1[/INST]A1</s>[INST]U2[/INST]A2</s>",
    "gemma": "<s><start_of_turn>user\nSYS\n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
    "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\nA2<end_of_turn>\n",
    "phi_3": "<s><|system|>\nSYS<|end|>\n<|user|>\nU1<|end|>\n<|assistant|>\nA1<|end|>\n<|user|>\nU2<|end|>\n"
    "<|assistant|>\nA2<|end|>\n",
}
GENERATION_PROMPT = {
    "chatml": "<|im_start|>assistant\n",
    "qwen_25": "<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral_v1": " [/INST]",
    "mistral_v2v3": "[/INST]",
    "mistral_v3_tekken": "[/INST]",
    "gemma": "<start_of_turn>model\n",
    "phi_3": "<|assistant|>\n",
}
# What each template trains of CHAT with the family's marker tokens added as special tokens.
TRAINED = {
    "chatml": ["It is 4.<|im_end|>", "Yes, I am.<|im_end|>"],
    "qwen_25": ["It is 4.<|im_end|>", "Yes, I am.<|im_end|>"],
    "llama3": ["It is 4.<|eot_id|>", "Yes, I am.<|eot_id|>"],
    "mistral_v1": [" It is 4.</s>", " Yes, I am.</s>"],
    "mistral_v2v3": [" It is 4.</s>", " Yes, I am.</s>"],
    "mistral_v3_tekken": ["It is 4.</s>", "Yes, I am.</s>"],
    "gemma": ["It is 4.<end_of_turn>", "Yes, I am.<end_of_turn>"],
    "phi_3": ["It is 4.<|end|>", "Yes, I am.<|end|>"],
}


def build(tokenizer, chat_template: str | None = "chatml", jinja: str | None = None, **config):
    return build_formatter(
        DatasetConfig(path="data.jsonl", type="chat_template", **config),
        tokenizer,
        train_on_inputs=False,
        chat_template=chat_template,
        label="datasets[0] (data.jsonl)",
        chat_template_jinja=jinja,
    )


def with_markers(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with every family's marker tokens, as the families' own tokenizers have them."""
    from cptune.data.chat_templates import MARKERS

    marked = copy.deepcopy(tokenizer)
    markers = sorted({m for names in MARKERS.values() for m in names})
    marked.add_tokens(markers, special_tokens=True)
    return marked


def test_every_axolotl_name_cptune_accepts_has_a_template():
    from cptune.config.compat import BUILT_IN_CHAT_TEMPLATES

    assert set(BUILT_IN_CHAT_TEMPLATES) == set(TEMPLATES) == set(DOCUMENTED)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_renders_the_documented_format(tokenizer: PreTrainedTokenizerFast, name: str):
    rendered = tokenizer.apply_chat_template(CONVERSATION, chat_template=TEMPLATES[name], tokenize=False)
    assert rendered == DOCUMENTED[name]
    prompt = tokenizer.apply_chat_template(
        CONVERSATION[:2], chat_template=TEMPLATES[name], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith(GENERATION_PROMPT[name])


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_trains_the_assistant_turns_and_their_end_token(
    tokenizer: PreTrainedTokenizerFast, name: str
):
    marked = with_markers(tokenizer)
    sample = build(marked, name)({"messages": CHAT})
    assert trained_text(marked, sample) == TRAINED[name]


def test_missing_marker_tokens_are_reported_not_refused(tokenizer: PreTrainedTokenizerFast, caplog):
    with caplog.at_level(logging.WARNING, logger="cptune.data.formats"):
        sample = build(tokenizer, "llama3")({"messages": CHAT})
    assert "chat_template llama3 writes <|start_header_id|>, <|end_header_id|>, <|eot_id|>" in caplog.text
    # Written as text, the end-of-turn marker is still trained with the turn.
    assert trained_text(tokenizer, sample) == ["It is 4.<|eot_id|>", "Yes, I am.<|eot_id|>"]


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
