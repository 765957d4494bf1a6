"""Fixtures shared by the end-to-end tests: a tiny model folder and a recipe writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import reorder, tiers
from tests.tiers import (  # noqa: F401 - hooks of the suite's tiers (tests/tiers.py)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
)

# Which pytest worker runs which test when the suite runs in several (scripts/test.sh).
pytest_plugins = ["tests.workers"]

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_DATA = REPO / "examples" / "data" / "quickstart.jsonl"


def pytest_configure(config):
    # Every process the tests start prints its Python stack if it dies of a signal (a crash inside
    # torch or gloo otherwise leaves only an exit code).
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    tiers.install_guard()
    # One torch thread in this process too, as in every process the tests start (run_cptune, and
    # the launcher's default OMP_NUM_THREADS=1): tiny tensors gain nothing from a second thread, and
    # on busy cores OpenMP's threads wait for each other (tests/parallel/test_activation_memory.py:
    # 177 s with 2 threads, 27 s with 1, at load average 11 on 2 cores). Under the reorder stress this
    # process takes 2 threads instead, so its parallel reductions split their sums elsewhere than by
    # default. An OMP_NUM_THREADS the caller sets wins.
    if "OMP_NUM_THREADS" not in os.environ:
        threads = 2 if reorder.active() else 1
        os.environ["OMP_NUM_THREADS"] = str(threads)  # read when torch loads
        if "torch" in sys.modules:  # already loaded by a conftest (tests/data/conftest.py)
            sys.modules["torch"].set_num_threads(threads)
    reorder.apply(threads=False)  # CPTUNE_TEST_REORDER=1: other summation orders (tests/reorder.py)


def pytest_report_header(config):
    if reorder.active():
        return f"{reorder.VARIABLE}: summation orders under stress (tests/reorder.py)"
    return None


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama and its tokenizer, trained on the quickstart texts, saved like a hub model."""
    from devtools.tiny import save_tiny_model_dir

    rows = [json.loads(line) for line in QUICKSTART_DATA.read_text().splitlines() if line.strip()]
    texts = [" ".join([r["instruction"], r.get("input", ""), r["output"]]) for r in rows]
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"), texts, seed=0)


def lora_recipe(folder: Path, tiny_model_dir: Path, name: str = "recipe.yaml", **keys: Any) -> Path:
    """Write a small LoRA recipe for the tiny model into ``folder``; keyword arguments override keys."""
    recipe: dict[str, Any] = {
        "base_model": str(tiny_model_dir),
        # Axolotl's alpaca without its preamble: the rows the tiny model was trained on (type: alpaca's
        # preamble is checked in tests/data and tests/axolotl).
        "datasets": [{"path": str(QUICKSTART_DATA), "type": "alpaca_instruct.load_no_prompt"}],
        "dataset_prepared_path": str(folder / "prepared"),
        "sequence_len": 128,
        "sample_packing": True,
        "adapter": "lora",
        "lora_r": 8,
        "lora_alpha": 16,
        "micro_batch_size": 2,
        "max_steps": 4,
        "learning_rate": 0.002,
        "output_dir": str(folder / "out"),
        "logging_steps": 1,
    }
    recipe.update(keys)
    path = folder / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def shipped_example(path: Path, root: Path, name: str) -> dict:
    """The example recipe at ``path`` as shipped, its files found from anywhere, its outputs under ``root``."""
    example = yaml.safe_load(path.read_text())
    return {
        **example,
        "base_model": str(REPO / example["base_model"]),
        "datasets": [{**d, "path": str(REPO / d["path"])} for d in example["datasets"]],
        "dataset_prepared_path": str(root / "prepared"),
        "output_dir": str(root / name),
    }


@pytest.fixture
def write_recipe(tmp_path: Path, tiny_model_dir: Path) -> Callable[..., Path]:
    """Write a small LoRA recipe for the tiny model into tmp_path (:func:`lora_recipe`)."""

    def write(name: str = "recipe.yaml", **keys: Any) -> Path:
        return lora_recipe(tmp_path, tiny_model_dir, name, **keys)

    return write


