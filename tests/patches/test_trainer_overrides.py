"""CptuneTrainer's overrides of private Trainer members are checked like patches."""

from __future__ import annotations

import ast
import inspect

import pytest
import transformers.trainer

from cptune.errors import PatchError
from cptune.patches.overrides import check_overrides
from cptune.patches.transformers_patches import TRAINER_OVERRIDES
from cptune.run.training import trainer as trainer_module
from cptune.run.training.preference_trainer import PreferenceTrainer


def test_the_installed_transformers_fits_every_override():
    plan = check_overrides(TRAINER_OVERRIDES)
    assert plan.ok, plan.describe()


@pytest.mark.parametrize("subclass", [trainer_module.CptuneTrainer, PreferenceTrainer])
def test_every_private_trainer_member_cptune_touches_is_declared(subclass):
    """An override or call of a private Trainer member in cptune's Trainers without a declaration fails here."""
    source = inspect.getsource(subclass)
    cls = ast.parse(source).body[0]
    trainer_members = set(vars(transformers.trainer.Trainer))
    overridden = {node.name for node in cls.body if isinstance(node, ast.FunctionDef)}
    called = {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    }
    private = {
        name
        for name in (overridden | called) & trainer_members
        if name.startswith("_") and not name.startswith("__")
    }
    declared = {override.target.rpartition(".")[2] for override in TRAINER_OVERRIDES}
    assert private <= declared, f"declare in TRAINER_OVERRIDES: {sorted(private - declared)}"


def test_a_changed_signature_stops_the_trainer_before_it_is_built(monkeypatch):
    def _get_output_dir(self, run):  # upstream renamed the parameter
        return "out"

    monkeypatch.setattr(transformers.trainer.Trainer, "_get_output_dir", _get_output_dir)
    with pytest.raises(
        PatchError, match=r"CptuneTrainer\._get_output_dir .*signature drift: parameters \['trial'\]"
    ):
        trainer_module.CptuneTrainer(backend_factory=None, cp_size=1)
