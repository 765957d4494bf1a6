"""Chat templates by name: cptune's own Jinja renderings of each model family's documented chat format.

A recipe's ``chat_template`` names one of these (Axolotl's names), ``tokenizer_default`` for the
tokenizer's own template, or ``jinja`` for ``chat_template_jinja``. Every template here is
prefix-stable (the rendering of the first messages of a conversation is a prefix of the rendering
of the whole), which is how cptune finds the tokens of each turn to train. Qwen3's format decides how
an assistant turn looks from what follows it (reasoning is shown only after the last user query), so
:data:`QWEN3` reads the whole conversation from ``all_messages`` when the formatter renders a part of
it: each turn then renders as it does in the whole conversation, the text Qwen3's own template gives.
The tokenizer's bos and eos tokens are written where the format has them, so the same template serves
any tokenizer of the family; the family's other marker tokens are written as text and are single
tokens only where the tokenizer has them (:func:`missing_marker_tokens` says which are not).

Where a family's own template differs, it says so below: Mistral's and Gemma's formats have no
system turn, so a system message is put before the first user message, separated by a blank line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from cptune.errors import DataError

logger = logging.getLogger(__name__)

_SYSTEM_INTO_FIRST_USER = (
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"
    "{%- set turns = messages[1:] if system is not none else messages -%}"
)


def _user_text() -> str:
    # The content of a user turn, with the system message before the first one.
    return "((system + '\\n\\n') if system is not none and loop.first else '') + message['content']"


# No bos before the first <|im_start|>: Axolotl's chatml template has none
# (src/axolotl/utils/chat_templates/templates/chatml.jinja, axolotl 0.21.0).
CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)
"""ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per turn, without a bos token (as Axolotl's)."""

FALCON_H1 = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)
"""Falcon-H1: ChatML after a bos token; a system message counts only as the first message (Falcon-H1's own
template, and Axolotl's ``falcon_h1``, leave out any later one). Tool definitions are not rendered."""

QWEN_25 = (
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)
"""Qwen2.5: ChatML without a bos token, with Qwen's default system message when the data has none."""

LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] | trim) "
    "+ '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif -%}"
)
"""Llama 3: ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`` per turn after bos."""


def _mistral(open_: str, close: str, reply: str) -> str:
    # One [INST] block per user turn; the assistant's reply follows it and ends with eos.
    return (
        "{{- bos_token -}}" + _SYSTEM_INTO_FIRST_USER + "{%- for message in turns -%}"
        "{%- if message['role'] == 'user' -%}"
        "{{ '" + open_ + "' + " + _user_text() + " + '" + close + "' }}"
        "{%- elif message['role'] == 'assistant' -%}"
        "{{ '" + reply + "' + message['content'] + eos_token }}"
        "{%- else -%}{{ raise_exception('Mistral chats have user and assistant turns only (and a first "
        "system message); got ' + message['role']) }}"
        "{%- endif -%}"
        "{%- endfor -%}"
    )


MISTRAL_V1 = _mistral(" [INST] ", " [/INST]", " ")
"""Mistral v1 (Mistral-7B v0.1/v0.2): `` [INST] {user} [/INST] {assistant}</s>`` after bos."""

MISTRAL_V2V3 = _mistral("[INST] ", "[/INST]", " ")
"""Mistral v2/v3 (SentencePiece): ``[INST] {user}[/INST] {assistant}</s>`` after bos."""

MISTRAL_V3_TEKKEN = _mistral("[INST]", "[/INST]", "")
"""Mistral v3 with the Tekken tokenizer (Nemo): ``[INST]{user}[/INST]{assistant}</s>`` after bos."""

GEMMA = (
    "{{- bos_token -}}" + _SYSTEM_INTO_FIRST_USER + "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{%- set text = " + _user_text() + " if message['role'] == 'user' else message['content'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (text | trim) + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif -%}"
)
"""Gemma: ``<start_of_turn>{user|model}\\n{content}<end_of_turn>\\n`` per turn after bos."""

GEMMA3 = (
    "{{- bos_token -}}" + _SYSTEM_INTO_FIRST_USER + "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{%- set prefix = (system + '\\n\\n') if system is not none and loop.first else '' -%}"
    "{{ '<start_of_turn>' + role + '\\n' + prefix + (message['content'] | trim) + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif -%}"
)
"""Gemma 3: Gemma's turns, with the system message as written (untrimmed) and a blank line before the first
turn's trimmed content, as Gemma 3's own template and Axolotl's ``gemma3`` write it."""

PHI_3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif -%}"
)
"""Phi-3: ``<|{role}|>\\n{content}<|end|>\\n`` per turn after bos."""

