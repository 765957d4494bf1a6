"""Mistakes with resume, evaluate and merge-lora fail before any work, with one clear message."""

from __future__ import annotations

import pytest

from cptune.config.loader import load_recipe
from cptune.errors import CptuneError
from tests.conftest import run_cptune
from tests.run.test_cli_errors import assert_clean_failure


@pytest.mark.e2e
def test_resume_without_a_complete_checkpoint(write_recipe, tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-4").mkdir(parents=True)  # e.g. a save that was interrupted
    done = run_cptune("train", str(write_recipe(context_parallel_size=2)), "--resume")
    assert_clean_failure(
        done, "resume_from_checkpoint: there is no complete checkpoint", "incomplete, ignored: checkpoint-4"
    )
    assert not (out / "train_log.json").exists()


def test_evaluate_without_evaluation_data(write_recipe):
    from cptune.run.commands.evaluate import check_eval_data

    with pytest.raises(CptuneError, match="evaluate: the recipe has no evaluation data"):
        check_eval_data(load_recipe(write_recipe()))


def test_evaluate_an_incomplete_checkpoint_or_a_folder_without_a_model(tmp_path):
    from cptune.run.commands.weights import model_source

    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "adapter_config.json").write_text("{}")
    with pytest.raises(CptuneError, match="is an incomplete checkpoint"):
        model_source(tmp_path / "checkpoint-3")
    with pytest.raises(CptuneError, match="holds neither a LoRA adapter"):
        model_source(tmp_path)


def test_evaluate_a_sharded_checkpoint_points_to_the_gathered_model(tmp_path):
    from cptune.run.commands.weights import model_source
    from cptune.run.training.checkpoints import write_marker

    checkpoint = tmp_path / "checkpoint-2"
    (checkpoint / "pytorch_model_fsdp_0").mkdir(parents=True)
    (checkpoint / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"shard")
    write_marker(checkpoint, 2)
    with pytest.raises(
        CptuneError, match=r"is a sharded checkpoint of an FSDP2 run .* Give the run's output_dir"
    ):
        model_source(checkpoint)


def test_merge_without_an_adapter_or_for_a_full_fine_tune(write_recipe):
    from cptune.run.commands.merge import merge_lora

    with pytest.raises(CptuneError, match="holds no trained LoRA adapter"):
        merge_lora(load_recipe(write_recipe()))
    with pytest.raises(CptuneError, match="fine-tunes the whole model"):
        merge_lora(load_recipe(write_recipe("full.yaml", adapter=None)))
