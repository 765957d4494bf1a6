"""Preference pairs: turn a row (prompt, chosen, rejected) into one sample of two documents.

The sample is ``prompt + chosen`` then ``prompt + rejected``, each a document of its own
(positions restart at 0), with the prompt's labels -100: the targets of a document are its
response's tokens (``docs/preference-training.md``). The layouts, with Axolotl's type names:

* ``chat_template.default``: the prompt's messages (``field_messages``: a list of messages, or a
  text that becomes one user message) and each response (``field_chosen``, ``field_rejected``: a
  text, a message, or a list of messages whose last is the response) rendered with the chat
  template. The prompt is the conversation with the generation prompt (the assistant header); a
  response is what rendering it after the prompt adds, through its end-of-turn token (whitespace
  after that token is left out, as Axolotl's ``rstrip`` of the rendered response does).
* ``chat_template.argilla_chat``: the same, the prompt being the messages of ``field_chosen`` less
  its last (argilla's rows hold each side as the whole conversation).
* ``passthrough.default``: prompt, chosen and rejected as text, tokenized as TRL 1.16's DPOTrainer
  tokenizes such rows: the tokenizer's eos text is appended to a response that does not end with
  it, ``prompt + response`` is tokenized whole (the tokenizer's own special tokens included), and the
  response starts where that and the prompt tokenized alone first differ (a token can straddle the
  boundary; then the prompt's last token counts as the response's).
* ``chatml.*``, ``llama3.*`` (:mod:`cptune.data.preference_templates`): the texts written in a fixed
  template from the type's own columns, then tokenized as ``passthrough.default``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from cptune.config.data import DatasetConfig
from cptune.data.chat_format import message_list, render_chat
from cptune.data.chat_templates import resolve_chat_template
from cptune.data.preference_templates import TEMPLATED_PREFERENCE_TYPES, templated_pair_texts
from cptune.data.sample import Formatter, RowProblem, Sample, field_problem, text_field
from cptune.errors import DataError
from cptune.labels import IGNORE_INDEX

__all__ = ["build_pair_formatter", "pair_sample"]


def pair_sample(prompt: Sequence[int], chosen: Sequence[int], rejected: Sequence[int]) -> Sample:
    """The two-document sample of a pair: prompt + chosen, prompt + rejected; only the responses trained."""
    masked = [IGNORE_INDEX] * len(prompt)
    return Sample(
        input_ids=[*prompt, *chosen, *prompt, *rejected],
        labels=[*masked, *chosen, *masked, *rejected],
        document_lengths=(len(prompt) + len(chosen), len(prompt) + len(rejected)),
    )


def _end_token(span: list[int], special_ids: set[int], tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """Where a response's end-of-turn token is in its tokens: (start, end); (len, len) when it has none.

    The end-of-turn token is the span's last special token when only whitespace follows it
    ("<|im_end|>\n"): generation stops at the token, so the whitespace is never trained.
    """
    last_special = max((i for i, t in enumerate(span) if t in special_ids), default=None)
    if last_special is None or tokenizer.decode(span[last_special + 1 :]).strip():
        return len(span), len(span)
    return last_special, last_special + 1


def _special_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Named special tokens and every token added as special (a family's <end_of_turn>, <|eot_id|> ...)."""
    return set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if token.special
    }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _text_pair_tokenizer(config: DatasetConfig, tokenizer: PreTrainedTokenizerBase):
    """Tokenize a pair given as text (prompt, chosen, rejected) as TRL 1.16 does; see the module's docstring."""
    eos = tokenizer.eos_token
    if eos is None:
        raise DataError(
            f"The tokenizer has no eos token, which {config.type} responses end with. "
            "Use a tokenizer that defines eos_token (tokenizer_config in the recipe)."
        )

    def tokenize(prompt: str, chosen: str, rejected: str) -> Sample:
        responses = [text if text.endswith(eos) else text + eos for text in (chosen, rejected)]
        prompt_ids = tokenizer(prompt)["input_ids"]
        chosen_ids, rejected_ids = (tokenizer(prompt + text)["input_ids"] for text in responses)
        start = min(_common_prefix(prompt_ids, chosen_ids), _common_prefix(prompt_ids, rejected_ids))
        return pair_sample(prompt_ids[:start], chosen_ids[start:], rejected_ids[start:])

    return tokenize


