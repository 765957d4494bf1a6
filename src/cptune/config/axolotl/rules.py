"""The rules over Axolotl's keys: mapped keys that cannot work together, fused kernels, FSDP1's form.

Each rule names the key and what to do; :data:`cptune.config.rules.RULES` lists them with the others.
Plugins are refused one line each.
"""

from __future__ import annotations

from collections.abc import Iterator

from cptune.config.axolotl.fsdp1 import HYBRID, written
from cptune.config.axolotl.plugins import MAPPED_PLUGINS, plugin_refusal
from cptune.config.parallelism import list_strategies, reshard_sources
from cptune.config.recipe import Recipe

# Attention implementations an Axolotl recipe may name (cptune picks the attention from cp_backend).
_ATTENTION_NAMES = ("flash_attention_2", "flash_attention_3", "sdpa")


def is_hub_flash_kernel(name: str) -> bool:
    """A FlashAttention build from the hub's kernels-community (``kernels-community/vllm-flash-attn3``,
    ``kernels-community/flash-attn``), which Axolotl's recipes name for the same attention as flash_attention_2/3."""
    owner, _, kernel = name.partition("/")
    return owner == "kernels-community" and "flash-attn" in kernel


def axolotl_mapped(r: Recipe) -> Iterator[tuple[str, str]]:
    """Axolotl keys cptune maps.

    - `attn_implementation` is one of `flash_attention_2`, `flash_attention_3`, `sdpa` or a FlashAttention build
      of the hub's `kernels-community` (e.g. `kernels-community/vllm-flash-attn3`; cptune picks the attention
      from `cp_backend`; eager, flex and others are refused).
    - `gradient_checkpointing_kwargs` may only set `use_reentrant` (`true` runs as `false`, noted).
    - `evals_per_epoch` and `eval_steps` together are refused, and so are `saves_per_epoch` and `save_steps`.
    - `bfloat16` must agree with `bf16`, and `float16` with `fp16`.
    - `dataset_num_proc` must agree with `dataset_processes` where both are set.
    - `cosine_min_lr_ratio` needs `lr_scheduler: cosine`.
    - `model_type` is `AutoModelForCausalLM` or a `...ForCausalLM` class (checked against the model's config
      when the model is checked).
    - `plugins` may list Axolotl's `CutCrossEntropyPlugin` and `LigerPlugin` (both map onto cptune's chunked
      loss, `cut_cross_entropy`; with `LigerPlugin` only `liger_fused_linear_cross_entropy` has an
      equivalent); every other plugin is refused.
    - `batch_size` must be `micro_batch_size` x `gradient_accumulation_steps` (it sets the latter when unset).
    - `save_strategy` / `eval_strategy`: `steps` needs how often (`save_steps` or `saves_per_epoch`, `eval_steps`
      or `evals_per_epoch`); `epoch` and `no` are refused with them.
    """
    yield from _batch_size(r)
    yield from _schedule(r, "save", r.save_strategy, ("save_steps", "saves_per_epoch"))
    yield from _schedule(r, "eval", r.eval_strategy, ("eval_steps", "evals_per_epoch"))
    attention = r.attn_implementation
    if attention is not None and attention not in _ATTENTION_NAMES and not is_hub_flash_kernel(attention):
        yield (
            "attn_implementation",
            f"cptune does not run '{r.attn_implementation}' attention; it picks the attention from cp_backend "
            "(flash-attn kernels for ring-flash-attn, SDPA otherwise). Use flash_attention_2 or sdpa, or remove it.",
        )
    kwargs = r.gradient_checkpointing_kwargs
    if kwargs is not None and dict(kwargs) not in ({}, {"use_reentrant": False}, {"use_reentrant": True}):
        yield (
            "gradient_checkpointing_kwargs",
            f"{dict(kwargs)} is not supported: cptune checkpoints with use_reentrant: false and no other "
            "argument (the reentrant variant recomputes without the step's CP metadata; use_reentrant: true is "
            "run so too); keep only use_reentrant or remove it.",
        )
    for per_epoch, steps in (("evals_per_epoch", "eval_steps"), ("saves_per_epoch", "save_steps")):
        if getattr(r, per_epoch) is not None and getattr(r, steps) is not None:
            yield (
                per_epoch,
                f"and {steps} both set how often (Axolotl's count per epoch, cptune's steps); set one of them.",
            )
    for axolotl, ours in (("bfloat16", "bf16"), ("float16", "fp16")):
        value = getattr(r, axolotl)
        if value is not None and value != (getattr(r, ours) is True):
            yield (
                axolotl,
                f"is {value} but {ours} is {getattr(r, ours)}; they are the same setting, set {ours} only.",
            )
    if None not in (r.dataset_num_proc, r.dataset_processes) and r.dataset_num_proc != r.dataset_processes:
        yield (
            "dataset_num_proc",
            f"is {r.dataset_num_proc} but dataset_processes is {r.dataset_processes}; they are the same setting, "
            "set dataset_processes only.",
        )
    if r.cosine_min_lr_ratio is not None and r.lr_scheduler != "cosine":
        yield (
            "cosine_min_lr_ratio",
            f"shapes the cosine schedule's end, but lr_scheduler is {r.lr_scheduler}; set lr_scheduler: cosine or "
            "remove it.",
        )
    if r.model_type is not None and not r.model_type.endswith("ForCausalLM"):
        yield (
            "model_type",
            f"'{r.model_type}' is not a causal language model class; use AutoModelForCausalLM (or remove it).",
        )
    for index, plugin in enumerate(r.plugins or ()):
        if plugin.rsplit(".", 1)[-1] not in MAPPED_PLUGINS:
            yield f"plugins[{index}]", plugin_refusal(plugin)


