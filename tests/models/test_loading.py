"""Loading the model a recipe names: damaged weight files are the user's to fix, not tracebacks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from cptune.config.loader import validate_recipe
from cptune.errors import CptuneError
from cptune.models.loading import check_local_weights, load_model


def recipe_for(folder: Path):
    return validate_recipe({"base_model": str(folder), "datasets": [{"path": "d.jsonl"}]})


def copy_truncated(tiny_model_dir: Path, folder: Path, name: str, fraction: float) -> Path:
    folder.mkdir()
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    data = (tiny_model_dir / "model.safetensors").read_bytes()
    if name.endswith(".bin"):
        from safetensors.torch import load_file

        torch.save(load_file(tiny_model_dir / "model.safetensors"), folder / name)
        data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[: int(len(data) * fraction)])
    return folder


@pytest.mark.parametrize("fraction", [0.0001, 0.9], ids=["header-cut", "data-cut"])
def test_a_truncated_safetensors_file_is_refused_before_loading(tiny_model_dir, tmp_path, fraction):
    folder = copy_truncated(tiny_model_dir, tmp_path / "model", "model.safetensors", fraction)
    with pytest.raises(CptuneError, match=r"model\.safetensors' is damaged or incomplete \(Error while"):
        check_local_weights(recipe_for(folder))


def test_complete_weights_pass_the_check(tiny_model_dir):
    check_local_weights(recipe_for(tiny_model_dir))


def test_a_damaged_weight_file_is_a_clear_error_when_loading(tiny_model_dir, tmp_path):
    """A .bin file cannot be checked cheaply beforehand; loading it says what is wrong, without a traceback."""
    folder = copy_truncated(tiny_model_dir, tmp_path / "model", "pytorch_model.bin", 0.5)
    with pytest.raises(CptuneError, match=r"base_model: cannot load '.*' \(PytorchStreamReader failed"):
        load_model(recipe_for(folder), "sdpa")
