"""Row formats: turn one raw row into ``input_ids`` and ``labels`` (-100 where not trained).

Four formats, chosen by a dataset's ``type``: ``alpaca``, ``chat_template``,
``completion`` and ``pretokenized``; and the preference pairs of ``rl``
(:mod:`cptune.data.preference_formats`). A format never sees the row index or the
dataset name; it raises :class:`RowProblem` and the caller (see
:mod:`cptune.data.rows`) turns that into a :class:`~cptune.errors.DataError`
naming dataset, row and field, or counts and skips the row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from cptune.config.data import DatasetConfig
from cptune.data.chat_templates import CHATML, resolve_chat_template
from cptune.errors import DataError
from cptune.labels import IGNORE_INDEX

__all__ = [
    "CHATML_TEMPLATE",
    "RowProblem",
    "Sample",
    "build_formatter",
    "required_columns",
    "resolve_chat_template",
]

CHATML_TEMPLATE = CHATML
"""The built-in template used when the recipe sets ``chat_template: chatml``."""

# Axolotl's default mapping of the role names found in data to the template's roles.
DEFAULT_ROLES: dict[str, tuple[str, ...]] = {
    "user": ("human", "user"),
    "assistant": ("gpt", "assistant"),
    "system": ("system",),
    "tool": ("tool",),
}

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"

logger = logging.getLogger(__name__)

_SKIP_HINT = "Fix the row, or set skip_invalid_rows: true to skip such rows (they are counted and reported)."


class RowProblem(Exception):
    """A row that a format cannot use.

    Attributes:
        reason: Short text used to count skipped rows (``field 'output' is missing``).
        detail: The full sentence for an error message.
        skippable: Whether ``skip_invalid_rows`` may skip the row. Problems of the
            setup rather than of the row (a chat template that is not
            prefix-stable) are not.
    """

    def __init__(self, reason: str, detail: str | None = None, *, skippable: bool = True):
        self.reason = reason
        self.detail = detail or f"{reason}. {_SKIP_HINT}"
        self.skippable = skippable
        super().__init__(self.detail)


@dataclass(frozen=True)
class Sample:
    """One tokenized sample; ``labels`` is -100 on tokens that are not trained.

    ``document_lengths``: the documents the sample is made of, end to end (their positions restart
    at 0 each); None for one document. A preference pair is two: prompt + chosen, prompt + rejected
    (:mod:`cptune.data.preference_formats`).
    """

    input_ids: list[int]
    labels: list[int]
    document_lengths: tuple[int, ...] | None = None

    @property
    def documents(self) -> tuple[int, ...]:
        """The length of each document of the sample."""
        return self.document_lengths if self.document_lengths is not None else (len(self.input_ids),)

    @property
    def position_ids(self) -> list[int]:
        """Positions 0..n-1 of each document in turn."""
        return [position for length in self.documents for position in range(length)]

    def truncated(self, length: int) -> Sample:
        """The sample cut to ``length`` tokens, keeping the start of every document.

        One document: its first ``length`` tokens. Two (a preference pair): each side keeps its start;
        a side shorter than half of ``length`` stays whole and the other gets the rest, otherwise
        each gets half, so both sides keep their prompt and as much of their response as fits.
        """
        documents = self.documents
        if sum(documents) <= length:
            return self
        if len(documents) == 1:
            return Sample(self.input_ids[:length], self.labels[:length])
        if len(documents) != 2:
            raise ValueError(f"cannot truncate a sample of {len(documents)} documents")
        first, second = documents
        half = length // 2
        if first <= half:
            kept = (first, length - first)
        elif second <= half:
            kept = (length - second, second)
        else:
            kept = (half, length - half)
        spans = [(0, kept[0]), (first, first + kept[1])]
        return Sample(
            [token for start, stop in spans for token in self.input_ids[start:stop]],
            [label for start, stop in spans for label in self.labels[start:stop]],
            kept,
        )


Formatter = Callable[[Mapping[str, Any]], Sample]


def field_problem(name: str, problem: str) -> RowProblem:
    return RowProblem(f"field {name!r} {problem}")


def text_field(row: Mapping[str, Any], name: str, *, required: bool = True) -> str:
    value = row.get(name)
    if value is None:
        if required:
            raise field_problem(name, "is missing")
        return ""
    if not isinstance(value, str):
        raise field_problem(name, f"is a {type(value).__name__}, not text")
    if required and not value.strip():
        raise field_problem(name, "is empty")
    return value


def _leading_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    # The ids the tokenizer puts before a text (bos, if it adds one), found by
    # comparing an encoding with and without special tokens. Only the leading
    # ones are kept: a tokenizer that appends eos to every text must not put an
    # eos between a prompt and its response.
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError(
            "The tokenizer has no eos token, which alpaca and completion rows end with. "
            "Use a tokenizer that defines eos_token (tokenizer_config in the recipe)."
        )
    return int(tokenizer.eos_token_id)


def _alpaca(config: DatasetConfig, tokenizer: PreTrainedTokenizerBase, train_on_inputs: bool) -> Formatter:
    bos, eos = _leading_special_ids(tokenizer), _eos_id(tokenizer)

    def format_row(row: Mapping[str, Any]) -> Sample:
        instruction = text_field(row, config.field_instruction)
        extra = text_field(row, config.field_input, required=False)
        output = text_field(row, config.field_output)
        template = ALPACA_PROMPT if extra.strip() else ALPACA_PROMPT_NO_INPUT
        prompt = template.format(instruction=instruction, input=extra)
        # Tokenized apart so the prompt/response boundary is exact: no token
        # straddles "### Response:\n" and the first word of the answer.
        prompt_ids = bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = [*tokenizer(output, add_special_tokens=False)["input_ids"], eos]
        input_ids = prompt_ids + response_ids
        labels = list(input_ids) if train_on_inputs else [IGNORE_INDEX] * len(prompt_ids) + response_ids
        return Sample(input_ids, labels)

    return format_row


def _completion(config: DatasetConfig, tokenizer: PreTrainedTokenizerBase) -> Formatter:
    bos, eos = _leading_special_ids(tokenizer), _eos_id(tokenizer)

    def format_row(row: Mapping[str, Any]) -> Sample:
        text = text_field(row, config.field)
        input_ids = [*bos, *tokenizer(text, add_special_tokens=False)["input_ids"], eos]
        return Sample(input_ids, list(input_ids))

    return format_row


def _int_list(row: Mapping[str, Any], name: str, *, allow: Callable[[int], bool], allowed: str) -> list[int]:
    value = row.get(name)
    if value is None:
        raise field_problem(name, "is missing")
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise field_problem(name, f"is a {type(value).__name__}, not a list of token ids")
    if len(value) == 0:
        raise field_problem(name, "is empty")
    for position, item in enumerate(value):
        # bool is an int subclass; a True in a token list is a data bug.
        if not isinstance(item, int) or isinstance(item, bool):
            raise field_problem(name, f"holds a {type(item).__name__} at position {position}, not an int")
        if not allow(item):
            raise field_problem(name, f"holds {item} at position {position}; {allowed}")
    return list(value)


def _pretokenized(config: DatasetConfig, tokenizer: PreTrainedTokenizerBase) -> Formatter:
    vocab = len(tokenizer)

    def in_vocab(token: int) -> bool:
        return 0 <= token < vocab

    def label_ok(token: int) -> bool:
        return token == IGNORE_INDEX or 0 <= token < vocab

    def format_row(row: Mapping[str, Any]) -> Sample:
        input_ids = _int_list(
            row, config.field_input_ids, allow=in_vocab, allowed=f"token ids must be in 0..{vocab - 1}"
        )
        if row.get(config.field_labels) is None:
            return Sample(input_ids, list(input_ids))
        labels = _int_list(
            row, config.field_labels, allow=label_ok, allowed=f"labels must be -100 or in 0..{vocab - 1}"
        )
        if len(labels) != len(input_ids):
            raise field_problem(
                config.field_labels,
                f"has {len(labels)} entries but {config.field_input_ids} has {len(input_ids)}",
            )
        return Sample(input_ids, labels)

    return format_row


def _role_names(config: DatasetConfig) -> dict[str, str]:
    """Data role name -> template role (Axolotl's ``roles``; by default human -> user, gpt -> assistant)."""
    roles = config.roles if config.roles is not None else DEFAULT_ROLES
    return {source: target for target, sources in roles.items() for source in sources}


def _messages(row: Mapping[str, Any], config: DatasetConfig) -> list[dict[str, str]]:
    name = config.field_messages
    value = row.get(name)
    if value is None:
        raise field_problem(name, "is missing")
    return message_list(value, name, config)


def message_list(value: Any, name: str, config: DatasetConfig) -> list[dict[str, str]]:
    """The messages of column ``name`` as the template sees them (role names mapped, reasoning kept).

    Raises:
        RowProblem: The value is not a non-empty list of messages with a text role and content.
    """
    role_key, content_key = config.resolved_message_fields
    reasoning_key = config.resolved_reasoning_field
    role_names = _role_names(config)
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
            converted["reasoning_content"] = reasoning
        messages.append(converted)
    return messages


def end_token(span: list[int], special_ids: set[int], tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """Where a turn's end-of-turn token is in its tokens: (start, end); (len, len) when it has none.

    The end-of-turn token is the turn's last special token when only whitespace follows it
    ("<|im_end|>\n"): generation stops at the token, so the whitespace is never trained.
    """
    last_special = max((i for i, t in enumerate(span) if t in special_ids), default=None)
    if last_special is None or tokenizer.decode(span[last_special + 1 :]).strip():
        return len(span), len(span)
    return last_special, last_special + 1


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Named special tokens and every token added as special (a family's <end_of_turn>, <|eot_id|> ...)."""
    return set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if token.special
    }


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    messages: list[dict[str, str]],
    whole: list[dict[str, str]],
    add_generation_prompt: bool,
) -> list[int]:
    """The token ids of ``messages`` rendered with the chat template.

    ``whole``: the whole conversation (``all_messages``), for templates whose rendering of a turn
    depends on what follows it (qwen3 shows reasoning only after the last user query); the others
    ignore it.

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


def _chat(
    config: DatasetConfig, tokenizer: PreTrainedTokenizerBase, train_on_inputs: bool, template: str | None
) -> Formatter:
    special_ids = special_token_ids(tokenizer)
    trained_roles = set(config.roles_to_train)
    eos_policy = config.train_on_eos
    # A template that never names reasoning_content cannot show it: say so once rather than drop it unseen.
    shows_reasoning = "reasoning_content" in (template or tokenizer.chat_template or "")
    warned = False

    def render(
        messages: list[dict[str, str]], whole: list[dict[str, str]], add_generation_prompt: bool
    ) -> list[int]:
        return render_chat(tokenizer, template, messages, whole, add_generation_prompt)

    def not_prefix_stable(turn: int, what: str) -> RowProblem:
        return RowProblem(
            "chat template is not prefix-stable",
            f"the chat template is not prefix-stable: {what}, so the trained tokens of message {turn} "
            "cannot be located. Set chat_template: chatml in the recipe, or use a template whose "
            "earlier turns render the same whatever follows them.",
            skippable=False,
        )

    def turn_range(messages: list[dict[str, str]], full: list[int], turn: int) -> tuple[int, int, int]:
        """(first token, end-of-turn token, end) of message ``turn`` in ``full``."""
        # The turn's tokens are what rendering it adds to the conversation before it
        # (plus the assistant header, which is the prompt).
        header = messages[turn]["role"] == "assistant"
        before = render(messages[:turn], messages, add_generation_prompt=header) if turn or header else []
        through = render(messages[: turn + 1], messages, add_generation_prompt=False)
        if through[: len(before)] != before:
            raise not_prefix_stable(
                turn, f"messages[:{turn}] does not render to a token prefix of messages[:{turn + 1}]"
            )
        if full[: len(through)] != through:
            raise not_prefix_stable(
                turn, f"messages[:{turn + 1}] does not render to a token prefix of the whole conversation"
            )
        eot_start, eot_end = end_token(through[len(before) :], special_ids, tokenizer)
        return len(before), len(before) + eot_start, len(before) + eot_end

    def format_row(row: Mapping[str, Any]) -> Sample:
        nonlocal warned
        messages = _messages(row, config)
        if not (shows_reasoning or warned) and any(m.get("reasoning_content") for m in messages):
            warned = True
            logger.warning(
                "%s: messages carry reasoning (%r) that the chat template does not show, so it is not "
                "trained; use chat_template: qwen3 (or a template that writes reasoning_content), or put the "
                "reasoning in the content.",
                config.path,
                config.resolved_reasoning_field,
            )
        turns = [i for i, m in enumerate(messages) if m["role"] in trained_roles]
        if not turns:
            raise RowProblem(
                f"no message with a role in roles_to_train {list(config.roles_to_train)}",
            )
        full = render(messages, messages, add_generation_prompt=False)
        labels = list(full) if train_on_inputs else [IGNORE_INDEX] * len(full)
        if train_on_inputs:
            return Sample(full, labels)
        for turn in range(len(messages)) if eos_policy == "all" else turns:
            start, eot_start, end = turn_range(messages, full, turn)
            if turn in turns:
                labels[start:eot_start] = full[start:eot_start]
            if (
                eos_policy == "all"
                or (eos_policy == "turn" and turn in turns)
                or (eos_policy == "last" and turn == turns[-1])
            ):
                labels[eot_start:end] = full[eot_start:end]
        return Sample(full, labels)

    return format_row


def required_columns(config: DatasetConfig) -> tuple[str, ...]:
    """Columns a dataset of this type must have (optional ones excluded)."""
    if config.type == "chat_template.default":
        return (config.field_messages, config.field_chosen, config.field_rejected)
    if config.type == "passthrough.default":
        return (config.field_prompt, config.field_chosen, config.field_rejected)
    if config.type == "alpaca":
        return (config.field_instruction, config.field_output)
    if config.type == "chat_template":
        return (config.field_messages,)
    if config.type == "completion":
        return (config.field,)
    return (config.field_input_ids,)


def build_formatter(
    config: DatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    train_on_inputs: bool,
    chat_template: str | None,
    label: str,
    chat_template_jinja: str | None = None,
) -> Formatter:
    """A function that turns one row of this dataset into a :class:`Sample`.

    Args:
        config: The dataset entry (its ``type`` and field names).
        tokenizer: The model's tokenizer.
        train_on_inputs: Train on prompt tokens too (alpaca, chat_template).
        chat_template: The recipe's ``chat_template``.
        label: Names the dataset in messages.
        chat_template_jinja: The recipe's ``chat_template_jinja``.

    Returns:
        The formatter; it raises :class:`RowProblem` for a row it cannot use.

    Raises:
        DataError: If the tokenizer cannot serve this format (no eos, no chat template).
    """
    if config.type == "alpaca":
        return _alpaca(config, tokenizer, train_on_inputs)
    if config.type == "completion":
        return _completion(config, tokenizer)
    if config.type == "pretokenized":
        return _pretokenized(config, tokenizer)
    if config.type == "chat_template":
        template = resolve_chat_template(tokenizer, chat_template, label, chat_template_jinja)
        return _chat(config, tokenizer, train_on_inputs, template)
    raise ValueError(
        f"no formatter of single samples for dataset type {config.type!r} "
        "(preference pairs: cptune.data.preference_formats.build_pair_formatter)"
    )
