"""``merge_lora(recipe)``: fold a trained LoRA adapter into the base model and save a standalone model.

The result loads with ``AutoModelForCausalLM.from_pretrained`` alone (no peft,
no cptune): the base model's config with the merged weights, plus the tokenizer
the run saved. It runs in one process; merging is a weight update, not a
forward pass, so nothing about it depends on context parallelism. The output
folder is written beside its final place and renamed into it, so an interrupted
merge never leaves a folder that looks like a finished model.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from cptune.atomic import publish_folder
from cptune.config.recipe import Recipe
from cptune.errors import CptuneError
from cptune.models.added_tokens import fit_embeddings
from cptune.models.loading import load_model, load_tokenizer
from cptune.models.quantization import dequantize_in_place
from cptune.run.commands.weights import ADAPTER_CONFIG, model_source
from cptune.run.training.checkpoints import latest_complete_checkpoint

log = logging.getLogger("cptune.merge")

MERGED_DIR = "merged"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def merge_lora(recipe: Recipe, checkpoint: str | Path | None = None, out: str | Path | None = None) -> Path:
    """Merge the adapter in ``checkpoint`` (default: ``output_dir``) into the base model; returns the folder.

    Args:
        recipe: The recipe the adapter was trained with (its ``base_model`` and dtype).
        checkpoint: ``output_dir`` or a complete ``checkpoint-N`` folder holding the adapter.
        out: Where to save the merged model; default ``output_dir/merged``. Replaced if it exists.

    Raises:
        CptuneError: no adapter at ``checkpoint``, or ``out`` is a file.
    """
    from peft import PeftModel

    if checkpoint is None and not recipe.is_lora:
        raise CptuneError(
            "merge-lora: the recipe fine-tunes the whole model (no adapter: lora), so output_dir already "
            "holds a standalone model; there is no adapter to merge."
        )
    if checkpoint is None:
        checkpoint = Path(recipe.output_dir)
        if not (checkpoint / ADAPTER_CONFIG).is_file():
            latest = latest_complete_checkpoint(checkpoint)
            hint = f" (e.g. --checkpoint {latest})" if latest is not None else ""
            raise CptuneError(
                f"merge-lora: output_dir '{checkpoint}' holds no trained LoRA adapter ({ADAPTER_CONFIG}) yet. "
                f"Train first, or pass --checkpoint with the folder that holds the adapter{hint}."
            )
    source = model_source(checkpoint)
    if source.kind != "adapter" or source.path is None:
        raise CptuneError(
            f"merge-lora: '{source.path}' holds a full model, not a LoRA adapter; there is nothing to merge. "
            "Use that folder as the model directly."
        )
    target = Path(out) if out is not None else Path(recipe.output_dir) / MERGED_DIR
    if target.exists() and not target.is_dir():
        raise CptuneError(f"--out: '{target}' is a file; give the path of a folder for the merged model.")
    # The tokenizer the run saved beside the adapter (its pad token included), else the recipe's.
    has_tokenizer = any((source.path / name).is_file() for name in TOKENIZER_FILES)
    if has_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=recipe.trust_remote_code)
    else:
        tokenizer = load_tokenizer(recipe)
    # transformers' own attention (sdpa, or eager where the model has none): the saved model must not name
    # cptune's CP attention.
    base = load_model(recipe, None)
    if recipe.is_quantized:
        # The adapter was trained on the quantized weights: merge it into those, dequantized, so the
        # merged model computes what the trained one did (not into the original weights).
        base = dequantize_in_place(base)
        log.info("dequantized the %s base model to %s before merging", _bits(recipe), base.dtype)
    fit_embeddings(base, tokenizer, recipe)  # as training grew them: the adapter saved the grown embeddings
    merged = PeftModel.from_pretrained(base, str(source.path)).merge_and_unload()
    if not recipe.causal:
        log.warning(
            "the adapter was trained with bidirectional attention (causal: false); the merged model loads "
            "with the model class's own (causal) attention unless you choose another when you load it."
        )

    # A dequantized model must not claim the quantization it no longer has.
    if getattr(merged.config, "quantization_config", None) is not None:
        del merged.config.quantization_config
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    merged.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    publish_folder(staging, target)
    # The base model's own files are only read: the merged weights are a new model in target.
    log.info(
        "merged the adapter in %s with the base model %s; wrote the merged model to %s",
        source.path,
        recipe.base_model,
        target,
    )
    return target


def _bits(recipe: Recipe) -> str:
    return "4-bit" if recipe.load_in_4bit else "8-bit"
