"""The rules across the recipe's keys, and the one list of them: :data:`RULES`.

A rule reads a recipe (or, when some keys failed validation, one whose broken keys hold their
defaults) and yields (key path, message) for each combination that cannot work; the loader reports
them together with the keys' own errors. :data:`RULES` holds this module's rules, each backend's
(:meth:`~cptune.parallel.backends.spec.BackendPolicy.recipe_rules`) and those over Axolotl's keys
(:mod:`cptune.config.axolotl.rules`). The recipe reference page lists them, titled by each rule's
docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from cptune.config.axolotl.rules import axolotl_mapped, fsdp1_rules, lora_kernels
from cptune.config.recipe import Recipe
from cptune.parallel.backends.table import BACKENDS, named_backend

# A rule reads a recipe (possibly only partly valid) and yields (key, message).
Rule = Callable[[Recipe], Iterator[tuple[str, str]]]


def _precision(r: Recipe) -> Iterator[tuple[str, str]]:
    """Precision.

    - `bf16: true` and `fp16: true` together are refused: choose one (or neither for fp32).
    """
    if r.bf16 is True and r.fp16:
        yield "fp16", "bf16 and fp16 are both true; choose one (or neither for fp32)."


def _warmup(r: Recipe) -> Iterator[tuple[str, str]]:
    """Warmup.

    - `warmup_steps` and `warmup_ratio` together are refused: set one.
    """
    if r.warmup_steps is not None and r.warmup_ratio is not None:
        yield "warmup_ratio", "set either warmup_steps or warmup_ratio, not both."


# The Trainer's optimizers that take no Adam betas or epsilon: transformers 5.23's trainer_optimizer.py builds them
# without its adam_kwargs (_get_sgd, _get_adagrad, _get_rmsprop, _get_adafactor, _get_lomo_optimizer,
# _get_grokadamw), so adam_beta1/adam_beta2/adam_epsilon would change nothing.
_WITHOUT_ADAM_ARGUMENTS = ("sgd", "adagrad", "rmsprop", "adafactor", "lomo", "adalomo", "grokadamw")


def _optimizer(r: Recipe) -> Iterator[tuple[str, str]]:
    """Optimizer.

    - `adam_beta1`, `adam_beta2` or `adam_epsilon` with an optimizer that does not use them (`sgd`, `adagrad`,
      `rmsprop`, `adafactor`, `lomo`, `adalomo`, `grokadamw`) is refused: they would change nothing.
    """
    if r.optimizer in _WITHOUT_ADAM_ARGUMENTS:
        for key in r.adam_arguments:
            yield (
                key,
                f"optimizer {r.optimizer} does not use Adam's betas or epsilon, so {key} would change nothing; "
                "remove it, or pick an Adam-family optimizer (adamw_torch, adamw_8bit, ...).",
            )


def _evaluation(r: Recipe) -> Iterator[tuple[str, str]]:
    """Evaluation data.

    - `val_set_size` and `test_datasets` together are refused: set one.
    - `val_set_size` of 1 or more counts rows and must be a whole number.
    - `eval_steps` needs evaluation data: `val_set_size` or `test_datasets`.
    """
    if r.val_set_size and r.test_datasets:
        yield "val_set_size", "set either val_set_size or test_datasets, not both."
    if r.val_set_size >= 1 and r.val_set_size != int(r.val_set_size):
        yield (
            "val_set_size",
            f"{r.val_set_size} is 1 or more, so it counts rows and must be a whole number; "
            "use a whole number of rows, or a share below 1.",
        )
    if r.eval_steps is not None and not (r.val_set_size or r.test_datasets):
        yield "eval_steps", "evaluation needs data: set val_set_size or test_datasets."


def _output(r: Recipe) -> Iterator[tuple[str, str]]:
    """Output folder.

    - `overwrite_output_dir: true` and `resume_from_checkpoint` are refused together: one starts
      afresh, the other continues the earlier run.
    """
    if r.overwrite_output_dir and r.resume_from_checkpoint not in (None, False):
        yield (
            "overwrite_output_dir",
            "resume_from_checkpoint continues the earlier run in output_dir, overwrite_output_dir starts "
            "afresh and removes it; set only one of them.",
        )


def _context_parallel(r: Recipe) -> Iterator[tuple[str, str]]:
    """Context parallelism.

    - `sequence_len` must hold at least one chunk per rank: `context_parallel_size` chunks, or twice
      that for `batch_zigzag` and for `cp_backend: torch` with load balancing.
    - Each backend's own keys and combinations: the sections below.
    """
    chunks = r.context_parallel_size * named_backend(r).chunks_per_rank(r)
    if r.sequence_len < chunks:
        yield (
            "sequence_len",
            f"{r.sequence_len} tokens cannot be split into the {chunks} chunks that "
            f"context_parallel_size={r.context_parallel_size} needs; use a longer sequence_len "
            "or a smaller context_parallel_size.",
        )


def _adapter(r: Recipe) -> Iterator[tuple[str, str]]:
    """LoRA.

    - `lora_target_modules` must not be an empty list.
    """
    if r.lora_target_modules is not None and len(r.lora_target_modules) == 0:
        yield "lora_target_modules", "is empty; list module names or set lora_target_linear: true."


def _fsdp(r: Recipe) -> Iterator[tuple[str, str]]:
    """Sharding of model states (FSDP2).

    - `fsdp_version: 1` is refused: cptune shards with FSDP2 only.
    - `fsdp_config`, `dp_shard_size` and `dp_replicate_size` need `fsdp_version: 2`.
    """
    if r.fsdp_version == 1 and not r.fsdp:  # with Axolotl's fsdp list: fsdp1_rules names both keys
        yield (
            "fsdp_version",
            "FSDP1 is not supported (transformers deprecates it); use fsdp_version: 2, which shards the same "
            "model states with FSDP2.",
        )
    if r.fsdp_version is None:
        for key in ("fsdp_config", "dp_shard_size", "dp_replicate_size"):
            if getattr(r, key) is not None:
                yield (
                    key,
                    "applies only with fsdp_version: 2 (without FSDP every rank holds the whole model and the "
                    "data-parallel size is the number of processes / context_parallel_size); set fsdp_version: 2 "
                    "or remove it.",
                )
        return


def _tensor_parallel(r: Recipe) -> Iterator[tuple[str, str]]:
    """Tensor parallelism.

    - `tensor_parallel_size` > 1 needs `fsdp_version: 2` (the tensor-parallel pieces are sharded and their
      gradients averaged by FSDP2).
    - It trains full fine-tunes only (no `adapter`) with `cp_backend: ring-flash-attn`; DeepSpeed
      (`deepspeed`, `zero_stage`) is refused with it.
    - The model's attention heads and key/value heads must divide by it (checked when the model's config is
      read).
    """
    if r.tensor_parallel_size == 1:
        return
    size = f"tensor_parallel_size={r.tensor_parallel_size}"
    if r.fsdp_version != 2:
        yield (
            "tensor_parallel_size",
            f"{size} needs fsdp_version: 2 (FSDP2 shards the tensor-parallel pieces and averages their "
            "gradients); set it, or remove tensor_parallel_size.",
        )
    if r.adapter is not None:
        yield (
            "adapter",
            f"{r.adapter} with {size} is not supported (LoRA layers are not split over tensor-parallel ranks); "
            "train the adapter with context_parallel_size and FSDP2 alone, or remove tensor_parallel_size.",
        )
    if r.context_parallel_size > 1 and not named_backend(r).takes_tensor_parallel:
        able = " or ".join(f"cp_backend: {b.name}" for b in BACKENDS.values() if b.takes_tensor_parallel)
        yield (
            "cp_backend",
            f"{r.cp_backend} with {size} is not supported; use {able}, which rings over "
            "each tensor-parallel rank's own heads.",
        )
    for key in ("deepspeed", "zero_stage"):
        if getattr(r, key) is not None:
            yield (
                key,
                f"DeepSpeed with {size} is not supported (cptune's tensor parallelism runs under FSDP2); "
                "shard with fsdp_version: 2 instead.",
            )


def _memory(r: Recipe) -> Iterator[tuple[str, str]]:
    """Memory for long sequences.

    - `activation_offloading` takes `true`, `two_level` or `false` (Axolotl's CPU modes `legacy` and
      `hidden_states` mean `true`; `disk` is refused) and needs `gradient_checkpointing: true` (it offloads
      the layer inputs that checkpointing keeps); `two_level` is refused with FSDP2 or DeepSpeed.
    - `tiled_mlp_num_shards` needs `tiled_mlp: true`; `tiled_mlp_use_original_mlp: false` is refused.
    """
    if r.activation_offloading == "disk":
        yield (
            "activation_offloading",
            "'disk' (Axolotl's offloading to files) is not supported; cptune offloads to host memory with "
            "activation_offloading: true.",
        )
    elif r.offloads_activations and not r.resolved_gradient_checkpointing:
        yield (
            "activation_offloading",
            "offloads the layer inputs that gradient checkpointing keeps for the backward pass; set "
            "gradient_checkpointing: true as well.",
        )
    sharded = _sharding_key(r)
    if r.two_level_offloading and sharded:
        yield (
            "activation_offloading",
            f"two_level with sharded weights ({sharded}) is not built yet: its backward runs a layer's forward "
            "again outside the layer's call, where FSDP2 and DeepSpeed gather the layer's weights. Use "
            "activation_offloading: true.",
        )
    if r.tiled_mlp_num_shards is not None and not r.tiled_mlp:
        yield (
            "tiled_mlp_num_shards",
            "applies only with tiled_mlp: true; set it or remove tiled_mlp_num_shards.",
        )
    if not r.tiled_mlp_use_original_mlp:
        yield (
            "tiled_mlp_use_original_mlp",
            "cptune always tiles the model's own MLP module (with its LoRA layers); remove the key or set it true.",
        )


def _sharding_key(r: Recipe) -> str | None:
    """The key that shards the weights (FSDP or DeepSpeed), None without sharding."""
    return (
        "fsdp_version" if r.is_fsdp else next((k for k in ("deepspeed", "zero_stage") if getattr(r, k)), None)
    )


def _quantization(r: Recipe) -> Iterator[tuple[str, str]]:
    """Quantized base models (QLoRA).

    - `adapter: qlora` needs `load_in_4bit: true`, and `load_in_4bit: true` needs `adapter: qlora`.
    - `load_in_8bit: true` needs `adapter: lora` (LoRA on an 8-bit base).
    - `bnb_config_kwargs` needs `load_in_4bit` or `load_in_8bit`.
    - An 8-bit base is refused under FSDP2 (FSDP2 would shard bitsandbytes' 8-bit weights and lose their
      scales); a 4-bit base is sharded with the other weights when its packed weights are stored in a float
      dtype (`bnb_4bit_quant_storage`, default the training dtype), and kept whole on every rank when uint8.
    - `quantize_moe_experts` needs `load_in_4bit` (cptune packs the experts in 4 bits only) and gradient
      checkpointing (the layers' recomputation dequantizes their experts again in the backward, instead of
      every layer's dequantized experts staying in memory until then); FSDP and DeepSpeed are refused with it
      (the packed experts are not built to be sharded).
    """
    if r.adapter == "qlora" and not r.load_in_4bit:
        yield (
            "adapter",
            "qlora trains a LoRA adapter on a 4-bit base: set load_in_4bit: true (or use adapter: lora).",
        )
    if r.load_in_4bit and r.adapter != "qlora":
        yield (
            "load_in_4bit",
            "a 4-bit base model is trained through a LoRA adapter: set adapter: qlora, or remove load_in_4bit.",
        )
    if r.load_in_8bit and r.adapter != "lora":
        why = (
            "use load_in_4bit with qlora" if r.adapter == "qlora" else "8-bit weights cannot be trained whole"
        )
        yield "load_in_8bit", f"an 8-bit base model is trained through adapter: lora ({why}); or remove it."
    if r.bnb_config_kwargs is not None and not (r.load_in_4bit or r.load_in_8bit):
        yield "bnb_config_kwargs", "applies only with load_in_4bit or load_in_8bit; remove it."
    if r.load_in_8bit and r.is_fsdp:
        yield (
            "load_in_8bit",
            "an 8-bit base cannot be trained under FSDP2 (fsdp_version: 2 or fsdp): bitsandbytes' 8-bit weights "
            "lose their scales when FSDP2 shards them. Use load_in_4bit with adapter: qlora (FSDP2 shards its 4-bit "
            "weights), or train without FSDP.",
        )
    if r.quantize_moe_experts:
        yield from _expert_quantization(r)


def _expert_quantization(r: Recipe) -> Iterator[tuple[str, str]]:
    if not r.load_in_4bit:
        yield (
            "quantize_moe_experts",
            "cptune stores a mixture of experts' expert weights in 4 bits only, under QLoRA: set load_in_4bit: "
            "true with adapter: qlora (with load_in_8bit the experts stay in the training dtype), or remove "
            "quantize_moe_experts.",
        )
    if not r.resolved_gradient_checkpointing:
        yield (
            "quantize_moe_experts",
            "needs gradient_checkpointing: true: the backward recomputes each layer and dequantizes its experts "
            "again; without it every layer's dequantized experts would stay in memory until the backward, as "
            "much as unquantized experts.",
        )
    sharded = _sharding_key(r)
    if sharded:
        yield (
            "quantize_moe_experts",
            f"4-bit experts are not built for sharded weights ({sharded}): FSDP2 and DeepSpeed would split the "
            "packed experts apart from their quantization constants. Train without sharding (one GPU, or data "
            "parallelism with context parallelism), or remove quantize_moe_experts.",
        )


def _mxfp4(r: Recipe) -> Iterator[tuple[str, str]]:
    """MXFP4 checkpoints (gpt-oss).

    - `model_quantization_config: Mxfp4Config` needs `model_quantization_config_kwargs: {dequantize: true}`:
      cptune trains the MXFP4 weights dequantized to the training dtype, not in MXFP4.
    - `model_quantization_config_kwargs` needs `model_quantization_config`.
    - `model_quantization_config` with `load_in_4bit` or `load_in_8bit` is refused: one quantization at a time.
    """
    # A partly valid recipe holds None for a key that failed its own validation: each problem is filed under
    # the key whose failure would make it wrong, so that the loader drops it then.
    options = r.model_quantization_config_kwargs
    if r.dequantizes_mxfp4 and not (options and options.dequantize):
        yield (
            "model_quantization_config_kwargs",
            f"model_quantization_config: {r.model_quantization_config} keeps the weights in MXFP4 unless "
            "dequantize is true, and MXFP4 weights cannot be trained; set model_quantization_config_kwargs: "
            "{dequantize: true} to train them dequantized to the training dtype.",
        )
    if options is not None and r.model_quantization_config is None:
        yield (
            "model_quantization_config",
            "is not set, but model_quantization_config_kwargs is; set model_quantization_config: Mxfp4Config, "
            "or remove model_quantization_config_kwargs.",
        )
    if r.model_quantization_config is not None and r.is_quantized:
        key = "load_in_4bit" if r.load_in_4bit else "load_in_8bit"
        yield (
            key,
            f"the base model is loaded with model_quantization_config: {r.model_quantization_config} (dequantized "
            f"for training), so bitsandbytes cannot quantize it too; one quantization at a time: remove {key} "
            "or model_quantization_config.",
        )


def _adapter_extras(r: Recipe) -> Iterator[tuple[str, str]]:
    """LoRA extras.

    - `lora_model_dir` and `lora_modules_to_save` need `adapter: lora` or `qlora`.
    """
    for key in ("lora_model_dir", "lora_modules_to_save"):
        if getattr(r, key) is not None and not r.is_lora:
            yield key, "applies only with adapter: lora or qlora; remove it."


def _unfrozen(r: Recipe) -> Iterator[tuple[str, str]]:
    """Partly frozen full fine-tune (`unfrozen_parameters`).

    - `unfrozen_parameters` with `adapter: lora` or `qlora` is refused: Axolotl matches the patterns against the
      adapter-wrapped names (`base_model.model.…`) and freezes whatever they miss, the adapter included; use
      `lora_modules_to_save` to train whole modules next to an adapter, or `lora_target_modules` to adapt fewer.
    """
    if r.unfrozen_parameters and r.is_lora:
        yield (
            "unfrozen_parameters",
            f"selects the parameters of a full fine-tune, but adapter: {r.adapter} trains a LoRA adapter (Axolotl "
            "matches these patterns against the adapter-wrapped names, base_model.model.…, and freezes what they "
            "miss, the adapter included). To train whole modules next to the adapter, name them in "
            "lora_modules_to_save (e.g. [lm_head]); to adapt fewer layers, set lora_target_modules; or remove "
            "adapter to train only the selected parameters.",
        )


def _preference(r: Recipe) -> Iterator[tuple[str, str]]:
    """Preference training (`rl`).

    - `rl` takes `dpo`, `ipo`, `orpo` or `simpo`; Axolotl's other values (`kto`, `grpo`) are refused, each
      with what it would need.
    - `rl: dpo` and `ipo` need a reference: a LoRA or QLoRA adapter (the base model with the adapter
      disabled) or `precompute_ref_log_probs`; `lora_model_dir` is refused with them (TRL's reference would
      be the starting adapter). `orpo` and `simpo` read no reference: `precompute_ref_log_probs` is refused
      with them. `train_on_inputs: true` is refused (the prompt is never trained). Tensor parallelism takes
      each of them (a full fine-tune under FSDP2, `_tensor_parallel`; `dpo` and `ipo` then precompute their
      reference, whose first pass keeps each row's sums on one rank of its CP and TP groups).
    - At `context_parallel_size` above 1 the `cp_backend` must compute the per-pair sums
      (`ring-flash-attn`).
    - With `rl` every dataset is a preference type (`chat_template.default`, `passthrough.default`), and
      without it none is; `rl_beta` and `dpo_beta` may not disagree; `dpo_label_smoothing` applies to
      `rl: dpo` only, `orpo_alpha` to `rl: orpo` (whose λ it is: `rl_beta` and `dpo_beta` are refused with
      it), `simpo_gamma` and `cpo_alpha` to `rl: simpo`.
    """
    refusal = r.rl_refusal()
    if refusal is not None:
        yield "rl", f"{refusal}."
        return
    entries = [("datasets", i, d) for i, d in enumerate(r.datasets)]
    entries += [("test_datasets", i, d) for i, d in enumerate(r.test_datasets or ())]
    if r.rl is None:
        for key, index, dataset in entries:
            if dataset.is_preference:
                yield (
                    f"{key}[{index}].type",
                    f"{dataset.type} holds preference pairs (prompt, chosen, rejected), which rl (dpo, ipo, orpo, "
                    "simpo) trains; set rl, or use a supervised type (chat_template, alpaca, completion, pretokenized).",
                )
        for key in ("rl_beta", "dpo_beta"):
            if getattr(r, key) is not None:
                yield key, "applies only with rl (dpo, ipo or simpo); remove it."
        if r.dpo_label_smoothing:
            yield "dpo_label_smoothing", "applies only with rl: dpo; remove it."
        if r.precompute_ref_log_probs:
            yield "precompute_ref_log_probs", "applies only with rl: dpo or rl: ipo; remove it."
        yield from _variant_keys(r)
        return
    rl = f"rl: {r.rl}"
    for key, index, dataset in entries:
        if not dataset.is_preference:
            yield (
                f"{key}[{index}].type",
                f"{dataset.type} rows are not preference pairs, which {rl} trains; use type: chat_template.default "
                "(field_messages, field_chosen, field_rejected) or passthrough.default (prompt, chosen and rejected "
                "text).",
            )
    if not r.needs_reference and r.precompute_ref_log_probs:
        yield (
            "precompute_ref_log_probs",
            f"{rl} reads no reference model (its loss compares the policy's own per-token log-probs of the two "
            "sides), so there is nothing to precompute; remove precompute_ref_log_probs.",
        )
    if r.needs_reference and r.adapter is None and not r.precompute_ref_log_probs:
        yield (
            "adapter",
            f"{rl} needs a reference model: with adapter: lora (or qlora) it is the base model with the adapter "
            "disabled, no copy; a full fine-tune has no adapter to disable. Set precompute_ref_log_probs: true (the "
            "reference's log-probs of every pair computed in a first pass, from the model as loaded), or adapter: lora.",
        )
    if r.needs_reference and r.lora_model_dir is not None:
        yield (
            "lora_model_dir",
            f"{rl} would compare with the base model (the adapter disabled), not with the adapter you start from; "
            "a reference copy of a starting adapter is not built yet. Merge it into the base (cptune merge-lora) "
            "and train a fresh adapter on the merged model.",
        )
    if r.train_on_inputs:
        yield (
            "train_on_inputs",
            f"{rl} trains the responses only (the prompt's log-probs are the same in the chosen and rejected "
            "sequences); remove train_on_inputs.",
        )
    backend = named_backend(r)
    if r.context_parallel_size > 1 and not backend.trains_preference_pairs:
        able = " or ".join(f"cp_backend: {b.name}" for b in BACKENDS.values() if b.trains_preference_pairs)
        yield (
            "cp_backend",
            f"{rl} at context_parallel_size {r.context_parallel_size} needs a backend that sums each pair's "
            f"log-probs over its shards, which {backend.label} does not yet; use {able}.",
        )
    if r.rl_beta is not None and r.dpo_beta is not None and r.rl_beta != r.dpo_beta:
        yield "dpo_beta", f"{r.dpo_beta} disagrees with rl_beta: {r.rl_beta} (two names of β); set one."
    if r.dpo_label_smoothing and r.rl != "dpo":
        yield "dpo_label_smoothing", f"applies only with rl: dpo (not {rl}); remove it."
    if r.rl == "orpo":
        for key in ("rl_beta", "dpo_beta"):
            if getattr(r, key) is not None:
                yield (
                    key,
                    "rl: orpo weighs its odds-ratio term with orpo_alpha (ORPO's λ); set orpo_alpha instead.",
                )
    yield from _variant_keys(r)


def _variant_keys(r: Recipe) -> Iterator[tuple[str, str]]:
    """The keys of one loss variant set with another rl (or none)."""
    for key, owner in (("orpo_alpha", "orpo"), ("simpo_gamma", "simpo"), ("cpo_alpha", "simpo")):
        if getattr(r, key) is not None and r.rl != owner:
            now = f" (not rl: {r.rl})" if r.rl is not None else ""
            yield key, f"applies only with rl: {owner}{now}; remove it, or set rl: {owner}."


def _chat_template(r: Recipe) -> Iterator[tuple[str, str]]:
    """Chat templates.

    - `chat_template: jinja` needs `chat_template_jinja`; `chat_template_jinja` goes with
      `chat_template: jinja` or no `chat_template`.
    """
    if r.chat_template == "jinja" and r.chat_template_jinja is None:
        yield "chat_template", "jinja needs the template in chat_template_jinja (its text or a .jinja file)."
    if r.chat_template_jinja is not None and r.chat_template not in (None, "jinja"):
        yield (
            "chat_template_jinja",
            f"chat_template: {r.chat_template} names another template; set chat_template: jinja (or remove one).",
        )


RULES: tuple[Rule, ...] = (
    _precision,
    _warmup,
    _optimizer,
    _evaluation,
    _output,
    _context_parallel,
    *(backend.recipe_rules for backend in BACKENDS.values()),
    _fsdp,
    fsdp1_rules,
    _tensor_parallel,
    _adapter,
    _quantization,
    _mxfp4,
    _adapter_extras,
    _unfrozen,
    _preference,
    _chat_template,
    axolotl_mapped,
    lora_kernels,
    _memory,
)
"""Every rule, in the order their problems are reported."""


def combination_problems(recipe: Recipe, missing: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Problems that involve several keys, as (key path, message) pairs.

    Args:
        recipe: The validated recipe, or one built from the keys that passed validation.
        missing: Required keys ``recipe`` lacks (they failed validation and have no default). A rule
            that reads one of them stays silent, as that key has its own error; any other exception
            a rule raises is a bug in the rule and propagates.
    """
    problems: list[tuple[str, str]] = []
    for rule in RULES:
        try:
            problems.extend(rule(recipe))
        except AttributeError as err:
            if not (err.obj is recipe and err.name in missing):
                raise
    return problems
