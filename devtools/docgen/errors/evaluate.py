"""Troubleshooting entries of the section "cptune evaluate and merge-lora"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "cptune evaluate and merge-lora"
NOTE: str | None = None
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "evaluate-without-eval-data",
        SECTION,
        "cptune evaluate with a recipe without evaluation data",
        "evaluate: the recipe has no evaluation data; set val_set_size",
        "Set `val_set_size` (a held-out share of the training data) or `test_datasets` in the recipe, or "
        "with an override: `cptune evaluate recipe.yaml --val_set_size=0.05`.",
    ),
    Entry(
        "evaluate-checkpoint-not-a-folder",
        SECTION,
        "--checkpoint that is not a folder",
        "is not a folder; give output_dir or a checkpoint-N folder of a run.",
        "`--checkpoint` takes the folder a run saved its adapter or model in: output_dir, or one of its "
        "`checkpoint-N` folders.",
    ),
    Entry(
        "evaluate-checkpoint-incomplete",
        SECTION,
        "--checkpoint that is an incomplete checkpoint",
        "is an incomplete checkpoint (no cptune_checkpoint_complete.json matching its files: its save was "
        "interrupted).",
        "Evaluate another checkpoint (or output_dir after the run finished).",
    ),
    Entry(
        "evaluate-checkpoint-without-model",
        SECTION,
        "--checkpoint that holds neither an adapter nor a model",
        "holds neither a LoRA adapter (adapter_config.json) nor a model (config.json).",
        "Point `--checkpoint` at the folder a run saved its adapter or model in (output_dir after training, "
        "or a `checkpoint-N` folder; the message names one when the folder holds checkpoints).",
    ),
    Entry(
        "evaluate-sharded-checkpoint",
        SECTION,
        "--checkpoint that is a sharded checkpoint of an FSDP2 run",
        "is a sharded checkpoint of an FSDP2 run (each process wrote its own part of the weights), for "
        "resuming that run with `cptune train --resume`. Give the run's output_dir instead",
        "Evaluate (or merge) the run's output_dir: when an FSDP2 run ends, its model or adapter is gathered "
        "there into a standard Hugging Face folder. Its `checkpoint-N` folders hold each process's shards "
        "and the optimizer state, for `cptune train --resume` with the same number of processes.",
    ),
    Entry(
        "merge-full-fine-tune",
        SECTION,
        "cptune merge-lora for a full fine-tune",
        "merge-lora: the recipe fine-tunes the whole model (no adapter: lora)",
        "A full fine-tune saves a standalone model in output_dir already; load it directly.",
    ),
    Entry(
        "merge-without-adapter",
        SECTION,
        "cptune merge-lora before training",
        "holds no trained LoRA adapter (adapter_config.json) yet. Train first, or pass --checkpoint",
        "Train first, or pass `--checkpoint` with the folder that holds the adapter.",
    ),
    Entry(
        "merge-full-model",
        SECTION,
        "cptune merge-lora --checkpoint with a full model",
        "holds a full model, not a LoRA adapter; there is nothing to merge.",
        "That folder is already a standalone model; use it directly.",
    ),
    Entry(
        "merge-out-is-file",
        SECTION,
        "cptune merge-lora --out that is a file",
        "is a file; give the path of a folder for the merged model.",
        "Give a folder path for `--out` (it is created, or replaced if it holds an earlier merge).",
    ),
    Entry(
        "checkpoint-adapter-without-weights",
        SECTION,
        "--checkpoint that holds an adapter's config but no weights",
        "holds adapter_config.json but no weights (adapter_model.safetensors or adapter_model.bin); the save did "
        "not finish",
        "The folder has the adapter's config without its weights: a save that did not finish, or a copy that "
        "left the weight file behind. Use the run's output_dir after training, or a complete `checkpoint-N`. "
        "`cptune evaluate`, `merge-lora` and `inference` all check this before loading anything.",
    ),
    Entry(
        "checkpoint-model-without-weights",
        SECTION,
        "--checkpoint that holds a model's config but no weights",
        "holds config.json but no weights (*.safetensors or *.bin); the save did not finish or the weight files "
        "were not copied",
        "Copy the model's weight files into the folder too, or point `--checkpoint` at a complete folder.",
    ),
)

DOCUMENTED: tuple[Documented, ...] = ()
