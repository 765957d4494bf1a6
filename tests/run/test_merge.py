"""``cptune merge-lora``: what it says it did is what it did."""

from __future__ import annotations

import logging
from pathlib import Path

from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from cptune.config.loader import load_recipe
from cptune.run.commands.merge import merge_lora


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_merge_says_where_the_merged_model_went_and_leaves_the_base_alone(
    write_recipe, tiny_model_dir, tmp_path, caplog
):
    recipe = load_recipe(write_recipe())
    # An untrained adapter is enough: the message and the files are what is checked here.
    adapter = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    adapter.save_pretrained(recipe.output_dir)
    base_before = _files(tiny_model_dir)
    with caplog.at_level(logging.INFO, logger="cptune"):
        target = merge_lora(recipe)
    assert target == Path(recipe.output_dir) / "merged"
    assert (target / "config.json").is_file()
    assert _files(tiny_model_dir) == base_before
    merged_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("merged")]
    assert merged_lines == [
        f"merged the adapter in {recipe.output_dir} with the base model {tiny_model_dir}; "
        f"wrote the merged model to {target}"
    ]
