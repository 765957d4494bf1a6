"""Tokens a recipe adds to the tokenizer (``special_tokens``, ``tokens``), and the embeddings they need.

A token the tokenizer lacks gets a new id past its vocabulary; the model's input and output
embeddings grow to hold it (:func:`fit_embeddings`). A new token starts with an untrained embedding,
so a LoRA run must also train the embeddings (``lora_modules_to_save``), and a run with
``unfrozen_parameters`` must select them, unless the only new token is the pad token, which is never
a target and only ever attends to itself (padding is a document of its own in cptune's batches).

With ``resize_token_embeddings_to_32x`` the embeddings grow further, to a multiple of 32 rows (as
Axolotl does). No token id maps to those rows, so they need no training: they are never inputs, and
never targets, though the output layer gives each a logit that takes part in the loss's softmax.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError

log = logging.getLogger("cptune.models")

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def add_recipe_tokens(tokenizer: Any, recipe: Recipe) -> list[str]:
    """Set the recipe's special tokens and add its new tokens to ``tokenizer``; returns the tokens it added.

    The returned tokens are those the tokenizer did not have before, in id order.
    """
    before = len(tokenizer)
    special = recipe.special_tokens
    if special is not None:
        values = _special_token_values(recipe)
        if values:
            tokenizer.add_special_tokens(values)
        if special.additional_special_tokens:
            tokenizer.add_tokens(list(special.additional_special_tokens), special_tokens=True)
    if recipe.tokens:
        tokenizer.add_tokens(list(recipe.tokens))
    return [tokenizer.convert_ids_to_tokens(i) for i in range(before, len(tokenizer))]


def _special_token_values(recipe: Recipe) -> dict[str, str]:
    """``{bos_token: ..., ...}``: the special tokens the recipe sets."""
    special = recipe.special_tokens
    if special is None:
        return {}
    return {key: getattr(special, key) for key in SPECIAL_TOKEN_KEYS if getattr(special, key) is not None}


def recipe_token_ids(tokenizer: Any, recipe: Recipe) -> set[int]:
    """The ids of every token the recipe names (``tokens``, ``special_tokens``), added or already there.

    The model's embeddings hold them once :func:`fit_embeddings` has grown them, so they are left out
    when the data's token ids are checked against the base model's ``vocab_size``.
    """
    names = [*(recipe.tokens or ()), *_special_token_values(recipe).values()]
    if recipe.special_tokens is not None:
        names += list(recipe.special_tokens.additional_special_tokens or ())
    return {i for i in tokenizer.convert_tokens_to_ids(names) if i is not None}


def untrained_new_tokens(tokenizer: Any, added: list[str]) -> list[str]:
    """The added tokens whose embeddings must be trained: all but the pad token."""
    return [token for token in added if token != tokenizer.pad_token]


def embedding_module_names(model: torch.nn.Module) -> list[str]:
    """The short names (``embed_tokens``, ``lm_head``) of the model's input and output embeddings."""
    wanted = [model.get_input_embeddings(), model.get_output_embeddings()]
    names = []
    for name, module in model.named_modules():
        if any(module is w for w in wanted if w is not None):
            short = name.rsplit(".", 1)[-1]
            if short not in names:
                names.append(short)
    return names


