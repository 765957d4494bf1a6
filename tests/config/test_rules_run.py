"""Every recipe rule runs to the end on a valid recipe of each backend and layout, and a rule that raises fails loudly.

A recipe that failed field validation is rebuilt from its valid keys for the rules, and a rule that
reads a required key the user got wrong stays silent (that key has its own error). Anything else a
rule raises is a bug in the rule: ``combination_problems`` lets it through, rather than switching the
rule off without a word (it once skipped every ``AttributeError`` and ``TypeError``). Here every rule
also runs over recipes that validate, so such a bug fails the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cptune.config import rules
from cptune.config.loader import load_recipe, validate_recipe
from cptune.config.rules import RULES
from cptune.errors import RecipeError
from cptune.parallel.backends.rows import NAMES
from tests.conftest import REPO

EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))


def _recipes() -> list[tuple[str, Path, tuple[str, ...]]]:
    cases = [(path.relative_to(REPO).as_posix(), path, ()) for path in EXAMPLES]
    quickstart = REPO / "examples" / "quickstart.yaml"
    # The shipped examples cover every backend; these add the layouts the examples do not.
    for name, overrides in {
        "torch-unpacked-cp2": (
            "cp_backend=torch",
            "ring_attn_func=null",
            "sample_packing=false",
            "context_parallel_size=2",
        ),
        "deepspeed-zero3-cp2": (
            "cp_backend=deepspeed",
            "ring_attn_func=null",
            "context_parallel_size=2",
            "zero_stage=3",
        ),
        "ring-cp1": ("context_parallel_size=1",),
        "ring-zero3-cp2": ("context_parallel_size=2", "zero_stage=3"),
        "torch-zero2-cp2": (
            "cp_backend=torch",
            "ring_attn_func=null",
            "sample_packing=false",
            "zero_stage=2",
        ),
    }.items():
        cases.append((f"quickstart+{name}", quickstart, overrides))
    return cases


@pytest.mark.parametrize(
    ("path", "overrides"), [(p, o) for _, p, o in _recipes()], ids=[c[0] for c in _recipes()]
)
def test_every_rule_runs_without_raising_on_a_valid_recipe(path, overrides):
    recipe = load_recipe(path, overrides)
    for rule in RULES:
        list(rule(recipe))  # raises here if the rule itself is broken


def test_the_recipes_cover_every_backend():
    backends = {load_recipe(path, overrides).cp_backend for _, path, overrides in _recipes()}
    assert backends == set(NAMES)


MINIMAL = {"base_model": "m", "datasets": [{"path": "d.jsonl"}]}


def test_a_rule_that_raises_fails_loudly(monkeypatch):
    def broken(recipe):
        yield "sequence_len", recipe.sequence_len + "tokens"  # a bug: TypeError

    def misspelt(recipe):
        yield "sequence_len", recipe.sequence_length  # a bug: AttributeError

    for rule, error in ((broken, TypeError), (misspelt, AttributeError)):
        monkeypatch.setattr(rules, "RULES", (*RULES, rule))
        with pytest.raises(error):
            validate_recipe(MINIMAL)
        with pytest.raises(error):  # also on a recipe rebuilt from its valid keys
            validate_recipe({**MINIMAL, "lora_r": 0})


def test_a_rule_reading_a_required_key_the_user_got_wrong_stays_silent(monkeypatch):
    def reads_the_base_model(recipe):
        if recipe.base_model.startswith("/"):
            yield "base_model", "never reached"

    monkeypatch.setattr(rules, "RULES", (*RULES, reads_the_base_model))
    with pytest.raises(RecipeError) as raised:
        validate_recipe({"datasets": [{"path": "d.jsonl"}], "lora_r": 0})
    assert [p.key for p in raised.value.problems] == ["base_model", "lora_r"]


def test_a_failing_recipe_reaches_the_rules_with_its_keys_where_the_recipe_reads_them():
    """Axolotl's FSDP2 recipes put the version in fsdp_config (12 of its examples): the recipe lifts it to
    the top level before typing fsdp_config, so the rebuilt recipe must too. It once reached the rules
    as an untyped dict, and validation ended in an AttributeError instead of the recipe's problems."""
    fsdp2 = {**MINIMAL, "fsdp_config": {"fsdp_version": 2, "sharding_strategy": "NO_SHARD"}}
    with pytest.raises(RecipeError) as raised:
        validate_recipe({**fsdp2, "typo_key": 1})
    found = {p.key: p.message for p in raised.value.problems}
    assert set(found) == {"typo_key", "fsdp_config.sharding_strategy"}
    assert "plain data parallelism" in found["fsdp_config.sharding_strategy"]
    with pytest.raises(RecipeError) as raised:  # the same problems as when nothing else is wrong
        validate_recipe(fsdp2)
    assert [p.key for p in raised.value.problems] == ["fsdp_config.sharding_strategy"]
