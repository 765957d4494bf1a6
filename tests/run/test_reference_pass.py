"""The first pass of precompute_ref_log_probs: which batches each data-parallel group runs, and the rows' sums."""

from __future__ import annotations

import pytest

from cptune.run.training.reference_pass import COLUMN, RowsAwaitingReference, first_pass_schedule


@pytest.mark.parametrize("batches", [0, 1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_every_group_runs_as_many_forwards_and_each_batch_is_kept_once(batches, dp_size):
    schedules = [first_pass_schedule(batches, rank, dp_size) for rank in range(dp_size)]
    # With sharded parameters every forward gathers from every rank: the groups must run in step.
    assert len({len(schedule) for schedule in schedules}) == 1
    kept = sorted(number for schedule in schedules for number, keep in schedule if keep)
    assert kept == list(range(batches))
    # Group g keeps g, g + dp, ... (the rows the Trainer's groups would see in the stored order).
    for rank, schedule in enumerate(schedules):
        assert [n for n, keep in schedule if keep] == list(range(rank, batches, dp_size))
        assert all(0 <= n < max(batches, 1) for n, _ in schedule)


def test_three_batches_over_two_groups_give_the_second_group_a_filler():
    assert first_pass_schedule(3, 0, 2) == [(0, True), (2, True)]
    assert first_pass_schedule(3, 1, 2) == [(1, True), (1, False)]
    assert first_pass_schedule(1, 1, 2) == [(0, False)]


def test_rows_awaiting_reference_give_their_sums_once_filled():
    rows = RowsAwaitingReference([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    assert len(rows) == 2
    with pytest.raises(RuntimeError, match="before the first pass computed"):
        rows[0]
    with pytest.raises(ValueError, match="1 rows of reference sums for 2 training rows"):
        rows.fill([[0.5, -1.0]])
    rows.fill([[-1.5, -2.5], [-3.0, -4.0]])
    assert rows[1] == {"input_ids": [3], COLUMN: [-3.0, -4.0]}
