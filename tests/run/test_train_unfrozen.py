"""A run with unfrozen_parameters: one optimizer step moves exactly the selected weights, as freezing by hand does."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from cptune.run.training import train as train_module
from tests.conftest import logged_losses
from tests.numerics import logged_tolerance
from tests.run.test_train_fsdp import train_in_one_launch

# What the patterns select in the tiny Llama, written out by hand for the reference run.
PATTERNS = ["model.layers.1.mlp", "^lm_head.weight$", "model.layers.+.input_layernorm"]
SELECTED = {
    "model.layers.1.mlp.gate_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "lm_head.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.1.input_layernorm.weight",
}


def full_finetune(write_recipe, folder, name: str, **keys):
    # Weight decay and clipping act on the trained parameters only: a frozen weight must not decay either.
    defaults = {"adapter": None, "max_steps": 1, "weight_decay": 0.1, "learning_rate": 0.01}
    return write_recipe(f"{name}.yaml", **{**defaults, "output_dir": str(folder / name), **keys})


def test_one_step_moves_only_the_selected_weights_bit_exactly_as_freezing_by_hand(
    write_recipe, tiny_model_dir, tmp_path, cptune_in_process, monkeypatch
):
    base = load_file(tiny_model_dir / "model.safetensors")
    assert set(base) > SELECTED

    done = cptune_in_process(
        "train", str(full_finetune(write_recipe, tmp_path, "unfrozen", unfrozen_parameters=PATTERNS))
    )
    assert done.returncode == 0, done.stderr[-3000:]
    unfrozen = load_file(tmp_path / "unfrozen" / "model.safetensors")

    # The reference: the same recipe without the key, its model frozen by hand where cptune loads it.
    load_model = train_module.load_model

    def frozen_by_hand(*args, **kwargs):
        model = load_model(*args, **kwargs)
        for name, param in model.named_parameters():
            param.requires_grad_(name in SELECTED)
        return model

    monkeypatch.setattr(train_module, "load_model", frozen_by_hand)
    done = cptune_in_process("train", str(full_finetune(write_recipe, tmp_path, "by-hand")))
    assert done.returncode == 0, done.stderr[-3000:]
    by_hand = load_file(tmp_path / "by-hand" / "model.safetensors")

    assert set(unfrozen) == set(by_hand) == set(base)
    for name, before in base.items():
        if name in SELECTED:
            assert not torch.equal(unfrozen[name], before), f"{name} did not train"
            assert torch.equal(unfrozen[name], by_hand[name]), name
        else:
            assert torch.equal(unfrozen[name], before), f"{name} is frozen but changed"


def test_validate_counts_only_the_selected_parameters_as_trained(
    write_recipe, tiny_model_dir, tmp_path, cptune_in_process
):
    base = load_file(tiny_model_dir / "model.safetensors")
    total, head = sum(t.numel() for t in base.values()), base["lm_head.weight"].numel()
    recipe = full_finetune(write_recipe, tmp_path, "validate", unfrozen_parameters=["^lm_head.weight$"])
    done = cptune_in_process("validate", str(recipe))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{total:,} parameters, {head:,} trained (unfrozen_parameters)" in done.stdout


@pytest.mark.distributed
def test_cp2_under_fsdp2_trains_the_selected_weights_as_one_process_does(
    write_recipe, tiny_model_dir, tmp_path, cptune_in_process
):
    """FSDP2 shards frozen and trained parameters of one layer together; cp=2 splits each row over 2 ranks.

    SGD (its update is the learning rate times the gradient), 2 steps of one 128-token row: the logged losses
    and the selected weights' updates within the gradients' bound (tests/numerics.py), the frozen weights
    bit-identical to the base model's.
    """
    keys = {
        "optimizer": "sgd",
        "learning_rate": 0.05,
        "weight_decay": 0.0,
        "max_steps": 2,
        "micro_batch_size": 1,
    }
    keys.update(unfrozen_parameters=PATTERNS, dataset_prepared_path=str(tmp_path / "prepared"))
    reference = full_finetune(write_recipe, tmp_path, "reference", **keys)
    done = cptune_in_process("train", str(reference))
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = full_finetune(
        write_recipe, tmp_path, "sharded", context_parallel_size=2, fsdp_version=2, **keys
    )
    ranks = train_in_one_launch(2, tmp_path / "launch", sharded)["sharded"]
    # Each rank holds half of every weight: FSDP2 sharded the frozen and the trained ones.
    assert all(2 * rank["weight_bytes"] == rank["model_weight_bytes"] for rank in ranks), ranks

    tolerance = logged_tolerance(128, 1)
    expected = logged_losses(tmp_path / "reference")
    assert len(expected) == 2
    assert max(
        abs(a - b) / abs(b) for a, b in zip(logged_losses(tmp_path / "sharded"), expected, strict=True)
    ) <= (tolerance)
    base = load_file(tiny_model_dir / "model.safetensors")
    got, want = (
        load_file(tmp_path / "sharded" / "model.safetensors"),
        load_file(tmp_path / "reference" / "model.safetensors"),
    )
    for name, before in base.items():
        if name in SELECTED:
            update, expected_update = got[name] - before, want[name] - before
            assert float(expected_update.abs().max()) > 0, name
            assert float((update - expected_update).abs().max() / expected_update.abs().max()) <= tolerance, (
                name
            )
        else:
            assert torch.equal(got[name], before), f"{name} is frozen but changed"
