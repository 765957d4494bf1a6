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


def test_overrides_of_model_config_turn_on_a_moe_models_router_loss(tmp_path):
    from cptune.models.loading import model_config
    from cptune.parallel.router_loss import RouterBalance
    from devtools.tiny import build_tiny_qwen3_moe

    folder = tmp_path / "moe"
    build_tiny_qwen3_moe(97, seed=1, output_router_logits=False).save_pretrained(folder)
    assert RouterBalance.from_config(model_config(recipe_for(folder))) is None
    recipe = validate_recipe(
        {
            "base_model": str(folder),
            "datasets": [{"path": "d.jsonl"}],
            "overrides_of_model_config": {"output_router_logits": True, "router_aux_loss_coef": 0.05},
        }
    )
    assert RouterBalance.from_config(model_config(recipe)) == RouterBalance(coef=0.05, num_experts=4, top_k=2)


def test_an_override_of_a_field_the_config_lacks_is_refused(tiny_model_dir):
    from cptune.models.loading import model_config

    recipe = validate_recipe(
        {
            "base_model": str(tiny_model_dir),
            "datasets": [{"path": "d.jsonl"}],
            "overrides_of_model_config": {"output_router_logits": True},
        }
    )
    with pytest.raises(
        CptuneError, match=r"overrides_of_model_config: LlamaConfig has no field 'output_router_logits'"
    ):
        model_config(recipe)


def test_gradient_checkpointing_is_turned_on_without_a_deprecation_warning(tiny_model_dir):
    """transformers 5.23 renamed gradient_checkpointing_enable (a FutureWarning in every rank's log of a
    recipe that checkpoints); cptune calls activation_checkpointing_enable, as non-reentrant as before."""
    import warnings

    recipe = validate_recipe(
        {"base_model": str(tiny_model_dir), "datasets": [{"path": "d.jsonl"}], "gradient_checkpointing": True}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_model(recipe, "sdpa")
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    for layer in model.model.layers:
        assert layer.gradient_checkpointing
        assert layer._gradient_checkpointing_func.keywords == {"use_reentrant": False}
