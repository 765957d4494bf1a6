"""Every command in README.md and docs/ runs as written (issue 33).

The commands are those of the pages' ```bash blocks, continuation lines joined and comments
dropped. Each page runs in a fresh copy of what a clone holds for it (``examples/``), in the
page's order, with the environment of this test run (its interpreter's ``cptune``, ``accelerate``
and ``torchrun`` first on PATH, this checkout's source first on PYTHONPATH) and stdout/stderr in a
pipe, as in a log file. A command is either run or named in :data:`NOT_RUN` with the reason; a
``yaml`` block that the page tells the reader to write (``Write `my-recipe.yaml`:``) is written.

Kept out, each with its reason: commands for GPUs or several nodes, commands on ``recipe.yaml``
(the reader's own recipe: no file of that name ships), the scripts that install into ``.venv``
(tested by tests/scripts/test_setup.py, and the quickstart's training command is the next command
on its page), and the CPU examples' full trainings, which tests/test_examples.py trains (minutes
each). What runs trains the quickstart once (cp=2), the page's own recipe for 20 steps, and one
``accelerate launch`` of 2 steps. The getting-started page's first command, the quickstart's
training, is run as written once per session (``quickstart_page_run`` in tests/conftest.py), in a
fresh copy of ``examples/``; the quickstart's own tests share that run, and the page goes on from
it in a copy of its folder. Each command's time is printed with ``-s``.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.as_written import fresh_clone, run_as_written
from tests.conftest import QUICKSTART_COMMAND, REPO
from tests.quiet_log import noise_in

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# A bash block, or a yaml block the page asks the reader to save ("Write `my-recipe.yaml`:" before it).
BLOCK = re.compile(
    r"^```bash\n(.*?)^```|Write\s+`([\w./-]+\.yaml)`:\s*\n+```yaml\n(.*?)^```", flags=re.M | re.S
)

GPU = "needs GPUs (8 per node) or several nodes; the CPU checks of the launch layout are in tests/run/test_launch.py"
READERS_RECIPE = "recipe.yaml stands for the reader's own recipe; no file of that name ships"

# (pattern a command matches, why it is not run). Checked: every entry still matches a command.
NOT_RUN: tuple[tuple[str, str], ...] = (
    (
        r"^bash scripts/quickstart\.sh\b",
        "installs into .venv (tests/scripts/test_setup.py); its training "
        "command, `cptune train examples/quickstart.yaml --overwrite`, is the next command on the page and runs",
    ),
    (r"^bash scripts/test\.sh\b", "runs this whole suite"),
    (r"^\. \.venv/bin/activate$", "this test's PATH already holds its environment's bin folder"),
    (r"(?<![\w-])recipe\.yaml\b", READERS_RECIPE),
    (r"--nproc-per-node 8|--num_processes 8|--nnodes", GPU),
    (r"^MASTER_ADDR=|^srun ", GPU + " (a Slurm job script)"),
    (r"--base-model /models/", "a GPU benchmark of Llama-3.1-8B (weights not shipped)"),
    (
        r"^cptune train examples/quickstart\.yaml --context_parallel_size=1 ",
        "the quickstart again at cp=1 (about 15 s here): tests/run/test_train_e2e.py checks cp=1 against cp=2 "
        "step by step; left out to keep the suite within its time",
    ),
    (
        r"^cptune train my-recipe\.yaml$",
        "the page's recipe trained to its end (3 epochs); the next command trains the same recipe for 20 steps "
        "with --overwrite, which runs the same code; left out to keep the suite within its time",
    ),
    (
        r"^cptune train examples/cpu/\w+\.yaml$",
        "the CPU example's whole training: tests/test_examples.py "
        "trains it (and the other backends' parity tests check them); minutes each here",
    ),
)
# A page whose commands follow another page's: the launching page's accelerate line is run in the
# folder where the getting-started page left the quickstart's run (issue 33: it refused then).
RUNS_AFTER = {"docs/launching.md": "docs/getting-started.md"}
GETTING_STARTED = "docs/getting-started.md"


@dataclass(frozen=True)
class Step:
    """A command to run, or a file to write (``text`` set)."""

    command: str = ""
    path: str = ""
    text: str = ""


def _commands(block: str) -> list[str]:
    joined = re.sub(r"\s*\\\n\s*", " ", block)
    commands = []
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        # A comment starts at a '#' after a space outside quotes: shlex reads the line as bash would.
        commands.append(shlex.join(shlex.split(line, comments=True)) if "#" in line else line.strip())
    return commands


def page_steps(page: Path) -> list[Step]:
    """The page's commands and files to write, in order."""
    steps = []
    for match in BLOCK.finditer(page.read_text(encoding="utf-8")):
        if match.group(1) is not None:
            steps += [Step(command=command) for command in _commands(match.group(1))]
        else:
            steps.append(Step(path=match.group(2), text=match.group(3)))
    return steps


