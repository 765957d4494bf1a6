"""Progress lines while a dataset is tokenized, where no progress bar is drawn (cptune.data.progress)."""

from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

import cptune.data.prepare as prepare
import cptune.data.progress as progress
from cptune.config.loader import validate_recipe
from cptune.data.progress import RowProgress
from tests.data.test_rows import GOOD, LABEL, run_with_documents

ROWS = 2500  # three of datasets' batches of 1000 rows: 0-999, 1000-1999, 2000-2499


def tokenize(tokenizer, tmp_path: Path, row_progress: RowProgress, num_proc: int | None = None):
    return run_with_documents(
        tokenizer, [GOOD] * ROWS, tmp_path, num_proc=num_proc, progress=row_progress, type="alpaca"
    )


def test_a_line_at_most_every_interval_with_the_row_the_share_the_rate_and_the_time_left():
    lines: list[str] = []
    ticks = itertools.count(0, 25)  # 25 s per call of the clock
    row_progress = RowProgress(LABEL, 10_000, every_seconds=60, clock=lambda: next(ticks), log=lines.append)
    row_progress.started(0)  # t = 0
    row_progress.reached(1000)  # t = 25: too soon
    row_progress.reached(2000)  # t = 50: too soon
    row_progress.reached(3000)  # t = 75: a line, 3000 rows in 75 s
    row_progress.reached(4000)  # t = 100: 25 s after the last line
    row_progress.reached(9000)  # t = 125: 50 s after
    row_progress.reached(9500)  # t = 150: a line
    assert lines == [
        "datasets[0] (data/train.jsonl): tokenized up to row 3,000 of 10,000 (30%), 40 rows/s, about 3 min left",
        "datasets[0] (data/train.jsonl): tokenized up to row 9,500 of 10,000 (95%), 63 rows/s, about 8 s left",
    ]


def test_tokenizing_reports_its_batches_in_one_process(tokenizer: PreTrainedTokenizerFast, tmp_path: Path):
    lines: list[str] = []
    ticks = itertools.count(0, 40)
    row_progress = RowProgress(LABEL, ROWS, every_seconds=60, clock=lambda: next(ticks), log=lines.append)
    table, stats, _ = tokenize(tokenizer, tmp_path, row_progress)
    assert stats.rows_out == table.num_rows == ROWS
    # Batch 1 starts the clock at 0 and ends at 40 (too soon); batch 2 ends at 80; batch 3 at 120: too soon.
    assert lines == [
        "datasets[0] (data/train.jsonl): tokenized up to row 2,000 of 2,500 (80%), 25 rows/s, about 20 s left"
    ]


def append_line(path: Path, line: str) -> None:
    with path.open("a") as file:
        file.write(line + "\n")


@pytest.mark.distributed  # datasets forks num_proc workers
def test_each_worker_reports_its_own_part_by_the_rows_global_index(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
):
    log_file = tmp_path / "progress.log"
    row_progress = RowProgress(LABEL, ROWS, every_seconds=0, log=functools.partial(append_line, log_file))
    tokenize(tokenizer, tmp_path, row_progress, num_proc=2)
    line = re.compile(
        r"datasets\[0\] \(data/train.jsonl\): tokenized up to row ([\d,]+) of 2,500 \(\d+%\), [\d,]+ rows/s "
        r"in the worker that started at row ([\d,]+)"
    )
    reports = sorted(
        tuple(int(n.replace(",", "")) for n in line.fullmatch(text).groups())
        for text in log_file.read_text().splitlines()
    )
    # Two workers of 1250 rows each, every batch of datasets' 1000 rows reported.
    assert reports == [(1000, 0), (1250, 0), (2250, 1250), (2500, 1250)]


def test_prepare_logs_reading_and_tokenizing_progress_only_where_no_bar_is_drawn(
    monkeypatch, tmp_path: Path, tokenizer: PreTrainedTokenizerFast
):
    data = tmp_path / "train.jsonl"
    data.write_text("".join('{"instruction": "Say hi.", "input": "", "output": "Hi."}\n' for _ in range(30)))
    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.0)

    def prepared_lines(on_terminal: bool, folder: str) -> list[str]:
        monkeypatch.setattr(prepare, "draws_progress_bars", lambda: on_terminal)
        recipe = validate_recipe(
            {
                "base_model": "m",
                "datasets": [{"path": str(data), "type": "alpaca"}],
                "sequence_len": 256,
                "dataset_prepared_path": str(tmp_path / folder),
            }
        )
        lines: list[str] = []
        prepare.prepare_datasets(recipe, tokenizer, log=lines.append)
        return [line for line in lines if line.startswith("datasets[0]")]

    read, tokenized = prepared_lines(on_terminal=False, folder="log")
    label = re.escape(f"datasets[0] ({data})")
    assert re.fullmatch(rf"{label}: 30 rows read in \d+\.\d s; tokenizing", read), read
    assert re.fullmatch(
        rf"{label}: tokenized up to row 30 of 30 \(100%\), [\d,]+ rows/s, about 0 s left", tokenized
    ), tokenized
    assert prepared_lines(on_terminal=True, folder="terminal") == []
