"""Fixtures for the data tests: a tiny tokenizer, recipes and data files in a temp dir."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from cptune.config.recipe import Recipe
from devtools.tiny import GENERIC_CORPUS, build_tiny_tokenizer

# Texts the tokenizer is trained on; the data below reuses their words so that
# rows encode into real merges, not only bytes.
TOKENIZER_TEXTS = (
    *GENERIC_CORPUS,
    "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\nThe sum is 5.",
    "Hello! How are you? I am fine, thank you.",
)


@pytest.fixture(scope="session")
def tokenizer_texts() -> tuple[str, ...]:
    """The texts the ``tokenizer`` fixture was trained on (to rebuild it in another process)."""
    return TOKENIZER_TEXTS


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE tokenizer with a ChatML template (bos <s>, eos </s>)."""
    return build_tiny_tokenizer(TOKENIZER_TEXTS)


@pytest.fixture
def make_recipe(tmp_path: Path) -> Callable[..., Recipe]:
    """Build a Recipe whose cache lives in tmp_path; keyword arguments override its keys."""

    def make(datasets: list[dict[str, Any]], **overrides: Any) -> Recipe:
        keys: dict[str, Any] = {
            "base_model": "tiny",
            "datasets": datasets,
            "dataset_prepared_path": str(tmp_path / "prepared"),
            "sequence_len": 256,
        }
        keys.update(overrides)
        return Recipe(**keys)

    return make
