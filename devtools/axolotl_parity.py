"""Write the fixture of Axolotl's own preprocessing output that ``tests/axolotl/test_axolotl_parity.py`` compares with.

Each recipe in ``tests/axolotl/parity/recipes/`` names the shipped tiny model and shipped data. This script
runs Axolotl's ``load_cfg`` and ``prepare_datasets`` (what ``axolotl preprocess`` runs) on each, in a fresh
process, and writes every training example's ``input_ids`` and ``labels``, in order, to
``tests/axolotl/parity/axolotl-outputs.jsonl.gz``: a header line (Axolotl's version, the wheel's sha256,
the Python, the commands), then one line per example. Run it from the repository root with an interpreter
that can import ``axolotl``::

    python -m devtools.axolotl_parity                 # every recipe
    python -m devtools.axolotl_parity chat-chatml     # some of them (the others are kept)

Nothing in ``src/`` imports this; the tests read only the fixture.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARITY_DIR = REPO / "tests" / "axolotl" / "parity"
RECIPES_DIR = PARITY_DIR / "recipes"
FIXTURE = PARITY_DIR / "axolotl-outputs.jsonl.gz"


def _worker(recipe: str, out: str, scratch: str) -> None:
    """In a fresh process: Axolotl's preprocessing of one recipe, its examples as JSON lines in ``out``."""
    os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from axolotl.cli.config import load_cfg
    from axolotl.loaders import load_tokenizer
    from axolotl.utils.data import prepare_datasets

    cfg = load_cfg(
        recipe,
        dataset_prepared_path=os.path.join(scratch, "prepared"),
        output_dir=os.path.join(scratch, "out"),
        dataset_num_proc=1,
    )
    train, _, _, _ = prepare_datasets(cfg, load_tokenizer(cfg))
    with open(out, "w", encoding="utf-8") as sink:
        for row in train:
            sink.write(
                json.dumps({"input_ids": list(row["input_ids"]), "labels": list(row["labels"])}) + "\n"
            )


def _axolotl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("axolotl")
    except PackageNotFoundError:  # imported from an unpacked wheel on PYTHONPATH
        import axolotl

        found = Path(axolotl.__file__).resolve().parent.parent
        wheels = sorted(found.glob("axolotl-*.dist-info"))
        return wheels[-1].name.removeprefix("axolotl-").removesuffix(".dist-info") if wheels else "unknown"


def run_recipe(name: str) -> list[dict[str, object]]:
    """Axolotl's examples of ``recipes/<name>.yaml``, in order."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "examples.jsonl"
        code = f"from devtools.axolotl_parity import _worker; _worker({str(RECIPES_DIR / f'{name}.yaml')!r}, "
        code += f"{str(out)!r}, {scratch!r})"
        subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
        return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


def read_fixture(path: Path = FIXTURE) -> tuple[dict[str, object], dict[str, list[dict[str, object]]]]:
    """The fixture's header and its examples by recipe name."""
    with gzip.open(path, "rt", encoding="utf-8") as source:
        header = json.loads(source.readline())
        examples: dict[str, list[dict[str, object]]] = {}
        for line in source:
            row = json.loads(line)
            examples.setdefault(row.pop("recipe"), []).append(row)
    return header, examples


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.axolotl_parity", description=__doc__.split("\n")[0]
    )
    parser.add_argument("recipes", nargs="*", help="recipe names (default: every recipe)")
    parser.add_argument("--note", default="", help="how this Python got Axolotl, for the header")
    args = parser.parse_args(argv)
    names = args.recipes or sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    examples = read_fixture()[1] if FIXTURE.is_file() and args.recipes else {}
    for name in names:
        print(f"axolotl preprocess: {name}", flush=True)
        examples[name] = run_recipe(name)
    header = {
        "axolotl": _axolotl_version(),
        "python": platform.python_version(),
        "generated_by": "python -m devtools.axolotl_parity (from the repository root)",
        "recipes": "tests/axolotl/parity/recipes/<recipe>.yaml, run with dataset_num_proc: 1",
        "what": "Axolotl's prepare_datasets (axolotl preprocess): every training example's input_ids and "
        "labels, in order",
        "note": args.note,
    }
    lines = [json.dumps(header)] + [
        json.dumps({"recipe": name, **row}, separators=(",", ":"))
        for name in sorted(examples)
        for row in examples[name]
    ]
    # mtime 0: the same examples give the same bytes.
    with gzip.GzipFile(FIXTURE, "wb", compresslevel=9, mtime=0) as sink:
        sink.write(("\n".join(lines) + "\n").encode("utf-8"))
    print(
        f"wrote {FIXTURE.relative_to(REPO)}: {sum(map(len, examples.values()))} examples of {len(examples)} recipes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
