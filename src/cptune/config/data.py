"""The recipe's keys of the data: the datasets and how their rows become training rows, and the tokens."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from cptune.config.base import Frozen, one_or_many

# Axolotl's alpaca family: the prompt style after a colon (alpaca:chat), and the loaders that drop the preamble.
ALPACA_TYPES = (
    "alpaca",
    "alpaca:instruct",
    "alpaca:chat",
    "alpaca:chatml",
    "alpaca:phi",
    "alpaca_instruct",
    "alpaca_instruct.load_no_prompt",
    "alpaca_chat",
    "alpaca_chat.load_no_prompt",
)
"""The alpaca types cptune renders as Axolotl does (:mod:`cptune.data.alpaca`)."""

# Axolotl's chatml.* and llama3.* preference types: a fixed template each (cptune.data.preference_templates).
TEMPLATED_PREFERENCE_TYPES = tuple(
    f"{family}.{layout}"
    for family, layouts in (
        ("chatml", ("argilla", "argilla_chat", "icr", "intel", "prompt_pairs", "ultra")),
        ("llama3", ("default", "argilla_chat", "icr", "intel", "prompt_pairs", "ultra")),
    )
    for layout in layouts
)
PREFERENCE_TYPES = (
    "chat_template.default",
    "chat_template.argilla_chat",
    "passthrough.default",
    *TEMPLATED_PREFERENCE_TYPES,
)
"""Dataset types whose rows are preference pairs (prompt, chosen, rejected), with Axolotl's names; for ``rl``."""

# The modules of Axolotl's preference (DPO) strategies: `type: <module>.<strategy>` (prompt_strategies/dpo/).
_AXOLOTL_PREFERENCE_MODULES = (
    "chat_template",
    "chatml",
    "llama3",
    "mistral",
    "passthrough",
    "user_defined",
    "zephyr",
)


def is_axolotl_preference_type(name: object) -> bool:
    """``name`` reads as one of Axolotl's preference types (``zephyr.nectar``, ``user_defined.default``, ...)."""
    return isinstance(name, str) and name.partition(".")[0] in _AXOLOTL_PREFERENCE_MODULES and "." in name


DatasetType = Literal[(*ALPACA_TYPES, "chat_template", "completion", "pretokenized", *PREFERENCE_TYPES)]  # type: ignore[valid-type]
RowFormat = Literal["alpaca", "chat_template", "completion", "pretokenized"]
TrainOnEos = Literal["turn", "all", "last", "none"]
DataFileType = Literal["json", "csv", "parquet", "arrow", "text"]

BUILT_IN_CHAT_TEMPLATES = (
    "chatml",
    "llama3",
    "qwen_25",
    "qwen3",
    "qwen3_5",
    "mistral_v1",
    "mistral_v2v3",
    "mistral_v3_tekken",
    "gemma",
    "gemma3",
    "phi_3",
    "falcon_h1",
)
"""Axolotl's chat template names that cptune renders with its own templates (:mod:`cptune.data.chat_templates`)."""

# tokenizer_default: the tokenizer's own template; jinja: chat_template_jinja; else one cptune renders itself.
ChatTemplateName = Literal[("tokenizer_default", "jinja", *BUILT_IN_CHAT_TEMPLATES)]  # type: ignore[valid-type]


