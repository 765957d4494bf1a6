"""Catalogue cases of the section "cptune evaluate and merge-lora" (their text: devtools/docgen/errors/evaluate.py)."""

from __future__ import annotations

from tests.reliability.catalogue.framework import DELETE, Case
from tests.reliability.catalogue.setups import (
    _adapter_folder,
    _adapter_without_weights,
    _full_model_folder,
    _incomplete_checkpoint,
    _model_folder_without_weights,
    _sharded_checkpoint,
)

CASES: tuple[Case, ...] = (
    Case(
        "evaluate-without-eval-data",
        command="evaluate",
    ),
    Case(
        "evaluate-checkpoint-not-a-folder",
        keys={"val_set_size": 0.1},
        command="evaluate",
        args=("--checkpoint", "{ws}/no-such-checkpoint"),
    ),
    Case(
        "evaluate-checkpoint-incomplete",
        keys={"val_set_size": 0.1},
        command="evaluate",
        args=("--checkpoint", "{ws}/out/checkpoint-4"),
        setup=_incomplete_checkpoint,
    ),
    Case(
        "evaluate-checkpoint-without-model",
        keys={"val_set_size": 0.1},
        command="evaluate",
        args=("--checkpoint", "{ws}/out"),
    ),
    Case(
        "evaluate-sharded-checkpoint",
        keys={"val_set_size": 0.1},
        command="evaluate",
        args=("--checkpoint", "{ws}/out/checkpoint-2"),
        setup=_sharded_checkpoint,
    ),
    Case(
        "merge-full-fine-tune",
        keys={"adapter": DELETE},
        command="merge-lora",
    ),
    Case(
        "merge-without-adapter",
        command="merge-lora",
    ),
    Case(
        "merge-full-model",
        command="merge-lora",
        args=("--checkpoint", "{ws}/full-model"),
        setup=_full_model_folder,
    ),
    Case(
        "merge-out-is-file",
        command="merge-lora",
        args=("--checkpoint", "{ws}/adapter", "--out", "{ws}/merged.txt"),
        setup=_adapter_folder,
    ),
    Case(
        "checkpoint-adapter-without-weights",
        command="inference",
        args=("--checkpoint", "{ws}/adapter-no-weights", "--prompt", "Say hello."),
        setup=_adapter_without_weights,
    ),
    Case(
        "checkpoint-model-without-weights",
        keys={"val_set_size": 0.1},
        command="evaluate",
        args=("--checkpoint", "{ws}/model-no-weights"),
        setup=_model_folder_without_weights,
    ),
)