def why_not_run(command: str) -> str | None:
    for pattern, why in NOT_RUN:
        if re.search(pattern, command):
            return why
    return None


def _name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


RUNNABLE = [page for page in PAGES if any(s.text or not why_not_run(s.command) for s in page_steps(page))]


def test_every_not_run_entry_still_matches_a_command():
    commands = [step.command for page in PAGES for step in page_steps(page) if step.command]
    unused = [pattern for pattern, _ in NOT_RUN if not any(re.search(pattern, c) for c in commands)]
    assert not unused, f"NOT_RUN entries that match no command of the docs any more: {unused}"


def test_the_getting_started_recipe_is_written_and_the_launch_line_is_extracted():
    """The extraction itself: what the runs below depend on."""
    steps = page_steps(REPO / "docs" / "getting-started.md")
    assert [s.path for s in steps if s.path] == ["my-recipe.yaml"]
    assert Step(command="cptune validate my-recipe.yaml") in steps
    launching = [s.command for s in page_steps(REPO / "docs" / "launching.md") if not why_not_run(s.command)]
    assert launching == [
        "accelerate launch --multi_gpu --num_processes 2 -m cptune train examples/quickstart.yaml "
        "--max_steps=2 --logging_steps=1 --output_dir=outputs/accelerate-launch"
    ]


def run_page(
    page: Path, folder: Path, already_run: dict[str, subprocess.CompletedProcess] | None = None
) -> list[str]:
    """Runs the page's steps in ``folder``; returns a transcript line per step.

    ``already_run`` maps a command to its finished process when the session ran it as written in
    this same folder before (it must come before every other command the page runs): its result
    is checked like a command run here, and it is not run again.
    """
    already_run = dict(already_run or {})
    transcript = []
    for step in page_steps(page):
        if step.path:
            (folder / step.path).write_text(step.text, encoding="utf-8")
            transcript.append(f"wrote {step.path}")
            continue
        why = why_not_run(step.command)
        if why:
            transcript.append(f"not run: {step.command} ({why})")
            continue
        where = f"{_name(page)}: `{step.command}`"
        started = time.monotonic()
        if step.command in already_run:
            ran_here = [line for line in transcript if line.startswith(("ran ", "wrote "))]
            assert not ran_here, f"{where} ran before the page's earlier steps: {ran_here}"
            done = already_run.pop(step.command)
            ran = "ran once for the session (quickstart_page_run)"
        else:
            done = run_as_written(step.command, folder)
            ran = f"ran ({time.monotonic() - started:.1f} s)"
        if done.returncode != 0:
            pytest.fail(
                f"{where} exited {done.returncode}\n--- stdout:\n{done.stdout[-4000:]}\n"
                f"--- stderr:\n{done.stderr[-8000:]}",
                pytrace=False,
            )
        noise = noise_in(done.stdout + done.stderr)
        assert not noise, (
            f"{where} printed noise:\n" + "\n".join(noise) + f"\n--- stderr:\n{done.stderr[-6000:]}"
        )
        transcript.append(f"{ran}: {step.command}")
    assert not already_run, f"{_name(page)} has no command {sorted(already_run)}"
    return transcript


@pytest.fixture(scope="module")
def finished_pages(tmp_path_factory) -> dict[str, Path]:
    """Page name -> the folder its commands ran in (filled as the tests run)."""
    return {}


def _start_page(name: str, root: Path, request: pytest.FixtureRequest) -> tuple[Path, dict]:
    """A folder to run page ``name`` in from its start, and the commands the session already ran there.

    The getting-started page starts with the quickstart's training, which the session runs once
    as written (``quickstart_page_run``, shared with the quickstart's own tests): the page goes on
    in a copy of the fresh folder that command ran in, holding what it wrote.
    """
    if name != GETTING_STARTED:
        return fresh_clone(root), {}
    shared = request.getfixturevalue("quickstart_page_run")
    folder = root / "clone"
    shutil.copytree(shared.folder, folder)
    return folder, {QUICKSTART_COMMAND: shared.done}


@pytest.mark.e2e
@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_the_pages_commands_run_as_written(page: Path, finished_pages, tmp_path_factory, request):
    name = _name(page)
    root = tmp_path_factory.mktemp(re.sub(r"\W", "-", name))
    before = RUNS_AFTER.get(name)
    if before is None:
        folder, already_run = _start_page(name, root, request)
    else:
        if before not in finished_pages:
            earlier, already_run = _start_page(
                before, tmp_path_factory.mktemp(re.sub(r"\W", "-", before)), request
            )
            run_page(REPO / before, earlier, already_run)
            finished_pages[before] = earlier
        folder, already_run = root / "clone", {}
        shutil.copytree(finished_pages[before], folder)
    transcript = run_page(page, folder, already_run)
    finished_pages[name] = folder
    print("\n".join(transcript))
    assert any(line.startswith(("ran ", "wrote ")) for line in transcript)
