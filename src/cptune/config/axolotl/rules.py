"""Rules and notes for the Axolotl keys of :mod:`cptune.config.axolotl.mapped`.

The rules refuse combinations that cannot work (each names the key and what to do), Axolotl plugins
one line each; :func:`axolotl_notes` says where an accepted key means something else in cptune.
:data:`cptune.config.recipe.RULES` includes :data:`COMPAT_RULES`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from cptune.config.axolotl.fsdp1 import fsdp1_notes

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe

# Attention implementations an Axolotl recipe may name (cptune picks the attention from cp_backend).
_ATTENTION_NAMES = ("flash_attention_2", "flash_attention_3", "sdpa")

Rule = Callable[["Recipe"], Iterator[tuple[str, str]]]


def _quantization(r: Recipe) -> Iterator[tuple[str, str]]:
    """Quantized base models (QLoRA).

    - `adapter: qlora` needs `load_in_4bit: true`, and `load_in_4bit: true` needs `adapter: qlora`.
    - `load_in_8bit: true` needs `adapter: lora` (LoRA on an 8-bit base).
    - `bnb_config_kwargs` needs `load_in_4bit` or `load_in_8bit`.
    - An 8-bit base is refused under FSDP2 (FSDP2 would shard bitsandbytes' 8-bit weights and lose their
      scales); a 4-bit base is sharded with the other weights when its packed weights are stored in a float
      dtype (`bnb_4bit_quant_storage`, default the training dtype), and kept whole on every rank when uint8.
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


def _adapter_extras(r: Recipe) -> Iterator[tuple[str, str]]:
    """LoRA extras.

    - `lora_model_dir` and `lora_modules_to_save` need `adapter: lora` or `qlora`.
    """
    for key in ("lora_model_dir", "lora_modules_to_save"):
        if getattr(r, key) is not None and not r.is_lora:
            yield key, "applies only with adapter: lora or qlora; remove it."


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


