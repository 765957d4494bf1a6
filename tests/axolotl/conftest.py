"""Local models for Axolotl's recipes: the tiny Llama, and the same weights as a tiny Mistral and a tiny Qwen2."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    """Model folders by family: Axolotl's Mistral recipes name MistralForCausalLM in model_type, and its Qwen2
    recipe wraps Qwen2DecoderLayer with FSDP."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    llama = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    c = llama.config
    shared = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "sliding_window": None,
        "tie_word_embeddings": c.tie_word_embeddings,
    }
    folders = {"llama": tiny_model_dir}
    for family, config, model_class in (
        ("mistral", MistralConfig(**shared), MistralForCausalLM),
        ("qwen2", Qwen2Config(**shared, use_sliding_window=False), Qwen2ForCausalLM),
    ):
        model = model_class(config)
        # The same layers under the same names; Qwen2's q/k/v biases (not in Llama) start at zero.
        missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
        assert not unexpected and all(name.endswith("_proj.bias") for name in missing)
        with torch.no_grad():
            for name in missing:
                model.get_parameter(name).zero_()
        folders[family] = tmp_path_factory.mktemp(f"tiny-{family}")
        model.save_pretrained(folders[family])
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tiny_model_dir / name).is_file():
                shutil.copy(tiny_model_dir / name, folders[family] / name)
    return folders
