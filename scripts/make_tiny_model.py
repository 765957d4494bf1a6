"""Build ``examples/tiny-llama``: the tiny base model that the quickstart fine-tunes.

The folder holds a byte-level BPE tokenizer and a 2-layer, hidden-64 Llama built
by :mod:`devtools.tiny`, saved with ``save_pretrained`` so that
``AutoTokenizer.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained``
load it offline.

* The tokenizer is trained on the quickstart data (alpaca prompts and chat
  turns), the pre-training prose below and :data:`devtools.tiny.GENERIC_CORPUS`;
  byte fallback lets it encode any other text.
* The model is pre-trained for a few seconds on generated prose that states the
  facts and shows the skills the quickstart asks for ("In hex, teal is
  #008080.", "Forwards: a b c. Backwards: c b a."), never in the
  instruction format. LoRA cannot teach a random model much: its frozen
  ``lm_head`` (std 0.02) and final norm keep every logit within about
  ``0.02 * hidden_size`` = 1.3 of zero, and the quickstart loss only went from
  6.67 to 6.0. After pre-training, the quickstart is what it is meant to show,
  instruction tuning: LoRA teaches the alpaca format to a base that already
  knows the content.

Everything is deterministic. Pre-training runs on one thread, so the weights do
not depend on the core count, but float rounding may differ between CPU types
and grows over the steps; ``--check`` therefore compares the tokenizer and
configs exactly and the weights within a tolerance far below what any change
to the recipe produces.

Usage (with cptune installed, or ``PYTHONPATH=src``; :mod:`devtools.tiny` is found from the checkout)::

    python scripts/make_tiny_model.py            # rebuild examples/tiny-llama
    python scripts/make_tiny_model.py --check    # exit 1 if the folder is stale
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from make_quickstart_data import ALPACA_PATH, CHAT_PATH, COLOURS, NUMBER_WORDS, OPPOSITES, WORDS
from safetensors.torch import load_file

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # devtools/ lives at the root of the checkout, not in the package
    sys.path.insert(0, str(REPO_ROOT))

from devtools import tiny  # noqa: E402

MODEL_DIR = REPO_ROOT / "examples" / "tiny-llama"

SEED = 0
PROSE_SEED = 7
PROSE_SENTENCES = 600
PRETRAIN_STEPS = 300

# Weights may differ by float rounding between CPU types (see the module
# docstring): rebuilding with ATEN_CPU_CAPABILITY=default instead of avx512
# moved them by at most 7e-4, while one pre-training step less moves them by 0.25.
WEIGHT_ATOL = 1e-2

# Written only to train the tokenizer, so it can differ from the data
# pipeline's prompt without harm: it only decides which merges are learnt.
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{output}"
ALPACA_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n{output}"
# JSON keys whose values depend on the installed library, not on this script.
VOLATILE_KEYS = frozenset({"transformers_version"})


def prose_corpus(seed: int = PROSE_SEED, count: int = PROSE_SENTENCES) -> list[str]:
    """Return ``count`` generated sentences about the quickstart's colours, words and numbers."""
    rng = random.Random(seed)

    def colour() -> str:
        name = rng.choice(sorted(COLOURS))
        code = COLOURS[name]
        return rng.choice(
            (
                f"The colour {name} is written {code} in hex.",
                f"In hex, {name} is {code}.",
                f"{code} is the code for {name}.",
            )
        )

    def opposite() -> str:
        word = rng.choice(sorted(OPPOSITES))
        other = OPPOSITES[word]
        return rng.choice(
            (
                f"The opposite of {word} is {other}.",
                f"{word} and {other} are opposites.",
                f"It was not {word}, it was {other}.",
            )
        )

    def reversal() -> str:
        words = rng.sample(WORDS, rng.randint(3, 5))
        forwards, backwards = " ".join(words), " ".join(reversed(words))
        return rng.choice(
            (
                f"Forwards: {forwards}. Backwards: {backwards}.",
                f"{forwards} becomes {backwards} when reversed.",
            )
        )

    def length() -> str:
        metres = rng.randint(1, 99)
        return rng.choice(
            (
                f"A rope of {metres} m is {metres * 100} cm long.",
                f"{metres} metres is {metres * 100} centimetres.",
            )
        )

    def counting() -> str:
        start = rng.randint(0, 6)
        numbers = range(start, rng.randint(start + 2, min(start + 5, 10)) + 1)
        names = [str(n) for n in numbers] if rng.random() < 0.5 else [NUMBER_WORDS[n] for n in numbers]
        return "Counting: " + ", ".join(names) + "."

    def mention() -> str:
        a, b, c = rng.sample(WORDS, 3)
        return rng.choice((f"The {a} was next to the {b} and the {c}.", f"We packed a {a}, a {b} and a {c}."))

    kinds = (colour, opposite, reversal, length, counting, mention)
    return [rng.choice(kinds)() for _ in range(count)]


