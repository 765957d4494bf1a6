"""Troubleshooting entries of the section "DeepSpeed (cp_backend: deepspeed)"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "DeepSpeed (cp_backend: deepspeed)"
NOTE: str | None = None
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "ulysses-kv-heads",
        SECTION,
        "Key/value heads not divisible for DeepSpeed Ulysses",
        "context_parallel_size: 3 neither divides nor is a multiple of the model's 4 key/value heads",
        "Ulysses splits key/value heads across the ranks (or copies them when there are fewer): choose a "
        "context_parallel_size the message lists, or `cp_backend: ring-flash-attn`.",
    ),
    Entry(
        "ulysses-sliding-window",
        SECTION,
        "A sliding-window model with DeepSpeed Ulysses and sdpa",
        "which cp_backend: deepspeed with ulysses_attn_implementation: sdpa cannot compute exactly: DeepSpeed's "
        "Ulysses wrapper drops the attention mask",
        "sdpa gets its window from the mask DeepSpeed drops. Use `ulysses_attn_implementation: cptune` (the "
        "default, exact on CPU and GPU, causal) or `flash_attention_2` on GPUs.",
    ),
    Entry(
        "deepspeed-json-optimizer",
        SECTION,
        "A DeepSpeed JSON with an optimizer or scheduler section",
        "has an 'optimizer' section; cptune takes the optimizer and learning-rate schedule from the recipe",
        "Remove the section; set `optimizer`, `learning_rate`, `lr_scheduler` and `warmup_*` in the recipe.",
    ),
    Entry(
        "deepspeed-json-batch-size",
        SECTION,
        "A DeepSpeed JSON whose batch size contradicts the recipe",
        'sets train_micro_batch_size_per_gpu: 4, but the recipe\'s micro_batch_size is 2. Set it to "auto" '
        "(or remove it): cptune fills it from the recipe.",
        'cptune fills the batch sizes, accumulation and clipping from the recipe: set them to `"auto"` in '
        "the JSON or remove them.",
    ),
    Entry(
        "deepspeed-json-train-batch-size",
        SECTION,
        "A DeepSpeed JSON that sets train_batch_size",
        'sets train_batch_size; set it to "auto" (or remove it)',
        "The global batch follows from `micro_batch_size`, `gradient_accumulation_steps` and the number of "
        "processes; remove it from the JSON.",
    ),
    Entry(
        "deepspeed-json-zero-stage",
        SECTION,
        "zero_stage contradicts the DeepSpeed JSON",
        "zero_stage: 2 contradicts zero_optimization.stage: 3 in deepspeed:",
        "Set the ZeRO stage in one place: `zero_stage` in the recipe or `zero_optimization.stage` in the JSON.",
    ),
    Entry(
        "deepspeed-json-invalid",
        SECTION,
        "A DeepSpeed JSON that is not valid JSON",
        "' is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
        "Fix the JSON at the line and column shown (JSON needs double quotes and no trailing commas).",
    ),
    Entry(
        "deepspeed-json-not-an-object",
        SECTION,
        "A DeepSpeed JSON that is not an object",
        "must hold a JSON object (a DeepSpeed config).",
        "A DeepSpeed config is one JSON object (`{...}`) at the top level.",
    ),
    Entry(
        "deepspeed-json-missing",
        SECTION,
        "The DeepSpeed JSON does not exist",
        "deepspeed: cannot read the DeepSpeed config",
        "Fix the path of `deepspeed` (relative paths are read from the folder you run cptune in).",
    ),
    Entry(
        "ulysses-flash-attn-missing",
        SECTION,
        "Ulysses with flash_attention_2 where flash-attn is not installed",
        "ulysses_attn_implementation: flash_attention_2 needs flash-attn on a CUDA GPU, which is not "
        "available here.",
        "Use `ulysses_attn_implementation: cptune` (the default, exact everywhere), or install flash-attn on "
        "a CUDA machine (`pip install 'cptune[flash-attn]'`).",
    ),
)

DOCUMENTED: tuple[Documented, ...] = ()
