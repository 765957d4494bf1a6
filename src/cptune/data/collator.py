"""Batch prepared rows into tensors, with next-token targets that never cross a document.

The batch carries no ``attention_mask``: with ``attention_mask=None`` and no KV
cache (``use_cache=False``), transformers reads document boundaries from
``position_ids`` (``masking_utils.find_packed_sequence_indices``: a new document
starts wherever ``position_ids[i] != position_ids[i - 1] + 1``) and builds a
block-diagonal causal mask. Padding is given positions 0..p-1 so that it forms a
document of its own: real tokens never attend to it, whatever it attends to is
discarded because its targets are -100.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from cptune.config.recipe import Recipe
from cptune.labels import IGNORE_INDEX, pair_sequence_ids, shift_labels_within_documents

__all__ = ["PackedCollator"]


@dataclass(frozen=True)
class PackedCollator:
    """Turn rows of ``input_ids``/``labels``/``position_ids`` lists into a padded batch.

    The batch has ``input_ids``, ``labels`` (-100 on padding), ``position_ids``
    (0..p-1 on the padding, so padding is its own document) and ``shift_labels``
    (see :func:`shift_labels_within_documents`). Rows are right-padded to the
    longest row, or to ``sequence_len`` when ``pad_to_sequence_len``; then up to a
    multiple of ``pad_to_multiple_of`` (context parallelism needs the length to
    split evenly).

    Args:
        pad_token_id: Id written into padded ``input_ids``. Any valid id works (padding
            is its own document and never trained); None, for tokenizers
            without a pad token, writes 0.
        sequence_len: The recipe's ``sequence_len``; used when ``pad_to_sequence_len``.
        pad_to_sequence_len: Pad every batch to ``sequence_len`` (constant shapes).
        pad_to_multiple_of: Round the padded length up to a multiple of this.
        preference: The rows hold preference pairs (``rl``): the batch also has ``sequence_ids``
            (:func:`~cptune.labels.pair_sequence_ids`) and ``pairs``, the number of pairs in it.
        pair_sides_in_own_rows: With ``preference``: each row holds one pair (two documents), which
            the batch lays out as two rows, the chosen side then the rejected side, each followed by
            padding (``Recipe.pair_sides_in_own_rows``: attention without a document mask stays exact).
    """

    pad_token_id: int | None
    sequence_len: int | None = None
    pad_to_sequence_len: bool = False
    pad_to_multiple_of: int | None = None
    preference: bool = False
    pair_sides_in_own_rows: bool = False

    @classmethod
    def for_recipe(cls, recipe: Recipe, pad_token_id: int | None) -> PackedCollator:
        """The collator training uses for ``recipe`` (``cptune preprocess --debug`` shows its labels)."""
        return cls(
            pad_token_id=pad_token_id,
            sequence_len=recipe.sequence_len,
            pad_to_sequence_len=recipe.pad_to_sequence_len,
            preference=recipe.is_preference,
            pair_sides_in_own_rows=recipe.pair_sides_in_own_rows,
        )

    def __post_init__(self) -> None:
        if self.pad_to_sequence_len and self.sequence_len is None:
            raise ValueError("pad_to_sequence_len needs sequence_len")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")

    def padded_length(self, longest: int) -> int:
        """Length every row of a batch whose longest row has ``longest`` tokens is padded to."""
        length = max(longest, self.sequence_len) if self.pad_to_sequence_len else longest
        multiple = self.pad_to_multiple_of
        if multiple and length % multiple:
            length += multiple - length % multiple
        return length

    def __call__(self, rows: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
        """Collate rows into ``input_ids``, ``labels``, ``position_ids`` and ``shift_labels`` of shape
        (batch, seq), plus ``num_tokens``: the number of real (non-padding) tokens."""
        if not rows:
            raise ValueError("cannot collate an empty batch")
        if self.pair_sides_in_own_rows:
            rows = [side for row in rows for side in split_pair_sides(row)]
        length = self.padded_length(max(len(row["input_ids"]) for row in rows))
        pad = 0 if self.pad_token_id is None else self.pad_token_id
        input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        # Padding positions 0..p-1: a restart at 0 is a document boundary for
        # transformers, so real tokens and padding never see each other.
        position_ids = torch.arange(length, dtype=torch.long).repeat(len(rows), 1)
        for b, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            labels[b, :n] = torch.as_tensor(row["labels"], dtype=torch.long)
            if "position_ids" in row:
                position_ids[b, :n] = torch.as_tensor(row["position_ids"], dtype=torch.long)
            position_ids[b, n:] = torch.arange(length - n, dtype=torch.long)
        batch = {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": position_ids,
            "shift_labels": shift_labels_within_documents(labels, position_ids),
            # Real (non-padding) tokens, for throughput logging; never given to the model.
            "num_tokens": torch.tensor(sum(len(row["input_ids"]) for row in rows)),
        }
        if self.preference:
            sequence_ids = pair_sequence_ids(
                position_ids,
                [len(row["input_ids"]) for row in rows],
                one_side_per_row=self.pair_sides_in_own_rows,
            )
            batch["sequence_ids"] = sequence_ids
            batch["pairs"] = (sequence_ids.max() + 1) // 2
            if "reference_logps" in rows[0]:
                # Precomputed (precompute_ref_log_probs): chosen, rejected of each pair of the row, in order;
                # sides split into rows carry their pair's two values on the chosen side's row.
                batch["reference_logps"] = torch.tensor(
                    [v for row in rows for v in row.get("reference_logps", ())], dtype=torch.float32
                )
        return batch


def split_pair_sides(row: Mapping[str, Sequence[int]]) -> list[dict[str, list[int]]]:
    """A prepared pair row (prompt + chosen, then prompt + rejected) as two rows, one per side.

    Raises:
        ValueError: The row does not hold exactly two documents (``position_ids`` restart once).
    """
    positions = list(row["position_ids"])
    starts = [i for i, p in enumerate(positions) if p == 0]
    if len(starts) != 2 or starts[0] != 0:
        raise ValueError(
            f"a preference row to split into its sides holds {len(starts)} documents, not one pair"
        )
    cut = starts[1]
    chosen = {key: list(row[key][:cut]) for key in ("input_ids", "labels", "position_ids")}
    rejected = {key: list(row[key][cut:]) for key in ("input_ids", "labels", "position_ids")}
    if "reference_logps" in row:
        chosen["reference_logps"], rejected["reference_logps"] = list(row["reference_logps"]), []
    return [chosen, rejected]