def tokenizer_texts() -> list[str]:
    """Return the tokenizer's training texts, in a fixed order."""
    texts = []
    for line in ALPACA_PATH.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        texts.append((ALPACA_PROMPT if row["input"] else ALPACA_PROMPT_NO_INPUT).format(**row))
    for line in CHAT_PATH.read_text(encoding="utf-8").splitlines():
        # Chat markers are special tokens, added whole; train only on the text around them.
        texts.extend(f"{m['role']}\n{m['content']}\n" for m in json.loads(line)["messages"])
    return texts + prose_corpus() + list(tiny.GENERIC_CORPUS)


def build(out_dir: Path) -> Path:
    """Build the tiny model folder into ``out_dir``."""
    return tiny.save_tiny_model_dir(
        out_dir,
        tokenizer_texts(),
        seed=SEED,
        pretrain_texts=[*prose_corpus(), *tiny.GENERIC_CORPUS],
        pretrain_steps=PRETRAIN_STEPS,
    )


def _load_json(path: Path) -> object:
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if k not in VOLATILE_KEYS}
    return data


def compare_model_dirs(expected: Path, actual: Path, weight_atol: float = WEIGHT_ATOL) -> list[str]:
    """Compare two model folders file by file.

    JSON files are compared as data without :data:`VOLATILE_KEYS`,
    ``*.safetensors`` tensor by tensor (names, dtypes, shapes exactly; values
    within ``weight_atol``), anything else byte for byte.

    Args:
        expected: The folder that should be reproduced (e.g. the committed one).
        actual: A freshly built folder.
        weight_atol: Largest allowed absolute difference of a weight.

    Returns:
        One line per difference; empty when the folders match.
    """
    problems = []
    expected_files = sorted(p.name for p in expected.iterdir() if p.is_file())
    actual_files = sorted(p.name for p in actual.iterdir() if p.is_file())
    if expected_files != actual_files:
        problems.append(f"files differ: {expected_files} vs {actual_files}")
    for name in sorted(set(expected_files) & set(actual_files)):
        want, got = expected / name, actual / name
        if name.endswith(".safetensors"):
            problems.extend(
                f"{name}: {p}" for p in _compare_tensors(load_file(want), load_file(got), weight_atol)
            )
        elif name.endswith(".json"):
            if _load_json(want) != _load_json(got):
                problems.append(f"{name}: content differs")
        elif want.read_bytes() != got.read_bytes():
            problems.append(f"{name}: bytes differ")
    return problems


def _compare_tensors(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], atol: float) -> list[str]:
    if sorted(want) != sorted(got):
        return [f"tensor names differ: {sorted(set(want) ^ set(got))}"]
    problems = []
    for key in sorted(want):
        a, b = want[key], got[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{key}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif (diff := (a - b).abs().max().item()) > atol:
            problems.append(f"{key}: max abs difference {diff:.3g} > {atol}")
    return problems


def check(model_dir: Path = MODEL_DIR) -> list[str]:
    """Rebuild the folder in a temporary directory and compare it with ``model_dir``."""
    if not model_dir.is_dir():
        return [f"{model_dir} does not exist"]
    with tempfile.TemporaryDirectory() as tmp:
        return compare_model_dirs(model_dir, build(Path(tmp)))


def main(argv: list[str] | None = None) -> int:
    """Rebuild ``examples/tiny-llama``, or with ``--check`` verify it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the committed folder instead of writing")
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help="folder to write or check")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(f"{args.out} is stale: run python scripts/make_tiny_model.py", file=sys.stderr)
            return 1
        print(f"{args.out} matches the script")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        written = sorted(p.name for p in build(Path(tmp)).iterdir())
        for name in written:
            # copyfile, not a move: new files get the usual permissions, not the temp dir's.
            shutil.copyfile(Path(tmp) / name, args.out / name)
    print(f"wrote {args.out}: {', '.join(written)}")
    # Left alone rather than deleted: --out may point at a folder with the user's files.
    for extra in sorted(p for p in args.out.iterdir() if p.is_file() and p.name not in written):
        print(f"warning: {extra} was not written by this script; remove it if it is stale", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
