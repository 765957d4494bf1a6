"""Checks that run before any process is started or any weight is loaded.

A launch that cannot work fails here, in one process, with one message: the
process layout, the model's attention and heads, its weight files and LoRA
targets, the backend's dependencies and precision, the output folder, the
checkpoint to resume from, and the data (which is also
prepared and cached here, so the ranks only load it). Nothing in output_dir
is written or removed here.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import yaml

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError
from cptune.run.plan import RunPlan
from cptune.run.training.checkpoints import resume_checkpoint
from cptune.run.training.output_dir import check_earlier_run, check_output_dir
from cptune.run.training.run_recipe import check_resumed_recipe

log = logging.getLogger("cptune.preflight")


def preflight(
    plan: RunPlan,
    *,
    prepare_data: bool = True,
    training: bool = True,
    processes_per_node: int | None = None,
) -> None:
    """Fail early (before launching) on anything the recipe and launch cannot do together.

    Args:
        plan: The launch's plan (its recipe and its processes).
        processes_per_node: Processes on this node (default: all of the launch's), for the host-RAM check.
        prepare_data: Prepare and cache the data here (the ranks then only load it).
        training: Also check what only training needs (the checkpoint to resume from).
    """
    recipe = plan.recipe
    for problem in missing_packages(recipe):
        raise problem
    check_output_dir(recipe, writable=training)
    if training:
        check_resume(recipe)
        check_earlier_run(recipe)
    config = check_model(plan)
    if training:
        from cptune.run.memory_plan import check_host_memory

        check_host_memory(recipe, config, processes_per_node or plan.dims.world_size)
    plan.check_ready(training=training)
    if prepare_data:
        from cptune.data.prepare import prepare_datasets
        from cptune.models.loading import check_token_ids, load_tokenizer

        tokenizer = load_tokenizer(recipe)
        prepared = prepare_datasets(recipe, tokenizer)
        check_token_ids(prepared, tokenizer, getattr(config.get_text_config(), "vocab_size", None), recipe)
        plan.check_prepared_rows(prepared)
        # Here the data was prepared or found in the cache: the one place that knows which.
        log.info("%s", prepared.stats.format())


def check_resume(recipe: Recipe) -> None:
    """Refuse a resume without a complete checkpoint, or one that changes how the run is shaped.

    Names the checkpoint a resume starts from.
    """
    resume = resume_checkpoint(recipe)
    check_resumed_recipe(recipe, resume)
    if resume is not None:
        log.info("will resume from %s", resume)


def check_model(plan: RunPlan) -> Any:
    """Check the model's architecture against the plan's backend and the LoRA targets and unfrozen_parameters,
    without loading weights.

    Also checks that a local base_model folder holds complete weight files, that model_type names
    the model's class, that lora_model_dir holds an adapter, and that new tokens get trained.

    Returns:
        The model's config.
    """
    from transformers import AutoModelForCausalLM

    from cptune.models.loading import (
        check_causal_lm,
        check_local_weights,
        check_lora_model_dir,
        check_lora_targets,
        check_model_type,
        check_unfrozen_parameters,
        model_config,
    )
    from cptune.models.memory_features import check_memory_features

    recipe = plan.recipe
    config = model_config(recipe)
    check_causal_lm(recipe, config)
    check_model_type(recipe, config)
    check_local_weights(recipe)
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    plan.check_model(config, model_class)
    check_lora_model_dir(recipe)
    check_lora_targets(recipe, config)
    check_unfrozen_parameters(recipe, config)
    check_new_tokens(recipe, config)
    check_router_loss_with_rl(recipe, config)
    check_memory_features(recipe, config)
    return config


def check_router_loss_with_rl(recipe: Recipe, config: Any) -> None:
    """Refuse, before loading, preference training of a model that adds a router load-balancing loss.

    The trainer refuses it too (a rank under torchrun runs no preflight); here it is said before any weight loads.
    """
    from cptune.parallel.router_loss import RouterBalance

    if not recipe.rl:
        return
    try:
        router = RouterBalance.from_config(config)
    except ValueError:
        return  # the trainer's model check names what the config lacks
    if router is not None:
        raise CptuneError(
            "rl: the model adds a router load-balancing loss (output_router_logits with router_aux_loss_coef "
            f"{router.coef}), which cptune's preference loss does not include yet. Set "
            "output_router_logits: false in overrides_of_model_config to train without it."
        )


def check_new_tokens(recipe: Recipe, config: Any) -> None:
    """Refuse new tokens whose embeddings a LoRA run or unfrozen_parameters would leave untrained (see
    :mod:`cptune.models.added_tokens`)."""
    if not ((recipe.is_lora or recipe.unfrozen_parameters) and (recipe.tokens or recipe.special_tokens)):
        return
    from cptune.models.added_tokens import check_new_token_training
    from cptune.models.loading import load_tokenizer_with_additions, meta_model

    tokenizer, added = load_tokenizer_with_additions(recipe)
    if added:
        check_new_token_training(recipe, tokenizer, added, meta_model(recipe, config))


def missing_packages(recipe: Recipe) -> list[CptuneError]:
    """What the recipe needs that is not installed here: bitsandbytes, the optimizer's package, wandb."""
    from cptune.models.quantization import check_bitsandbytes
    from cptune.run.training.optimizers import check_optimizer
    from cptune.run.training.tracking import check_trackers

    problems = []
    for check in (check_bitsandbytes, check_optimizer, check_trackers):
        try:
            check(recipe)
        except CptuneError as err:
            problems.append(err)
    return problems


def describe_plan(
    plan: RunPlan,
    *,
    processes_per_node: int | None = None,
    gpu_memory_gib: float | None = None,
    host_memory_gib: float | None = None,
    tokenizer: Any = None,
) -> str:
    """Human-readable plan for ``cptune validate``: resolved recipe, layout, memory, patches, data.

    Args:
        plan: The launch's plan.
        processes_per_node: Processes on this node (default: all of the launch's), for the host-RAM check.
        gpu_memory_gib: GPU memory to estimate against (default: this machine's GPU, else an H100 80GB).
        host_memory_gib: A node's host RAM to plan the offloaded activations for (default: what this
            machine has available now); a run that would pin too much of it is refused.
        tokenizer: The recipe's tokenizer when the caller has loaded it (default: loaded here).
    """
    from cptune.config.axolotl.notes import axolotl_notes
    from cptune.patches.overrides import check_overrides
    from cptune.patches.transformers_patches import TRAINER_OVERRIDES
    from cptune.run.memory_plan import (
        GpuMemory,
        HostMemory,
        activation_memory_lines,
        check_host_memory,
        describe_state_memory,
    )
    from cptune.run.training.optimizers import optimizer_notes

    recipe, dims = plan.recipe, plan.dims
    config = check_model(plan)
    per_node = processes_per_node or dims.world_size
    host = HostMemory.detect(host_memory_gib)
    check_host_memory(recipe, config, per_node, host)
    lines = ["Resolved recipe:"]
    # In the order of the recipe's key groups (cptune.config.recipe.KEY_GROUPS_IN_ORDER).
    dumped = yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False).rstrip()
    lines += ["  " + line for line in dumped.splitlines()]
    training = f"LoRA r={recipe.lora_r}" if recipe.is_lora else "full fine-tune"
    if recipe.is_quantized:
        training += f" on a {'4-bit NF4' if recipe.load_in_4bit else '8-bit'} base (bitsandbytes)"
    if recipe.lora_model_dir is not None:
        training += f", starting from the adapter in {recipe.lora_model_dir}"
    lines += [
        "",
        "Plan:",
        f"  model:      {recipe.base_model} ({training})",
        f"  tokenizer:  {recipe.tokenizer_path}",
        f"  processes:  {_describe_processes(plan)}",
    ]
    lines += [f"  {line}" for line in plan.backend.plan_lines(recipe)]
    if recipe.is_preference:
        layout = (
            "each side of a pair a row of its own"
            if recipe.pair_sides_in_own_rows
            else "pairs packed in rows"
        )
        lines.append(f"  training:   {_preference_plan(recipe)}, {layout}; {_reference_plan(recipe)}")
    lines += ["", *describe_state_memory(plan, config)]
    lines += ["", *activation_memory_lines(plan, config, GpuMemory.detect(gpu_memory_gib), per_node, host)]
    notes = [*axolotl_notes(recipe), *optimizer_notes(recipe, cuda=torch.cuda.is_available())]
    notes += [f"not installed here: {err}" for err in missing_packages(recipe)]
    if notes:
        lines += ["", "Notes:", *(f"  - {note}" for note in notes)]
    patches = plan.patches.plan(recipe)
    lines += ["", "Patches:", *("  " + line for line in patches.describe().splitlines())]
    lines += _import_time_patch_lines(plan)
    lines += ["", "Private Trainer members cptune's Trainer relies on (checked like patches):"]
    lines += [f"  {override.name}: {override.target}" for override in TRAINER_OVERRIDES]
    lines += [f"  problem: {problem}" for problem in check_overrides(TRAINER_OVERRIDES).problems]
    lines += ["", "Data:", *("  " + line for line in _data_status(recipe, tokenizer).splitlines())]
    return "\n".join(lines)


