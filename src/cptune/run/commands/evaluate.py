"""``evaluate(recipe)``: loss and perplexity on the recipe's evaluation data, sharded like training.

Runs in every process of a launch, like :func:`cptune.run.training.train.train`, with the
same backend, patches and Trainer, so the evaluation of a long sequence is split
across the CP group exactly as its training was, and reports the same
token-weighted loss (:mod:`cptune.run.training.eval_loop`). The model is the recipe's
base model, or what a run saved: a LoRA adapter (on the base model) or a full
model, in ``output_dir`` or a ``checkpoint-N`` folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError
from cptune.models.loading import load_tokenizer
from cptune.models.memory_features import install_memory_features
from cptune.run.commands.weights import ModelSource, load_source_model, model_source
from cptune.run.plan import RunPlan
from cptune.run.training.distributed import read_dist_env

log = logging.getLogger("cptune.evaluate")


def check_eval_data(recipe: Recipe) -> None:
    """Refuse a recipe without evaluation data (before any process starts or data is prepared)."""
    if not (recipe.val_set_size or recipe.test_datasets):
        raise CptuneError(
            "evaluate: the recipe has no evaluation data; set val_set_size (a held-out share of the "
            "training data) or test_datasets."
        )


def check_preference_source(recipe: Recipe, source: ModelSource) -> None:
    """Refuse evaluating preference pairs (``rl``) where the model would be compared with itself.

    The preference loss compares a model with its reference, the base model: with a LoRA adapter the
    reference is the adapter disabled, so the adapter must be the one a run saved; the base model alone
    is its own reference (every pair's loss ln 2). A saved full model's reference is the base model, which is
    not loaded beside it: the evaluation pairs' sums are read from those a training run of the recipe stored
    (``precompute_ref_log_probs``, :mod:`cptune.run.training.reference_cache`).

    Raises:
        CptuneError: ``recipe`` has ``rl`` and ``source`` is the base model, or a full model without
            ``precompute_ref_log_probs``.
    """
    if not recipe.is_preference or source.kind == "adapter":
        return
    if source.kind == "base":
        raise CptuneError(
            f"evaluate: rl: {recipe.rl} compares a model with its reference, the base model, and --checkpoint is "
            "not given, so the base model would be compared with itself (every pair's loss ln 2). Give "
            "--checkpoint with the LoRA adapter a run saved (output_dir or a checkpoint-N folder)."
        )
    if recipe.needs_reference and not recipe.precompute_ref_log_probs:
        raise CptuneError(
            f"evaluate: rl: {recipe.rl} compares a model with its reference, the base model, and '{source.path}' is "
            "a full model: the base model's log-prob sums of the evaluation pairs are read from those a training "
            "run stored, which needs precompute_ref_log_probs: true in the recipe (as a full fine-tune's has)."
        )


def evaluate(
    recipe: Recipe, checkpoint: str | Path | None = None, *, plan: RunPlan | None = None
) -> dict[str, float]:
    """Evaluate in this process (one rank of the launch); every rank returns the same metrics.

    ``plan`` is this process's plan of ``recipe`` when the caller has built it (a one-process
    evaluation after the launcher's preflight); by default it is built here for the launch's processes.

    Returns:
        ``eval_loss`` (Σ token losses / Σ target tokens over the whole evaluation set),
        ``eval_perplexity``, ``eval_tokens`` and the Trainer's timing metrics. With ``rl``: ``eval_loss``
        (the mean pair loss over every evaluation pair), the preference metrics as TRL names them
        (``eval_rewards/chosen``, ...) and ``eval_pairs``
        (:meth:`~cptune.run.training.preference_trainer.PreferenceTrainer.evaluation_loop`).

    Raises:
        CptuneError: the recipe has no evaluation data, or ``checkpoint`` is not usable (with ``rl``: the
            base model, or a full model without ``precompute_ref_log_probs`` (:func:`check_preference_source`) or
            without stored reference sums of the evaluation pairs).
    """
    from cptune.data.prepare import prepare_datasets
    from cptune.run.training.builder import build_trainer, run_scope

    check_eval_data(recipe)
    source = model_source(checkpoint)
    check_preference_source(recipe, source)
    env = read_dist_env()
    plan = plan or RunPlan.build(recipe, env.world_size)
    tokenizer = load_tokenizer(recipe)
    prepared = prepare_datasets(recipe, tokenizer)
    if prepared.eval is None:  # cannot happen after check_eval_data, unless the cache was edited
        raise CptuneError(f"evaluate: the prepared data in {prepared.path} has no evaluation split.")
    plan.check_prepared_rows(prepared)
    attention = plan.attention(tokenizer.pad_token_id)
    model = load_source_model(
        recipe,
        source,
        attention.attn_implementation,
        tokenizer,
        check_model=plan.check_model,
        local_rank=env.local_rank,
    )
    if env.rank == 0:
        log.info("evaluating %s on %d rows", source.describe(recipe), len(prepared.eval))
    with run_scope(plan):
        loss = install_memory_features(model, recipe).loss  # tiled MLP and the chunked loss help here too
        trainer = build_trainer(
            plan,
            env,
            model,
            tokenizer,
            prepared,
            attention.build,
            loss,
            training=False,
            model_is_reference=source.kind != "full",
        )
        metrics = trainer.evaluate()
        trainer.accelerator.wait_for_everyone()
    # The Trainer adds the training epoch to every log; a standalone evaluation has none.
    metrics.pop("epoch", None)
    return metrics