# Axolotl's LoRA kernels that fuse several projections into one autograd function (each only where every one of
# its projections carries the adapter), and how the fused function drops the LoRA inputs
# (axolotl/kernels/lora.py: apply_lora_mlp_swiglu, apply_lora_qkv).
_SHARED_DROPOUT_KERNELS: dict[str, tuple[tuple[str, ...], str]] = {
    "lora_mlp_kernel": (
        ("gate_proj", "up_proj", "down_proj"),
        "shares one dropout mask between gate_proj and up_proj and drops nothing before down_proj",
    ),
    "lora_qkv_kernel": (
        ("q_proj", "k_proj", "v_proj"),
        "shares one dropout mask between q_proj, k_proj and v_proj",
    ),
}


def _targets(r: Recipe, projection: str) -> bool:
    """Whether the adapter goes on ``projection`` (peft matches a module name or its dotted suffix)."""
    if r.lora_target_modules is None:
        return True  # every linear layer
    return any(t == projection or t.endswith("." + projection) for t in r.lora_target_modules)


def lora_kernels(r: Recipe) -> Iterator[tuple[str, str]]:
    """Axolotl's fused LoRA kernels.

    - `lora_mlp_kernel` and `lora_qkv_kernel` are refused with `lora_dropout` > 0 when the adapter covers every
      projection they fuse (gate/up/down, q/k/v): there the kernel draws its dropout masks differently from
      peft's LoRA layers, which cptune runs. Without dropout they compute the same, and are accepted.
    """
    if not (r.is_lora and r.lora_dropout):
        return
    for key, (projections, how) in _SHARED_DROPOUT_KERNELS.items():
        if getattr(r, key) and all(_targets(r, p) for p in projections):
            yield (
                key,
                f"with lora_dropout: {r.lora_dropout} Axolotl's kernel {how}, whereas peft's LoRA layers (which "
                "cptune runs) draw a mask for each projection, so the model would train differently. Set "
                f"lora_dropout: 0 (what Axolotl's kernels document) or {key}: false (peft's dropout).",
            )


