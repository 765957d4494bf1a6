"""Axolotl's preference types that write the prompt and responses in one fixed template (chatml.*, llama3.*).

Each type names a template family and a row layout. The family's text wraps the prompt as a user turn
(after a system turn when the row has a non-empty ``system``) followed by the assistant header, and each
response with the end-of-turn text; the three texts are then tokenized as ``passthrough.default`` tokenizes
its rows (:mod:`cptune.data.preference_formats`), which is how TRL's DPOTrainer reads what Axolotl's
transform returns. The layouts (columns fixed by the type, as in Axolotl 0.21's
``prompt_strategies/dpo/chatml.py`` and ``llama3.py``):

* ``argilla`` (chatml) and ``default`` (llama3): the prompt in the first of ``prompt``, ``input``,
  ``question``, ``instruction`` the row has; the responses in ``chosen``/``rejected`` or else
  ``chosen_response``/``rejected_response``, as text.
* ``icr``: the prompt in ``input``; ``intel``: in ``question``; ``prompt_pairs``: in ``prompt``; the
  responses in ``chosen``, ``rejected``, as text.
* ``ultra``: the prompt in ``prompt``; each response the second message's content of ``chosen`` and
  ``rejected`` (a user message, then the assistant's).
* ``argilla_chat``: the prompt the first message's content of ``chosen``, each response the second
  message's content of ``chosen`` and ``rejected``; no system turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cptune.config.data import TEMPLATED_PREFERENCE_TYPES
from cptune.data.sample import field_problem, text_field

__all__ = ["TEMPLATED_PREFERENCE_TYPES", "templated_columns", "templated_pair_texts"]


@dataclass(frozen=True)
class _Family:
    """The texts of one template family: a system turn, a user turn with the assistant header, a response."""

    system: str
    user: str
    response: str


_FAMILIES = {
    "chatml": _Family(
        system="<|im_start|>system\n{}<|im_end|>\n",
        user="<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
        response="{}<|im_end|>",
    ),
    "llama3": _Family(
        system="<|start_header_id|>system<|end_header_id|>\n\n{}<|eot_id|>",
        user="<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        response="{}<|eot_id|>",
    ),
}


def _first_present(row: Mapping[str, Any], names: tuple[str, ...]) -> str:
    return next((name for name in names if name in row), names[-1])


def _second_message(row: Mapping[str, Any], name: str) -> str:
    """The content of the second message of the conversation in column ``name`` (the assistant's reply)."""
    value = row.get(name)
    if value is None:
        raise field_problem(name, "is missing")
    if not isinstance(value, list) or len(value) < 2 or not isinstance(value[1], Mapping):
        raise field_problem(
            name, "is not a conversation of at least two messages (a user message, then the reply)"
        )
    content = value[1].get("content")
    if not isinstance(content, str):
        raise field_problem(f"{name}[1].content", "is missing or not text")
    return content


def _first_message(row: Mapping[str, Any], name: str) -> str:
    _second_message(row, name)  # the same shape checks
    content = row[name][0].get("content") if isinstance(row[name][0], Mapping) else None
    if not isinstance(content, str):
        raise field_problem(f"{name}[0].content", "is missing or not text")
    return content


def _columns(layout: str, row: Mapping[str, Any]) -> tuple[str, str, str, bool]:
    """(prompt, chosen, rejected) texts of a row in ``layout``, and whether a system turn may precede."""
    if layout in ("argilla", "default"):
        prompt = _first_present(row, ("prompt", "input", "question", "instruction"))
        chosen = "chosen" if "chosen" in row else "chosen_response"
        rejected = "rejected" if "rejected" in row else "rejected_response"
        return text_field(row, prompt), text_field(row, chosen), text_field(row, rejected), True
    if layout == "argilla_chat":
        return (
            _first_message(row, "chosen"),
            _second_message(row, "chosen"),
            _second_message(row, "rejected"),
            False,
        )
    if layout == "ultra":
        return (
            text_field(row, "prompt"),
            _second_message(row, "chosen"),
            _second_message(row, "rejected"),
            True,
        )
    prompt = {"icr": "input", "intel": "question", "prompt_pairs": "prompt"}[layout]
    return text_field(row, prompt), text_field(row, "chosen"), text_field(row, "rejected"), True


# The columns each layout always reads (argilla's and default's prompt and responses have alternatives).
_REQUIRED = {
    "argilla": (),
    "default": (),
    "argilla_chat": ("chosen", "rejected"),
    "icr": ("input", "chosen", "rejected"),
    "intel": ("question", "chosen", "rejected"),
    "prompt_pairs": ("prompt", "chosen", "rejected"),
    "ultra": ("prompt", "chosen", "rejected"),
}


def templated_columns(dataset_type: str) -> tuple[str, ...]:
    """The columns every row of ``dataset_type`` must have (fixed by the type, as in Axolotl)."""
    return _REQUIRED[dataset_type.split(".", 1)[1]]


def templated_pair_texts(dataset_type: str, row: Mapping[str, Any]) -> tuple[str, str, str]:
    """The prompt, chosen and rejected texts of ``row`` in the fixed template of ``dataset_type``.

    Raises:
        RowProblem: A column the type reads is missing or not of its shape.
    """
    family_name, layout = dataset_type.split(".", 1)
    family = _FAMILIES[family_name]
    prompt, chosen, rejected, takes_system = _columns(layout, row)
    system = row.get("system") if takes_system else None
    head = family.system.format(system) if isinstance(system, str) and system else ""
    return head + family.user.format(prompt), family.response.format(chosen), family.response.format(rejected)