def _axolotl_mapped(r: Recipe) -> Iterator[tuple[str, str]]:
    """Axolotl keys cptune maps.

    - `attn_implementation` is one of `flash_attention_2`, `flash_attention_3` or `sdpa` (cptune picks the
      attention from `cp_backend`; eager, flex and others are refused).
    - `gradient_checkpointing_kwargs` may only say `use_reentrant: false`.
    - `evals_per_epoch` and `eval_steps` together are refused, and so are `saves_per_epoch` and `save_steps`.
    - `bfloat16` must agree with `bf16`, and `float16` with `fp16`.
    - `model_type` is `AutoModelForCausalLM` or a `...ForCausalLM` class (checked against the model's config
      when the model is checked).
    - `plugins` may list Axolotl's `CutCrossEntropyPlugin` and `LigerPlugin` (both map onto cptune's chunked
      loss, `cut_cross_entropy`; with `LigerPlugin` only `liger_fused_linear_cross_entropy` has an
      equivalent); every other plugin is refused.
    """
    if r.attn_implementation is not None and r.attn_implementation not in _ATTENTION_NAMES:
        yield (
            "attn_implementation",
            f"cptune does not run '{r.attn_implementation}' attention; it picks the attention from cp_backend "
            "(flash-attn kernels for ring-flash-attn, SDPA otherwise). Use flash_attention_2 or sdpa, or remove it.",
        )
    kwargs = r.gradient_checkpointing_kwargs
    if kwargs is not None and dict(kwargs) not in ({}, {"use_reentrant": False}):
        yield (
            "gradient_checkpointing_kwargs",
            f"{dict(kwargs)} is not supported: cptune checkpoints with use_reentrant: false only (the reentrant "
            "variant recomputes without the step's CP metadata); write use_reentrant: false or remove it.",
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


def _lora_kernels(r: Recipe) -> Iterator[tuple[str, str]]:
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


COMPAT_RULES: tuple[Rule, ...] = (
    _quantization,
    _adapter_extras,
    _chat_template,
    _axolotl_mapped,
    _lora_kernels,
)
"""Rules over the keys of this module; :data:`cptune.config.recipe.RULES` includes them."""


# Axolotl plugins (last part of the class path) that map onto a cptune feature: both fused losses become
# cptune's chunked head loss (Recipe.resolved_head_loss).
CUT_CROSS_ENTROPY_PLUGIN = "CutCrossEntropyPlugin"
LIGER_PLUGIN = "LigerPlugin"
MAPPED_PLUGINS = frozenset({CUT_CROSS_ENTROPY_PLUGIN, LIGER_PLUGIN})


def plugin_refusal(plugin: str) -> str:
    """The one-line refusal of an Axolotl plugin that has no cptune equivalent."""
    return (
        f"'{plugin}': cptune runs no Axolotl plugins; remove it. (CutCrossEntropyPlugin and LigerPlugin are "
        "accepted: they map onto cptune's chunked loss, cut_cross_entropy.)"
    )


# --- notes ---------------------------------------------------------------------------

_LORA_KERNEL_KEYS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel")


def axolotl_notes(r: Recipe) -> list[str]:
    """What accepted Axolotl keys mean here where that differs from Axolotl, one line each."""
    notes = []
    asked = r.attention_asked
    if asked is not None:
        notes.append(
            f"attn_implementation: {asked} is not what picks the attention in cptune: at "
            "context_parallel_size 1 it is transformers' sdpa (which keeps packed samples apart), above 1 the "
            "cp_backend's (ring-flash-attn runs flash-attn's kernels when installed; deepspeed its "
            "ulysses_attn_implementation)."
        )
    if r.tokenizer_type not in (None, "AutoTokenizer"):
        notes.append(
            f"tokenizer_type: {r.tokenizer_type} is not used: cptune loads the tokenizer class that the tokenizer "
            "folder names (AutoTokenizer)."
        )
    if r.tf32 is not None:
        notes.append(f"tf32: {str(r.tf32).lower()} applies on NVIDIA GPUs only (it has no effect on CPU).")
    if r.eval_sample_packing is not None and r.eval_sample_packing != r.sample_packing:
        notes.append(
            f"eval_sample_packing: {str(r.eval_sample_packing).lower()} is not used: evaluation rows are packed as "
            f"training rows are (sample_packing: {str(r.sample_packing).lower()}); packed samples are kept apart, "
            "so the eval loss is the same."
        )
    if r.evals_per_epoch and not (r.val_set_size or r.test_datasets):
        notes.append(
            "evals_per_epoch is not used: the recipe has no evaluation data (val_set_size, test_datasets)."
        )
    if r.fsdp_config is not None and r.fsdp_config.state_dict_type == "FULL_STATE_DICT":
        notes.append(
            "fsdp_config.state_dict_type: FULL_STATE_DICT applies to the final model only: cptune gathers it (or "
            "the adapter) into a standard Hugging Face folder in output_dir, as Axolotl does, but always writes "
            "checkpoints sharded (each rank its own part; resume with the same number of processes)."
        )
    notes += fsdp1_notes(r)
    if r.activation_offloading in ("legacy", "hidden_states"):
        notes.append(
            f"activation_offloading: {r.activation_offloading} runs cptune's own offloading: the layer inputs that "
            "gradient checkpointing keeps go to pinned host memory and come back on a side stream (exact)."
        )
    kernels = [k for k in _LORA_KERNEL_KEYS if getattr(r, k)]
    if kernels:
        notes.append(
            f"{', '.join(kernels)}: cptune runs peft's LoRA layers: the same result, without Axolotl's fused "
            "kernels." + ("" if r.is_lora else " (They apply to LoRA adapters only, in Axolotl too.)")
        )
    if r.fused_attn_kernel:
        notes.append(
            "fused_attn_kernel: cptune runs the model's own q/k RMSNorm and RoPE and the backend's attention: the "
            "same result, without Axolotl's fused kernel."
        )
    if r.strict is not None:
        notes.append("strict is not used: cptune always refuses unknown keys.")
    if (r.wandb_entity or r.wandb_name or r.wandb_mode or r.wandb_run_id) and not r.wandb_enabled:
        notes.append(
            "wandb_* keys are not used: W&B logging is on only with wandb_project or use_wandb: true."
        )
    return notes