def run_cptune(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300):
    """Run ``python -m cptune ARGS`` like a user would; returns the completed process."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "cptune", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_short_run(root: Path, name: str, base_model: Path, **keys) -> Path:
    """A recipe of 3 SGD steps of packed 128-token alpaca rows (micro batch 2, accumulation 2), logging every
    step into ``root / name``; ``keys`` add to it or override it. Returns the recipe's path."""
    recipe = {
        "base_model": str(base_model),
        "datasets": [{"path": str(QUICKSTART_DATA), "type": "alpaca"}],
        "dataset_prepared_path": str(root / "prepared"),
        "sequence_len": 128,
        "sample_packing": True,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "optimizer": "sgd",
        "learning_rate": 0.05,
        "logging_steps": 1,
        "output_dir": str(root / name),
        **keys,
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def succeeded(done: subprocess.CompletedProcess) -> None:
    """Fail with the run's whole stderr (an assertion message would be cut to a few lines)."""
    if done.returncode != 0:
        pytest.fail(f"exit code {done.returncode}; stderr:\n{done.stderr[-20000:]}", pytrace=False)


# docs/getting-started.md's first training command, run as written in a fresh copy of examples/: the
# quickstart (cp=2) into outputs/quickstart, its data prepared into prepared/ (examples/quickstart.yaml).
QUICKSTART_COMMAND = "cptune train examples/quickstart.yaml --overwrite"


@dataclass(frozen=True)
class PageRun:
    """A documented command's finished process and the fresh copy of ``examples/`` it ran in."""

    done: subprocess.CompletedProcess
    folder: Path


@pytest.fixture(scope="session")
def quickstart_page_run(tmp_path_factory) -> PageRun:
    """The quickstart as the getting-started page runs it (:data:`QUICKSTART_COMMAND`), once per session.

    tests/docs/test_commands.py continues the page in a copy of its folder; the tests of the
    quickstart (tests/test_examples.py), of ``cptune inference`` and of the data report share it
    through ``quickstart_run``.
    """
    from tests.as_written import fresh_clone, run_as_written

    folder = fresh_clone(tmp_path_factory.mktemp("quickstart"))
    return PageRun(run_as_written(QUICKSTART_COMMAND, folder), folder)


@pytest.fixture(scope="session")
def quickstart_run(quickstart_page_run) -> tuple[subprocess.CompletedProcess, Path]:
    """The session's quickstart run: its finished process and its output_dir (the adapter)."""
    return quickstart_page_run.done, quickstart_page_run.folder / "outputs" / "quickstart"


def logged_losses(output_dir: Path) -> list[float]:
    history = json.loads((output_dir / "train_log.json").read_text())
    return [entry["loss"] for entry in history if "loss" in entry]


def logged(output_dir: Path, key: str) -> dict[int, float]:
    """``{step: value}`` of every entry of the run's train_log.json that holds ``key``."""
    history = json.loads((output_dir / "train_log.json").read_text())
    return {entry["step"]: entry[key] for entry in history if key in entry}


def max_rel_diff(got: dict[int, float], expected: dict[int, float]) -> float:
    """Largest relative difference of two runs' logged values, step by step (same steps required)."""
    assert sorted(got) == sorted(expected) and expected, (got, expected)
    return max(abs(got[step] - value) / abs(value) for step, value in expected.items())


@pytest.fixture
def collective_audit(tmp_path: Path):
    """Record the collectives cptune's code calls in every process the test starts (tests/collective_audit.py)."""
    from tests.collective_audit import auditing

    with auditing(tmp_path / "collectives") as audit:
        yield audit


#: The progress bars a cptune command turns off where stderr is not a terminal (cptune.console's
#: ``progress_bars_on_terminal_only``): module, whether its bars are on, how to turn them on or off. transformers'
#: switch also sets the hub's, so it comes first.
_PROGRESS_BARS = (
    (
        "transformers.utils.logging",
        lambda m: m.is_progress_bar_enabled(),
        "enable_progress_bar",
        "disable_progress_bar",
    ),
    (
        "huggingface_hub.utils",
        lambda m: not m.are_progress_bars_disabled(),
        "enable_progress_bars",
        "disable_progress_bars",
    ),
    ("datasets", lambda m: m.is_progress_bar_enabled(), "enable_progress_bars", "disable_progress_bars"),
)


def in_process_state() -> dict[str, Any]:
    """What a cptune command run in this process changes for the rest of it: the environment (``cptune train`` sets
    the allocator's variable), the progress bars (off under pytest's captured stderr; a library not imported yet
    counts as on, as a fresh import leaves them), the ``cptune`` logger's level and the random generators a run
    seeds (Python's, torch's CPU generator, numpy's)."""
    import logging
    import random

    import numpy as np
    import torch

    bars = {
        name: is_on(sys.modules[name]) if sys.modules.get(name) else True
        for name, is_on, _, _ in _PROGRESS_BARS
    }
    kind, keys, *rest = np.random.get_state(legacy=True)
    return {
        "environ": dict(os.environ),
        "progress bars": bars,
        "cptune log level": logging.getLogger("cptune").level,
        # The random generators transformers' set_seed seeds (a run seeds them from its recipe), as bytes and tuples
        # so that two states compare with ==.
        "random": random.getstate(),
        "torch rng": torch.get_rng_state().numpy().tobytes(),
        "numpy rng": (kind, keys.tobytes(), *rest),
    }


def restore_in_process_state(state: dict[str, Any]) -> None:
    """Put back what :func:`in_process_state` read."""
    import logging

    os.environ.clear()
    os.environ.update(state["environ"])
    for name, _, enable, disable in _PROGRESS_BARS:
        if sys.modules.get(name):
            getattr(sys.modules[name], enable if state["progress bars"][name] else disable)()
    logging.getLogger("cptune").setLevel(state["cptune log level"])
    import random

    import numpy as np
    import torch

    random.setstate(state["random"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch rng"]), dtype=torch.uint8))
    kind, keys, *rest = state["numpy rng"]
    np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32).copy(), *rest))


@pytest.fixture
def cptune_in_process(capsys, monkeypatch):
    """Run ``cptune ARGS`` through the console entry point in this process (no start-up cost).

    Returns what :func:`run_cptune` returns: ``returncode``, ``stdout`` and ``stderr``. What the command leaves
    changed for the rest of the process (:func:`in_process_state`: the environment, progress bars, log level, the
    root logger's handlers) is put back after each run, as a command in a process of its own leaves nothing behind.
    """
    import logging

    from cptune.cli import main

    handlers = list(logging.root.handlers)
    # For the test's length, not per run: a state the runs then find and leave alike.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def run(*args: str) -> subprocess.CompletedProcess:
        state = in_process_state()
        capsys.readouterr()
        code: int | str | None = 0
        try:
            main(list(args))
        except SystemExit as exited:
            code = exited.code
        finally:
            logging.root.handlers[:] = handlers  # main() adds a handler bound to this test's stderr
            restore_in_process_state(state)
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code or 0, captured.out, captured.err)

    return run
