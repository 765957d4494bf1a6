"""What a run leaves behind and what it trusts: patches, environment, remote code, pickles.

- train() that raises after its patches were applied leaves the patch targets and
  os.environ as they were (in-process; tests/run/test_train_e2e.py checks the same
  in 2 processes after a successful run and a failing one);
- trust_remote_code is off unless the recipe sets it, and reaches every Auto*.from_pretrained call;
- recipes are read with YAML's safe loader: no tag builds a Python object;
- checkpoints are loaded without unpickling arbitrary objects: every torch.load in cptune
  and in the resume path of the installed transformers Trainer passes weights_only=True.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap

import pytest

from cptune.config.loader import load_recipe
from tests.conftest import REPO
from tests.run.revert_worker import snapshot


def test_train_that_raises_restores_patches_and_environment(write_recipe, monkeypatch):
    """In one process, train() with cp=2 applies its patches, raises, and leaves nothing behind.

    The process claims to be rank 0 of 2 (no process group is needed before the Trainer is
    built), so the context-parallel patches really are applied when the failure happens.
    """
    from cptune.run.training import train as train_module
    from cptune.run.training.distributed import DistEnv

    recipe = load_recipe(write_recipe(max_steps=1, context_parallel_size=2))
    monkeypatch.setattr(train_module, "read_dist_env", lambda: DistEnv(rank=0, world_size=2))
    before_patches, before_env = snapshot(recipe), dict(os.environ)
    during: dict[str, int] = {}

    def fail(*args, **kwargs):
        during.update(snapshot(recipe))
        os.environ["CPTUNE_TEST_LEAKED"] = "1"  # as a library would while setting up
        os.environ.pop("HOME", None)
        raise RuntimeError("simulated failure after the patches were applied")

    monkeypatch.setattr(train_module, "build_trainer", fail)
    with pytest.raises(RuntimeError, match="simulated failure"):
        train_module.train(recipe)
    applied = {target for target, original in before_patches.items() if during[target] != original}
    assert len(applied) >= 4, f"the failure came before the patches were applied: {applied}"
    assert snapshot(recipe) == before_patches
    assert dict(os.environ) == before_env


@pytest.mark.parametrize("trust", [False, True])
def test_trust_remote_code_is_off_unless_the_recipe_sets_it(write_recipe, monkeypatch, trust):
    import transformers

    from cptune.models.loading import load_model, load_tokenizer, model_config

    keys = {"trust_remote_code": True} if trust else {}
    recipe = load_recipe(write_recipe(**keys))
    assert recipe.trust_remote_code is trust
    seen: list[tuple[str, object]] = []
    for name in ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM"):
        auto = getattr(transformers, name)
        original = auto.from_pretrained.__func__

        def spy(cls, *args, _name=name, _original=original, **kwargs):
            seen.append((_name, kwargs.get("trust_remote_code", "<not passed>")))
            return _original(cls, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", classmethod(spy))
    model_config(recipe)
    load_tokenizer(recipe)
    load_model(recipe, "sdpa")
    assert {name for name, _ in seen} == {"AutoConfig", "AutoTokenizer", "AutoModelForCausalLM"}
    assert all(value is trust for _, value in seen), seen


def test_every_auto_from_pretrained_in_cptune_passes_the_recipes_trust_remote_code():
    """Also the calls the test above does not run (merge-lora's tokenizer): none may fall back to a default."""
    calls = []
    for path in sorted((REPO / "src" / "cptune").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "from_pretrained"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id.startswith("Auto")
            ):
                calls.append((path.name, node))
    assert len(calls) >= 5, calls
    for name, call in calls:
        passed = {k.arg: k.value for k in call.keywords}
        value = passed.get("trust_remote_code")
        assert isinstance(value, ast.Attribute) and value.attr == "trust_remote_code", f"{name}:{call.lineno}"


@pytest.mark.parametrize(
    "value",
    [
        '!!python/object/apply:os.system ["echo pwned"]',
        "!!python/name:os.system",  # YAML's FullLoader builds this one
        "!!python/tuple [1, 2]",  # and this one
        "!!python/module:os",
    ],
)
def test_recipes_are_read_with_a_safe_loader(tmp_path, value):
    from cptune.config.loader import read_recipe_file
    from cptune.errors import RecipeError

    path = tmp_path / "recipe.yaml"
    path.write_text(f"base_model: {value}\n")
    with pytest.raises(RecipeError, match="is not allowed: cptune reads recipes with YAML's safe loader"):
        read_recipe_file(path)


def torch_load_calls(source: str) -> list[ast.Call]:
    tree = ast.parse(textwrap.dedent(source))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "load"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
    ]


def loads_weights_only(call: ast.Call) -> bool:
    return any(
        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def test_cptune_never_unpickles_arbitrary_objects():
    for path in sorted((REPO / "src" / "cptune").rglob("*.py")):
        for call in torch_load_calls(path.read_text()):
            assert loads_weights_only(call), f"{path}:{call.lineno}: torch.load without weights_only=True"


def test_the_trainers_resume_path_loads_with_weights_only():
    """Resume reads the Trainer's rng, optimizer, scheduler and scaler files: all weights_only=True.

    A guard on the installed transformers: if an upgrade loosens this, the test says so.
    """
    from transformers import Trainer

    methods = (Trainer._load_rng_state, Trainer._load_optimizer_and_scheduler, Trainer._load_scaler)
    calls = [call for method in methods for call in torch_load_calls(inspect.getsource(method))]
    assert len(calls) >= 4
    assert all(loads_weights_only(call) for call in calls)