def _import_time_patch_lines(plan: RunPlan) -> list[str]:
    """The patches applied only while the backend's library is imported (a run logs them first)."""
    from cptune.patches.registry import import_patch_set

    runtime = plan.backend.runtime()
    patches = import_patch_set(runtime).plan(None)
    if not (patches.selected or patches.skipped or patches.problems):
        return []
    header = f"Patches applied while {runtime.library} is imported (and reverted right after):"
    return ["", header, *("  " + line for line in patches.describe().splitlines())]


def _describe_processes(plan: RunPlan) -> str:
    """The layout line of the plan; under DeepSpeed's engine, the ZeRO stage that holds the model states."""
    dims = plan.dims
    stage = plan.zero_stage()
    if stage is None:
        return dims.describe()
    return (
        f"{dims.world_size} = {dims.dp_size} data-parallel × {dims.cp_size} context-parallel; model states: "
        f"DeepSpeed ZeRO-{stage} over all {dims.world_size} ranks"
    )


def _data_status(recipe: Recipe, tokenizer: Any) -> str:
    from cptune.data.prepare import cached_stats
    from cptune.models.loading import load_tokenizer

    try:
        stats = cached_stats(recipe, tokenizer or load_tokenizer(recipe))
    except CptuneError as err:
        return f"cannot check the cache: {err}"
    if stats is None:
        return "not prepared yet (`cptune preprocess` or `cptune train` will prepare it)"
    return stats


def _preference_plan(recipe: Recipe) -> str:
    """``rl`` and its parameters, as the plan shows them."""
    if recipe.rl == "orpo":
        return f"rl: orpo, orpo_alpha {recipe.resolved_beta:g}"
    if recipe.rl == "simpo":
        return (
            f"rl: simpo, beta {recipe.resolved_beta:g}, simpo_gamma {recipe.resolved_simpo_gamma:g}, "
            f"cpo_alpha {recipe.resolved_cpo_alpha:g}"
        )
    return f"rl: {recipe.rl}, beta {recipe.resolved_beta:g}"


def _reference_plan(recipe: Recipe) -> str:
    if not recipe.needs_reference:
        return "no reference model (per-token mean log-probs of the policy only)"
    if recipe.precompute_ref_log_probs:
        return "reference: log-prob sums precomputed in a first pass"
    return "reference: the base model (adapter disabled), a second forward without gradients"
