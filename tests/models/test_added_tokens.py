"""The embeddings' rows: resize_token_embeddings_to_32x rounds them up to a multiple of 32, as Axolotl does.

The tokens a recipe adds, and the training they need under LoRA: tests/models/test_quantization.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cptune.config.loader import load_recipe, validate_recipe
from cptune.errors import CptuneError
from cptune.models.added_tokens import fit_embeddings
from cptune.models.head_loss import logits_loss
from cptune.models.loading import load_model, load_tokenizer
from cptune.run.commands.inference import GenerationOptions, generate
from tests.conftest import QUICKSTART_DATA
from tests.numerics import float64_loss_sum, reorder_bound


def recipe(model_dir: Path, **keys):
    return validate_recipe({"base_model": str(model_dir), "datasets": [{"path": "d.jsonl"}], **keys})


def rows_of(model) -> tuple[int, int, int]:
    """Rows of the input and output embeddings, and the config's vocab_size."""
    return (
        model.get_input_embeddings().weight.shape[0],
        model.get_output_embeddings().weight.shape[0],
        model.config.vocab_size,
    )


def test_the_rows_round_up_to_a_multiple_of_32_only_when_asked(tiny_model_dir):
    tokenizer = load_tokenizer(recipe(tiny_model_dir))
    tokens = len(tokenizer)
    assert tokens % 32 != 0  # the tiny model's vocabulary is no multiple of 32 (714 tokens)
    padded_rows = (tokens // 32 + 1) * 32

    plain = load_model(recipe(tiny_model_dir), "sdpa")
    assert rows_of(plain) == (tokens,) * 3
    fit_embeddings(plain, tokenizer, recipe(tiny_model_dir))
    assert rows_of(plain) == (tokens,) * 3

    padded = recipe(tiny_model_dir, resize_token_embeddings_to_32x=True)
    model = load_model(padded, "sdpa")
    fit_embeddings(model, tokenizer, padded)
    assert rows_of(model) == (padded_rows,) * 3
    # The tokens' own rows are kept; every rank (and a later merge) draws the same new rows.
    for grown, kept in zip(
        (model.get_input_embeddings(), model.get_output_embeddings()),
        (plain.get_input_embeddings(), plain.get_output_embeddings()),
        strict=True,
    ):
        assert torch.equal(grown.weight[:tokens], kept.weight)
    again = load_model(padded, "sdpa")
    fit_embeddings(again, tokenizer, padded)
    assert torch.equal(again.get_output_embeddings().weight, model.get_output_embeddings().weight)

    # A new token counts: 715 tokens still round up to the same rows.
    with_token = recipe(tiny_model_dir, resize_token_embeddings_to_32x=True, tokens=["<tool>"])
    grown_tokenizer = load_tokenizer(with_token)
    assert len(grown_tokenizer) == tokens + 1
    model = load_model(with_token, "sdpa")
    fit_embeddings(model, grown_tokenizer, with_token)
    assert rows_of(model) == (padded_rows,) * 3

    # Embeddings with enough rows are kept as they are (Axolotl resizes only to grow).
    wide = load_model(padded, "sdpa")
    wide.resize_token_embeddings(padded_rows + 3)
    fit_embeddings(wide, tokenizer, padded)
    assert rows_of(wide) == (padded_rows + 3,) * 3


def test_the_extra_rows_are_never_targets_but_their_logits_share_the_softmax(tiny_model_dir):
    """cptune's loss is the cross-entropy over every row of the output layer, the extra ones unmasked (as
    Axolotl's and transformers' are): no target is an extra row, yet each takes probability, at first at
    most its share (the rows start at the mean of the others: by Jensen, exp(mean logit) <= mean exp(logit)).
    Their input embeddings get no gradient (no token maps to them); their output rows get one."""
    padded = recipe(tiny_model_dir, resize_token_embeddings_to_32x=True)
    tokenizer = load_tokenizer(padded)
    model = load_model(padded, "sdpa").double()
    fit_embeddings(model, tokenizer, padded)
    tokens, rows = len(tokenizer), model.config.vocab_size
    extra = rows - tokens
    row = json.loads(QUICKSTART_DATA.read_text().splitlines()[0])
    ids = torch.tensor([tokenizer(row["instruction"] + " " + row["output"])["input_ids"]])
    shift_labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    targets = int((shift_labels != -100).sum())

    loss, outputs = logits_loss(model, {"input_ids": ids}, shift_labels)
    logits = outputs.logits.detach()
    assert logits.shape[-1] == rows and int(shift_labels.max()) < tokens
    over_all_rows = float64_loss_sum(logits, shift_labels)
    over_the_tokens = float64_loss_sum(logits[..., :tokens], shift_labels)
    # cptune's loss takes the fp32 cross-entropy of each token over its row of logits, then sums the tokens.
    bound = reorder_bound(rows + targets, float(over_all_rows) + 2 * targets * float(logits.abs().max()))
    loss_value = float(loss.detach())
    assert abs(loss_value - float(over_all_rows)) <= bound
    assert loss_value - float(over_the_tokens) > 10 * bound

    # The extra rows' probability per token, against their share: the rows start at the mean plus noise of
    # covariance 1e-9 times the rows' (transformers' mean_resizing), so each extra logit is within 6 standard
    # deviations of sqrt(1e-9) times the spread of the token's logits of the mean logit.
    probabilities = torch.softmax(logits, dim=-1)[0, :-1]
    extra_mass = probabilities[:, tokens:].sum(-1)
    slack = torch.exp(6 * math.sqrt(1e-9) * logits[0, :-1, :tokens].std(-1, correction=0))
    share = extra * slack / (tokens + extra * slack)
    assert bool((extra_mass > 0).all()) and bool((extra_mass <= share).all()), (extra_mass, share)

    loss.backward()
    assert not model.get_input_embeddings().weight.grad[tokens:].any()
    assert model.get_output_embeddings().weight.grad[tokens:].abs().sum(-1).min() > 0


def test_data_that_holds_the_recipes_new_token_trains(write_recipe, tmp_path, cptune_in_process):
    """A token the recipe adds gets the id after the base model's last row, and the data holds it: the check
    that the data's ids fit the model (a tokenizer of another model) leaves the recipe's own tokens out, since
    the embeddings grow to hold them. It once refused every such recipe, before training."""
    data = tmp_path / "new-token.jsonl"
    row = {"instruction": "Say the new token twice.", "input": "", "output": "<zz> <zz>"}
    data.write_text("".join(json.dumps(row) + "\n" for _ in range(8)))
    path = write_recipe(
        datasets=[{"path": str(data), "type": "alpaca"}],
        tokens=["<zz>"],
        lora_modules_to_save=["embed_tokens", "lm_head"],
        max_steps=1,
    )
    tokenizer = load_tokenizer(load_recipe(path))
    new_id = tokenizer.convert_tokens_to_ids("<zz>")
    assert new_id == len(tokenizer) - 1
    done = cptune_in_process("train", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    with safe_open(tmp_path / "out" / "adapter_model.safetensors", "pt") as saved:
        assert saved.get_tensor("base_model.model.model.embed_tokens.weight").shape[0] == new_id + 1


def test_generation_never_picks_a_padded_row(tiny_model_dir):
    """The rows past the tokenizer's last id are no token: generation suppresses them. Here the last padded
    row is made the greedy choice for the prompt's next token (its logit 1000, far above any other); the
    answer must still be a token of the tokenizer."""
    padded = recipe(tiny_model_dir, resize_token_embeddings_to_32x=True)
    tokenizer = load_tokenizer(padded)
    model = load_model(padded, "sdpa")
    fit_embeddings(model, tokenizer, padded)
    rows = rows_of(model)[1]
    assert rows > len(tokenizer)
    prompt = tokenizer("Say hello.")["input_ids"]
    with torch.no_grad():
        last = model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        model.get_output_embeddings().weight[rows - 1] = last * (1000 / last.dot(last))
        assert model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax() == rows - 1
    answer = generate(model, tokenizer, prompt, GenerationOptions(max_new_tokens=1), stops=[], stream=False)
    assert len(answer.output_ids) == 1 and answer.output_ids[0] < len(tokenizer)


def test_new_tokens_whose_embeddings_unfrozen_parameters_freeze_are_refused(tiny_model_dir):
    """A partly frozen full fine-tune must select the embeddings of the tokens it adds, as LoRA must save them."""
    from cptune.models.loading import model_config
    from cptune.run.launch.preflight import check_new_tokens

    frozen = recipe(tiny_model_dir, tokens=["<tool>"], unfrozen_parameters=["model.layers.+.mlp", "^lm_head"])
    with pytest.raises(CptuneError) as refused:
        check_new_tokens(frozen, model_config(frozen))
    assert str(refused.value) == (
        "tokens: adds 1 token(s) the tokenizer did not have (<tool>); their embeddings start untrained, and "
        "unfrozen_parameters freezes model.embed_tokens.weight. Add [^model.embed_tokens.weight$] to "
        "unfrozen_parameters to train them, or use tokens the tokenizer already has."
    )
    selected = recipe(
        tiny_model_dir, tokens=["<tool>"], unfrozen_parameters=["^model.embed_tokens", "^lm_head"]
    )
    check_new_tokens(selected, model_config(selected))
    # A new pad token alone is never a target: nothing to train.
    padded = recipe(
        tiny_model_dir, special_tokens={"pad_token": "<newpad>"}, unfrozen_parameters=["^lm_head"]
    )
    check_new_tokens(padded, model_config(padded))
