"""Tokenizing a dataset: row-level error messages, skip counting, length policy."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import datasets
import pytest
from transformers import PreTrainedTokenizerFast

from cptune.config.data import DatasetConfig
from cptune.data.formats import build_formatter, required_columns
from cptune.data.rows import count_tokens, tokenize_dataset
from cptune.errors import DataError
from cptune.labels import trained_token_count

LABEL = "datasets[0] (data/train.jsonl)"


def run(tokenizer: PreTrainedTokenizerFast, rows: list[dict[str, Any]], tmp_path: Path, **options: Any):
    """The kept samples and their counts (see :func:`run_with_documents` for the options)."""
    table, stats, _ = run_with_documents(tokenizer, rows, tmp_path, **options)
    return table, stats


def run_with_documents(
    tokenizer: PreTrainedTokenizerFast,
    rows: list[dict[str, Any]],
    tmp_path: Path,
    *,
    sequence_len: int = 256,
    strategy: str = "drop",
    skip: bool = False,
    num_proc: int | None = None,
    **config: Any,
):
    dataset_config = DatasetConfig(path="data/train.jsonl", **config)
    return tokenize_dataset(
        datasets.Dataset.from_list(rows),
        build_formatter(dataset_config, tokenizer, train_on_inputs=False, chat_template=None, label=LABEL),
        label=LABEL,
        key="datasets[0]",
        required=required_columns(dataset_config),
        sequence_len=sequence_len,
        excess_length_strategy=strategy,
        skip_invalid_rows=skip,
        scratch_dir=tmp_path,
        num_proc=num_proc,
    )


GOOD = {"instruction": "Say hi.", "input": "", "output": "Hi."}


def test_malformed_row_error_names_dataset_row_and_field(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    rows = [GOOD] * 17 + [{"instruction": "Say hi.", "input": "", "output": None}] + [GOOD] * 3
    with pytest.raises(DataError) as error:
        run(tokenizer, rows, tmp_path, type="alpaca")
    assert str(error.value) == (
        "datasets[0] (data/train.jsonl), row 17: field 'output' is missing. Fix the row, or set "
        "skip_invalid_rows: true to skip such rows (they are counted and reported)."
    )


@pytest.mark.distributed  # datasets forks num_proc workers
def test_error_row_index_survives_several_processes(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    rows = [GOOD] * 2500 + [{"instruction": " ", "input": "", "output": "x"}] + [GOOD] * 10
    with pytest.raises(DataError, match=r"row 2500: field 'instruction' is empty"):
        run(tokenizer, rows, tmp_path, num_proc=2, type="alpaca")


def test_skip_invalid_rows_counts_by_reason(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    rows = [
        GOOD,
        {"instruction": "x", "input": "", "output": None},
        {"instruction": None, "input": "", "output": "y"},
        {"instruction": "x", "input": "", "output": None},
        {"instruction": "x", "input": "", "output": ""},
        GOOD,
    ]
    table, stats = run(tokenizer, rows, tmp_path, skip=True, type="alpaca")
    assert table.num_rows == stats.rows_out == 2
    assert stats.rows_in == 6
    assert stats.skipped == {
        "field 'output' is missing": 2,
        "field 'instruction' is missing": 1,
        "field 'output' is empty": 1,
    }
    assert stats.skipped_total == 4


def test_missing_column_is_reported_once_even_when_skipping(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    with pytest.raises(DataError, match=r"no column 'answer' \(it has 'instruction', 'input', 'output'\)"):
        run(tokenizer, [GOOD], tmp_path, skip=True, type="alpaca", field_output="answer")


def test_prefix_unstable_template_is_not_skipped(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    unstable = copy.deepcopy(tokenizer)
    unstable.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
    )
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    with pytest.raises(DataError, match=r"row 0: the chat template is not prefix-stable"):
        run(unstable, rows, tmp_path, skip=True, type="chat_template")


def lengths_rows(tokenizer: PreTrainedTokenizerFast) -> tuple[list[dict[str, Any]], list[int]]:
    rows = [{"input_ids": list(range(5, 5 + n))} for n in (4, 12, 8, 20, 9)]
    return rows, [4, 12, 8, 20, 9]


def test_excess_length_drop(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    rows, _ = lengths_rows(tokenizer)
    table, stats = run(tokenizer, rows, tmp_path, sequence_len=9, type="pretokenized")
    assert [len(r) for r in table.column("input_ids").to_pylist()] == [4, 8, 9]
    assert (stats.dropped_too_long, stats.truncated, stats.rows_out) == (2, 0, 3)
    assert table.column("position_ids").to_pylist()[0] == [0, 1, 2, 3]
    assert (stats.tokens, stats.trained_tokens) == (21, 18)


def test_excess_length_truncate(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    rows, _ = lengths_rows(tokenizer)
    table, stats = run(tokenizer, rows, tmp_path, sequence_len=9, strategy="truncate", type="pretokenized")
    assert [len(r) for r in table.column("input_ids").to_pylist()] == [4, 9, 8, 9, 9]
    assert table.column("input_ids").to_pylist()[1] == list(range(5, 14))
    assert (stats.dropped_too_long, stats.truncated, stats.rows_out) == (0, 2, 5)


def test_samples_without_trained_tokens_are_dropped(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    rows = [
        {"input_ids": [5, 6, 7], "labels": [-100, -100, -100]},
        {"input_ids": [5, 6, 7], "labels": [5, -100, -100]},  # only the first label: nothing predicts it
        {"input_ids": [5, 6, 7], "labels": [-100, -100, 7]},
        # Truncation cuts away the only trained token.
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, -100, -100, 9]},
    ]
    table, stats = run(tokenizer, rows, tmp_path, sequence_len=4, strategy="truncate", type="pretokenized")
    assert table.column("labels").to_pylist() == [[-100, -100, 7]]
    assert (stats.dropped_no_trained_tokens, stats.truncated) == (3, 0)
    assert count_tokens(table) == (3, 1)
    assert trained_token_count([5, 6, -100]) == 1


def test_a_dataset_left_empty_is_an_error(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no sample is left of its 1 rows \(1 longer than sequence_len"):
        run(tokenizer, [{"input_ids": [1, 2, 3]}], tmp_path, sequence_len=2, type="pretokenized")


@pytest.mark.parametrize("strategy", ["drop", "truncate"])
def test_documents_table_keeps_every_formatted_length_and_what_the_policy_did(
    strategy: str, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    rows, lengths = lengths_rows(tokenizer)
    rows.insert(2, {"input_ids": [5, 10**6]})  # skipped as invalid (not in the vocabulary): no length
    # First, so that the labels column exists (from_list takes the columns of the first row).
    rows.insert(0, {"input_ids": [5, 6, 7], "labels": [-100, -100, -100]})
    _, _, documents = run_with_documents(
        tokenizer, rows, tmp_path, sequence_len=9, strategy=strategy, skip=True, type="pretokenized"
    )
    over = "too long" if strategy == "drop" else "truncated"
    assert documents.column("formatted_length").to_pylist() == [3, *lengths]
    assert documents.column("status").to_pylist() == ["no trained tokens", "kept", over, "kept", over, "kept"]
