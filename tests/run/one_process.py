"""The one-process (cp=1) reference runs of several test modules, trained in one launch of one process.

A cp=1 reference of a CP test trains for a few CPU-seconds; starting a process for it (importing torch and
transformers) costs as much again. So each module that compares with such runs registers a writer of their
recipes (:func:`one_process_reference`), and the session's ``one_process_runs`` fixture (tests/run/conftest.py)
trains the references of every selected test that asks for them one after the other in one launch of one
process (tests/run/train_worker.py), the first time a test asks, and hands each module its folder.

Each reference is still its own run: its own recipe, output_dir and train_log.json, trained by the same
``cptune.run.training.train.train`` that a rank of ``cptune train`` runs; only the process is shared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.collective_audit import VARIABLE as AUDIT_VARIABLE
from tests.dist_utils import run_ranks

WORKER = Path(__file__).with_name("train_worker.py")

WriteRecipes = Callable[[Path, Path], Iterable[Path]]
"""``write(folder, tiny_model_dir)``: writes a module's reference recipes (outputs under ``folder``), returns them."""


@dataclass(frozen=True)
class Reference:
    """Where a module's reference recipes come from, and which tests or fixtures compare with them."""

    write: WriteRecipes
    needed_by: tuple[str, ...]


REFERENCES: dict[str, Reference] = {}
"""name -> the reference runs registered under it (by the test modules, as they are imported)."""


def one_process_reference(name: str, *needed_by: str) -> Callable[[WriteRecipes], WriteRecipes]:
    """Register the decorated writer's recipes as the cp=1 references ``name`` of the tests named in ``needed_by``
    (a test function's name, or a fixture's that such tests use). They train only when such a test is selected."""

    def register(write: WriteRecipes) -> WriteRecipes:
        assert name not in REFERENCES or REFERENCES[name].write.__qualname__ == write.__qualname__, name
        REFERENCES[name] = Reference(write, needed_by)
        return write

    return register


def wanted_by(items: Iterable) -> set[str]:
    """The names of the registered references that the selected test ``items`` compare with."""
    wanted = set()
    for item in items:
        names = {getattr(item, "originalname", item.name), *getattr(item, "fixturenames", ())}
        wanted |= {name for name, reference in REFERENCES.items() if names & set(reference.needed_by)}
    return wanted


class OneProcessRuns:
    """The registered references' folders; the first look-up trains every wanted one in one launch.

    ``runs[name]`` is the folder that ``name``'s writer wrote its recipes into and its runs trained into.
    """

    def __init__(self, root: Path, tiny_model_dir: Path, wanted: set[str]):
        self.root, self.tiny_model_dir, self.wanted = root, tiny_model_dir, wanted
        self.trained: set[str] = set()
        self.failed: dict[str, str] = {}
        self.launched_in: dict[str, Path] = {}
        self.recipes: dict[str, list[Path]] = {}  # name -> its recipes, as the launch was given them
        self.launches = 0

    def __getitem__(self, name: str) -> Path:
        if name in self.failed:  # one launch trains them all: its failure is every test's that asked for them
            pytest.fail(
                f"the launch that trained the references {name!r} failed: {self.failed[name]}", pytrace=False
            )
        if (
            name not in self.wanted
        ):  # else it would train in a launch of its own, silently: a process start more
            pytest.fail(
                f"a test asked for the references {name!r}, but their registration names neither it nor its "
                f"fixtures (needed_by: {REFERENCES[name].needed_by}): name it in one_process_reference",
                pytrace=False,
            )
        if name not in self.trained:
            self._train(sorted(self.wanted - self.trained))
        return self.root / name

    def run_logs(self, name: str) -> dict[Path, str]:
        """Each of ``name``'s recipes -> what its run logged: its part of the launch's log, none of the other runs'.

        The launch's log holds every run it trained; a test that looks for a line of its own run there could
        find another run's.
        """
        self[name]
        from tests.run.train_worker import RUN_ENDS, RUN_STARTS  # the worker's module imports torch

        log = (self.launched_in[name] / "rank0.log").read_text()
        parts = {}
        for recipe in self.recipes[name]:
            starts, ends = (mark.format(recipe=recipe) + "\n" for mark in (RUN_STARTS, RUN_ENDS))
            start = log.index(starts) + len(starts)
            parts[recipe] = log[start : log.index(ends, start)]
        return parts

    def log(self, name: str) -> str:
        """What ``name``'s runs logged, one after the other (not the other runs of their launch)."""
        return "".join(self.run_logs(name).values())

    def _train(self, names: list[str]) -> None:
        self.launches += 1
        launch = self.root / f"launch-{self.launches}"
        try:
            for name in names:
                folder = self.root / name
                folder.mkdir()
                self.recipes[name] = list(REFERENCES[name].write(folder, self.tiny_model_dir))
            recipes = [str(path) for name in names for path in self.recipes[name]]
            # Outside the collective audit of the test that asks first (tests/collective_audit.py): the same
            # launch whichever test that is. The default timeout is meant for one run.
            with pytest.MonkeyPatch.context() as patch:
                patch.delenv(AUDIT_VARIABLE, raising=False)
                run_ranks(WORKER, 1, launch, *recipes, timeout=240 + 120 * len(recipes))
        except BaseException:
            self.failed |= dict.fromkeys(names, f"see the first test that asked, and {launch / 'rank0.log'}")
            raise
        self.trained |= set(names)
        self.launched_in |= dict.fromkeys(names, launch)
