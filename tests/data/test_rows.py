"""Tokenizing a dataset: row-level error messages, skip counting, length policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pytest
from transformers import PreTrainedTokenizerFast

from cptune.config.data import DatasetConfig
from cptune.data.formats import build_formatter, missing_columns_advice, required_columns
from cptune.data.progress import RowProgress
from cptune.data.rows import CHUNKED_TEXT_LIMIT, count_tokens, tokenize_dataset
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
    progress: RowProgress | None = None,
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
        progress=progress,
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


def test_missing_columns_of_a_dataset_without_type_point_at_type(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    # No type is Axolotl's pre-tokenized form; alpaca rows there are a missing type, not a field name.
    dataset_config = DatasetConfig(path="data/train.jsonl")
    with pytest.raises(DataError) as error:
        tokenize_dataset(
            datasets.Dataset.from_list([GOOD]),
            build_formatter(
                dataset_config, tokenizer, train_on_inputs=False, chat_template=None, label=LABEL
            ),
            label=LABEL,
            key="datasets[0]",
            required=required_columns(dataset_config),
            sequence_len=256,
            excess_length_strategy="drop",
            skip_invalid_rows=False,
            scratch_dir=tmp_path,
            column_advice=missing_columns_advice(dataset_config, "datasets[0]"),
        )
    assert "no column 'input_ids' (it has 'instruction', 'input', 'output')" in str(error.value)
    assert "datasets[0] has no type, which (as in Axolotl) means pre-tokenized rows" in str(error.value)
    assert "set datasets[0].type to the format of the rows (alpaca, chat_template, completion)" in str(
        error.value
    )


def test_completion_rows_are_cut_into_sequence_len_pieces(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    # Axolotl's completion type cuts a tokenized text (bos ... eos) into sequence_len pieces, each its own
    # sample (CompletionPromptTokenizingStrategy.tokenize_prompt, axolotl 0.21.0); a one-token piece (the eos
    # alone) is dropped, as Axolotl drops samples under two tokens.
    text = "The river runs past the old mill and under the stone bridge before it reaches the sea."
    whole = [1, *tokenizer(text, add_special_tokens=False)["input_ids"], 2]
    rows = [{"text": text}, {"text": "Hi."}]
    table, stats, documents = run_with_documents(
        tokenizer, rows, tmp_path, sequence_len=8, strategy="chunk", type="completion"
    )
    pieces = [whole[i : i + 8] for i in range(0, len(whole), 8)]
    pieces = [p for p in pieces if len(p) > 1]
    short = [1, *tokenizer("Hi.", add_special_tokens=False)["input_ids"], 2]
    assert table.column("input_ids").to_pylist() == [*pieces, short]
    assert table.column("labels").to_pylist() == [*pieces, short]
    assert table.column("position_ids").to_pylist()[1] == list(range(len(pieces[1])))
    assert (stats.rows_in, stats.rows_out, stats.chunked, stats.dropped_too_long) == (
        2,
        len(pieces) + 1,
        1,
        0,
    )
    assert documents.column("status").to_pylist() == ["chunked", "kept"]
    assert documents.column("formatted_length").to_pylist() == [len(whole), len(short)]


def test_completion_pieces_stop_at_64_times_sequence_len(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    # Axolotl tokenizes a completion text with max_length 64 * sequence_len: what lies beyond is never
    # trained, and the cut text has no eos.
    text = " ".join(str(i) for i in range(200))
    whole = [1, *tokenizer(text, add_special_tokens=False)["input_ids"], 2]
    assert len(whole) > CHUNKED_TEXT_LIMIT * 4
    table, _ = run(tokenizer, [{"text": text}], tmp_path, sequence_len=4, strategy="chunk", type="completion")
    kept = [t for piece in table.column("input_ids").to_pylist() for t in piece]
    assert kept == whole[: CHUNKED_TEXT_LIMIT * 4]


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
