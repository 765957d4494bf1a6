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
each). What runs trains the quickstart twice (cp=2 and cp=1), the page's own recipe twice, and
one ``accelerate launch`` of 2 steps: 2 min 45 s of CPU time in all (measured with its processes'
time; 18 min wall on a 2-core machine shared with other suites, load 15-20). Each command's time
is printed with ``-s``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
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


def _environment() -> dict[str, str]:
    python_path = os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": python_path.rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1",
    }


def run_page(page: Path, folder: Path) -> list[str]:
    """Runs the page's steps in ``folder``; returns a transcript line per step."""
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
        started = time.monotonic()
        done = subprocess.run(
            ["bash", "-c", step.command],
            cwd=folder,
            env=_environment(),
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
        where = f"{_name(page)}: `{step.command}`"
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
        transcript.append(f"ran ({time.monotonic() - started:.1f} s): {step.command}")
    return transcript


@pytest.fixture(scope="module")
def finished_pages(tmp_path_factory) -> dict[str, Path]:
    """Page name -> the folder its commands ran in (filled as the tests run)."""
    return {}


def _fresh_copy(root: Path) -> Path:
    folder = root / "clone"
    shutil.copytree(REPO / "examples", folder / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


@pytest.mark.e2e
@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_the_pages_commands_run_as_written(page: Path, finished_pages, tmp_path_factory):
    name = _name(page)
    root = tmp_path_factory.mktemp(re.sub(r"\W", "-", name))
    before = RUNS_AFTER.get(name)
    if before is None:
        folder = _fresh_copy(root)
    else:
        if before not in finished_pages:
            earlier = _fresh_copy(tmp_path_factory.mktemp(re.sub(r"\W", "-", before)))
            run_page(REPO / before, earlier)
            finished_pages[before] = earlier
        folder = root / "clone"
        shutil.copytree(finished_pages[before], folder)
    transcript = run_page(page, folder)
    finished_pages[name] = folder
    print("\n".join(transcript))
    assert any(line.startswith(("ran ", "wrote ")) for line in transcript)
