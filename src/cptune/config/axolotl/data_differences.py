"""What cptune trains differently from Axolotl for the same recipe and data: each difference, and what to set.

cptune renders and trains rows as Axolotl 0.21.0 does (the alpaca preambles and prompt styles, chat
messages' content and end tokens, chatml without bos, completion rows cut into pieces, pre-tokenized
rows); ``tests/axolotl/test_axolotl_parity.py`` compares every example of the shipped data with
Axolotl's own output. This list is what is left; ``docs/migrating-from-axolotl.md`` prints it, and
``cptune validate`` notes the entries a recipe meets (:func:`cptune.config.axolotl.notes.data_notes`).
"""

from __future__ import annotations

__all__ = ["DATA_DIFFERENCES", "PARITY_RECIPES"]

PARITY_RECIPES = (
    "`type: alpaca` (with and without input), `alpaca:chat`, `alpaca:chatml`, `alpaca:phi`, "
    "`alpaca_instruct.load_no_prompt`, `train_on_inputs: true`; `type: chat_template` with the tokenizer's "
    "template, `chatml`, `llama3`, `qwen3`, `qwen_25`, `mistral_v1`, `phi_3`, with `eot_tokens`, "
    "`special_tokens.eos_token`, `train_on_eos: all`, `train_on_inputs: true` and ShareGPT rows "
    "(`message_property_mappings`); `type: completion` with rows longer than `sequence_len`; a dataset "
    "without `type` (pre-tokenized rows)"
)
"""The recipes whose every example the parity test compares, token by token, with Axolotl's output."""

DATA_DIFFERENCES: tuple[tuple[str, str], ...] = (
    (
        "`chat_template: mistral_v2v3` and `mistral_v3_tekken` write a system message before the first user "
        "message; Axolotl's templates write it only into a user message that ends the conversation, so its "
        "training rows have none.",
        "Leave system messages out of the data to train what Axolotl trains.",
    ),
    (
        "`chat_template: gemma` writes a system message before the first user message; Axolotl's gemma template "
        "refuses a system message.",
        "Nothing, or leave system messages out.",
    ),
    (
        "A row's `system` and `tools` columns are not read: Axolotl puts the `system` column (`field_system`) "
        "before the messages as a system message and passes `tools` to the template. Message keys other than "
        "role, content and reasoning (`tool_calls`, `name`) are not passed to the template either.",
        "Put the system message first in the messages; tool calls are not supported.",
    ),
    (
        "cptune refuses, naming the row, an alpaca row whose instruction or output is empty or only "
        "whitespace, a completion row whose text is, and a chat row without a message of `roles_to_train`; "
        "Axolotl takes them (an empty one trains nothing and is dropped, a whitespace one trains its whitespace "
        "and eos).",
        "`skip_invalid_rows: true` skips and counts such rows.",
    ),
    (
        "Pre-tokenized rows: an `attention_mask` with a 0 is refused (Axolotl keeps the masked tokens in the row "
        "and trains what `labels` says); rows without `labels` train every token and rows without "
        "`attention_mask` are accepted, where Axolotl reads neither as pre-tokenized.",
        "Remove padding from pre-tokenized rows.",
    ),
    (
        "A sample whose only trained label is its first token is dropped (nothing predicts a first token, so "
        "Axolotl's loss does not use it either).",
        "Nothing: the loss is the same.",
    ),
    (
        "Packing (`sample_packing`) happens when the data is prepared (first-fit decreasing, each document "
        "whole), not per batch as Axolotl's multipack sampler packs: every document has the same tokens and "
        "labels, but which documents share a row differs, and the prepared rows keep the datasets' order (the "
        "trainer's sampler shuffles them; `shuffle_merged_datasets` adds nothing).",
        "Nothing.",
    ),
    (
        "`dataset_exact_deduplication: true` compares samples by what is stored and trained (tokens, labels, "
        "positions); Axolotl compares every column of its rows, so pre-tokenized rows, or preference rows, that "
        "differ only in a column nothing trains (an id) are duplicates here and kept there.",
        "Nothing, or `dataset_exact_deduplication: false` to keep such copies.",
    ),
)
"""(what differs, what to set) for each remaining difference in what is trained."""