# Qwen3 decides how an assistant turn looks from where it stands in the whole conversation: its reasoning is
# shown only after the last user query, and the conversation's last turn always opens a thinking block. The
# formatter renders the parts of a conversation with the whole of it in view (``all_messages``), so a turn
# renders the same in every part; without it (generation) the messages are the whole conversation.
_QWEN3_TURNS = (
    "{%- set whole = all_messages if all_messages is defined else messages -%}"
    "{%- set last = whole | length - 1 -%}"
    # The last query: the last user message that is not a tool response (the whole conversation's last
    # message when there is none).
    "{%- set ns = namespace(query=last) -%}"
    "{%- for m in whole -%}"
    "{%- if m['role'] == 'user' and not (m['content'].startswith('<tool_response>') "
    "and m['content'].endswith('</tool_response>')) %}{% set ns.query = loop.index0 %}{% endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- set i = loop.index0 -%}"
    "{%- if message['role'] == 'assistant' -%}"
    # Reasoning from reasoning_content, or from a <think>...</think> block written in the content.
    "{%- set answer = message['content'] -%}"
    "{%- set thought = '' -%}"
    "{%- if message['reasoning_content'] is string %}{% set thought = message['reasoning_content'] -%}"
    "{%- elif '</think>' in answer -%}"
    "{%- set thought = answer.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}"
    "{%- set answer = answer.split('</think>')[-1].lstrip('\n') -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if i > ns.query and (i == last or thought) -%}"
    "{{ '<think>\n' + thought.strip('\n') + '\n</think>\n\n' + answer.lstrip('\n') }}"
    "{%- else %}{{ answer }}{% endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' -%}"
    # Consecutive tool responses share one user turn.
    "{%- if i == 0 or whole[i - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if i == last or whole[i + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif -%}"
    "{%- elif message['role'] in ['system', 'user'] -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- else -%}{{ raise_exception('Qwen3 chats have system, user, assistant and tool turns; got ' "
    "+ message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
_THINKING_OFF = "enable_thinking is defined and enable_thinking is false"
QWEN3 = (
    _QWEN3_TURNS + "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if " + _THINKING_OFF + " %}{{ '<think>\n\n</think>\n\n' }}{% endif -%}"
    "{%- endif -%}"
)
"""Qwen3: ChatML without bos or default system message; an assistant turn after the last user query shows its
reasoning as ``<think>\n{reasoning}\n</think>\n\n{answer}`` (the conversation's last turn always, with an empty
block when it has none), earlier turns their answer only. ``enable_thinking: false`` closes an empty thinking
block in the generation prompt."""

QWEN3_5 = (
    _QWEN3_TURNS + "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if " + _THINKING_OFF + " %}{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n\n' }}{% endif -%}"
    "{%- endif -%}"
)
"""Qwen3.5 (text): Qwen3's turns (as Axolotl's qwen3_5 template writes chats of text); its generation prompt
opens a thinking block, ``<think>\n\n``, closed empty with ``enable_thinking: false``."""

TEMPLATES: dict[str, str] = {
    "chatml": CHATML,
    "qwen_25": QWEN_25,
    "falcon_h1": FALCON_H1,
    "qwen3": QWEN3,
    "qwen3_5": QWEN3_5,
    "llama3": LLAMA3,
    "mistral_v1": MISTRAL_V1,
    "mistral_v2v3": MISTRAL_V2V3,
    "mistral_v3_tekken": MISTRAL_V3_TEKKEN,
    "gemma": GEMMA,
    "gemma3": GEMMA3,
    "phi_3": PHI_3,
}
"""Template text by Axolotl's name (``chat_template: llama3``)."""

MARKERS: dict[str, tuple[str, ...]] = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "qwen_25": ("<|im_start|>", "<|im_end|>"),
    "falcon_h1": ("<|im_start|>", "<|im_end|>"),
    "qwen3": ("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
    "qwen3_5": ("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "mistral_v1": ("[INST]", "[/INST]"),
    "mistral_v2v3": ("[INST]", "[/INST]"),
    "mistral_v3_tekken": ("[INST]", "[/INST]"),
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
    "gemma3": ("<start_of_turn>", "<end_of_turn>"),
    "phi_3": ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
}
"""The marker tokens each format writes besides bos and eos."""


def template_text(name: str, jinja: str | None = None) -> str:
    """The template of ``chat_template: name`` (``jinja``: the text, or the file, given in chat_template_jinja).

    Raises:
        DataError: chat_template_jinja names a .jinja file that cannot be read.
    """
    if name != "jinja":
        return TEMPLATES[name]
    assert jinja is not None  # the recipe's rules require it
    if "{" not in jinja and jinja.strip().endswith(".jinja"):
        path = Path(jinja.strip()).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except OSError as err:
            raise DataError(
                f"chat_template_jinja: cannot read the template file '{path}' ({err.strerror}). Give the path of "
                "a readable .jinja file, or the template's text."
            ) from None
    return jinja


def missing_marker_tokens(name: str, tokenizer: Any) -> list[str]:
    """The markers of template ``name`` that the tokenizer does not have as one token each."""
    vocab = tokenizer.get_vocab()
    return [marker for marker in MARKERS.get(name, ()) if marker not in vocab]


def resolve_chat_template(
    tokenizer: Any, chat_template: str | None, label: str, jinja: str | None = None
) -> str | None:
    """The template to render chats with: ``None`` means the tokenizer's own.

    Args:
        tokenizer: The model's tokenizer.
        chat_template: The recipe's ``chat_template``: None or ``tokenizer_default`` (the tokenizer's),
            a built-in name (:mod:`cptune.data.chat_templates`), or ``jinja``.
        label: Names the dataset in messages.
        jinja: The recipe's ``chat_template_jinja`` (used when chat_template is ``jinja`` or unset).

    Raises:
        DataError: If the tokenizer's template is asked for and it has none.
    """
    if jinja is not None and chat_template in (None, "jinja"):
        return template_text("jinja", jinja)
    if chat_template not in (None, "tokenizer_default"):
        missing = missing_marker_tokens(chat_template, tokenizer)
        if missing:
            logger.warning(
                "%s: chat_template %s writes %s, which the tokenizer does not have as tokens; they are "
                "tokenized as text (add them with tokens: or special_tokens: to make them single tokens).",
                label,
                chat_template,
                ", ".join(missing),
            )
        return template_text(chat_template)
    if not tokenizer.chat_template:
        raise DataError(
            f"{label} has type chat_template, but the tokenizer has no chat template. Set "
            "chat_template: chatml (or another built-in name such as llama3) in the recipe to use one of "
            "cptune's templates, or use a tokenizer that ships a template (tokenizer_config)."
        )
    return None
