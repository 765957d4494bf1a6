"""Every recipe rule runs to the end on a valid recipe of each backend and layout.

``combination_problems`` skips a rule that raises ``AttributeError``/``TypeError``, because a recipe
that failed field validation is rebuilt from its valid keys only and a rule reading a broken key
must stay silent. The same guard would hide a bug in a rule (a misspelt recipe attribute) and
silently switch that rule off, now that each backend's rules live in its own package. Here every
rule runs unguarded over recipes that validate, so such a bug fails the suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cptune.config.loader import load_recipe
from cptune.config.recipe import RULES
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
