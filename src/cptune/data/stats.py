"""What preprocessing did: rows read, kept, dropped and why, tokens, packing.

Stored beside the prepared data as ``stats.json`` so that a run that reuses the
cache reports the same numbers as the run that built it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["DatasetStats", "PrepStats", "SplitStats"]


@dataclass
class DatasetStats:
    """Counts for one dataset entry of the recipe.

    Attributes:
        label: ``datasets[0] (data/train.jsonl)``.
        rows_in: Rows read from the source.
        rows_out: Samples kept.
        skipped: Invalid rows skipped (``skip_invalid_rows``), by reason.
        dropped_too_long: Samples longer than ``sequence_len`` dropped.
        truncated: Samples longer than ``sequence_len`` cut to it (and kept).
        chunked: Completion rows longer than ``sequence_len`` cut into pieces of it (each piece a
            sample, counted in ``rows_out``).
        dropped_no_trained_tokens: Samples without a single target token.
        dropped_too_short: Samples shorter than ``min_sample_len`` dropped.
        dropped_duplicates: Samples dropped by ``dataset_exact_deduplication``: each equal to a sample kept
            before it (of this dataset or an earlier one of the same list; with ``rl``, an evaluation pair
            may also equal a training pair). Not counted in ``rows_out``, ``tokens`` or ``trained_tokens``.
        tokens: Tokens in the kept samples.
        trained_tokens: Target tokens in the kept samples: positions after the
            first whose label is not -100 (the first token of a sample is never
            a target, as nothing precedes it).
    """

    label: str
    rows_in: int = 0
    rows_out: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    dropped_too_long: int = 0
    truncated: int = 0
    chunked: int = 0
    dropped_no_trained_tokens: int = 0
    dropped_too_short: int = 0
    dropped_duplicates: int = 0
    tokens: int = 0
    trained_tokens: int = 0

    @property
    def skipped_total(self) -> int:
        """Invalid rows skipped, all reasons together."""
        return sum(self.skipped.values())


@dataclass
class SplitStats:
    """The rows of one split (train or eval) as stored.

    Attributes:
        samples: Tokenized samples in the split.
        rows: Stored rows (packed rows when packing, else equal to ``samples``).
        tokens: Real tokens (no padding).
        trained_tokens: Target tokens.
        packing_efficiency: ``tokens / (rows * sequence_len)``.
    """

    samples: int = 0
    rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    packing_efficiency: float = 0.0


@dataclass
class PrepStats:
    """Everything :func:`cptune.data.prepare.prepare_datasets` reports.

    Attributes:
        datasets: One entry per ``datasets`` and ``test_datasets`` entry.
        train: The training split.
        eval: The evaluation split, or None without evaluation data.
        sequence_len: The recipe's ``sequence_len``.
        sample_packing: Whether rows are packed.
        seconds: Time the preparation took when it was built.
        fingerprint: The cache key of the prepared data.
        from_cache: True when this run loaded data another run prepared.
    """

    datasets: list[DatasetStats]
    train: SplitStats
    eval: SplitStats | None
    sequence_len: int
    sample_packing: bool
    seconds: float = 0.0
    fingerprint: str = ""
    from_cache: bool = False

    def to_json(self) -> str:
        """JSON text for ``stats.json`` (``from_cache`` is not stored: it describes a run)."""
        data = asdict(self)
        data.pop("from_cache")
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PrepStats:
        """Read what :meth:`to_json` wrote."""
        data: dict[str, Any] = json.loads(text)
        return cls(
            datasets=[DatasetStats(**d) for d in data["datasets"]],
            train=SplitStats(**data["train"]),
            eval=None if data["eval"] is None else SplitStats(**data["eval"]),
            **{
                f.name: data[f.name]
                for f in fields(cls)
                if f.name not in {"datasets", "train", "eval", "from_cache"}
            },
        )

    def format(self) -> str:
        """A few lines for the console: per dataset, then per split (counts with thousands separators, as the
        tokenizing progress lines write them)."""
        origin = "loaded from cache" if self.from_cache else f"prepared in {self.seconds:.1f} s"
        lines = [f"Data {self.fingerprint[:12]} ({origin}), sequence_len {self.sequence_len}:"]
        for d in self.datasets:
            dropped = [
                f"{count:,} {what}"
                for what, count in (
                    ("too long (dropped)", d.dropped_too_long),
                    ("truncated", d.truncated),
                    ("cut into sequence_len pieces", d.chunked),
                    ("without trained tokens (dropped)", d.dropped_no_trained_tokens),
                    ("shorter than min_sample_len (dropped)", d.dropped_too_short),
                    ("exact duplicates (dropped)", d.dropped_duplicates),
                )
                if count
            ]
            dropped += [f"{count:,} skipped: {reason}" for reason, count in sorted(d.skipped.items())]
            tail = f"; {', '.join(dropped)}" if dropped else ""
            lines.append(
                f"  {d.label}: {d.rows_in:,} rows -> {d.rows_out:,} samples, {d.tokens:,} tokens "
                f"({d.trained_tokens:,} trained){tail}"
            )
        for name, split in (("train", self.train), ("eval", self.eval)):
            if split is None:
                continue
            packed = (
                f" packed into {split.rows:,} rows, efficiency {split.packing_efficiency:.1%}"
                if self.sample_packing
                else f", fill {split.packing_efficiency:.1%} of sequence_len"
            )
            lines.append(
                f"  {name}: {split.samples:,} samples, {split.tokens:,} tokens ({split.trained_tokens:,} trained)"
                f"{packed}"
            )
        return "\n".join(lines)
