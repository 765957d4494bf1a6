"""Deterministic synthetic data for the benchmarks: length mixes, alpaca rows, pre-tokenized rows.

Real fine-tuning sets are not shipped with cptune and nothing may be downloaded,
so the benchmarks build their data from a seed. Sample lengths follow mixes
shaped like public instruction and long-context sets (log-normal bulk, long
tail); they are assumptions, stated on the results page, not measurements of a
particular dataset.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LengthMix:
    """A named distribution of sample lengths (tokens) for rows of ``sequence_len``.

    Attributes:
        name: Shown on the results page.
        sequence_len: Row capacity the samples are packed into.
        parts: (share, kind, a, b) per component: ``lognormal`` with median ``a`` and
            sigma ``b``, or ``uniform`` on ``[a, b]``. Shares add up to 1.
        description: One line for the page.
    """

    name: str
    sequence_len: int
    parts: tuple[tuple[float, str, float, float], ...]
    description: str

    def sample(self, count: int, seed: int = 0) -> list[int]:
        """``count`` lengths in ``[8, sequence_len]``, the same for the same seed."""
        rng = random.Random(seed)
        cumulative, total = [], 0.0
        for share, *_ in self.parts:
            total += share
            cumulative.append(total)
        lengths = []
        for _ in range(count):
            pick = rng.random() * total
            share, kind, a, b = self.parts[next(i for i, c in enumerate(cumulative) if pick <= c)]
            value = rng.lognormvariate(math.log(a), b) if kind == "lognormal" else rng.uniform(a, b)
            lengths.append(int(min(self.sequence_len, max(8, round(value)))))
        return lengths


LENGTH_MIXES = (
    LengthMix(
        "instruction mix @ 4K",
        4096,
        ((1.0, "lognormal", 350.0, 1.0),),
        "log-normal, median 350 tokens, sigma 1.0 (chat/instruction SFT shape)",
    ),
    LengthMix(
        "long-context mix @ 32K",
        32768,
        (
            (0.6, "lognormal", 600.0, 1.0),
            (0.3, "uniform", 2048.0, 16384.0),
            (0.1, "uniform", 16384.0, 32768.0),
        ),
        "60% log-normal (median 600), 30% 2K-16K documents, 10% 16K-32K documents",
    ),
)

_TEXT = (
    "the river runs past old mill and under stone bridge before it reaches sea morning baker opens shop "
    "lights oven sets out first loaves small model can learn simple task quickly when answers follow clear "
    "rule committee met on tuesday reviewed budget agreed to plant more trees in park weather report cold "
    "north warm south light rain by evening numbers such as 12 25 50 64 100 128 256 512 appear in tables"
)
_WORDS = tuple(_TEXT.split(" "))


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, words)))


def write_alpaca(path: Path, lengths: Sequence[int], seed: int = 0) -> Path:
    """An alpaca jsonl file with one row per length; a row has about ``length`` words in all."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for length in lengths:
            prompt = max(1, length // 4)
            row = {"instruction": _text(rng, prompt), "input": "", "output": _text(rng, length - prompt)}
            out.write(json.dumps(row) + "\n")
    return path


def write_pretokenized(path: Path, rows: int, length: int, vocab: int, seed: int = 0) -> Path:
    """A jsonl file of ``rows`` pre-tokenized rows of exactly ``length`` random token ids (all trained)."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(rows):
            out.write(json.dumps({"input_ids": [rng.randrange(5, vocab) for _ in range(length)]}) + "\n")
    return path