def fsdp1_rules(r: Recipe) -> Iterator[tuple[str, str]]:
    """Axolotl's FSDP1 keys.

    - `fsdp` (Axolotl's FSDP1 form) is refused with `fsdp_version: 1`, and with more than one sharding
      strategy in it.
    - `no_shard` / `NO_SHARD` is refused: that is plain data parallelism, which cptune runs without FSDP.
    - `hybrid_shard` / `HYBRID_SHARD` (and their ZERO2 forms) need `dp_replicate_size`.
    - `fsdp`, `fsdp_config.sharding_strategy` and `fsdp_config.reshard_after_forward` must agree, and `offload`
      in `fsdp` with `fsdp_config.offload_params`.
    """
    options = r.fsdp or ()
    if options and r.fsdp_version == 1:
        yield (
            "fsdp_version",
            f"is 1, but fsdp: {written(options)} asks for sharding that cptune runs with FSDP2 only; remove "
            "fsdp_version (fsdp implies fsdp_version: 2) or set it to 2.",
        )
    strategies = list_strategies(options)
    if len(strategies) > 1:
        yield "fsdp", f"{written(options)} lists {len(strategies)} sharding strategies; keep one."
    config = r.fsdp_config
    asked = [("fsdp", s.lower()) for s in strategies[:1]]
    if config is not None and config.sharding_strategy is not None:
        asked.append(("fsdp_config.sharding_strategy", config.sharding_strategy))
    for key, strategy in asked:
        if strategy.upper() == "NO_SHARD":
            yield (
                key,
                f"{strategy} is plain data parallelism (every rank holds the whole model), which cptune runs "
                "without FSDP: remove fsdp, fsdp_config and fsdp_version.",
            )
        elif strategy.upper() in HYBRID and r.dp_replicate_size is None:
            yield (
                key,
                f"{strategy} shards within a group of ranks and replicates across groups; in cptune's FSDP2 "
                "that is dp_replicate_size (the number of copies, e.g. nodes): set it, and each copy is sharded "
                "over processes / (dp_replicate_size × context_parallel_size) ranks.",
            )
    sources = reshard_sources(options, config)
    for key, value in sources[1:]:
        first, first_value = sources[0]
        if value != first_value:
            yield (
                key.split(":")[0],
                f"{key.split(': ')[1]} disagrees with {first}: one frees each layer's gathered weights after "
                "its forward pass (reshard_after_forward: true), the other keeps them for the backward (false); "
                "keep one of them.",
            )
    explicit = config is not None and "offload_params" in config.model_fields_set
    if "offload" in options and explicit and not config.offload_params:
        yield (
            "fsdp_config.offload_params",
            f"is false, but fsdp: {written(options)} asks for offload; keep one of them.",
        )


def _batch_size(r: Recipe) -> Iterator[tuple[str, str]]:
    if r.batch_size is None or r.batch_size == r.micro_batch_size * r.gradient_accumulation_steps:
        return
    steps = r.batch_size // r.micro_batch_size
    fix = (
        f"set gradient_accumulation_steps: {steps}"
        if r.batch_size % r.micro_batch_size == 0
        else f"choose a multiple of micro_batch_size {r.micro_batch_size}"
    )
    yield (
        "batch_size",
        f"{r.batch_size} is not micro_batch_size x gradient_accumulation_steps ({r.micro_batch_size} x "
        f"{r.gradient_accumulation_steps} = {r.micro_batch_size * r.gradient_accumulation_steps}), the rows each "
        f"process trains per optimizer step (Axolotl's meaning); {fix}, or remove batch_size.",
    )


def _schedule(
    r: Recipe, what: str, strategy: str | None, how_often: tuple[str, str]
) -> Iterator[tuple[str, str]]:
    """``save_strategy`` / ``eval_strategy`` against the keys that say how often."""
    given = [key for key in how_often if getattr(r, key)]
    if strategy == "steps" and not given:
        yield (
            f"{what}_strategy",
            f"steps needs how often: set {how_often[0]} or {how_often[1]}, or use {what}_strategy: epoch or no.",
        )
    elif strategy in ("epoch", "no") and given:
        yield (
            f"{what}_strategy",
            f"{strategy} and {given[0]} both say when ({strategy}: "
            f"{'at the end of each epoch' if strategy == 'epoch' else 'never'}); keep one of them.",
        )
