"""Which tokens end a turn of a chat dataset, and the warnings and errors Axolotl gives about them.

Axolotl trains, after a trained message, the first end-of-turn token (``eot_tokens``) and the first
eos token that follow its content within three tokens (``train_on_eot``, ``train_on_eos``). Without
``eot_tokens`` the end-of-turn token is the tokenizer's eos; a template that never writes eos (ChatML
ends a turn with ``<|im_end|>``) then trains no end of turn at all, and Axolotl warns. cptune does the
same, and its warning names the key to set and the token the template ends a turn with. (Behaviour read
from ``ChatTemplateStrategy.__init__`` and ``_validate_eot_and_eos_tokens`` in
``src/axolotl/prompt_strategies/chat_template.py`` of axolotl 0.21.0.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cptune.config.data import DatasetConfig
from cptune.errors import DataError

__all__ = ["EndTokens", "end_tokens"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndTokens:
    """The token ids that end a turn (``eot``) and the eos id; either may be empty / None."""

    eot: frozenset[int]
    eos: int | None


def _template_end_marker(tokenizer: Any, render: Callable[[list[dict[str, str]]], list[int]]) -> str | None:
    """The special token the template closes an assistant turn with (``<|im_end|>``), if it has one."""
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if token.special
    }
    try:
        ids = render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    except Exception:  # a template with other roles: no suggestion
        return None
    for position in range(len(ids) - 1, -1, -1):
        if ids[position] in special:
            if tokenizer.decode(ids[position + 1 :]).strip():
                return None
            return str(tokenizer.convert_ids_to_tokens(ids[position]))
    return None


def end_tokens(
    tokenizer: Any,
    template: str,
    eot_tokens: Sequence[str] | None,
    config: DatasetConfig,
    label: str,
    render: Callable[[list[dict[str, str]]], list[int]],
) -> EndTokens:
    """The end tokens of a chat dataset, with Axolotl's warnings and refusals.

    Args:
        tokenizer: The model's tokenizer.
        template: The chat template's text.
        eot_tokens: The recipe's ``eot_tokens`` (None: the tokenizer's eos).
        config: The dataset entry (``train_on_eos``, ``train_on_eot``).
        label: Names the dataset in messages.
        render: Renders a conversation to token ids (for the warning's suggestion).

    Raises:
        DataError: An end-of-turn token that is not one token, or one that is eos while
            train_on_eos and train_on_eot differ.
    """
    eos = tokenizer.eos_token
    eos_id = None if tokenizer.eos_token_id is None else int(tokenizer.eos_token_id)
    chosen = list(eot_tokens) if eot_tokens is not None else ([eos] if eos is not None else [])
    if eos is not None and chosen == [eos]:
        if eos not in template and "eos_token" not in template:
            marker = _template_end_marker(tokenizer, render)
            suggestion = (
                f"eot_tokens: ['{marker}']"
                if marker
                else "eot_tokens (the token your template ends a turn with)"
            )
            logger.warning(
                "%s: the chat template never writes the tokenizer's eos token %r, so no end of turn is trained (as in "
                "Axolotl) and the model does not learn to stop after its answers. Set %s in the recipe, or "
                "special_tokens: {eos_token: ...} to that token.",
                label,
                eos,
                suggestion,
            )
        return EndTokens(frozenset({eos_id}) if eos_id is not None else frozenset(), eos_id)
    kept = []
    for token in chosen:
        if token not in template:
            logger.warning("%s: eot_tokens: %r is not in the chat template; it is not used.", label, token)
            continue
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise DataError(
                f"eot_tokens: {token!r} is {len(ids)} tokens of the tokenizer, not one, so cptune cannot find it "
                f"after a turn. Add it as a token (tokens: [{token!r}]), or list the token the template ends a turn "
                "with."
            )
        kept.append(ids[0])
    if eos in chosen and eos in template and config.train_on_eos != config.resolved_train_on_eot:
        raise DataError(
            f"{label}: eot_tokens lists the eos token {eos!r}, but train_on_eos ({config.train_on_eos}) and "
            f"train_on_eot ({config.resolved_train_on_eot}) say different things about it. Set them alike, or "
            "remove the eos token from eot_tokens."
        )
    return EndTokens(frozenset(kept), eos_id)