def check_new_token_training(
    recipe: Recipe, tokenizer: Any, added: list[str], model: torch.nn.Module
) -> None:
    """Refuse a LoRA run whose new tokens would keep untrained embeddings.

    Args:
        recipe: The recipe.
        tokenizer: The tokenizer after :func:`add_recipe_tokens`.
        added: What :func:`add_recipe_tokens` returned.
        model: The model (a meta-device copy is enough): names the embedding modules.

    Raises:
        CptuneError: LoRA, new tokens other than pad, and lora_modules_to_save misses an embedding; or
            unfrozen_parameters that freeze an embedding (:func:`_check_unfrozen_embeddings`).
    """
    if recipe.unfrozen_parameters:
        _check_unfrozen_embeddings(recipe, untrained_new_tokens(tokenizer, added), model)
    if not recipe.is_lora:
        return
    new = untrained_new_tokens(tokenizer, added)
    names = embedding_module_names(model)
    missing = [n for n in names if n not in (recipe.lora_modules_to_save or ())]
    if not new or not missing:
        return
    shown = ", ".join(new[:5]) + (f" and {len(new) - 5} more" if len(new) > 5 else "")
    key = "tokens" if recipe.tokens else "special_tokens"
    wanted = list(dict.fromkeys([*(recipe.lora_modules_to_save or ()), *names]))
    raise CptuneError(
        f"{key}: adds {len(new)} token(s) the tokenizer did not have ({shown}); their embeddings start "
        "untrained, and a LoRA run trains only the adapter. Add lora_modules_to_save: "
        f"[{', '.join(wanted)}] to train the embeddings too (they are saved with the adapter), or use "
        "tokens the tokenizer already has."
    )


def _check_unfrozen_embeddings(recipe: Recipe, new: list[str], model: torch.nn.Module) -> None:
    """Refuse new tokens whose embedding rows ``unfrozen_parameters`` would freeze (a partly frozen full fine-tune).

    ``model`` is a fresh copy (a meta-device one is enough); its parameters are frozen here as the run would.
    """
    from cptune.models.freezing import freeze_all_but

    if not new:
        return
    freeze_all_but(model, recipe.unfrozen_parameters or ())
    embeddings = [model.get_input_embeddings(), model.get_output_embeddings()]
    frozen_ids = {id(m.weight) for m in embeddings if m is not None and not m.weight.requires_grad}
    frozen = [name for name, p in model.named_parameters() if id(p) in frozen_ids]
    if not frozen:
        return
    shown = ", ".join(new[:5]) + (f" and {len(new) - 5} more" if len(new) > 5 else "")
    key = "tokens" if recipe.tokens else "special_tokens"
    patterns = ", ".join(f"^{name}$" for name in frozen)
    raise CptuneError(
        f"{key}: adds {len(new)} token(s) the tokenizer did not have ({shown}); their embeddings start "
        f"untrained, and unfrozen_parameters freezes {', '.join(frozen)}. Add [{patterns}] to unfrozen_parameters "
        "to train them, or use tokens the tokenizer already has."
    )


EMBEDDING_ROW_MULTIPLE = 32
"""What ``resize_token_embeddings_to_32x`` rounds the embeddings' rows up to (Axolotl's key names the number)."""


def embedding_rows(recipe: Recipe, tokenizer: Any) -> int:
    """The rows the recipe's model needs: one per token of ``tokenizer``, rounded up to a multiple of
    :data:`EMBEDDING_ROW_MULTIPLE` with ``resize_token_embeddings_to_32x``."""
    tokens = len(tokenizer)
    if not recipe.resize_token_embeddings_to_32x:
        return tokens
    return -(-tokens // EMBEDDING_ROW_MULTIPLE) * EMBEDDING_ROW_MULTIPLE


def fit_embeddings(model: Any, tokenizer: Any, recipe: Recipe) -> None:
    """Grow the model's embeddings to the rows :func:`embedding_rows` asks for (no-op when they have as many).

    Training, evaluation, inference and merge-lora all call it before an adapter goes on, so that the
    embeddings an adapter saved fit the base model's. New rows start at the mean of the old ones plus
    noise (transformers' ``mean_resizing``), drawn with the recipe's seed so every rank (and a later
    merge) gets the same rows.
    """
    rows = model.get_input_embeddings().num_embeddings
    wanted = embedding_rows(recipe, tokenizer)
    if wanted <= rows:
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model.resize_token_embeddings(wanted)
    why = "the recipe's new tokens"
    if wanted > len(tokenizer):
        why = (
            f"the tokenizer's {len(tokenizer)} tokens, rounded up to a multiple of {EMBEDDING_ROW_MULTIPLE} "
            "(resize_token_embeddings_to_32x)"
        )
    log.info("embeddings grown from %d to %d rows for %s", rows, wanted, why)
