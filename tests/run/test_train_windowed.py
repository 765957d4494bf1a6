"""`cptune train` of a sliding-window model (tiny Mistral) at cp=2 logs what cp=1 logs, through the CLI.

The parity tests (tests/parallel/test_parity.py, test_ulysses_parity.py) hold the sharded attention to
cp=1; this runs the whole path a user runs: the model checks accept the windowed model for ring-flash-attn
and deepspeed (Ulysses), the trainer checks every windowed layer passed its window, and the logged
losses and gradient norms match.
"""

from __future__ import annotations

import pytest

from tests.conftest import logged, max_rel_diff, run_cptune, succeeded, write_short_run
from tests.numerics import logged_tolerance

WINDOW = 8  # keys a query sees; the quickstart rows pack documents of tens of tokens, most wider than it


def save_tiny_mistral(folder, tiny_model_dir):
    """A tiny Mistral (every layer windowed) with the tiny Llama's tokenizer."""
    from transformers import AutoTokenizer

    from devtools.tiny import build_tiny_mistral

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = build_tiny_mistral(
        len(tokenizer),
        seed=1,
        sliding_window=WINDOW,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.distributed
def test_a_sliding_window_model_trains_at_cp2_as_at_cp1(tmp_path, tiny_model_dir):
    """LoRA, packed rows of 128 tokens, SGD with accumulation 2: loss and gradient norm of every step at cp=1,
    at cp=2 with ring-flash-attn (varlen_llama3) and at cp=2 with deepspeed (Ulysses, cptune core attention)."""
    mistral = save_tiny_mistral(tmp_path / "mistral", tiny_model_dir)
    runs = {"cp1": {}, "ring": {"context_parallel_size": 2}}
    runs["ulysses"] = {"context_parallel_size": 2, "cp_backend": "deepspeed"}
    logs = {}
    for name, keys in runs.items():
        path = write_short_run(tmp_path, name, mistral, adapter="lora", lora_r=4, lora_alpha=8, **keys)
        succeeded(run_cptune("train", str(path)))
        logs[name] = {key: logged(tmp_path / name, key) for key in ("loss", "grad_norm")}
    assert len(logs["cp1"]["loss"]) == 3
    for name in ("ring", "ulysses"):
        diffs = {key: max_rel_diff(logs[name][key], logs["cp1"][key]) for key in logs["cp1"]}
        print(f"{name}: {diffs}")
        # Bound (tests/numerics.py): rows of 128 tokens, 4 a step (2 x accumulation 2).
        assert max(diffs.values()) <= logged_tolerance(128, 4), (name, diffs, logs)
