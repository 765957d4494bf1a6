"""Alpaca rows (instruction, optional input, output) rendered as Axolotl renders them.

Axolotl's ``type: alpaca`` opens every prompt with a system preamble (one sentence for rows with an
input, another for rows without), then the instruction in the prompt style the type names after a
colon: ``alpaca`` / ``alpaca:instruct`` (``### Instruction:`` ...), ``alpaca:chat`` (``USER:`` ...),
``alpaca:chatml`` and ``alpaca:phi``. Its ``alpaca_instruct`` and ``alpaca_chat`` loaders render the
instruct and chat styles, and their ``.load_no_prompt`` variants leave the preamble out
(``alpaca_instruct.load_no_prompt`` is the bare ``### Instruction:`` prompt).

The texts below are facts about Axolotl's interface, read from ``src/axolotl/prompters.py``
(``AlpacaPrompter``: ``system_prompt``, ``system_no_input_prompt``, and the formats of
``match_prompt_style``) and ``src/axolotl/prompt_strategies/alpaca_instruct.py`` / ``alpaca_chat.py``
of the axolotl 0.21.0 wheel on PyPI. The tokens they give on the shipped data are checked against
Axolotl's own output in ``tests/axolotl/parity``.

Tokenization follows Axolotl's ``InstructionPromptTokenizingStrategy``: the prompt is encoded with
the tokenizer's bos and is never trained (unless ``train_on_inputs``); the output is encoded apart,
so no token straddles the prompt/response boundary, and ends with eos unless its text already does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from cptune.config.data import DatasetConfig
from cptune.data.sample import Formatter, Sample, eos_id, leading_special_ids, text_field
from cptune.labels import IGNORE_INDEX

__all__ = ["AlpacaPrompt", "alpaca_formatter", "alpaca_prompt"]

# Axolotl's system preambles (AlpacaPrompter.system_prompt / system_no_input_prompt).
PREAMBLE = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)
PREAMBLE_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request."


@dataclass(frozen=True)
class AlpacaPrompt:
    """One prompt style: how the preamble is written, and the prompt with and without an input.

    Attributes:
        system: Format of the preamble (``{system}``), or None when the type leaves it out.
        with_input: The prompt of a row with an input (``{instruction}``, ``{input}``).
        without_input: The prompt of a row without one.
    """

    system: str | None
    with_input: str
    without_input: str

    def render(self, instruction: str, extra: str) -> str:
        """The prompt text of a row; ``extra`` is its input ("" for none)."""
        # Axolotl tests the input's truth, so an input of spaces still gets the input variant.
        if extra:
            head = "" if self.system is None else self.system.format(system=PREAMBLE)
            return head + self.with_input.format(instruction=instruction, input=extra)
        head = "" if self.system is None else self.system.format(system=PREAMBLE_NO_INPUT)
        return head + self.without_input.format(instruction=instruction)


# Axolotl's prompt styles (AlpacaPrompter.match_prompt_style): (preamble format, with input, without input).
_STYLES: dict[str, tuple[str, str, str]] = {
    "instruct": (
        "{system}\n\n",
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "### Instruction:\n{instruction}\n\n### Response:\n",
    ),
    "chat": (
        "SYSTEM: {system}\n",
        "USER: {instruction}\n{input}\nASSISTANT:",
        "USER: {instruction}\nASSISTANT:",
    ),
    "chatml": (
        "<|im_start|>system\n{system}<|im_end|>\n",
        "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n",
    ),
    "phi": (
        "<|system|>\n{system}<|end|>\n",
        "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
        "<|user|>\n{instruction}<|end|>\n<|assistant|>\n",
    ),
}

# Each alpaca type: its prompt style, and whether it opens with the preamble.
_TYPES: dict[str, tuple[str, bool]] = {
    "alpaca": ("instruct", True),
    "alpaca:instruct": ("instruct", True),
    "alpaca:chat": ("chat", True),
    "alpaca:chatml": ("chatml", True),
    "alpaca:phi": ("phi", True),
    "alpaca_instruct": ("instruct", True),
    "alpaca_instruct.load_no_prompt": ("instruct", False),
    "alpaca_chat": ("chat", True),
    "alpaca_chat.load_no_prompt": ("chat", False),
}


def alpaca_prompt(dataset_type: str) -> AlpacaPrompt:
    """The prompt style of an alpaca type (one of :data:`cptune.config.data.ALPACA_TYPES`)."""
    style, preamble = _TYPES[dataset_type]
    system, with_input, without_input = _STYLES[style]
    return AlpacaPrompt(system if preamble else None, with_input, without_input)


def alpaca_formatter(
    config: DatasetConfig, tokenizer: PreTrainedTokenizerBase, train_on_inputs: bool
) -> Formatter:
    """The formatter of an alpaca-family dataset (see the module's docstring)."""
    assert config.type is not None  # row_format is alpaca
    prompt = alpaca_prompt(config.type)
    bos, eos = leading_special_ids(tokenizer), eos_id(tokenizer)

    def format_row(row: Mapping[str, Any]) -> Sample:
        instruction = text_field(row, config.field_instruction)
        extra = text_field(row, config.field_input, required=False)
        output = text_field(row, config.field_output)
        prompt_ids = bos + tokenizer(prompt.render(instruction, extra), add_special_tokens=False)["input_ids"]
        response_ids = list(tokenizer(output, add_special_tokens=False)["input_ids"])
        if not response_ids or response_ids[-1] != eos:
            response_ids.append(eos)
        input_ids = prompt_ids + response_ids
        labels = list(input_ids) if train_on_inputs else [IGNORE_INDEX] * len(prompt_ids) + response_ids
        return Sample(input_ids, labels)

    return format_row
