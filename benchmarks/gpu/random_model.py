"""Save a Llama-3.1-8B-shaped model with random bf16 weights, for GPU runs without the hub.

Usage (on a GPU machine)::

    python -m benchmarks.gpu.random_model /tmp/llama8b

Memory and speed depend on the shapes, not on the weights, so the GPU script
(:mod:`benchmarks.gpu.run_gpu`) measures the same on this folder as on the real
model. The tokenizer is a word-level one with Llama 3's 128,256 ids (``t0`` ...),
so the script's pretokenized rows may use every id; it is not meant for text.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from benchmarks.gpu.flops import LLAMA_31_8B


def main(argv: list[str] | None = None) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path((sys.argv[1:] if argv is None else argv)[0])
    started = time.perf_counter()
    shape = LLAMA_31_8B
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape.vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token="t1", bos_token="t2", pad_token="t3"
    )
    tokenizer.save_pretrained(out)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"{billions:.2f}B-parameter model saved to {out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
