"""A launched rank leaves bitsandbytes unimported unless its recipe quantizes or uses its optimizers."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from cptune.config.loader import validate_recipe
from cptune.run.training.unused_imports import leave_out_bitsandbytes, uses_bitsandbytes


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """A local model folder saved unquantized (a hub id not in the local cache would keep bitsandbytes)."""
    folder = tmp_path_factory.mktemp("plain-model")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(folder)


@pytest.fixture(autouse=True)
def _base(plain_model, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "BASE", plain_model)


BASE = ""


def recipe(**keys):
    return validate_recipe({"base_model": BASE, "datasets": [{"path": "d.jsonl"}], **keys})


@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"adapter": "lora"},
        {"optimizer": "adamw_torch"},
        {"optimizer": "sgd"},
        {"optimizer": "adamw_torch_8bit"},
    ],
    ids=["full", "lora", "adamw_torch", "sgd", "torchao-8bit"],
)
def test_a_recipe_without_quantization_or_bitsandbytes_optimizer_leaves_it_out(keys):
    modules: dict = {}
    assert not uses_bitsandbytes(recipe(**keys))
    assert leave_out_bitsandbytes([recipe(**keys)], modules)
    assert modules == {
        "bitsandbytes": None
    }  # `import bitsandbytes` raises ImportError, find_spec answers None


@pytest.mark.parametrize(
    "keys",
    [
        {"adapter": "qlora", "load_in_4bit": True},
        {"adapter": "lora", "load_in_8bit": True},
        {"optimizer": "adamw_bnb_8bit"},
        {"optimizer": "paged_adamw_32bit"},
        {"optimizer": "lion_8bit"},
    ],
    ids=["qlora", "lora-8bit", "adamw_bnb_8bit", "paged", "lion_8bit"],
)
def test_a_recipe_that_uses_bitsandbytes_keeps_it(keys):
    modules: dict = {}
    assert uses_bitsandbytes(recipe(**keys))
    assert not leave_out_bitsandbytes([recipe(**keys)], modules)
    assert modules == {}


def test_one_recipe_of_several_that_uses_it_keeps_it():
    """A test worker trains several recipes in one process (tests/run/train_worker.py)."""
    modules: dict = {}
    assert not leave_out_bitsandbytes([recipe(), recipe(optimizer="adamw_bnb_8bit")], modules)
    assert modules == {}


def test_an_imported_bitsandbytes_is_left_alone():
    imported = object()
    modules = {"bitsandbytes": imported}
    assert not leave_out_bitsandbytes([recipe()], modules)
    assert modules["bitsandbytes"] is imported


def test_left_out_reads_as_not_installed(monkeypatch):
    """How transformers, peft and accelerate ask (importlib.util.find_spec) sees no bitsandbytes."""
    import sys

    # Undone in reverse after the test: whatever sys.modules held for it before comes back.
    monkeypatch.setitem(sys.modules, "bitsandbytes", "placeholder")
    monkeypatch.delitem(sys.modules, "bitsandbytes")
    leave_out_bitsandbytes([recipe()], sys.modules)
    assert importlib.util.find_spec("bitsandbytes") is None
    with pytest.raises(ImportError):
        import bitsandbytes  # noqa: F401


def test_the_cptune_program_leaves_it_out_and_a_users_call_of_main_does_not(write_recipe, monkeypatch):
    """``cptune validate`` as this process's program (``main()`` reads sys.argv) leaves bitsandbytes out
    for a LoRA recipe; ``main(argv)`` from a user's process (a notebook, ``cptune_in_process``) does not."""
    import logging
    import sys

    from cptune.cli import main

    recipe = str(write_recipe())
    handlers = list(logging.root.handlers)
    # Undone after the test, whatever sys.modules held for it before (the placeholder records that).
    monkeypatch.setitem(sys.modules, "bitsandbytes", "placeholder")
    monkeypatch.delitem(sys.modules, "bitsandbytes")
    try:
        # First: a user's call may import peft here, with bitsandbytes as installed.
        main(["validate", recipe])
        assert sys.modules.get("bitsandbytes", "not imported") is not None
        monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
        monkeypatch.setattr(sys, "argv", ["cptune", "validate", recipe])
        main()
        assert "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None
    finally:
        logging.root.handlers[:] = handlers  # main() adds a handler bound to this test's stderr


def test_a_model_saved_quantized_keeps_it(tmp_path, monkeypatch):
    """A pre-quantized base (its config.json carries a quantization_config, as a ``-bnb-4bit`` hub model's does),
    or a checkpoint saved so, loads through bitsandbytes whatever the recipe says: it stays importable."""
    plain, quantized, adapter = (tmp_path / name for name in ("plain", "quantized", "adapter"))
    for folder, config in (
        (plain, {}),
        (quantized, {"quantization_config": {"quant_method": "bitsandbytes"}}),
    ):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert not uses_bitsandbytes(recipe(base_model=str(plain)))
    assert not uses_bitsandbytes(recipe(base_model=str(plain)), models=[adapter])
    assert uses_bitsandbytes(recipe(base_model=str(quantized)))
    assert uses_bitsandbytes(recipe(base_model=str(plain)), models=[quantized])
    modules: dict = {}
    assert not leave_out_bitsandbytes([recipe(base_model=str(plain))], modules, models=[quantized])
    assert modules == {}
    # A hub id whose config is not in the local cache is unknown until the run downloads it: kept.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert uses_bitsandbytes(recipe(base_model="someone/some-model-bnb-4bit"))
