"""A fifth backend takes its own package and one row of the backend table, and nothing else.

The test copies ``src/cptune`` into a temporary folder, adds ``tests/parallel/backends/toy_backend/``
there as the package ``cptune/parallel/backends/toy`` and adds the package to the table's rows
(``parallel/backends/rows.py``: its import and its entry in ``ROWS``). In that copy, with no other
file changed, the recipe accepts ``cp_backend: toy`` and validates the toy's own key, the toy's rules
run with the others, ``RunPlan`` picks the toy and its plan line, the memory estimate takes the toy's
K/V buffer term, the data report its sequence split, the toy's patch is applied with the run's patch
set and reverted after it (and skipped for another backend), and the generated reference pages (the
recipe keys, the patches) list the toy's key and patch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[3] / "src" / "cptune"
TOY = Path(__file__).resolve().parent / "toy_backend"

# What a user of the copied cptune does with the new backend; prints what the test checks, as JSON.
SCRIPT = """
import json

from cptune.config.loader import validate_recipe
from cptune.errors import RecipeError
from cptune.parallel.backends.rows import NAMES
from cptune.parallel.backends.toy import upstream
from cptune.parallel.memory import ModelShape
from cptune.run.memory_plan import activation_setup
from cptune.run.plan import RunPlan
from devtools.docgen.patch_list import render_patch_list
from devtools.docgen.recipe_reference import render_recipe_reference

base = {"base_model": "m", "datasets": [{"path": "d.jsonl"}]}


def problems(keys):
    try:
        validate_recipe({**base, **keys})
    except RecipeError as err:
        return [[p.key, p.message] for p in err.problems]
    return []


toy = validate_recipe({**base, "cp_backend": "toy", "context_parallel_size": 2, "toy_ring_rounds": 3})
plan = RunPlan.build(toy, 2)
before = upstream.describe()
with plan.patches.applied(toy):
    during = upstream.describe()
after = upstream.describe()
ring = validate_recipe({**base, "context_parallel_size": 2})
with RunPlan.build(ring, 2).patches.applied(ring):
    under_ring = upstream.describe()
print(json.dumps({
    "names": list(NAMES),
    "rounds": toy.toy_ring_rounds,
    "backend": plan.backend.name,
    "plan_lines": plan.backend.plan_lines(toy),
    "split": plan.backend.sequence_split(toy),
    "buffers": activation_setup(plan, 4).attention_buffers(ModelShape(2, 64, 128, 4, 2, 16, 100), 4, 2),
    "patches_page": "### toy-upstream-describe" in render_patch_list(),
    "recipe_page": "| `toy_ring_rounds` |" in render_recipe_reference(),
    "patch_plan": plan.patches.plan(toy).describe(),
    "upstream": [before, during, after, under_ring],
    "bad_value": problems({"cp_backend": "toy", "context_parallel_size": 2, "toy_ring_rounds": 0}),
    "elsewhere": problems({"toy_ring_rounds": 2}),
    "packing": problems({"cp_backend": "toy", "context_parallel_size": 2, "sample_packing": True}),
    "typo": problems({"cp_backend": "toyy"}),
}))
"""


def add_toy_backend(root: Path) -> None:
    """Copy cptune to ``root`` with the toy backend's package and its row in the table; nothing else."""
    copy = root / "cptune"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(TOY, copy / "parallel" / "backends" / "toy", ignore=shutil.ignore_patterns("__pycache__"))
    table = copy / "parallel" / "backends" / "rows.py"
    text = table.read_text()
    row_import = "from cptune.parallel.backends import deepspeed_ulysses, ring_flash_attn, torch_cp\n"
    rows = "ROWS: tuple[ModuleType, ...] = (ring_flash_attn, torch_cp, deepspeed_ulysses)\n"
    assert text.count(row_import) == 1 and text.count(rows) == 1, "the table's rows changed shape"
    text = text.replace(row_import, row_import.replace("torch_cp\n", "torch_cp, toy\n"))
    text = text.replace(rows, rows.replace("deepspeed_ulysses)", "deepspeed_ulysses, toy)"))
    table.write_text(text)


@pytest.mark.e2e
def test_a_new_backend_is_its_package_and_one_row(tmp_path):
    add_toy_backend(tmp_path)
    # The copy first; the checkout's root after it for devtools (the page generators), which is no package of src.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SRC.parents[1])])}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["names"] == ["ring-flash-attn", "torch", "deepspeed", "toy"]
    # Its key is a top-level recipe key, validated by its own field.
    assert (found["rounds"], found["backend"]) == (3, "toy")
    assert found["bad_value"] == [["toy_ring_rounds", "Input should be greater than or equal to 1; got 0."]]
    # Its rules run with every other rule.
    assert found["elsewhere"] == [["toy_ring_rounds", "applies only to cp_backend: toy; remove it."]]
    assert found["packing"] == [
        ["sample_packing", "cp_backend: toy cannot keep packed samples apart; set sample_packing: false."]
    ]
    assert "Did you mean 'toy'?" in found["typo"][0][1]
    # The plan asks it, and its patch comes through the registry with the run's own.
    assert found["plan_lines"] == ["attention:  toy / 3 round(s)"]
    assert (
        "apply toy-upstream-describe: cptune.parallel.backends.toy.upstream:describe" in found["patch_plan"]
    )
    assert "apply trainer-cp-inputs-noop" in found["patch_plan"]  # it shards inputs itself
    # Its memory term: 2 x cp x kv_width x dtype bytes per token (the toy's policy), with kv_width 2 x 16.
    assert (found["split"], found["buffers"]) == ("contiguous", 2.0 * 4 * 32 * 2)
    assert found["patches_page"] and found["recipe_page"]
    before, during, after, under_ring = found["upstream"]
    assert (before, during, after) == ("upstream", "patched by toy", "upstream")
    assert under_ring == "upstream"  # another backend's run leaves it alone
