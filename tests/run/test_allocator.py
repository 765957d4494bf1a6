"""``cptune train`` gives every rank ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, unless the user set their own."""

from __future__ import annotations

import logging
import os

import pytest

from cptune.run.launch.allocator import (
    SETTING,
    USER_VARIABLES,
    VARIABLE,
    has_expandable_segments,
    use_expandable_segments,
)


def test_sets_expandable_segments_when_nothing_is_set():
    environ = {"PATH": "/bin"}
    assert use_expandable_segments(environ, ("tiled_mlp",)) is None
    assert environ == {"PATH": "/bin", VARIABLE: "expandable_segments:True"}


@pytest.mark.parametrize("name", USER_VARIABLES)
def test_keeps_the_users_setting_and_says_when_it_lacks_expandable_segments(name, caplog):
    environ = {name: "max_split_size_mb:512"}
    with caplog.at_level(logging.INFO, logger="cptune"):
        line = use_expandable_segments(environ, ("activation_offloading", "tiled_mlp"))
    assert environ == {name: "max_split_size_mb:512"}
    assert line == caplog.messages[-1] and len(caplog.messages) == 1
    assert line.startswith(
        f"cptune: keeping your {name}=max_split_size_mb:512; it lacks expandable_segments:True"
    )
    assert "(activation_offloading, tiled_mlp)" in line


def test_no_line_without_memory_features_or_with_expandable_segments_on(caplog):
    with caplog.at_level(logging.INFO, logger="cptune"):
        assert use_expandable_segments({VARIABLE: "max_split_size_mb:512"}, ()) is None
        mine = {VARIABLE: "max_split_size_mb:512, expandable_segments:True"}
        assert use_expandable_segments(mine, ("tiled_mlp",)) is None
        # A rank under a launcher: the same decision, not logged again.
        assert use_expandable_segments({VARIABLE: "max_split_size_mb:512"}, ("tiled_mlp",), note=False)
    assert caplog.messages == []


def test_reads_the_setting_as_torch_does():
    assert has_expandable_segments("expandable_segments:True")
    assert has_expandable_segments("max_split_size_mb:128, expandable_segments:True")
    assert not has_expandable_segments("expandable_segments:False")
    assert not has_expandable_segments("max_split_size_mb:128")


@pytest.fixture
def clean_environment(monkeypatch):
    """No allocator variable in this process; whatever ``cptune train`` sets is undone afterwards."""
    for name in USER_VARIABLES:
        monkeypatch.setenv(name, "-")  # records the original state, restored at teardown
        monkeypatch.delenv(name)
    return monkeypatch


def train_ranks(recipe, monkeypatch, nproc: int) -> list[dict[str, str]]:
    """Run ``cptune train`` (the launcher) with stand-in ranks: the environment each rank was given."""
    from cptune.cli import main
    from cptune.run.launch import processes

    environments = []

    class Finished:
        returncode = 0

        def poll(self):
            return 0

    def popen(command, env):
        environments.append(env)
        return Finished()

    monkeypatch.setattr("cptune.run.launch.preflight.preflight", lambda *args, **kwargs: None)
    monkeypatch.setattr(processes.subprocess, "Popen", popen)
    handlers = list(logging.root.handlers)
    try:
        main(["train", str(recipe), "--nproc-per-node", str(nproc)])
    finally:
        logging.root.handlers[:] = handlers  # main() installs a handler on this test's stderr
    assert len(environments) == nproc
    return environments


@pytest.mark.parametrize(
    ("user", "expected", "noted"),
    [
        ({}, {VARIABLE: SETTING}, False),
        ({VARIABLE: "max_split_size_mb:512"}, {VARIABLE: "max_split_size_mb:512"}, True),
        (
            {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"},
            {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"},
            True,
        ),
        ({VARIABLE: "expandable_segments:True,max_split_size_mb:512"}, None, False),
    ],
    ids=["unset", "user-cuda-variable", "user-generic-variable", "user-with-expandable-segments"],
)
def test_every_rank_gets_the_setting_or_the_users(
    user, expected, noted, write_recipe, clean_environment, caplog
):
    for name, value in user.items():
        clean_environment.setenv(name, value)
    recipe = write_recipe(context_parallel_size=2, tiled_mlp=True)
    with caplog.at_level(logging.INFO, logger="cptune"):
        ranks = train_ranks(recipe, clean_environment, nproc=2)
    expected = expected or user
    for env in ranks:
        assert {name: env.get(name) for name in USER_VARIABLES if name in env} == expected
    notes = [m for m in caplog.messages if "lacks expandable_segments" in m]
    assert len(notes) == (1 if noted else 0), notes


def test_a_run_in_this_process_has_the_setting_before_training(write_recipe, clean_environment):
    """World size 1: ``cptune train`` trains in its own process, after setting the variable."""
    from cptune.cli import main

    seen = []

    class Done:
        seconds, output_dir = 0.0, "out"

    def train(recipe, plan=None, **_):
        seen.append(os.environ.get(VARIABLE))
        return Done()

    clean_environment.setattr("cptune.run.launch.preflight.preflight", lambda *args, **kwargs: None)
    clean_environment.setattr("cptune.run.training.train.train", train)
    handlers = list(logging.root.handlers)
    try:
        main(["train", str(write_recipe())])
    finally:
        logging.root.handlers[:] = handlers
    assert seen == [SETTING]
