"""The label convention shared by formats, rows, packing and the collator.

``labels[i]`` is the label of token i itself (Hugging Face convention); the
target of position i is ``labels[i + 1]`` within the same document. Tokens
that are not trained carry :data:`IGNORE_INDEX`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["IGNORE_INDEX", "trained_token_count"]

from cptune.tokens import IGNORE_INDEX


def trained_token_count(labels: Sequence[int]) -> int:
    """Target tokens of one sample: labels after the first that are not -100.

    The first token of a sample is never predicted (nothing precedes it in its
    document), so its label does not count, whatever it is. This is the number
    of tokens the sample adds to a token-weighted loss.
    """
    return sum(1 for label in labels[1:] if label != IGNORE_INDEX)
