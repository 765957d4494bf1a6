"""The same recipe gives the tokens and labels Axolotl gives: ``cptune preprocess`` against Axolotl's own output.

``parity/axolotl-outputs.jsonl.gz`` holds every training example Axolotl 0.21.0's preprocessing made of the
recipes in ``parity/recipes/`` (the shipped tiny model and data; how it was generated: its header line and
``parity/README.md``). Each test prepares the same recipe with cptune, in this process, and compares
example by example: input ids and labels, exactly. A drift fails naming the recipe, the first differing
example and its first differing token. Where cptune trains something else on purpose, the test states the
difference (``docs/migrating-from-axolotl.md`` lists it) and checks that the documented remedy closes it.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from cptune.config.loader import validate_recipe
from cptune.data.prepare import prepare_datasets
from cptune.labels import IGNORE_INDEX
from cptune.models.loading import load_tokenizer_with_additions
from devtools.axolotl_parity import FIXTURE, RECIPES_DIR, read_fixture
from tests.conftest import REPO

Example = tuple[tuple[int, ...], tuple[int, ...]]

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
# Where cptune's rendering differs on purpose: docs/migrating-from-axolotl.md, "What is still trained differently".
DOCUMENTED_DIFFERENCES = {"chat-mistral_v2v3"}


@pytest.fixture(scope="module")
def axolotl() -> dict[str, list[Example]]:
    header, examples = read_fixture()
    assert header["axolotl"] == "0.21.0", header
    return {name: [_example(row) for row in rows] for name, rows in examples.items()}


def _example(row: dict[str, Any]) -> Example:
    return tuple(row["input_ids"]), tuple(row["labels"])


def _recipe(name: str, tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    data = yaml.safe_load((RECIPES_DIR / f"{name}.yaml").read_text(encoding="utf-8"))
    data["base_model"] = str(REPO / data["base_model"])
    for dataset in data["datasets"]:
        dataset["path"] = str(REPO / dataset["path"])
    return {**data, "dataset_prepared_path": str(tmp_path / "prepared"), **overrides}


def prepared_examples(data: dict[str, Any]) -> tuple[list[Example], Any]:
    """cptune's prepared training rows of a recipe, split into their samples (packed rows included)."""
    recipe = validate_recipe(data)
    tokenizer, _ = load_tokenizer_with_additions(recipe)
    prepared = prepare_datasets(recipe, tokenizer, log=lambda _: None)
    examples = []
    for row in prepared.train:
        ids, labels, positions = row["input_ids"], row["labels"], row["position_ids"]
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
        examples += [(tuple(ids[a:b]), tuple(labels[a:b])) for a, b in itertools.pairwise(starts)]
    return examples, tokenizer


def _token_at(tokens: tuple[int, ...], labels: tuple[int, ...], position: int, tokenizer: Any) -> str:
    if position >= len(tokens):
        return f"nothing (its {len(tokens)} tokens end before)"
    trained = "trained" if labels[position] != IGNORE_INDEX else "not trained"
    return f"{tokens[position]} {tokenizer.decode([tokens[position]])!r} ({trained})"


def first_difference(ours: list[Example], theirs: list[Example], tokenizer: Any) -> str | None:
    """Where the two lists first differ, in words: the example, the token, what each side has there."""
    if len(ours) != len(theirs):
        return f"cptune has {len(ours)} examples, Axolotl {len(theirs)}"
    for number, ((ids, labels), (their_ids, their_labels)) in enumerate(zip(ours, theirs, strict=True)):
        if (ids, labels) == (their_ids, their_labels):
            continue
        shorter = min(len(ids), len(their_ids))
        position = next(
            (i for i in range(shorter) if (ids[i], labels[i]) != (their_ids[i], their_labels[i])), shorter
        )
        context = tokenizer.decode(list(their_ids[max(0, position - 8) : position]))
        return (
            f"example {number}, token {position} (after {context!r}): Axolotl has "
            f"{_token_at(their_ids, their_labels, position, tokenizer)}, cptune has "
            f"{_token_at(ids, labels, position, tokenizer)}"
        )
    return None


def test_the_fixture_covers_every_recipe_and_nothing_else(axolotl):
    assert sorted(axolotl) == RECIPES
    assert all(axolotl[name] for name in RECIPES)
    with FIXTURE.open("rb") as raw:
        assert len(raw.read()) < 200_000  # a small committed file


@pytest.mark.parametrize("name", [r for r in RECIPES if r not in DOCUMENTED_DIFFERENCES])
def test_cptune_prepares_what_axolotl_prepares(name: str, axolotl, tmp_path: Path):
    ours, tokenizer = prepared_examples(_recipe(name, tmp_path))
    problem = first_difference(ours, axolotl[name], tokenizer)
    assert problem is None, f"{name}: {problem}"


@pytest.mark.parametrize("name", ["alpaca", "chat-eot-tokens", "completion", "pretokenized"])
def test_packed_rows_hold_axolotls_examples(name: str, axolotl, tmp_path: Path):
    """Packed, the rows hold the same examples (cptune packs when it prepares, Axolotl per batch)."""
    ours, _ = prepared_examples(_recipe(name, tmp_path, sample_packing=True))
    assert len(ours) == len(axolotl[name])
    assert Counter(ours) == Counter(axolotl[name])


def test_mistral_v2v3_differs_by_the_system_message_only(axolotl, tmp_path: Path):
    """Axolotl's mistral_v2v3 drops a system message from a conversation that ends with an answer; cptune
    writes it before the first user message. Without system messages the two agree."""
    data = _recipe("chat-mistral_v2v3", tmp_path)
    source = Path(data["datasets"][0]["path"])
    rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines()]
    ours, tokenizer = prepared_examples(data)
    theirs = axolotl["chat-mistral_v2v3"]
    has_system = [row["messages"][0]["role"] == "system" for row in rows]
    assert any(has_system)
    assert [a != b for a, b in zip(ours, theirs, strict=True)] == has_system
    stripped = tmp_path / "without-system.jsonl"
    stripped.write_text(
        "".join(
            json.dumps({"messages": [m for m in row["messages"] if m["role"] != "system"]}) + "\n"
            for row in rows
        )
    )
    data["datasets"][0]["path"] = str(stripped)
    data["dataset_prepared_path"] = str(tmp_path / "prepared-without-system")
    ours, _ = prepared_examples(data)
    assert first_difference(ours, theirs, tokenizer) is None
