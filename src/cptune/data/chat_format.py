"""Chat rows (a list of messages) rendered with a chat template, trained as Axolotl's ``chat_template`` trains them.

The conversation is rendered once, whole. A message is trained when its role is in ``roles_to_train``
(or with ``train_on_inputs``, every message): the tokens of its content (:mod:`cptune.data.chat_turns`),
never the template's headers. After a message's content, the first end-of-turn token and the first eos
token within three tokens are trained as ``train_on_eot`` and ``train_on_eos`` say: ``turn`` (after
trained messages), ``all`` (after every message), ``last`` (the last one found after a trained message),
``none``. Which tokens end a turn: :mod:`cptune.data.chat_end_tokens`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from cptune.config.data import DatasetConfig
from cptune.data.chat_end_tokens import EndTokens, end_tokens
from cptune.data.chat_turns import ContentSpans
from cptune.data.sample import Formatter, RowProblem, Sample, field_problem
from cptune.labels import IGNORE_INDEX

__all__ = ["DEFAULT_ROLES", "chat_formatter", "message_list", "render_chat"]

logger = logging.getLogger(__name__)

# Axolotl's default mapping of the role names found in data to the template's roles.
DEFAULT_ROLES: dict[str, tuple[str, ...]] = {
    "user": ("human", "user"),
    "assistant": ("gpt", "assistant"),
    "system": ("system",),
    "tool": ("tool",),
}

# How far after a message's content its end-of-turn / eos token may be (Axolotl's allowance for template text).
_END_TOKEN_REACH = 3


# transformers hands a message's reasoning to a chat template under each of these keys when the message has it
# under one of them (utils/chat_template_utils.py, _alias_reasoning_fields): gpt-oss's template reads thinking.
ALIASED_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _reads_key(template_text: str, key: str) -> bool:
    """Whether a chat template names ``key`` as a key: quoted (``message['key']``, ``message.get("key")``,
    ``'key' in message``) or as an attribute (``message.key``). A longer name that ends with it
    (``enable_thinking``) does not count."""
    quoted = re.escape(key)
    return re.search(rf"""['"]{quoted}['"]|\.{quoted}\b""", template_text) is not None


def _role_names(config: DatasetConfig) -> dict[str, str]:
    """Data role name -> template role (Axolotl's ``roles``; by default human -> user, gpt -> assistant)."""
    roles = config.roles if config.roles is not None else DEFAULT_ROLES
    return {source: target for target, sources in roles.items() for source in sources}


def _messages(
    row: Mapping[str, Any], config: DatasetConfig, role_names: dict[str, str]
) -> list[dict[str, str]]:
    name = config.field_messages
    value = row.get(name)
    if value is None:
        raise field_problem(name, "is missing")
    return message_list(value, name, config, role_names)


def message_list(
    value: Any, name: str, config: DatasetConfig, role_names: dict[str, str] | None = None
) -> list[dict[str, str]]:
    """The messages of column ``name`` as the template sees them (role names mapped, reasoning kept; with
    ``drop_system_message`` a first message of the system role left out).

    Raises:
        RowProblem: The value is not a non-empty list of messages with a text role and content.
    """
    role_names = _role_names(config) if role_names is None else role_names
    role_key, content_key = config.resolved_message_fields
    reasoning_key = config.resolved_reasoning_field
    if isinstance(value, Mapping) and isinstance(value.get(role_key), list):
        # datasets' legacy Sequence-of-struct feature decodes to a dict of lists.
        value = [dict(zip(value, turn, strict=False)) for turn in zip(*value.values(), strict=False)]
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise field_problem(name, "is not a non-empty list of messages")
    messages = []
    for turn, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise field_problem(name, f"message {turn} is a {type(message).__name__}, not an object")
        role, content = message.get(role_key), message.get(content_key)
        if not isinstance(role, str) or not role:
            raise field_problem(name, f"message {turn} has no text {role_key!r}")
        if not isinstance(content, str):
            raise field_problem(name, f"message {turn} has no text {content_key!r}")
        converted = {"role": role_names.get(role, role), "content": content}
        reasoning = message.get(reasoning_key)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise field_problem(name, f"message {turn} has a {reasoning_key!r} that is not text")
            converted[config.template_thinking_key] = reasoning
        messages.append(converted)
    if config.drop_system_message and messages[0]["role"] == "system":
        messages = messages[1:]
        if not messages:
            raise field_problem(name, "holds a system message only, which drop_system_message leaves out")
    return messages


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    messages: list[dict[str, str]],
    whole: list[dict[str, str]],
    add_generation_prompt: bool,
) -> list[int]:
    """The token ids of ``messages`` rendered with the chat template (the preference pairs' prompts and sides).

    ``whole``: the whole conversation (``all_messages``), for templates whose rendering of a turn
    depends on what follows it (qwen3 shows reasoning only after the last user query).

    Raises:
        RowProblem: The template rejected the messages (its ``raise_exception()``).
    """
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            all_messages=whole,
        )
    except Exception as error:  # a template's raise_exception() is a row problem
        raise RowProblem(f"the chat template rejected the messages ({error})") from error
    return list(ids)


