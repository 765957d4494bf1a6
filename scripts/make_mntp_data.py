"""Generate ``examples/data/mntp.jsonl``: masked next-token prediction rows for the bidirectional example.

With ``causal: false`` every token sees the whole document, so the plain next-token
objective would let position i read its own target (token i+1). Masked next-token
prediction (the LLM2Vec recipe for turning a decoder into a bidirectional encoder)
removes that leak: a share of the input tokens is replaced by a mask token, and only
those are trained, each predicted from the position before it, exactly where cptune's
shifted labels put the target. cptune needs no special code for it: the rows are
``pretokenized`` (``input_ids`` with the masks, ``labels`` with the original token at
masked positions and -100 elsewhere).

The texts are those of ``examples/data/quickstart.jsonl``, tokenized with the tiny
example tokenizer (``examples/tiny-llama``); the mask token is ``_`` (LLM2Vec uses ``_``
for Llama tokenizers, which have no mask token). Seeded; ``--check`` verifies the
committed file.

Usage::

    python scripts/make_mntp_data.py            # rewrite the file
    python scripts/make_mntp_data.py --check    # exit 1 if it differs
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE = REPO_ROOT / "examples" / "data" / "quickstart.jsonl"
TOKENIZER = REPO_ROOT / "examples" / "tiny-llama"
OUTPUT = REPO_ROOT / "examples" / "data" / "mntp.jsonl"

SEED = 20240612
ROWS = 300
MASK_SHARE = 0.2
MASK_TOKEN = "_"
IGNORE_INDEX = -100


def mntp_rows() -> list[dict[str, list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    rng = random.Random(SEED)
    rows = []
    for line in SOURCE.read_text(encoding="utf-8").splitlines()[:ROWS]:
        record = json.loads(line)
        text = " ".join(part for part in (record["instruction"], record["input"], record["output"]) if part)
        ids = [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
        # Token 0 (bos) has no position before it to be predicted from, so it is never masked.
        candidates = list(range(1, len(ids)))
        masked = set(rng.sample(candidates, max(1, round(MASK_SHARE * len(candidates)))))
        rows.append(
            {
                "input_ids": [mask_id if i in masked else token for i, token in enumerate(ids)],
                "labels": [token if i in masked else IGNORE_INDEX for i, token in enumerate(ids)],
            }
        )
    return rows


def expected_text() -> str:
    return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in mntp_rows())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the committed file instead of writing")
    args = parser.parse_args(argv)
    text = expected_text()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text(encoding="utf-8") != text:
            print(
                f"{OUTPUT.relative_to(REPO_ROOT)} differs from what {Path(__file__).name} generates",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(REPO_ROOT)} ({ROWS} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
