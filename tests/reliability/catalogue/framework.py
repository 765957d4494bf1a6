"""The catalogue's machinery: the workspace a case runs in, and :class:`Case`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from devtools.docgen.errors import ENTRIES, Entry

REPO = Path(__file__).resolve().parents[3]
QUICKSTART_DATA = REPO / "examples" / "data" / "quickstart.jsonl"

DELETE = object()
"""A key value that removes the key from the recipe."""


@dataclass
class Workspace:
    """The folder a case runs in, and the recipe keys it starts from."""

    root: Path
    model_dir: Path
    keys: dict[str, Any] = field(default_factory=dict)

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def out(self) -> Path:
        return self.root / "out"

    def write_rows(self, name: str, rows: list[Any]) -> str:
        path = self.data / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)


def base_keys(ws: Workspace) -> dict[str, Any]:
    """A small valid LoRA recipe for the tiny model; every case breaks one thing of it."""
    return {
        "base_model": str(ws.model_dir),
        # The tiny model's format (Axolotl's alpaca without its preamble), as the other tiny-model fixtures.
        "datasets": [{"path": str(ws.data / "train.jsonl"), "type": "alpaca_instruct.load_no_prompt"}],
        "dataset_prepared_path": str(ws.root / "prepared"),
        "sequence_len": 128,
        "sample_packing": True,
        "adapter": "lora",
        "micro_batch_size": 2,
        "max_steps": 2,
        "output_dir": str(ws.out),
    }


def make_workspace(root: Path, model_dir: Path) -> Workspace:
    """The starting state every case is built on (and which no failure may change)."""
    ws = Workspace(root=root, model_dir=model_dir)
    ws.data.mkdir(parents=True)
    shutil.copy(QUICKSTART_DATA, ws.data / "train.jsonl")
    earlier_cache = root / "prepared" / "0123456789abcdef"
    earlier_cache.mkdir(parents=True)
    (earlier_cache / "stats.json").write_text('{"earlier": "build"}')
    ws.out.mkdir()
    (ws.out / "notes.txt").write_text("not a run: cptune must leave this alone")
    ws.keys = base_keys(ws)
    return ws


# What a case's ``setup`` may return: recipe key changes (DELETE removes a key).
Setup = Callable[[Workspace], dict[str, Any] | None]


@dataclass(frozen=True)
class Case:
    """One bad input and the command that meets it.

    What the user must read (the message ``fragment``) and what the page says about it (``title``,
    ``fix``, ``section``) live in the :class:`~devtools.docgen.errors.base.Entry` with the same
    ``id`` (devtools/docgen/errors/, the module named like this case's).
    """

    id: str
    keys: dict[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    setup: Setup | None = None
    # Raw recipe file content instead of the YAML dump of the keys.
    recipe_text: str | bytes | None = None
    # YAML lines appended to the dump of the keys (e.g. a key written a second time).
    extra_yaml: str = ""
    command: str = "train"
    # Also run through a real subprocess, to check stderr of the console entry point.
    subprocess: bool = False
    # Point the command at this path (relative to the workspace) instead of recipe.yaml.
    recipe_at: str | None = None
    # Skip the case (with this reason) when it returns a reason; for inputs that are only bad on
    # some machines (a package that is absent here may be installed there).
    skip_if: Callable[[], str | None] | None = None

    @property
    def entry(self) -> Entry:
        """The troubleshooting text of this error (KeyError: the entry is missing)."""
        return ENTRIES[self.id]

    @property
    def section(self) -> str:
        return self.entry.section

    @property
    def title(self) -> str:
        return self.entry.title

    @property
    def fragment(self) -> str:
        """What the command must print (on stderr)."""
        return self.entry.fragment

    @property
    def fix(self) -> str:
        return self.entry.fix

    def write_recipe(self, ws: Workspace) -> Path:
        keys = dict(ws.keys)
        changes = dict(self.keys)
        if self.setup is not None:
            changes.update(self.setup(ws) or {})
        for key, value in changes.items():
            if value is DELETE:
                keys.pop(key, None)
            else:
                keys[key] = value
        if isinstance(self.recipe_text, bytes):
            ws.recipe.write_bytes(self.recipe_text)
        elif self.recipe_text is not None:
            ws.recipe.write_text(self.recipe_text)
        else:
            ws.recipe.write_text(yaml.safe_dump(keys) + self.extra_yaml)
        return ws.recipe

    def argv(self, ws: Workspace) -> list[str]:
        """The command line; ``{ws}`` in an argument stands for the workspace folder."""
        recipe = ws.root / self.recipe_at if self.recipe_at is not None else ws.recipe
        return [self.command, str(recipe), *(arg.replace("{ws}", str(ws.root)) for arg in self.args)]
