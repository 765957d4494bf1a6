"""Local models for Axolotl's recipes: the tiny Llama, and the same weights as a tiny Mistral."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    """Model folders by family: Axolotl's Mistral recipes name MistralForCausalLM in model_type."""
    import torch
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    c = llama.config
    config = MistralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        sliding_window=None,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    mistral = MistralForCausalLM(config)
    mistral.load_state_dict(llama.state_dict())  # the same layers under the same names
    folder = tmp_path_factory.mktemp("tiny-mistral")
    mistral.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, folder / name)
    return {"llama": tiny_model_dir, "mistral": folder}
