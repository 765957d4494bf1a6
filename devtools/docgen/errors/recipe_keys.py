"""Troubleshooting entries of the section "Recipe keys and values"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "Recipe keys and values"
NOTE: str | None = None
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "key-misspelt",
        SECTION,
        "A misspelt key",
        "sequnce_len: is not a known key. Did you mean 'sequence_len'?",
        "cptune never ignores a key it does not know (a misspelt key would otherwise silently keep its "
        "default). Use the suggested spelling.",
    ),
    Entry(
        "key-unknown",
        SECTION,
        "A key cptune does not know",
        "turbo_mode: is not a known key.",
        "Remove the key, or look up the key you meant in the recipe reference.",
    ),
    Entry(
        "key-axolotl-unsupported",
        SECTION,
        "An Axolotl key cptune does not support",
        "torch_compile: is an Axolotl key that cptune does not support",
        "The message says what cptune offers instead; remove the key. An empty value (`torch_compile:`) or "
        "`false` is accepted as not set, as in Axolotl's example recipes.",
    ),
    Entry(
        "key-axolotl-no-counterpart",
        SECTION,
        "An Axolotl key with no counterpart in cptune",
        "sage_attention: is an Axolotl key that cptune does not support: it has no counterpart in cptune",
        "Remove the key: cptune knows every key of Axolotl's schema and refuses those it has no counterpart "
        "for, so a refusal here is not a typo.",
    ),
    Entry(
        "key-axolotl-plugin",
        SECTION,
        "A key of an Axolotl integration (plugin)",
        "use_scattermoe: is a key of Axolotl's kernels integration (a plugin), which cptune does not run; remove it "
        "(an empty value, or false for a switch, is accepted as not set)",
        "Axolotl's integrations (kernels, knowledge distillation, diffusion, expert parallelism, lm_eval, "
        "SwanLab, ...) add keys for plugins listed under `plugins`; cptune runs none of them except the two loss "
        "plugins it maps (CutCrossEntropyPlugin, LigerPlugin). Remove the key; an empty value, or `false` for a "
        "switch, is accepted as not set.",
    ),
    Entry(
        "key-axolotl-other-name-clash",
        SECTION,
        "A key under both of Axolotl's names, with two values",
        "revision_of_model: is Axolotl's other name for model_revision, which the recipe also sets, to another "
        "value; keep one of the two.",
        "Axolotl reads `revision_of_model` and `model_revision`, `model_config` and `overrides_of_model_config`, as "
        "one key each; cptune does too. Given twice with different values, it cannot tell which you meant: keep "
        "one.",
    ),
    Entry(
        "quantization-config-not-mxfp4",
        SECTION,
        "A model_quantization_config other than Mxfp4Config",
        "model_quantization_config: cptune loads quantized checkpoints only with Mxfp4Config",
        "`Mxfp4Config` (with `model_quantization_config_kwargs: {dequantize: true}`) loads gpt-oss's MXFP4 "
        "checkpoints dequantized for training; other transformers quantization configs (Axolotl's "
        "`FineGrainedFP8Config`) are not supported. Remove the key to load a full-precision checkpoint, or use "
        "`load_in_4bit` with `adapter: qlora` to quantize one with bitsandbytes.",
    ),
    Entry(
        "dataset-key-misspelt",
        SECTION,
        "A misspelt key inside a dataset entry",
        "datasets[0].feild_output: is not a known key. Did you mean 'field_output'?",
        "Dataset entries are checked like the recipe itself; the key path says which entry.",
    ),
    Entry(
        "key-required-missing",
        SECTION,
        "A required key is missing",
        "base_model: is required but missing.",
        "Add the key: `base_model` (a model folder or hub id) and `datasets` have no default.",
    ),
    Entry(
        "type-not-an-integer",
        SECTION,
        "A number key holds text",
        "micro_batch_size: Input should be a valid integer, unable to parse string as an integer; got 'two'.",
        "Write the number as a number (`micro_batch_size: 2`).",
    ),
    Entry(
        "type-not-a-boolean",
        SECTION,
        "A true/false key holds something else",
        "sample_packing: Input should be a valid boolean",
        "Use `true` or `false`.",
    ),
    Entry(
        "range-lora-r",
        SECTION,
        "A value below its minimum",
        "lora_r: Input should be greater than or equal to 1; got 0.",
        "Each key's range is in the recipe reference; `lora_r` is at least 1.",
    ),
    Entry(
        "range-lora-dropout",
        SECTION,
        "A value above its maximum",
        "lora_dropout: Input should be less than 1; got 1.5.",
        "`lora_dropout` is a probability below 1.",
    ),
    Entry(
        "range-learning-rate",
        SECTION,
        "A negative learning rate",
        "learning_rate: Input should be greater than 0; got -0.0002.",
        "`learning_rate` is a positive number (e.g. `2e-4` for LoRA).",
    ),
    Entry(
        "choice-misspelt",
        SECTION,
        "A misspelt choice",
        "cp_backend: Input should be 'ring-flash-attn', 'torch' or 'deepspeed'; got 'ring-flash'. "
        "Did you mean 'ring-flash-attn'?",
        "Keys with a fixed set of values list them; use one of them.",
    ),
    Entry(
        "datasets-empty",
        SECTION,
        "No datasets",
        "datasets: List should have at least 1 item after validation, not 0; got [].",
        "List at least one dataset under `datasets`.",
    ),
    Entry(
        "datasets-not-a-list",
        SECTION,
        "datasets written as a single entry instead of a list",
        "datasets: Input should be a valid list; got {",
        "`datasets` is a list even with one dataset: start the entry with `- ` (`- path: ...`).",
    ),
    Entry(
        "override-unknown-key",
        SECTION,
        "A command-line override of a key that does not exist",
        "sequnce_len: is not a known key. Did you mean 'sequence_len'?",
        "Overrides are checked like recipe keys; use the suggested spelling.",
    ),
    Entry(
        "option-with-underscores",
        SECTION,
        "A command-line option spelt with underscores (`--nproc_per_node`)",
        "--nproc_per_node: cptune spells this option --nproc-per-node (with dashes)",
        "cptune's options are spelt with dashes; any other `--key=value` is a recipe override. Use the "
        "spelling the message gives (`cptune train --help` lists the options).",
    ),
    Entry(
        "override-malformed",
        SECTION,
        "A command-line override without a value",
        "override '--lora_r' is not of the form --key=value",
        "Overrides are `--key=value` (nested keys with dots: `--datasets.0.path=x.jsonl`).",
    ),
    Entry(
        "override-index-out-of-range",
        SECTION,
        "A command-line override of a list entry that does not exist",
        "datasets.3.path: override index '3' is out of range (list of 1)",
        "Count list entries from 0; the recipe has as many as the message says.",
    ),
    Entry(
        "override-inside-a-value",
        SECTION,
        "A command-line override of a key inside a plain value",
        "sequence_len.x: sequence_len holds a value of type int, which has no keys",
        "Only mappings and lists have keys: override the value itself (`--sequence_len=256`), or fix the "
        "key path (`--datasets.0.path=...`).",
    ),
    Entry(
        "fsdp-key-twice",
        SECTION,
        "An fsdp_config key written with and without the fsdp_ prefix",
        "'fsdp_offload_params' and 'offload_params' are the same key (with and without the fsdp_ prefix)",
        "`fsdp_config` accepts Axolotl's older `fsdp_`-prefixed spellings; keep one spelling of each key.",
    ),
    Entry(
        "attn-implementation-unsupported",
        SECTION,
        "attn_implementation cptune does not run (eager, flex_attention, ...)",
        "attn_implementation: cptune does not run 'eager' attention; it picks the attention from cp_backend",
        "cptune picks the attention from `cp_backend`; `flash_attention_2`, `flash_attention_3` and `sdpa` are "
        "accepted (validate notes what runs), other values are refused. Remove the key.",
    ),
    Entry(
        "reentrant-checkpointing",
        SECTION,
        "gradient_checkpointing_kwargs other than use_reentrant",
        "cptune checkpoints with use_reentrant: false and no other argument",
        "Keep only `use_reentrant` (`true` runs as `false`, what cptune does: the same gradients up to "
        "summation order) or remove "
        "`gradient_checkpointing_kwargs`.",
    ),
    Entry(
        "model-type-not-causal",
        SECTION,
        "model_type that is not a causal LM class",
        "model_type: 'AutoModel' is not a causal language model class",
        "Use `model_type: AutoModelForCausalLM` (or the model's `...ForCausalLM` class), or remove it.",
    ),
    Entry(
        "lora-kernel-with-dropout",
        SECTION,
        "Axolotl's fused LoRA kernel with lora_dropout",
        "Axolotl's kernel shares one dropout mask between q_proj, k_proj and v_proj, whereas peft's LoRA layers "
        "(which cptune runs) draw a mask for each projection",
        "Set `lora_dropout: 0` (what Axolotl's kernels are meant for), or `lora_qkv_kernel: false` to keep "
        "peft's dropout, a mask per projection.",
    ),
    Entry(
        "chat-template-not-built-in",
        SECTION,
        "A chat_template name cptune does not render itself",
        "chat_template: 'deepseek_v3' is not a chat template cptune renders itself",
        "Use `chat_template: tokenizer_default` when the model's tokenizer ships its template (DeepSeek-V3's "
        "does), one of the built-in names, or your own template in `chat_template_jinja`.",
    ),
    Entry(
        "message-mappings-extra-key",
        SECTION,
        "message_property_mappings beyond role and content",
        "maps name; cptune's chat messages have a role, a content and a reasoning_content only",
        "Map `role`, `content` and (for reasoning) `reasoning_content` only (e.g. `{role: from, content: value}`).",
    ),
    Entry(
        "activation-offloading-disk",
        SECTION,
        "activation_offloading: disk (Axolotl's offloading to files)",
        "activation_offloading: 'disk' (Axolotl's offloading to files) is not supported; cptune offloads to host "
        "memory with activation_offloading: true.",
        "Use `activation_offloading: true` (pinned host memory, copied on a side stream).",
    ),
    Entry(
        "activation-offloading-two-level-sharded",
        SECTION,
        "activation_offloading: two_level with FSDP2 or DeepSpeed",
        "activation_offloading: two_level with sharded weights (fsdp_version) is not built yet: its backward runs "
        "a layer's forward again outside the layer's call, where FSDP2 and DeepSpeed gather the layer's weights. "
        "Use activation_offloading: true.",
        "Use `activation_offloading: true` with sharded weights (twice the pinned host memory), or train without "
        "FSDP2/DeepSpeed: a LoRA adapter's states are small enough to replicate.",
    ),
    Entry(
        "tiled-mlp-generic-mlp",
        SECTION,
        "tiled_mlp_use_original_mlp: false",
        "tiled_mlp_use_original_mlp: cptune always tiles the model's own MLP module",
        "Remove the key: cptune tiles the model's own MLP, with its LoRA layers.",
    ),
    Entry(
        "plugins-unknown",
        SECTION,
        "An Axolotl plugin cptune has no equivalent for",
        "plugins[0]: 'axolotl.integrations.spectrum.SpectrumPlugin': cptune runs no Axolotl plugins; remove it.",
        "Remove it; each plugin gets its own line. `CutCrossEntropyPlugin` and `LigerPlugin` (with "
        "`liger_fused_linear_cross_entropy`) map onto cptune's chunked loss, `cut_cross_entropy`.",
    ),
    Entry(
        "unfrozen-row-range",
        SECTION,
        "unfrozen_parameters with Axolotl's row range (`[start:end]`)",
        "ends in Axolotl's row range [:32000], which cptune does not support",
        "cptune freezes and trains whole parameters: remove the range (`^model.embed_tokens.weight$`) to train "
        "the whole parameter. Axolotl trains such a range by zeroing the other rows' gradients, which weight decay "
        "and the optimizer's state still see.",
    ),
    Entry(
        "unfrozen-not-a-pattern",
        SECTION,
        "unfrozen_parameters entry that is not a regular expression",
        "'model.(layers' is not a regular expression (missing ), unterminated subpattern)",
        "Each entry is a regular expression matched at the start of a parameter's name (Python's `re`), its dots "
        "literal except in `.+`: close the bracket, or escape a character meant literally.",
    ),
)

DOCUMENTED: tuple[Documented, ...] = ()
