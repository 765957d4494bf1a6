"""dataset_exact_deduplication: which samples are dropped, where (before the split), and the cache key.

Axolotl's rule (src/axolotl/utils/data/{sft,rl,shared,utils}.py at 067b021c): the tokenized samples of
all ``datasets`` are deduplicated together, first copy kept, before val_set_size holds rows out;
``test_datasets`` among themselves; with ``rl`` an evaluation pair equal to a training pair is dropped too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from transformers import PreTrainedTokenizerFast

from cptune.config.recipe import Recipe
from cptune.data.cache import compute_fingerprint
from cptune.data.dedup import drop_duplicates, sample_digests
from cptune.data.prepare import prepare_datasets, resolve_sources
from cptune.errors import DataError
from tests.conftest import REPO

MakeRecipe = Callable[..., Recipe]
PAIRS = [
    json.loads(line) for line in (REPO / "examples" / "data" / "preference.jsonl").read_text().splitlines()
]


def quiet(_: str) -> None:
    pass


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def samples(dataset: Any) -> list[tuple[list[int], list[int]]]:
    return [(row["input_ids"], row["labels"]) for row in dataset]


# Pre-tokenized rows: what each sample is, exactly. The "id" column is read by nothing.
FIRST = [
    {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "id": "a"},
    {"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8], "id": "b"},  # the same tokens, other labels: kept
    {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "id": "c"},  # row 0 again (another id): dropped
    {"input_ids": [9, 10, 11], "labels": [9, 10, 11], "id": "d"},
    {"input_ids": [9, 10, 11], "labels": [9, 10, 11], "id": "d"},  # row 3 again: dropped
]
SECOND = [
    {"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8]},  # datasets[0] row 1 again: dropped
    {"input_ids": [12, 13, 14], "labels": [12, 13, 14]},
    {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},  # a prefix of datasets[0] row 0: kept
]


def test_the_first_copy_of_each_sample_is_kept_across_datasets_and_the_drops_are_counted(
    make_recipe: MakeRecipe, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    recipe = make_recipe(
        [
            {"path": write_jsonl(tmp_path / "first.jsonl", FIRST)},
            {"path": write_jsonl(tmp_path / "second.jsonl", SECOND)},
        ],
        dataset_exact_deduplication=True,
    )
    prepared = prepare_datasets(recipe, tokenizer, log=quiet)
    assert samples(prepared.train) == [
        ([5, 6, 7, 8], [-100, 6, 7, 8]),
        ([5, 6, 7, 8], [5, 6, 7, 8]),
        ([9, 10, 11], [9, 10, 11]),
        ([12, 13, 14], [12, 13, 14]),
        ([5, 6, 7], [-100, 6, 7]),
    ]
    first, second = prepared.stats.datasets
    assert (first.rows_in, first.rows_out, first.dropped_duplicates) == (5, 3, 2)
    assert (second.rows_in, second.rows_out, second.dropped_duplicates) == (3, 2, 1)
    # What is kept no longer counts the drops: 4 + 4 + 3 tokens, 3 + 3 + 2 targets (the first token never is one).
    assert (first.tokens, first.trained_tokens) == (11, 8)
    assert (second.tokens, second.trained_tokens) == (6, 4)
    assert first.tokens + second.tokens == prepared.stats.train.tokens
    lines = prepared.stats.format().splitlines()
    assert lines[1].endswith(": 5 rows -> 3 samples, 11 tokens (8 trained); 2 exact duplicates (dropped)")
    assert lines[2].endswith(": 3 rows -> 2 samples, 6 tokens (4 trained); 1 exact duplicates (dropped)")

    kept_all = prepare_datasets(
        recipe.model_copy(update={"dataset_exact_deduplication": False}), tokenizer, log=quiet
    )
    assert len(kept_all.train) == 8 and [d.dropped_duplicates for d in kept_all.stats.datasets] == [0, 0]


def test_duplicates_go_before_the_validation_split_so_no_held_out_sample_is_a_training_sample(
    make_recipe: MakeRecipe, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    rows = [
        {
            "instruction": f"Add {i % 4} and {i % 4 + 1}.",
            "input": "",
            "output": f"The sum is {2 * (i % 4) + 1}.",
        }
        for i in range(12)
    ]
    recipe = make_recipe(
        [{"path": write_jsonl(tmp_path / "alpaca.jsonl", rows), "type": "alpaca"}],
        val_set_size=0.5,
        dataset_exact_deduplication=True,
    )
    prepared = prepare_datasets(recipe, tokenizer, log=quiet)
    assert prepared.eval is not None
    train = [tuple(map(tuple, s)) for s in samples(prepared.train)]
    held_out = [tuple(map(tuple, s)) for s in samples(prepared.eval)]
    assert len(train) == len(held_out) == 2  # 4 distinct samples, half held out
    assert len(set(train + held_out)) == 4
    assert prepared.stats.datasets[0].dropped_duplicates == 8


def test_supervised_test_datasets_are_deduplicated_among_themselves_only(
    make_recipe: MakeRecipe, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    test_rows = [SECOND[1], FIRST[3], SECOND[1]]  # FIRST[3] is a training sample too: Axolotl keeps it
    recipe = make_recipe(
        [{"path": write_jsonl(tmp_path / "first.jsonl", FIRST)}],
        test_datasets=[{"path": write_jsonl(tmp_path / "test.jsonl", test_rows)}],
        dataset_exact_deduplication=True,
    )
    prepared = prepare_datasets(recipe, tokenizer, log=quiet)
    assert prepared.eval is not None
    assert samples(prepared.eval) == [([12, 13, 14], [12, 13, 14]), ([9, 10, 11], [9, 10, 11])]
    assert prepared.stats.datasets[1].dropped_duplicates == 1


def test_with_rl_an_evaluation_pair_equal_to_a_training_pair_is_dropped(
    make_recipe: MakeRecipe, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    def pairs_at(name: str, indices: list[int]) -> dict[str, Any]:
        path = write_jsonl(tmp_path / name, [PAIRS[i] for i in indices])
        return {"path": path, "type": "chat_template.default", "field_messages": "prompt"}

    def recipe(test: list[int]) -> Recipe:
        return make_recipe(
            [pairs_at("train.jsonl", [0, 1, 2, 0])],
            test_datasets=[pairs_at(f"test-{len(test)}.jsonl", test)],
            dataset_exact_deduplication=True,
            rl="dpo",
            adapter="lora",
        )

    only_train = make_recipe([pairs_at("alone.jsonl", [5, 6])], rl="dpo", adapter="lora")
    expected_eval = samples(prepare_datasets(only_train, tokenizer, log=quiet).train)
    # Pair 1 is a training pair; the second pair 5 repeats the first.
    prepared = prepare_datasets(recipe([1, 5, 5, 6]), tokenizer, log=quiet)
    assert prepared.eval is not None and samples(prepared.eval) == expected_eval
    assert [d.dropped_duplicates for d in prepared.stats.datasets] == [1, 2]
    assert len(prepared.train) == 3
    with pytest.raises(DataError, match=r"every evaluation pair of test_datasets equals a training pair"):
        prepare_datasets(recipe([2, 0]), tokenizer, log=quiet)


def test_the_setting_is_part_of_the_cache_key_so_neither_preparation_is_reused_for_the_other(
    make_recipe: MakeRecipe, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    recipe = make_recipe([{"path": write_jsonl(tmp_path / "first.jsonl", FIRST)}])
    deduplicated = recipe.model_copy(update={"dataset_exact_deduplication": True})
    key, dedup_key = (compute_fingerprint(r, tokenizer, resolve_sources(r)) for r in (recipe, deduplicated))
    assert key != dedup_key
    plain = prepare_datasets(recipe, tokenizer, log=quiet)
    fresh = prepare_datasets(deduplicated, tokenizer, log=quiet)
    assert not fresh.stats.from_cache and fresh.path != plain.path
    assert (len(plain.train), len(fresh.train)) == (5, 3)
    again = prepare_datasets(recipe, tokenizer, log=quiet)
    assert again.stats.from_cache and again.path == plain.path and len(again.train) == 5


def test_digests_cover_tokens_labels_and_positions() -> None:
    def table(rows: list[tuple[list[int], list[int], list[int]]]) -> pa.Table:
        ids, labels, positions = zip(*rows, strict=True)
        return pa.table({"input_ids": list(ids), "labels": list(labels), "position_ids": list(positions)})

    a = ([1, 2, 3, 4], [1, 2, 3, 4], [0, 1, 2, 3])
    other_positions = ([1, 2, 3, 4], [1, 2, 3, 4], [0, 1, 0, 1])  # the same tokens as two documents
    other_labels = ([1, 2, 3, 4], [-100, 2, 3, 4], [0, 1, 2, 3])
    digests = sample_digests(table([a, other_positions, other_labels, a]))
    assert len(set(digests)) == 3 and digests[0] == digests[3]
    # A sliced table (its columns start inside their backing arrays) gives the same digests.
    assert sample_digests(table([other_labels, a, a]).slice(1)) == [digests[0], digests[0]]
    result = drop_duplicates(
        [table([a, other_labels]), table([other_labels, other_positions])], earlier={digests[1]}
    )
    assert [t.num_rows for t in result.kept] == [2, 0] and [t.num_rows for t in result.dropped] == [0, 2]
    assert result.seen == set(digests)