class DatasetConfig(Frozen):
    """One dataset source and how to read its rows."""

    path: str = Field(description="Local file or folder, a `save_to_disk` folder, or a hub dataset id.")
    type: DatasetType | None = Field(
        None,
        description="Row format: alpaca (and Axolotl's alpaca styles, e.g. alpaca:chat, "
        "alpaca_instruct.load_no_prompt), chat_template, completion, pretokenized; unset: pre-tokenized rows "
        "(input_ids, labels), as in Axolotl. With rl, preference pairs: chat_template.default, "
        "chat_template.argilla_chat, passthrough.default, and Axolotl's chatml.* and llama3.* "
        "(docs/preference-training.md).",
    )
    ds_type: DataFileType | None = Field(
        None,
        description="The file format of path (or of data_files), when its extension does not say it (Axolotl's "
        "key); text reads each line as a row with a `text` column.",
    )
    split: str = Field("train", description="Split to read.")
    data_files: str | tuple[str, ...] | None = Field(None, description="Files to read inside `path`.")
    name: str | None = Field(None, description="Hub dataset configuration name.")
    revision: str | None = Field(None, description="Hub dataset revision.")
    # alpaca
    field_instruction: str = Field("instruction", description="alpaca: column of the instruction.")
    field_input: str = Field("input", description="alpaca: column of the optional input.")
    field_output: str = Field("output", description="alpaca: column of the response (the trained part).")
    # chat_template
    field_messages: str = Field(
        "messages",
        description="chat_template: column of the list of messages; chat_template.default: of the prompt's "
        "messages (or the prompt text, one user message).",
    )
    message_field_role: str = Field("role", description="chat_template: key of a message's role.")
    message_field_content: str = Field("content", description="chat_template: key of a message's text.")
    roles_to_train: tuple[str, ...] = Field(
        ("assistant",),
        description="chat_template: roles whose messages are trained (unless train_on_inputs).",
    )
    field_thinking: str = Field(
        "reasoning_content",
        description="chat_template: key of an assistant message's reasoning, for templates that show it (qwen3 "
        "writes it in a <think> block; it may also be written in the content as <think>...</think>).",
    )
    drop_system_message: bool = Field(
        False,
        description="chat_template: leave out a conversation's first message when its role is system (Axolotl's "
        "key). A system prompt the chat template writes by itself when there is none stays.",
    )
    template_thinking_key: str = Field(
        "reasoning_content",
        description="chat_template: the key of a message the chat template reads its reasoning from (Axolotl's "
        "key); the data's reasoning (field_thinking) is handed to the template under it. transformers also hands "
        "reasoning under reasoning_content, thinking and reasoning alike (gpt-oss's template reads thinking), so "
        "it matters for a template that reads another key.",
    )
    message_property_mappings: dict[str, str] | None = Field(
        None,
        description="chat_template: Axolotl's way to name a message's keys, e.g. {role: from, content: value} "
        "(the same as message_field_role, message_field_content and, for reasoning_content, field_thinking).",
    )
    roles: dict[str, tuple[str, ...]] | None = Field(
        None,
        description="chat_template: the role names of the data for each template role, e.g. {user: [human], "
        "assistant: [gpt]}; default: human -> user, gpt -> assistant (as Axolotl).",
    )
    train_on_eos: TrainOnEos = Field(
        "turn",
        description="chat_template: which eos tokens are trained: `turn` (the one after each trained turn), "
        "`last` (the last one), `all` (every turn's), `none`.",
    )
    train_on_eot: TrainOnEos | None = Field(
        None,
        description="chat_template: the same choice for the end-of-turn tokens of eot_tokens; default: "
        "train_on_eos's.",
    )
    # preference pairs (rl)
    field_prompt: str = Field(
        "prompt", description="passthrough.default: column of the prompt text (TRL's prompt/chosen/rejected)."
    )
    field_chosen: str = Field(
        "chosen",
        description="chat_template.default, passthrough.default: column of the chosen response (text, a "
        "message, or a list of messages whose last is the response).",
    )
    field_rejected: str = Field(
        "rejected", description="chat_template.default, passthrough.default: column of the rejected response."
    )
    # completion
    field: str = Field("text", description="completion: column of the text; every token is trained.")
    # pretokenized
    field_input_ids: str = Field("input_ids", description="pretokenized: column of the token ids.")
    field_labels: str = Field(
        "labels",
        description="pretokenized: column of the labels (-100: not trained); absent: train every token.",
    )

    @field_validator("message_property_mappings")
    @classmethod
    def _role_and_content_only(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        other = sorted(set(value or {}) - {"role", "content", "reasoning_content"})
        if other:
            raise ValueError(
                f"maps {', '.join(other)}; cptune's chat messages have a role, a content and a reasoning_content "
                "only (map those, or set message_field_role, message_field_content and field_thinking)"
            )
        return value

    @property
    def is_preference(self) -> bool:
        """Rows are preference pairs (a type of :data:`PREFERENCE_TYPES`)."""
        return self.type in PREFERENCE_TYPES

    @property
    def row_format(self) -> RowFormat:
        """How single-sample rows are read: the alpaca family, chat_template, completion, or pre-tokenized (no type)."""
        if self.type is None:
            return "pretokenized"
        if self.type in ALPACA_TYPES:
            return "alpaca"
        return self.type  # type: ignore[return-value]

    @property
    def resolved_train_on_eot(self) -> TrainOnEos:
        """Which end-of-turn tokens are trained: train_on_eot, or train_on_eos when it is unset (Axolotl's rule)."""
        return self.train_on_eot or self.train_on_eos

    @property
    def resolved_message_fields(self) -> tuple[str, str]:
        """The keys of a message's role and text (message_property_mappings wins over message_field_*)."""
        mappings = self.message_property_mappings or {}
        return mappings.get("role", self.message_field_role), mappings.get(
            "content", self.message_field_content
        )

    @property
    def resolved_reasoning_field(self) -> str:
        """The key of a message's reasoning (message_property_mappings' reasoning_content wins over field_thinking)."""
        return (self.message_property_mappings or {}).get("reasoning_content", self.field_thinking)


class DataKeys(BaseModel):
    """Key group of :class:`~cptune.config.recipe.Recipe`: the data sources, the rows made of them."""

    # --- data ------------------------------------------------------------
    datasets: tuple[DatasetConfig, ...] = Field(min_length=1, description="Training data sources.")
    test_datasets: tuple[DatasetConfig, ...] | None = Field(None, description="Evaluation data sources.")
    val_set_size: float = Field(
        0.0, ge=0, description="Held-out share (<1) or row count (>=1) of the training rows."
    )
    dataset_prepared_path: str = Field("prepared", description="Folder of the preprocessed-data cache.")
    dataset_processes: int | None = Field(None, ge=1, description="Worker processes for tokenization.")
    sequence_len: int = Field(2048, ge=2, description="Tokens per training row.")
    sample_packing: bool = Field(False, description="Pack several samples into each row.")
    pad_to_sequence_len: bool = Field(False, description="Pad every batch to sequence_len.")
    train_on_inputs: bool = Field(False, description="Also train on prompt tokens.")
    excess_length_strategy: Literal["drop", "truncate"] = Field(
        "drop", description="What to do with samples longer than sequence_len."
    )
    skip_invalid_rows: bool = Field(False, description="Skip (and count) malformed rows instead of stopping.")
    dataset_exact_deduplication: bool = Field(
        False,
        description="Drop every sample that equals one kept before it, as Axolotl does: samples are compared "
        "once tokenized and cut to the length policy, before the validation split (so val_set_size never holds "
        "out a copy of a training sample) and before packing, and are equal when their tokens, labels and "
        "positions are; the first copy (in `datasets` order, then row order) is kept. `test_datasets` are "
        "deduplicated among themselves; with `rl`, an evaluation pair equal to a training pair is dropped too "
        "(supervised `test_datasets` may repeat training samples, as in Axolotl). Unlike Axolotl, columns "
        "nothing trains are not compared: pre-tokenized rows, or preference rows, that differ only in such a "
        "column (an id) are duplicates here. The drops are counted per dataset in the preprocess output and "
        "the data report.",
    )
    chat_template: ChatTemplateName | None = Field(
        None,
        description="Chat template for chat_template datasets, by name (cptune's own rendering of each family's "
        "format; `jinja`: chat_template_jinja); default: the tokenizer's.",
    )


class SpecialTokens(Frozen):
    """Special tokens to set on the tokenizer (Axolotl's ``special_tokens``); new ones are added."""

    bos_token: str | None = Field(None, description="Beginning-of-sequence token.")
    eos_token: str | None = Field(
        None, description="End-of-sequence token (rows of alpaca/completion end with it)."
    )
    pad_token: str | None = Field(None, description="Padding token (never trained).")
    unk_token: str | None = Field(None, description="Unknown token.")
    additional_special_tokens: tuple[str, ...] | None = Field(None, description="More special tokens.")


class TokenKeys(BaseModel):
    """Key group of the recipe: tokens added to or set on the tokenizer, and the chat template."""

    # --- tokens and chat templates -----------------------------------------------
    special_tokens: SpecialTokens | None = Field(
        None, description="Set bos/eos/pad/unk tokens; a token the tokenizer lacks is added."
    )
    tokens: tuple[str, ...] | None = Field(
        None,
        description="New tokens to add to the tokenizer; the model's embeddings grow to hold them (with LoRA, "
        "train them through lora_modules_to_save).",
    )
    resize_token_embeddings_to_32x: bool = Field(
        False,
        description="Grow the model's input and output embeddings to the tokenizer's length rounded up to a "
        "multiple of 32 when they have fewer rows (Axolotl's key; embeddings with enough rows are kept). No "
        "token id maps to the extra rows, so they are never inputs or targets; but the output layer computes "
        "a logit for each, and the loss is the cross-entropy over all rows, unmasked, as in Axolotl and "
        "transformers. The extra rows start at the mean of the others, so at first they take at most about "
        "their share (extra rows / all rows) of each token's probability; training the output layer lowers "
        "it. A full model saves with the grown vocab_size; a LoRA adapter saves both embeddings whole.",
    )
    chat_template_jinja: str | None = Field(
        None,
        description="A Jinja chat template (the text, or the path of a .jinja file) for chat_template datasets; "
        "goes with chat_template: jinja (or no chat_template).",
    )
    eot_tokens: tuple[str, ...] | None = Field(
        None,
        description="chat_template: the tokens that end a turn (e.g. <|im_end|>), trained after each trained turn "
        "as train_on_eot says; default: the tokenizer's eos token only, as in Axolotl (a template that never "
        "writes it then trains no end of turn: preprocessing warns).",
    )

    @field_validator("tokens", "eot_tokens", mode="before")
    @classmethod
    def _many_tokens(cls, value: Any) -> Any:
        return one_or_many(value)
