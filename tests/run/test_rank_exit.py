"""How a rank ends: with its process groups destroyed and their threads joined, before Python shuts down.

A rank that exited with live gloo groups aborted at random ("terminate called without an active
exception"): a group's worker thread let go of a finished collective's tensors during interpreter
shutdown (see :func:`cptune.run.training.distributed.close_process_groups`). The abort is a race: two gloo
processes that exit right after an all_reduce aborted in 11 launches of 160 on a loaded 2-core
machine, and in none of 160 when they destroyed the group first. So the test checks the cause, which
is deterministic: after ``cptune train`` or ``cptune evaluate`` returns in a launched rank, no process
group is left and no gloo thread runs.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import QUICKSTART_DATA, REPO

WORKER = Path(__file__).with_name("rank_exit_worker.py")


@pytest.mark.distributed
def test_a_launched_rank_of_train_and_evaluate_leaves_no_process_group_and_no_gloo_thread(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "base_model": str(REPO / "examples" / "tiny-llama"),
                "datasets": [{"path": str(QUICKSTART_DATA), "type": "alpaca"}],
                "sequence_len": 128,
                "output_dir": str(tmp_path / "out"),
            }
        )
    )
    path = os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(WORKER), str(recipe)],
        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    for command, seen in report.items():
        # The stand-in's groups had running gloo threads, so the check below can fail.
        assert "pt_gloo_runloop" in seen["threads_started"], (command, seen)
        assert not seen["group_left"], f"cptune {command} left a process group: {seen}"
        assert seen["threads_left"] == [], f"gloo threads outlived cptune {command}: {seen}"


def _called_names(node: ast.AST) -> set[str]:
    """The names of what ``node`` calls: ``f(...)`` and ``x.f(...)`` both give ``f``."""
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            function = call.func
            names.add(function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", ""))
    return names


def test_every_rank_the_suite_and_devtools_launch_ends_as_cptunes_ranks_do():
    """The suite's and devtools' own ranks end with ``close_process_groups``, not a bare ``destroy_process_group``.

    A rank that only destroys its default group can still hold it from a reference cycle (a device mesh, an
    autograd graph) until interpreter shutdown, where a gloo worker letting go of its last collective's
    tensors aborts the process at random (close_process_groups' docstring). devtools/torch_cp_stress.py's
    ranks ended so when tests/parallel/backends/test_torch_cp_repeat.py once failed in a full run with ranks
    dead of a signal (faulthandler's dumps) after their checks had passed. A one-rank world in the test
    process (a ``HashStore``) is exempt: that process goes on.
    """
    bare, unclosed = [], []
    for path in sorted([*(REPO / "tests").rglob("*.py"), *(REPO / "devtools").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef):
                called = _called_names(function)
                if "destroy_process_group" in called and "HashStore" not in called:
                    bare.append(f"{path.relative_to(REPO)}: {function.name}")
        runs_cptunes_cli = any(  # cptune's commands close the groups themselves (cli.py)
            isinstance(call, ast.Call) and ast.unparse(call.func) == "cli.main" for call in ast.walk(tree)
        )
        if path.name.endswith("_worker.py") and not (
            runs_cptunes_cli or "close_process_groups" in _called_names(tree)
        ):
            unclosed.append(str(path.relative_to(REPO)))
    assert bare == [], "end these ranks with cptune.run.training.distributed.close_process_groups()"
    assert unclosed == [], "these rank scripts never close their process groups"
