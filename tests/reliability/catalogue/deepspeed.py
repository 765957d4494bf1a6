"""Catalogue cases of the section "DeepSpeed (cp_backend: deepspeed)" (their text: devtools/docgen/errors/deepspeed.py)."""

from __future__ import annotations

from tests.reliability.catalogue.framework import Case
from tests.reliability.catalogue.setups import (
    DEEPSPEED_CP,
    _deepspeed_json,
    _sliding_window_model,
    _twelve_heads_model,
    _with_flash_attn,
    _without_deepspeed,
)

CASES: tuple[Case, ...] = (
    Case(
        "ulysses-kv-heads",
        keys={"cp_backend": "deepspeed", "context_parallel_size": 3},
        args=("--nproc-per-node", "3"),
        setup=_twelve_heads_model,
    ),
    Case(
        "ulysses-sliding-window",
        keys={**DEEPSPEED_CP, "ulysses_attn_implementation": "sdpa", "sample_packing": False},
        setup=_sliding_window_model,
    ),
    Case(
        "deepspeed-json-optimizer",
        setup=lambda ws: _deepspeed_json(ws, '{"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}'),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-batch-size",
        setup=lambda ws: _deepspeed_json(ws, '{"train_micro_batch_size_per_gpu": 4}'),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-train-batch-size",
        setup=lambda ws: _deepspeed_json(ws, '{"train_batch_size": 16}'),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-zero-stage",
        setup=lambda ws: _deepspeed_json(ws, '{"zero_optimization": {"stage": 3}}', zero_stage=2),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-invalid",
        setup=lambda ws: _deepspeed_json(ws, "{'zero_optimization': {'stage': 2}}"),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-not-an-object",
        setup=lambda ws: _deepspeed_json(ws, '[{"zero_optimization": {"stage": 2}}]'),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-missing",
        setup=lambda ws: {**DEEPSPEED_CP, "deepspeed": str(ws.root / "no-such-ds-config.json")},
        skip_if=_without_deepspeed,
    ),
    Case(
        "ulysses-flash-attn-missing",
        keys={**DEEPSPEED_CP, "ulysses_attn_implementation": "flash_attention_2", "sample_packing": False},
        skip_if=_with_flash_attn,
    ),
)
