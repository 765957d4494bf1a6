"""The arithmetic of preference evaluation (cptune.run.training.preference_trainer): filler pairs count nowhere,
and the eval loss is the mean over every pair, not a mean of per-batch means.

The end-to-end checks run in existing launches: tests/run/test_evaluate.py (LoRA, cp=2, dp=2, dp=2×cp=2 against
every side of every pair through the plain model) and tests/run/test_train_preference.py (a full fine-tune's evaluation
with the reference precomputed, cp=2 and dp=2 against cp=1, a filler row at dp=2).
"""

from __future__ import annotations

import torch

from cptune.data.collator import PackedCollator
from cptune.data.preference_formats import pair_sample
from cptune.parallel.preference import METRICS, PairBatch, PreferenceLoss
from cptune.run.training.eval_loop import EvalRows
from cptune.run.training.preference_trainer import PairMetrics, pairs_with_targets


def _row(*pairs: tuple[list[int], list[int], list[int]]) -> dict[str, list[int]]:
    samples = [pair_sample(*pair) for pair in pairs]
    return {
        "input_ids": [t for s in samples for t in s.input_ids],
        "labels": [t for s in samples for t in s.labels],
        "position_ids": [t for s in samples for t in s.position_ids],
    }


def test_a_filler_rows_pairs_count_nowhere():
    """EvalRows pads a data-parallel group with a copy of row 0 whose labels are all -100: its pairs have no
    targets on either side, so they add no loss, no metric and no pair."""
    rows = [_row(([5, 6], [7, 8, 9], [10, 11]), ([12], [13, 14], [15, 16, 17]))]
    padded = EvalRows(rows, indices=[], length=1)  # a group with no row of its own: one filler
    collate = PackedCollator(pad_token_id=0, preference=True)
    real, filler = PairBatch.from_inputs(collate(rows)), PairBatch.from_inputs(collate([padded[0]]))
    assert filler.pairs == 2 and int(filler.target_counts().sum()) == 0
    loss = PreferenceLoss("dpo", beta=0.1)
    for batch in (real, filler):
        policy = torch.arange(batch.sequences, dtype=torch.float32) - 10.0
        outputs = loss.pair_outputs(policy, torch.zeros_like(policy), batch.target_counts())
        kept = pairs_with_targets(outputs, batch.target_counts())
        assert len(kept.losses) == (2 if batch is real else 0)
        assert torch.equal(kept.losses, outputs.losses[: len(kept.losses)])


def test_the_eval_loss_is_the_mean_over_pairs_not_a_mean_of_batch_means():
    metrics = PairMetrics(("loss", *METRICS))
    zeros = dict.fromkeys(METRICS, torch.tensor(0.0))
    metrics.add({"loss": torch.tensor(3.0), **zeros}, 1)  # a batch of one pair with loss 3
    metrics.add({"loss": torch.tensor(3.0), **zeros}, 3)  # a batch of three pairs with loss 1 each
    means = metrics.means()
    assert means["loss"] == 6.0 / 4  # a mean of the batch means would give (3 + 1) / 2
    assert metrics.last_pairs == 4
    assert metrics.means() == {}  # reset: no pair since the last call
