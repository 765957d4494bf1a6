"""``cptune validate``'s check of the first rows of each data file with the dataset's type."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import pytest

from cptune.config.data import DatasetConfig
from cptune.data.first_rows import FIRST_ROWS, first_row_problems, read_first_rows
from cptune.data.sources import load_source, resolve_source
from tests.data.test_sources import write

ROWS = [
    {
        "instruction": f"Add {i} and 3.",
        "input": "" if i % 2 else f"{i} and 3",
        "output": f"The sum is {i + 3}.",
    }
    for i in range(14)
]
SKIP_HINT = "Fix the row, or set skip_invalid_rows: true to skip such rows (they are counted and reported)."


def write_arrow(path: Path, rows: list[dict]) -> Path:
    # As datasets writes it (an IPC stream), which its arrow builder reads.
    datasets.Dataset.from_list(rows).save_to_disk(str(path.parent / "saved"))
    [shard] = (path.parent / "saved").glob("*.arrow")
    shard.rename(path)
    return path


@pytest.mark.parametrize(
    "name",
    [
        "rows.jsonl",
        "rows.json",
        "pretty.json",
        "columns.json",
        "rows.csv",
        "rows.tsv",
        "rows.parquet",
        "rows.arrow",
    ],
)
def test_the_first_rows_are_those_datasets_gives_the_formatter(tmp_path, name):
    path = tmp_path / name
    if name == "rows.tsv":
        path.write_text(
            "instruction\tinput\toutput\n"
            + "".join(f"{r['instruction']}\t{r['input']}\t{r['output']}\n" for r in ROWS)
        )
    elif name == "rows.arrow":
        write_arrow(path, ROWS)
    elif name == "pretty.json":  # one array over many lines
        path.write_text(json.dumps(ROWS, indent=2))
    elif name == "columns.json":  # one object of columns
        path.write_text(json.dumps({key: [r[key] for r in ROWS] for key in ROWS[0]}, indent=1))
    else:
        write(path, ROWS)
    config = DatasetConfig(path=str(path), type="alpaca")
    source = resolve_source(config, "datasets", 0)
    loaded = load_source(source, config, cache_dir=tmp_path / "hf-cache")
    read = list(read_first_rows(path, source, 4))
    expected = loaded.select(range(min(4, len(loaded)))).to_list()
    assert [r.row for r in read] == expected
    assert [r.index for r in read] == list(range(len(expected)))
    # (datasets reads an object of columns over several lines as one row.)
    assert len(expected) == (1 if name == "columns.json" else 4)


def test_compressed_json_lines_and_text_files(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt") as out:
        out.write("".join(json.dumps(r) + "\n" for r in ROWS))
    config = DatasetConfig(path=str(path), type="alpaca")
    source = resolve_source(config, "datasets", 0)
    assert [r.row for r in read_first_rows(path, source, 2)] == ROWS[:2]
    text = tmp_path / "notes.txt"
    text.write_text("first line\nsecond line\n")
    config = DatasetConfig(path=str(text), type="completion", ds_type="text")
    source = resolve_source(config, "datasets", 0)
    loaded = load_source(source, config, cache_dir=tmp_path / "hf-cache")
    assert [r.row for r in read_first_rows(text, source, 5)] == loaded.to_list()


def test_bad_rows_are_named_by_file_row_and_line_with_what_is_wrong(tmp_path, make_recipe, tokenizer):
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps(ROWS[0]), "", json.dumps({"instruction": "Add.", "outpt": "5"}), json.dumps(ROWS[1])]
    lines += ['{"instruction": "Add.", "output": "5"', json.dumps(ROWS[2])]
    path.write_text("\n".join(lines) + "\n")
    problems = first_row_problems(make_recipe([{"path": str(path), "type": "alpaca"}]), tokenizer)
    label = f"datasets[0] ({path})"
    assert [str(p) for p in problems] == [
        # The blank line 2 is no row (datasets skips it): line 3 holds row 1.
        f"{label}, row 1 (line 3): field 'output' is missing. {SKIP_HINT}",
        f"{label}, row 3 (line 5): not valid JSON (Expecting ',' delimiter, column 38). Each line of a JSON "
        "lines file must be one JSON object; fix the line.",
    ]
    # skip_invalid_rows: the row that train would skip is no problem; the line that does not parse still is.
    recipe = make_recipe([{"path": str(path), "type": "alpaca"}], skip_invalid_rows=True)
    assert [str(p) for p in first_row_problems(recipe, tokenizer)] == [str(problems[1])]


def test_only_the_first_rows_are_read(tmp_path, make_recipe, tokenizer):
    path = write(tmp_path / "rows.jsonl", [*ROWS[:FIRST_ROWS], {"instruction": "late", "outpt": "x"}])
    assert first_row_problems(make_recipe([{"path": str(path), "type": "alpaca"}]), tokenizer) == []
    assert len(first_row_problems(make_recipe([{"path": str(path), "type": "alpaca"}]), tokenizer, 11)) == 1


def test_a_column_the_type_needs_is_named_once_and_each_file_of_a_folder_is_checked(
    tmp_path, make_recipe, tokenizer
):
    folder = tmp_path / "data"
    write(folder / "a.jsonl", ROWS[:3])
    write(folder / "b.jsonl", [{"instruction": "Add.", "answer": "5"}] * 3)
    chats = write(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": 5}]}])
    recipe = make_recipe(
        [{"path": str(folder), "type": "alpaca"}],
        test_datasets=[{"path": str(chats), "type": "chat_template"}],
        chat_template="chatml",
    )
    problems = [str(p) for p in first_row_problems(recipe, tokenizer)]
    assert problems[0] == (
        f"datasets[0] ({folder}), file '{folder / 'b.jsonl'}': its first 3 rows have no column 'output' "
        "(they have 'answer', 'instruction'). Set the field name keys of datasets[0] (e.g. field_output, "
        "field_messages, field) to the columns your data uses."
    )
    assert problems[1].startswith(f"test_datasets[0] ({chats}), row 0 (line 1): "), problems
    assert len(problems) == 2, problems


def test_entries_that_do_not_resolve_and_hub_datasets_are_left_to_their_own_checks(make_recipe, tokenizer):
    recipe = make_recipe(
        [{"path": "missing.jsonl", "type": "alpaca"}, {"path": "owner/name", "type": "alpaca"}]
    )
    assert first_row_problems(recipe, tokenizer) == []


def test_a_saved_dataset_folder_is_checked_from_its_split(tmp_path, make_recipe, tokenizer):
    rows = [*ROWS[:2], {"instruction": "Add.", "input": "", "output": None}]
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(folder))
    problems = first_row_problems(make_recipe([{"path": str(folder), "type": "alpaca"}]), tokenizer)
    assert [str(p) for p in problems] == [
        f"datasets[0] ({folder}), row 2: field 'output' is missing. {SKIP_HINT}"
    ]
    # A split the folder does not have is left to preprocess and train, which name the splits it has.
    recipe = make_recipe([{"path": str(folder), "type": "alpaca", "split": "test"}])
    assert first_row_problems(recipe, tokenizer) == []
