"""A router loss is refused where a CP attention without documents would let counted padding see real tokens."""

from __future__ import annotations

import pytest

from cptune.config.loader import validate_recipe
from cptune.errors import CptuneError
from cptune.parallel.backends.deepspeed_ulysses.policy import DeepSpeedUlysses
from cptune.parallel.backends.ring_flash_attn.policy import RingFlashAttn
from cptune.parallel.backends.torch_cp.policy import TorchCp
from devtools.tiny import build_tiny_mixtral

BASE = {"base_model": "unused", "datasets": [{"path": "d.jsonl"}], "context_parallel_size": 2}


def text_config(router_loss: bool = True):
    return build_tiny_mixtral(97, seed=1, output_router_logits=router_loss).config


@pytest.mark.parametrize(
    ("backend", "keys", "padding"),
    [
        (
            TorchCp(),
            {"cp_backend": "torch", "sample_packing": False, "micro_batch_size": 2},
            "micro_batch_size: 2",
        ),
        (
            TorchCp(),
            {"cp_backend": "torch", "sample_packing": False, "pad_to_sequence_len": True},
            "pad_to_sequence_len",
        ),
        (
            DeepSpeedUlysses(),
            {
                "cp_backend": "deepspeed",
                "sample_packing": False,
                "ulysses_attn_implementation": "sdpa",
                "micro_batch_size": 2,
            },
            "micro_batch_size: 2",
        ),
        (
            RingFlashAttn(),
            {"ring_attn_func": "batch_zigzag", "bf16": True, "sample_packing": False, "micro_batch_size": 2},
            "micro_batch_size: 2",
        ),
    ],
    ids=["torch-mbs2", "torch-pad-to-sequence-len", "deepspeed-sdpa-mbs2", "zigzag-mbs2"],
)
def test_padded_rows_with_a_router_loss_are_refused_with_the_reason(backend, keys, padding):
    recipe = validate_recipe({**BASE, **keys})
    with pytest.raises(CptuneError) as refused:
        backend.check_model(recipe, 2, text_config())
    message = str(refused.value)
    assert message.startswith(f"{padding}"), message
    assert "takes no document mask, so the padding would attend to the row's real tokens" in message, message


def test_one_row_per_micro_batch_or_no_router_loss_or_a_document_aware_core_is_accepted():
    torch_recipe = validate_recipe({**BASE, "cp_backend": "torch", "sample_packing": False})
    TorchCp().check_model(torch_recipe, 2, text_config())  # one row: no collator padding
    padded = validate_recipe({**BASE, "cp_backend": "torch", "sample_packing": False, "micro_batch_size": 2})
    TorchCp().check_model(padded, 2, text_config(router_loss=False))
    TorchCp().check_model(padded, 1, text_config())  # cp=1: nothing is split
    # Ulysses around cptune's document attention keeps the padding a document of its own.
    ulysses = validate_recipe({**BASE, "cp_backend": "deepspeed", "micro_batch_size": 2})
    DeepSpeedUlysses().check_model(ulysses, 2, text_config())
    # So do ring-flash-attn's varlen_llama3 (packed or not) and the zigzag ring with one row per micro batch.
    varlen = validate_recipe({**BASE, "sample_packing": False, "micro_batch_size": 2})
    RingFlashAttn().check_model(varlen, 2, text_config())
    zigzag = validate_recipe(
        {**BASE, "ring_attn_func": "batch_zigzag", "bf16": True, "sample_packing": False}
    )
    RingFlashAttn().check_model(zigzag, 2, text_config())
