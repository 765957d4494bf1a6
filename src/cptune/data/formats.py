"""Row formats: turn one raw row into ``input_ids`` and ``labels`` (-100 where not trained).

A dataset's ``type`` picks the format: the alpaca family (:mod:`cptune.data.alpaca`), ``chat_template``
(:mod:`cptune.data.chat_format`), ``completion`` and ``pretokenized`` (here; a dataset without a
``type`` is pre-tokenized, as in Axolotl). The preference pairs of ``rl`` have their own formats
(:mod:`cptune.data.preference_formats`). A format raises :class:`RowProblem` for a row it cannot use
(:mod:`cptune.data.sample`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from cptune.config.data import DatasetConfig
from cptune.data.alpaca import alpaca_formatter
from cptune.data.chat_format import chat_formatter
from cptune.data.chat_templates import CHATML, resolve_chat_template
from cptune.data.preference_formats import build_pair_formatter
from cptune.data.preference_templates import TEMPLATED_PREFERENCE_TYPES, templated_columns
from cptune.data.sample import (
    Formatter,
    RowProblem,
    Sample,
    eos_id,
    field_problem,
    leading_special_ids,
    text_field,
)
from cptune.labels import IGNORE_INDEX

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe

__all__ = [
    "CHATML_TEMPLATE",
    "Formatter",
    "RowProblem",
    "Sample",
    "build_formatter",
    "dataset_formatter",
    "missing_columns_advice",
    "required_columns",
    "resolve_chat_template",
]

CHATML_TEMPLATE = CHATML
"""The built-in template used when the recipe sets ``chat_template: chatml``."""


def _completion(config: DatasetConfig, tokenizer: PreTrainedTokenizerBase) -> Formatter:
    bos, eos = leading_special_ids(tokenizer), eos_id(tokenizer)

    def format_row(row: Mapping[str, Any]) -> Sample:
        # The whole text: rows longer than sequence_len are cut into pieces later (cptune.data.rows).
        text = text_field(row, config.field)
        input_ids = [*bos, *tokenizer(text, add_special_tokens=False)["input_ids"]]
        if input_ids[-1:] != [eos]:
            input_ids.append(eos)
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


def _check_attention_mask(row: Mapping[str, Any], length: int) -> None:
    # Axolotl's pre-tokenized rows carry an attention_mask; cptune attends to every token of a row, so a
    # masked-out token (padding) would be trained on and attended to: refuse it rather than drop the mask.
    mask = row.get("attention_mask")
    if mask is None:
        return
    values = _int_list(
        row, "attention_mask", allow=lambda v: v in (0, 1), allowed="a mask holds 0 and 1 only"
    )
    if len(values) != length:
        raise field_problem("attention_mask", f"has {len(values)} entries but the row has {length} tokens")
    if 0 in values:
        raise field_problem(
            "attention_mask",
            f"holds 0 at position {values.index(0)}: cptune attends to every token of a pre-tokenized row; remove "
            "the padding from the row (pack with sample_packing instead)",
        )


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
        _check_attention_mask(row, len(input_ids))
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


def required_columns(config: DatasetConfig) -> tuple[str, ...]:
    """Columns a dataset of this type must have (optional ones excluded)."""
    if config.type == "chat_template.default":
        return (config.field_messages, config.field_chosen, config.field_rejected)
    if config.type == "passthrough.default":
        return (config.field_prompt, config.field_chosen, config.field_rejected)
    if config.type == "chat_template.argilla_chat":
        return (config.field_chosen, config.field_rejected)
    if config.type in TEMPLATED_PREFERENCE_TYPES:
        return templated_columns(config.type)
    row_format = config.row_format
    if row_format == "alpaca":
        return (config.field_instruction, config.field_output)
    if row_format == "chat_template":
        return (config.field_messages,)
    if row_format == "completion":
        return (config.field,)
    return (config.field_input_ids,)


def missing_columns_advice(config: DatasetConfig, key: str) -> str:
    """What to do when the data lacks the columns of its type (the end of the error message)."""
    if config.type is None:
        return (
            f"{key} has no type, which (as in Axolotl) means pre-tokenized rows (input_ids, and labels); set "
            f"{key}.type to the format of the rows (alpaca, chat_template, completion)."
        )
    if config.type in TEMPLATED_PREFERENCE_TYPES:
        return (
            f"{config.type} reads the columns its type names, as Axolotl's does (docs/preference-training.md); for "
            "other column names use passthrough.default or chat_template.default with field_prompt, field_messages, "
            "field_chosen and field_rejected."
        )
    return f"Set the field name keys of {key} (e.g. field_output, field_messages, field) to the columns your data uses."


def build_formatter(
    config: DatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    train_on_inputs: bool,
    chat_template: str | None,
    label: str,
    chat_template_jinja: str | None = None,
    eot_tokens: Sequence[str] | None = None,
) -> Formatter:
    """A function that turns one row of this dataset into a :class:`Sample`.

    Args:
        config: The dataset entry (its ``type`` and field names).
        tokenizer: The model's tokenizer.
        train_on_inputs: Train on prompt tokens too (alpaca, chat_template).
        chat_template: The recipe's ``chat_template``.
        label: Names the dataset in messages.
        chat_template_jinja: The recipe's ``chat_template_jinja``.
        eot_tokens: The recipe's ``eot_tokens`` (chat_template).

    Returns:
        The formatter; it raises :class:`RowProblem` for a row it cannot use.

    Raises:
        DataError: If the tokenizer cannot serve this format (no eos, no chat template, an
            end-of-turn token that is not one token).
    """
    if config.is_preference:
        raise ValueError(
            f"no formatter of single samples for dataset type {config.type!r} "
            "(preference pairs: cptune.data.preference_formats.build_pair_formatter)"
        )
    row_format = config.row_format
    if row_format == "alpaca":
        return alpaca_formatter(config, tokenizer, train_on_inputs)
    if row_format == "completion":
        return _completion(config, tokenizer)
    if row_format == "pretokenized":
        return _pretokenized(config, tokenizer)
    template = resolve_chat_template(tokenizer, chat_template, label, chat_template_jinja)
    return chat_formatter(config, tokenizer, train_on_inputs, template, eot_tokens, label)


def dataset_formatter(
    recipe: Recipe, config: DatasetConfig, tokenizer: PreTrainedTokenizerBase, label: str
) -> Formatter:
    """The formatter of one dataset entry of ``recipe``: its preference pairs, or its single samples.

    Raises:
        DataError: If the tokenizer cannot serve the dataset's format (see :func:`build_formatter`).
    """
    if config.is_preference:
        return build_pair_formatter(
            config, tokenizer, recipe.chat_template, label, recipe.chat_template_jinja
        )
    return build_formatter(
        config,
        tokenizer,
        train_on_inputs=recipe.train_on_inputs,
        chat_template=recipe.chat_template,
        label=label,
        chat_template_jinja=recipe.chat_template_jinja,
        eot_tokens=recipe.eot_tokens,
    )