def _first_after(input_ids: list[int], start: int, wanted: frozenset[int]) -> int | None:
    """The first index at or after ``start`` holding one of ``wanted``, if it is within reach."""
    for index in range(start, min(len(input_ids), start + _END_TOKEN_REACH + 1)):
        if input_ids[index] in wanted:
            return index
    return None


def _label_turns(
    messages: list[dict[str, str]],
    input_ids: list[int],
    spans: ContentSpans,
    trained: list[bool],
    ends: EndTokens,
    config: DatasetConfig,
) -> list[int]:
    labels = [IGNORE_INDEX] * len(input_ids)
    policies = (
        (ends.eot, config.resolved_train_on_eot),
        (frozenset() if ends.eos is None else frozenset({ends.eos}), config.train_on_eos),
    )
    every_turn = any(policy == "all" for _, policy in policies)
    last_found: list[int | None] = [None, None]
    for turn in range(len(messages)):
        if not (trained[turn] or every_turn):
            continue
        span = spans.span(turn)
        if span is None:
            continue
        start, end = span
        if trained[turn]:
            labels[start:end] = input_ids[start:end]
        for kind, (wanted, policy) in enumerate(policies):
            found = _first_after(input_ids, end, wanted)
            if found is None:
                continue
            last_found[kind] = found
            if policy == "all" or (policy == "turn" and trained[turn]):
                labels[found] = input_ids[found]
    for (_, policy), found in zip(policies, last_found, strict=True):
        if policy == "last" and found is not None:
            labels[found] = input_ids[found]
    return labels


def chat_formatter(
    config: DatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_on_inputs: bool,
    template: str | None,
    eot_tokens: Sequence[str] | None,
    label: str,
) -> Formatter:
    """The formatter of a chat_template dataset (see the module's docstring).

    Args:
        config: The dataset entry.
        tokenizer: The model's tokenizer.
        train_on_inputs: Train every message's content, not only those of roles_to_train.
        template: The template's text; None for the tokenizer's own.
        eot_tokens: The recipe's ``eot_tokens``.
        label: Names the dataset in messages.
    """
    role_names = _role_names(config)
    trained_roles = {role_names.get(role, role) for role in config.roles_to_train}
    template_text = template if template is not None else str(tokenizer.chat_template or "")
    # A template that never names the reasoning's key cannot show it: say so once rather than drop it unseen.
    thinking_key = config.template_thinking_key
    readable = ALIASED_REASONING_KEYS if thinking_key in ALIASED_REASONING_KEYS else (thinking_key,)
    shows_reasoning = any(_reads_key(template_text, key) for key in readable)
    warned = False

    def render(messages: list[dict[str, str]], whole: list[dict[str, str]], *, tokenize: bool) -> Any:
        # ``all_messages``: the whole conversation, for templates whose rendering of a turn depends on what
        # follows it (qwen3 shows reasoning only after the last user query); the others ignore it.
        try:
            return tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=tokenize, return_dict=False, all_messages=whole
            )
        except Exception as error:  # a template's raise_exception() is a row problem
            raise RowProblem(f"the chat template rejected the messages ({error})") from error

    def render_ids(messages: list[dict[str, str]], whole: list[dict[str, str]]) -> list[int]:
        return list(render(messages, whole, tokenize=True))

    def render_text(messages: list[dict[str, str]]) -> str:
        return str(render(messages, messages, tokenize=False))

    ends = end_tokens(tokenizer, template_text, eot_tokens, config, label, lambda m: render_ids(m, m))

    def format_row(row: Mapping[str, Any]) -> Sample:
        nonlocal warned
        messages = _messages(row, config, role_names)
        if not (shows_reasoning or warned) and any(m.get(thinking_key) for m in messages):
            warned = True
            logger.warning(
                "%s: messages carry reasoning (%r) that the chat template does not show, so it is not "
                "trained: the template never reads %r (template_thinking_key). Use chat_template: qwen3 (or a "
                "template that writes it), set template_thinking_key to the key the template reads, or put the "
                "reasoning in the content.",
                config.path,
                config.resolved_reasoning_field,
                thinking_key,
            )
        trained = [train_on_inputs or m["role"] in trained_roles for m in messages]
        if not any(trained):
            raise RowProblem(f"no message with a role in roles_to_train {list(config.roles_to_train)}")
        input_ids = render_ids(messages, messages)
        spans = ContentSpans(messages, input_ids, tokenizer, render_text, render_ids)
        return Sample(input_ids, _label_turns(messages, input_ids, spans, trained, ends, config))

    return format_row