def _passthrough(config: DatasetConfig, tokenizer: PreTrainedTokenizerBase) -> Formatter:
    tokenize = _text_pair_tokenizer(config, tokenizer)

    def format_row(row: Mapping[str, Any]) -> Sample:
        prompt = text_field(row, config.field_prompt)
        return tokenize(
            prompt, *(text_field(row, name) for name in (config.field_chosen, config.field_rejected))
        )

    return format_row


def _templated(config: DatasetConfig, tokenizer: PreTrainedTokenizerBase) -> Formatter:
    tokenize = _text_pair_tokenizer(config, tokenizer)

    def format_row(row: Mapping[str, Any]) -> Sample:
        return tokenize(*templated_pair_texts(str(config.type), row))

    return format_row


def _response(value: Any, name: str, config: DatasetConfig) -> list[dict[str, str]]:
    """A response column as one message: a text is the assistant's, a list's last message is the response."""
    role_key, content_key = config.resolved_message_fields
    if isinstance(value, str):
        value = [{role_key: "assistant", content_key: value}]
    elif isinstance(value, Mapping):
        value = [value]
    elif isinstance(value, Sequence) and value:
        value = [value[-1]]
    if value is None:
        raise field_problem(name, "is missing")
    return message_list(value, name, config)


def _chat_pairs(config: DatasetConfig, tokenizer: PreTrainedTokenizerBase, template: str | None) -> Formatter:
    special_ids = _special_token_ids(tokenizer)

    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        return render_chat(tokenizer, template, messages, messages, add_generation_prompt)

    def response_ids(prompt: list[dict[str, str]], prompt_ids: list[int], response: list[dict[str, str]]):
        full = render([*prompt, *response], add_generation_prompt=False)
        if full[: len(prompt_ids)] != prompt_ids:
            raise RowProblem(
                "chat template is not prefix-stable",
                "the chat template is not prefix-stable: the prompt with the generation prompt does not render "
                "to a token prefix of the prompt followed by the response, so the response cannot be located. "
                "Set chat_template: chatml in the recipe, or use a template that renders earlier turns the same "
                "whatever follows them.",
                skippable=False,
            )
        tail = full[len(prompt_ids) :]
        _, end = _end_token(tail, special_ids, tokenizer)
        return tail[:end]

    def prompt_value(row: Mapping[str, Any]) -> tuple[str, Any]:
        """The prompt's column and its value: argilla_chat's prompt is the chosen conversation less its reply."""
        if config.type == "chat_template.argilla_chat":
            name = config.field_chosen
            value = row.get(name)
            if not isinstance(value, list) or len(value) < 2:
                raise field_problem(
                    name, "is not a conversation of at least two messages (the prompt, then the reply)"
                )
            return name, value[:-1]
        return config.field_messages, row.get(config.field_messages)

    def format_row(row: Mapping[str, Any]) -> Sample:
        name, value = prompt_value(row)
        if isinstance(value, str):
            role_key, content_key = config.resolved_message_fields
            value = [{role_key: "user", content_key: value}]
        if value is None:
            raise field_problem(name, "is missing")
        prompt = message_list(value, name, config)
        prompt_ids = render(prompt, add_generation_prompt=True)
        chosen, rejected = (
            response_ids(prompt, prompt_ids, _response(row.get(field), field, config))
            for field in (config.field_chosen, config.field_rejected)
        )
        return pair_sample(prompt_ids, chosen, rejected)

    return format_row


def build_pair_formatter(
    config: DatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    chat_template: str | None,
    label: str,
    chat_template_jinja: str | None = None,
) -> Formatter:
    """The formatter of a preference dataset (``config.type`` one of the preference types).

    Raises:
        DataError: The tokenizer cannot serve the format (no eos, no chat template).
    """
    if config.type == "passthrough.default":
        return _passthrough(config, tokenizer)
    if config.type in TEMPLATED_PREFERENCE_TYPES:
        return _templated(config, tokenizer)
    template = resolve_chat_template(tokenizer, chat_template, label, chat_template_jinja)
    return _chat_pairs(config, tokenizer, template)
