"""The recipe's keys of training: batches, the optimizer and its schedule, precision, output and logging,
the memory features for long sequences, and the experiment trackers."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from cptune.config.axolotl.plugins import CUT_CROSS_ENTROPY_PLUGIN
from cptune.config.base import one_or_many
from cptune.config.unfrozen import name_regex, row_range

# The Trainer's optimizer names (transformers 5.23 OptimizerNames, tests/config checks they agree);
# cptune refuses at launch only those that cannot run here (cptune.run.training.optimizers).
OptimizerName = Literal[
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_torch_xla",
    "adamw_torch_npu_fused",
    "adafactor",
    "adamw_anyprecision",
    "adamw_torch_4bit",
    "adamw_torch_8bit",
    "ademamix",
    "sgd",
    "adagrad",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "ademamix_8bit",
    "lion_8bit",
    "lion_32bit",
    "paged_adamw_32bit",
    "paged_adamw_8bit",
    "paged_ademamix_32bit",
    "paged_ademamix_8bit",
    "paged_lion_32bit",
    "paged_lion_8bit",
    "rmsprop",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
    "galore_adamw",
    "galore_adamw_8bit",
    "galore_adafactor",
    "galore_adamw_layerwise",
    "galore_adamw_8bit_layerwise",
    "galore_adafactor_layerwise",
    "lomo",
    "adalomo",
    "grokadamw",
    "schedule_free_radam",
    "schedule_free_adamw",
    "schedule_free_sgd",
    "apollo_adamw",
    "apollo_adamw_layerwise",
    "stable_adamw",
]


class TrainingKeys(BaseModel):
    """Key group of :class:`~cptune.config.recipe.Recipe`: steps, optimizer, precision, output and logging."""

    # --- training ----------------------------------------------------------
    micro_batch_size: int = Field(1, ge=1, description="Rows per process per forward pass.")
    eval_batch_size: int | None = Field(
        None,
        ge=1,
        description="Rows per process per forward pass in evaluation; micro_batch_size when not set. The "
        "evaluation loss is summed over the target tokens of every row and divided by their count, so it does "
        "not depend on how the rows are batched. `cptune validate` plans the memory of an evaluation batch "
        "beside the training step's.",
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro batches per optimizer step.")
    num_epochs: float = Field(
        1.0, gt=0, description="Passes over the training rows (max_steps wins when set)."
    )
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    optimizer: OptimizerName = Field(
        "adamw_torch",
        description="The Trainer's optimizer by its name (8-bit and paged ones need bitsandbytes, *_torch_4bit/8bit "
        "torchao); cptune refuses before launching one that cannot run here, saying why.",
    )
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "cosine", description="Learning-rate schedule after warmup."
    )
    warmup_steps: int | None = Field(None, ge=0, description="Warmup length in optimizer steps.")
    warmup_ratio: float | None = Field(None, ge=0, lt=1, description="Warmup length as a share of all steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping; 0 disables.")
    seed: int = Field(42, description="Seed of the LoRA init, data order and validation split.")
    bf16: bool | Literal["auto"] = Field(
        False, description="Train in bfloat16 (`auto`: when the GPU has it)."
    )
    fp16: bool = Field(False, description="Train in float16 with loss scaling.")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each layer in the backward pass: less activation memory, "
        "about one more forward pass of compute.",
    )
    unfrozen_parameters: tuple[str, ...] | None = Field(
        None,
        description="Train only the parameters whose names these patterns select and freeze the rest (a full "
        "fine-tune of part of the model), read as Axolotl reads them: a regular expression matched at the start "
        "of the name (`lm_head` selects `lm_head.weight`; end it in `$` to match the whole name), each dot a "
        "literal dot except in `.+`, which stands for any text (e.g. `model.layers.+.mlp`). Each pattern must "
        "select a parameter of the model. Axolotl's row ranges (`[start:end]`) and an adapter are refused; an "
        "empty list trains every parameter.",
    )
    output_dir: str = Field(
        "./outputs", description="Where the model/adapter, checkpoints and train_log.json go."
    )
    overwrite_output_dir: bool = Field(
        False,
        description="Start afresh in an output_dir that holds an earlier run (its checkpoints and train "
        "log are removed); without it cptune refuses, so a finished run is never replaced by mistake.",
    )
    logging_steps: int = Field(
        1, ge=1, description="Log loss, learning rate and tokens/s every this many steps."
    )
    save_steps: int | None = Field(
        None, ge=1, description="Write a checkpoint-N folder every this many steps."
    )
    save_total_limit: int | None = Field(
        None, ge=1, description="Keep only the newest this many checkpoints."
    )
    resume_from_checkpoint: bool | str | None = Field(
        None,
        description="`true`: continue from the newest complete checkpoint in output_dir; or a checkpoint path.",
    )
    eval_steps: int | None = Field(
        None, ge=1, description="Evaluate every this many steps and at the end (needs evaluation data)."
    )
    report_to: tuple[Literal["tensorboard", "wandb", "none"], ...] = Field(
        ("none",), description="Loggers besides train_log.json; one name or a list."
    )
    dataloader_num_workers: int = Field(0, ge=0, description="Data-loader worker processes per rank.")
    ddp_find_unused_parameters: bool = Field(
        False,
        description="Let DDP search each step's autograd graph for parameters that got no gradient, which it "
        "needs when a step leaves some trained parameters unused (e.g. a multimodal model's vision tower on "
        "text-only data); default false: the same model runs every step, no search. DDP only (no effect under "
        "FSDP or DeepSpeed).",
    )
    ddp_timeout: int = Field(
        1800,
        ge=1,
        description="Seconds a collective may wait for the other processes before the run fails "
        "(a hung or lost process then stops the run instead of holding it forever), on GPUs "
        "and on CPU alike.",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _many_report_to(cls, value: Any) -> Any:
        return one_or_many(value)

    @field_validator("unfrozen_parameters", mode="before")
    @classmethod
    def _many_unfrozen_parameters(cls, value: Any) -> Any:
        return one_or_many(value)

    @field_validator("unfrozen_parameters")
    @classmethod
    def _unfrozen_patterns(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for pattern in value or ():
            suffix = row_range(pattern)
            if suffix is not None:
                raise ValueError(
                    f"'{pattern}' ends in Axolotl's row range {suffix}, which cptune does not support: it trains "
                    "whole parameters (Axolotl zeroes the other rows' gradients, which still lets weight decay move "
                    "them and keeps optimizer state for every row); remove the range to train the whole parameter"
                )
            try:
                name_regex(pattern)
            except re.error as err:
                raise ValueError(
                    f"'{pattern}' is not a regular expression ({err.msg}); each entry is a pattern matched at the "
                    "start of a parameter's name, e.g. model.layers.+.mlp or ^lm_head.weight$"
                ) from None
        return value


class MemoryKeys(BaseModel):
    """Key group of :class:`~cptune.config.recipe.Recipe`: the memory features for long sequences."""

    # --- memory for long sequences ----------------------------------------------
    activation_offloading: bool | Literal["two_level", "legacy", "hidden_states", "disk"] = Field(
        False,
        description="Keep the layer inputs that gradient checkpointing saves in (pinned) host memory between "
        "the forward and the backward pass, copied back on a side stream while the layer after runs; exact. "
        "Needs gradient_checkpointing: true and host RAM for them (`cptune validate` says how much). "
        "`two_level` offloads every second layer's input only and regenerates the others in the backward pass "
        "with one more forward of the layer before (its RNG state replayed, so dropout too is exact): half the "
        "host RAM for a forward of half the layers. Axolotl's `legacy` and `hidden_states` (and "
        "`gradient_checkpointing: offload`) mean `true` here; `disk` is refused.",
    )
    tiled_mlp: bool = Field(
        False,
        description="Run each decoder layer's MLP over tiles of the sequence, recomputing one tile at a time in the "
        "backward pass, so its intermediates exist for one tile only (ALST's TiledMLP); works with LoRA and every "
        "cp_backend. Weight gradients are summed tile by tile (same values up to summation order).",
    )
    tiled_mlp_num_shards: int | None = Field(
        None,
        ge=1,
        description="Tiles per MLP call with tiled_mlp; default ceil(tokens per rank / hidden size), as in ALST.",
    )
    tiled_mlp_use_original_mlp: bool = Field(
        True, description="Accepted for Axolotl recipes: cptune always tiles the model's own MLP module."
    )
    recompute_norms: bool = Field(
        False,
        description="Each decoder layer's RMSNorms keep their (bf16) input instead of the fp32 copy transformers' "
        "norm saves, and recompute from it in the backward pass (16 KiB per token per norm at Llama-3.1-8B's "
        "width, two norms per layer); bit-identical losses and gradients.",
    )
    attention_kv_heads_per_call: int | None = Field(
        None,
        ge=1,
        description="cptune's document attention (packed rows at cp=1, cp_backend: deepspeed with "
        "ulysses_attn_implementation: cptune) calls FlashAttention-2 for this many KV heads (and their query heads) "
        "at a time, so its backward expands dK/dV to the query heads and accumulates dQ in fp32 for one group "
        "instead of every head (GPU memory). Heads are independent: the same attention (checked on CPU's stand-in "
        "kernels; on a GPU, out, dK and dV came out the same bits and dQ did not, as FlashAttention-2's dQ is not "
        "repeatable from run to run by default; benchmarks/gpu/check_kernels.py now compares them under torch's "
        "deterministic setting, not yet run: hence off by default). ring-flash-attn's heads_k_stride does the "
        "same for its ring.",
    )
    cut_cross_entropy: bool | None = Field(
        None,
        description="Compute the loss from the final hidden states and the output layer a chunk of tokens at a "
        "time, recomputed in the backward pass, so the full logits never exist (plain PyTorch, exact per token; "
        "what Axolotl's CutCrossEntropyPlugin does); default: on when plugins lists that plugin.",
    )
    liger_fused_linear_cross_entropy: bool = Field(
        False,
        description="The same chunked loss as cut_cross_entropy (accepted for Axolotl's LigerPlugin recipes).",
    )
    plugins: tuple[str, ...] | None = Field(
        None,
        description="Axolotl plugins: the CutCrossEntropyPlugin and LigerPlugin map onto cptune's chunked loss; "
        "others are refused.",
    )

    @field_validator("plugins", mode="before")
    @classmethod
    def _many_plugins(cls, value: Any) -> Any:
        return one_or_many(value)

    @property
    def offloads_activations(self) -> bool:
        """Checkpointed layer inputs go to host memory (``activation_offloading`` true, or Axolotl's CPU modes)."""
        return self.activation_offloading in (True, "two_level", "legacy", "hidden_states")

    @property
    def two_level_offloading(self) -> bool:
        """Only every second layer's input is offloaded, the others regenerated (``activation_offloading: two_level``)."""
        return self.activation_offloading == "two_level"

    @property
    def resolved_head_loss(self) -> bool:
        """The loss is computed from the hidden states in chunks (cut_cross_entropy or its Axolotl spellings)."""
        if self.cut_cross_entropy is not None:
            return self.cut_cross_entropy or self.liger_fused_linear_cross_entropy
        listed = any(p.rsplit(".", 1)[-1] == CUT_CROSS_ENTROPY_PLUGIN for p in self.plugins or ())
        return listed or self.liger_fused_linear_cross_entropy

    @property
    def memory_features(self) -> tuple[str, ...]:
        """The recipe keys of the memory features that are on, for plan lines and estimates."""
        names = (
            ("activation_offloading", self.offloads_activations),
            ("tiled_mlp", self.tiled_mlp),
            ("recompute_norms", self.recompute_norms),
            ("cut_cross_entropy", self.resolved_head_loss),
        )
        return tuple(name for name, on in names if on)


class OptimizerKeys(BaseModel):
    """Key group of the recipe: arguments of the Trainer's optimizers beyond the learning rate."""

    # --- optimizer arguments ----------------------------------------------------
    optim_args: str | dict[str, Any] | None = Field(
        None,
        description="Extra optimizer arguments, as the Trainer's optim_args (`key=value,...` or a mapping).",
    )
    optim_target_modules: tuple[str, ...] | None = Field(
        None, description="Modules GaLore/APOLLO optimizers project (the Trainer's optim_target_modules)."
    )
    adam_beta1: float | None = Field(
        None, ge=0, lt=1, description="Adam's first-moment decay (the Trainer's adam_beta1; default 0.9)."
    )
    adam_beta2: float | None = Field(
        None, ge=0, lt=1, description="Adam's second-moment decay (the Trainer's adam_beta2; default 0.999)."
    )
    adam_epsilon: float | None = Field(
        None, gt=0, description="Adam's epsilon (the Trainer's adam_epsilon; default 1e-8)."
    )

    @field_validator("optim_target_modules", mode="before")
    @classmethod
    def _many_optim_target_modules(cls, value: Any) -> Any:
        return one_or_many(value)

    @property
    def adam_arguments(self) -> dict[str, float]:
        """The Adam keys the recipe sets, as the Trainer's arguments (those left out keep the Trainer's defaults)."""
        keys = ("adam_beta1", "adam_beta2", "adam_epsilon")
        return {key: getattr(self, key) for key in keys if getattr(self, key) is not None}

    @property
    def resolved_optim_args(self) -> str | None:
        if isinstance(self.optim_args, dict):
            return ",".join(f"{key}={value}" for key, value in self.optim_args.items())
        return self.optim_args


class TrackingKeys(BaseModel):
    """Key group of the recipe: experiment trackers (the Trainer's integrations); TensorBoard and train_log.json need nothing."""

    # --- experiment tracking ---------------------------------------------------------
    use_wandb: bool = Field(False, description="Log to Weights & Biases (also on when wandb_project is set).")
    wandb_project: str | None = Field(None, description="W&B project; setting it turns W&B logging on.")
    wandb_entity: str | None = Field(None, description="W&B team or user.")
    wandb_name: str | None = Field(None, description="W&B run name.")
    wandb_run_id: str | None = Field(None, description="W&B run id (to continue a run).")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="`offline` writes the run under output_dir/wandb with no network; sync it later."
    )
    wandb_watch: Literal["false", "gradients", "parameters", "all"] | None = Field(
        None, description="Log gradient and/or parameter histograms."
    )
    wandb_log_model: Literal["false", "checkpoint", "end"] | None = Field(
        None, description="Upload checkpoints or the final model as W&B artifacts."
    )
    use_tensorboard: bool = Field(
        False, description="Log to TensorBoard (the same as report_to: tensorboard)."
    )

    @field_validator("wandb_watch", "wandb_log_model", mode="before")
    @classmethod
    def _false_is_text(cls, value: Any) -> Any:
        # Axolotl writes `wandb_watch: false`; W&B reads the text "false".
        return "false" if value is False else value

    @property
    def wandb_enabled(self) -> bool:
        return self.use_wandb or self.wandb_project is not None
