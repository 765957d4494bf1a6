"""Axolotl's own example recipes, pointed at local files: the model and the data, nothing else.

The recipes under ``recipes/`` are copies of files in Axolotl's ``examples/`` folder (origin, commit
and license: ``recipes/ORIGIN.md``; a file named ``llama-3--lora-1b.yml`` is Axolotl's
``examples/llama-3/lora-1b.yml``). :func:`localised` changes what a user moving to a machine without
the hub would change: ``base_model`` becomes a local model folder, and every dataset ``path`` a local
file in the recipe's row format (``data_files``, which selects files inside a hub dataset, goes with
it), and a relative ``deepspeed`` config path is read from ``recipes/`` (which holds the one config the
recipes name, copied from Axolotl's repository root). Every other key is left as Axolotl wrote it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO

HERE = Path(__file__).resolve().parent
RECIPES_DIR = HERE / "recipes"
DATA_DIR = HERE / "data"
RECIPES = sorted(p for p in RECIPES_DIR.iterdir() if p.suffix in (".yml", ".yaml"))

# Local rows in each format the recipes use: (type, column) -> file.
_DATA = {
    ("alpaca", None): REPO / "examples" / "data" / "quickstart.jsonl",
    ("chat_template", "messages"): REPO / "examples" / "data" / "quickstart_chat.jsonl",
    ("chat_template", "conversations"): DATA_DIR / "conversations.jsonl",
    ("completion", "text"): DATA_DIR / "text.jsonl",
    ("completion", "chapter"): DATA_DIR / "chapter.jsonl",
}


def axolotl_path(recipe: Path) -> str:
    """The recipe's path in Axolotl's repository (``examples/llama-3/lora-1b.yml``)."""
    return "examples/" + recipe.name.replace("--", "/")


def local_data(dataset: dict[str, Any]) -> Path:
    """The local file that stands in for a hub dataset of this entry's row format."""
    kind = dataset.get("type", "alpaca")
    column = None
    if kind == "chat_template":
        column = dataset.get("field_messages") or "messages"
    elif kind == "completion":
        column = dataset.get("field") or "text"
    return _DATA[(kind, column)]


def model_family(recipe: Path) -> str:
    """The architecture of the recipe's base model: ``mistral``/``qwen2`` for Axolotl's Mistral/Qwen2 recipes,
    else ``llama``."""
    for family in ("mistral", "qwen2"):
        if recipe.name.startswith(f"{family}--"):
            return family
    return "llama"


def localised(recipe: Path, model_dir: Path | dict[str, Path]) -> dict[str, Any]:
    """The recipe as a mapping, with ``base_model`` and the dataset paths pointed at local files.

    Args:
        recipe: One of :data:`RECIPES`.
        model_dir: The local model, or one per :func:`model_family` (a recipe that names its model
            class in ``model_type`` gets a model of that class).
    """
    data = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    data["base_model"] = str(model_dir[model_family(recipe)] if isinstance(model_dir, dict) else model_dir)
    for key in ("datasets", "test_datasets"):
        for dataset in data.get(key) or ():
            dataset["path"] = str(local_data(dataset))
            dataset.pop("data_files", None)
    if data.get("deepspeed") and not Path(data["deepspeed"]).is_absolute():
        data["deepspeed"] = str(RECIPES_DIR / data["deepspeed"])
    return data
