"""Generate the quickstart datasets: ``examples/data/quickstart.jsonl`` and ``quickstart_chat.jsonl``.

The task is a mix of five small word puzzles whose answers follow from the
question alone, so that the 2-layer example model (``examples/tiny-llama``)
visibly learns them in a couple of minutes on a laptop CPU:

* colour name -> hex code (``"teal"`` -> ``"#008080"``),
* word -> its opposite (``"early"`` -> ``"late"``),
* reverse the order of 3-5 words,
* metres -> centimetres (``"7 m"`` -> ``"700 cm"``),
* count from a to b, asked in the instruction alone (the ``input`` is empty,
  which exercises the alpaca prompt without an input block).

The data is generated here from a fixed seed; the output is committed and
``--check`` verifies that it still matches this script.

Usage::

    python scripts/make_quickstart_data.py            # rewrite the files
    python scripts/make_quickstart_data.py --check    # exit 1 if they differ
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "examples" / "data"
ALPACA_PATH = DATA_DIR / "quickstart.jsonl"
CHAT_PATH = DATA_DIR / "quickstart_chat.jsonl"

SEED = 20240611
ROWS_PER_TASK = 120
CHAT_ROWS = 100

COLOURS = {
    "black": "#000000",
    "white": "#ffffff",
    "red": "#ff0000",
    "lime": "#00ff00",
    "blue": "#0000ff",
    "yellow": "#ffff00",
    "cyan": "#00ffff",
    "magenta": "#ff00ff",
    "silver": "#c0c0c0",
    "grey": "#808080",
    "maroon": "#800000",
    "olive": "#808000",
    "green": "#008000",
    "purple": "#800080",
    "teal": "#008080",
    "navy": "#000080",
    "orange": "#ffa500",
    "pink": "#ffc0cb",
    "gold": "#ffd700",
    "brown": "#a52a2a",
    "coral": "#ff7f50",
    "indigo": "#4b0082",
    "violet": "#ee82ee",
    "salmon": "#fa8072",
}

OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "early": "late",
    "open": "closed",
    "fast": "slow",
    "light": "dark",
    "full": "empty",
    "high": "low",
    "old": "new",
    "happy": "sad",
    "up": "down",
    "wet": "dry",
    "hard": "soft",
    "loud": "quiet",
    "rich": "poor",
    "thick": "thin",
    "win": "lose",
    "push": "pull",
    "inside": "outside",
    "before": "after",
}
# Each pair is asked both ways round.
OPPOSITES.update({b: a for a, b in list(OPPOSITES.items())})

WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "lamp", "bread", "window", "garden", "horse",
    "music", "paper", "train", "candle", "forest", "silver", "rabbit", "pencil", "ocean", "mirror",
    "summer", "bridge", "cheese", "kettle", "planet", "button", "ladder", "orange", "pocket", "violin",
)  # fmt: skip

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")

Row = dict[str, str]


def colour_row(rng: random.Random) -> Row:
    """Ask for the hex code of a named colour."""
    name = rng.choice(sorted(COLOURS))
    instruction = rng.choice(
        (
            "Give the hex code of this colour.",
            "What is the hex code for this colour?",
            "Convert the colour name to hex.",
        )
    )
    return {"instruction": instruction, "input": name, "output": COLOURS[name]}


def opposite_row(rng: random.Random) -> Row:
    """Ask for the opposite of a word."""
    word = rng.choice(sorted(OPPOSITES))
    instruction = rng.choice(("Give the opposite of this word.", "What is the opposite of this word?"))
    return {"instruction": instruction, "input": word, "output": OPPOSITES[word]}


def reverse_row(rng: random.Random) -> Row:
    """Ask to reverse the order of a few words."""
    words = rng.sample(WORDS, rng.randint(3, 5))
    instruction = rng.choice(("Reverse the order of these words.", "Write these words in reverse order."))
    return {"instruction": instruction, "input": " ".join(words), "output": " ".join(reversed(words))}


def metres_row(rng: random.Random) -> Row:
    """Ask to convert whole metres to centimetres."""
    metres = rng.randint(1, 99)
    instruction = rng.choice(
        ("Convert this length from metres to centimetres.", "How many centimetres is this?")
    )
    return {"instruction": instruction, "input": f"{metres} m", "output": f"{metres * 100} cm"}


def count_row(rng: random.Random) -> Row:
    """Ask to count between two small numbers; the question has no input."""
    start = rng.randint(0, 6)
    stop = rng.randint(start + 2, min(start + 5, 10))
    numbers = range(start, stop + 1)
    if rng.random() < 0.5:
        instruction = f"Count from {start} to {stop}."
        output = ", ".join(str(n) for n in numbers)
    else:
        instruction = f"Count from {NUMBER_WORDS[start]} to {NUMBER_WORDS[stop]} in words."
        output = ", ".join(NUMBER_WORDS[n] for n in numbers)
    return {"instruction": instruction, "input": "", "output": output}


TASKS: tuple[Callable[[random.Random], Row], ...] = (
    colour_row,
    opposite_row,
    reverse_row,
    metres_row,
    count_row,
)

SYSTEM_PROMPTS = ("You are a concise assistant.", "Answer with the result only.")


def alpaca_rows(seed: int = SEED, rows_per_task: int = ROWS_PER_TASK) -> list[Row]:
    """Return the alpaca-format rows: ``rows_per_task`` of each task, shuffled."""
    rng = random.Random(seed)
    rows = [task(rng) for task in TASKS for _ in range(rows_per_task)]
    rng.shuffle(rows)
    return rows


def _user_text(row: Row) -> str:
    return f"{row['instruction']}\n{row['input']}" if row["input"] else row["instruction"]


def chat_rows(seed: int = SEED + 1, count: int = CHAT_ROWS) -> list[dict[str, list[Row]]]:
    """Return chat-format rows of the same task: 1-3 exchanges, some with a system prompt."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(count):
        messages: list[Row] = []
        if rng.random() < 0.4:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(rng.choice((1, 1, 2, 3))):
            row = rng.choice(TASKS)(rng)
            messages.append({"role": "user", "content": _user_text(row)})
            messages.append({"role": "assistant", "content": row["output"]})
        conversations.append({"messages": messages})
    return conversations


def to_jsonl(rows: list) -> str:
    """Serialise rows as JSON Lines, one compact object per line."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def expected_files() -> dict[Path, str]:
    """Return the content each generated file must have."""
    return {ALPACA_PATH: to_jsonl(alpaca_rows()), CHAT_PATH: to_jsonl(chat_rows())}


def main(argv: list[str] | None = None) -> int:
    """Write the datasets, or with ``--check`` compare them with the committed files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the committed files instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for path, text in expected_files().items():
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(REPO_ROOT)} ({text.count(chr(10))} rows)")
    for path in stale:
        print(
            f"{path.relative_to(REPO_ROOT)} differs from what {Path(__file__).name} generates",
            file=sys.stderr,
        )
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
