"""Progress lines while a dataset is tokenized, for logs where no progress bar is drawn.

On a terminal ``datasets`` draws a bar for each tokenization. In a log file (a batch job, ``nohup``,
a launcher's log) cptune turns those bars off (:func:`cptune.console.progress_bars_on_terminal_only`),
and tokenizing a large long-context dataset would otherwise print nothing for as long as it runs.
:class:`RowProgress` logs one line every :data:`PROGRESS_SECONDS` instead: the row reached, the
share of the dataset, the rate and the time left at that rate. In ``dataset_processes`` worker
processes each worker reports its own part (its rows start where its first batch started).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

__all__ = ["PROGRESS_SECONDS", "RowProgress"]

PROGRESS_SECONDS = 60.0
"""Seconds between two progress lines of one process."""

logger = logging.getLogger(__name__)


class RowProgress:
    """Told where each batch of rows starts and ends; logs a line when enough time has passed.

    Args:
        label: Names the dataset: ``datasets[0] (data/train.jsonl)``.
        total_rows: Rows of the whole dataset.
        every_seconds: Least time between two lines of one process; default :data:`PROGRESS_SECONDS`.
        clock: Seconds, monotonic (a test's fake clock).
        log: Receives each line; default: this module's logger at INFO. It must pickle (worker
            processes get a copy).
    """

    def __init__(
        self,
        label: str,
        total_rows: int,
        *,
        every_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] | None = None,
    ):
        self.label = label
        self.total_rows = total_rows
        self.every_seconds = PROGRESS_SECONDS if every_seconds is None else every_seconds
        self.clock = clock
        self.log = log
        self._parent = os.getpid()
        # (pid, first row, time) of this process's first batch: a worker process starts its own clock.
        self._start: tuple[int, int, float] | None = None
        self._last = 0.0

    def started(self, first_row: int) -> None:
        """A batch starting at ``first_row`` is about to be tokenized (the clock starts at a process's first)."""
        if self._start is None or self._start[0] != os.getpid():
            now = self.clock()
            self._start, self._last = (os.getpid(), first_row, now), now

    def reached(self, next_row: int) -> None:
        """Every row before ``next_row`` of this process's part is tokenized."""
        if self._start is None:
            return
        now = self.clock()
        if now - self._last < self.every_seconds:
            return
        self._last = now
        _, first_row, began = self._start
        done = next_row - first_row
        rate = done / max(now - began, 1e-9)
        line = (
            f"{self.label}: tokenized up to row {next_row:,} of {self.total_rows:,} "
            f"({100 * next_row / max(self.total_rows, 1):.0f}%), {rate:,.0f} rows/s"
        )
        if os.getpid() != self._parent:
            # A worker of dataset_processes: its own part, from its first row.
            line += f" in the worker that started at row {first_row:,}"
        elif rate > 0:
            line += f", about {_duration((self.total_rows - next_row) / rate)} left"
        (self.log or logger.info)(line)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
