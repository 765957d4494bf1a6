"""``cptune preprocess --report``: every number equals one computed here from the data and the stored rows.

The expected values are computed independently: document lengths by formatting the source rows
with the dataset's format, percentiles by nearest rank on a sorted list, row figures from the
stored rows' positions and labels, and the attention work from the sharding functions
(:mod:`cptune.parallel.shard`) themselves.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from cptune.config.loader import load_recipe
from cptune.data.formats import build_formatter
from cptune.data.prepare import prepare_datasets
from cptune.models.loading import load_tokenizer
from cptune.parallel.backends.table import backend_for
from cptune.parallel.shard import TokenBatch, pad_tokens, split_contiguous, zigzag_indices
from cptune.run.commands.data_report import build_report, format_report
from tests.conftest import succeeded

WORDS = ["apple", "river", "stone", "cloud", "music", "paper", "orange", "garden", "silver", "candle"]


def _alpaca(i: int) -> dict[str, str]:
    # Every seventh answer is long enough to go over sequence_len.
    answer = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + (i % 5) + 40 * (i % 7 == 0)))
    return {"instruction": f"List {i} words.", "input": "" if i % 2 else "some words", "output": answer}


def _completion(i: int) -> dict[str, str]:
    return {"text": " ".join(WORDS[: 2 + i % 9]) + "."}


def _write(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def report_recipe(tmp_path: Path, write_recipe):
    alpaca = [_alpaca(i) for i in range(40)]
    completion = [_completion(i) for i in range(25)]

    def make(**keys):
        path = write_recipe(
            datasets=[
                # Axolotl's alpaca without its preamble: the short prompts keep most rows under sequence_len.
                {
                    "path": str(_write(tmp_path / "alpaca.jsonl", alpaca)),
                    "type": "alpaca_instruct.load_no_prompt",
                },
                {"path": str(_write(tmp_path / "completion.jsonl", completion)), "type": "completion"},
            ],
            sequence_len=64,
            val_set_size=0.2,
            context_parallel_size=2,
            micro_batch_size=2,
            gradient_accumulation_steps=2,
            **keys,
        )
        return path, {"alpaca": alpaca, "completion": completion}

    return make


def _nearest_rank(values: list[int], percent: int) -> int:
    ordered = sorted(values)
    return ordered[math.ceil(percent * len(ordered) / 100) - 1]


def _work(positions: list[int], cp: int, split: str) -> list[int]:
    multiple = cp if split == "contiguous" else 2 * cp
    row = torch.tensor([positions])
    padded = pad_tokens(TokenBatch(row, row, torch.zeros_like(row)), multiple, 0).position_ids[0]
    if split == "contiguous":
        shards = [split_contiguous(padded, cp, r) for r in range(cp)]
    else:
        shards = [padded[zigzag_indices(len(padded), cp, r)] for r in range(cp)]
    return [int((shard + 1).sum()) for shard in shards]


@pytest.mark.parametrize("strategy", ["drop", "truncate"])
def test_report_numbers_equal_an_independent_computation(strategy, report_recipe):
    path, sources = report_recipe(excess_length_strategy=strategy)
    recipe = load_recipe(path)
    tokenizer = load_tokenizer(recipe)
    prepared = prepare_datasets(recipe, tokenizer, log=lambda _: None)
    report = build_report(recipe, prepared, backend_for(recipe))
    S = recipe.sequence_len

    all_lengths = []
    for section, config, name in zip(
        report["datasets"], recipe.datasets, ("alpaca", "completion"), strict=True
    ):
        formatter = build_formatter(config, tokenizer, train_on_inputs=False, chat_template=None, label=name)
        lengths = [len(formatter(row).input_ids) for row in sources[name]]
        all_lengths += lengths
        docs = section["documents"]
        assert section["rows"] == docs["count"] == len(sources[name])
        assert (docs["min"], docs["max"], docs["tokens"]) == (min(lengths), max(lengths), sum(lengths))
        assert docs["mean"] == pytest.approx(sum(lengths) / len(lengths))
        assert [docs[f"p{p}"] for p in (50, 90, 99)] == [_nearest_rank(lengths, p) for p in (50, 90, 99)]
        histogram = docs["histogram"]
        assert sum(histogram["counts"]) == len(lengths)
        for (low, high), count in zip(histogram["bins"], histogram["counts"], strict=True):
            assert count == sum(low <= n <= high for n in lengths)
            assert high <= S or low > S, "a bin straddles sequence_len"
        over = [n for n in lengths if n > S]
        expected = {
            "rows": len(over),
            "dropped": len(over) if strategy == "drop" else 0,
            "truncated": len(over) if strategy == "truncate" else 0,
            "chunked": 0,
            "tokens_lost": sum(over) if strategy == "drop" else sum(n - S for n in over),
        }
        assert section["over_sequence_len"] == expected
    assert report["datasets"][0]["over_sequence_len"]["rows"] == 6  # rows 0, 7, ..., 35
    total = report["total"]["documents"]
    assert (total["count"], total["p90"]) == (len(all_lengths), _nearest_rank(all_lengths, 90))

    for name, rows in (("train", prepared.train), ("eval", prepared.eval)):
        section = report["splits"][name]
        positions = rows["position_ids"]
        trained = [
            sum(label != -100 and pos != 0 for label, pos in zip(r["labels"], r["position_ids"], strict=True))
            for r in rows
        ]
        documents = [sum(p == 0 for p in row) for row in positions]
        tokens = sum(len(row) for row in positions)
        assert (section["rows"], section["tokens"], section["trained_tokens"]) == (
            len(rows),
            tokens,
            sum(trained),
        )
        assert section["fill"] == pytest.approx(tokens / (len(rows) * S))
        per_row = section["documents_per_row"]
        assert (per_row["min"], per_row["max"], section["documents"]) == (
            min(documents),
            max(documents),
            sum(documents),
        )
        assert per_row["mean"] == pytest.approx(sum(documents) / len(rows))
        assert max(documents) > 1, "rows are packed"
        for split in ("contiguous", "zigzag"):
            work = [_work(row, 2, split) for row in positions]
            ratios = [max(w) / (sum(w) / 2) for w in work]
            figures = section["attention"][split]
            assert figures["worst_row"] == pytest.approx(max(ratios))
            assert figures["mean_row"] == pytest.approx(sum(ratios) / len(ratios))
            assert figures["epoch"] == pytest.approx(
                sum(max(w) for w in work) / sum(sum(w) / 2 for w in work)
            )
        assert section["attention"]["used"] == "contiguous"
        if name == "train":
            train_trained = trained

    steps = report["steps"]
    rows_per_step = 2 * 2 * 1  # micro_batch_size × gradient_accumulation_steps × data-parallel groups
    steps_per_epoch = math.ceil(math.ceil(len(prepared.train) / 2) / 2)
    assert (steps["rows_per_step"], steps["steps_per_epoch"]) == (rows_per_step, steps_per_epoch)
    target = steps["target_tokens_per_step"]
    assert target["mean"] == pytest.approx(sum(train_trained) / steps_per_epoch)
    ordered = sorted(train_trained)
    assert (target["lightest"], target["heaviest"]) == (sum(ordered[:4]), sum(ordered[-4:]))

    text = format_report(report, recipe, backend_for(recipe))
    verb = "dropped" if strategy == "drop" else "truncated to 64 tokens"
    assert f"6 over sequence_len 64 (15.0%): {verb}" in text
    assert "contiguous (this recipe):" in text


def test_report_counts_the_exact_duplicates_dropped(report_recipe):
    path, sources = report_recipe(dataset_exact_deduplication=True)
    recipe = load_recipe(path)
    tokenizer = load_tokenizer(recipe)
    prepared = prepare_datasets(recipe, tokenizer, log=lambda _: None)
    report = build_report(recipe, prepared, backend_for(recipe))
    # The alpaca rows are all different; the completion texts repeat every 9 rows.
    distinct = list(dict.fromkeys(row["text"] for row in sources["completion"]))
    assert len(distinct) == 9
    assert report["dropped_duplicates"] == 25 - 9
    formatter = build_formatter(
        recipe.datasets[1], tokenizer, train_on_inputs=False, chat_template=None, label="completion"
    )
    assert report["datasets"][1]["tokens"] == sum(len(formatter({"text": t}).input_ids) for t in distinct)
    lines = format_report(report, recipe, backend_for(recipe)).splitlines()
    assert "  16 samples dropped as exact duplicates (dataset_exact_deduplication)" in lines


def test_report_says_completion_rows_are_cut_into_pieces(tmp_path: Path, write_recipe):
    # Completion rows longer than sequence_len are cut into pieces (as Axolotl cuts them), not dropped.
    rows = [{"text": " ".join(WORDS * 3)}, {"text": "apple river."}]
    path = write_recipe(
        datasets=[{"path": str(_write(tmp_path / "long.jsonl", rows)), "type": "completion"}], sequence_len=16
    )
    recipe = load_recipe(path)
    prepared = prepare_datasets(recipe, load_tokenizer(recipe), log=lambda _: None)
    report = build_report(recipe, prepared, backend_for(recipe))
    over = report["datasets"][0]["over_sequence_len"]
    assert (over["rows"], over["chunked"], over["dropped"], over["truncated"]) == (1, 1, 0, 0)
    text = format_report(report, recipe, backend_for(recipe))
    assert "1 over sequence_len 16 (50.0%): cut into sequence_len pieces" in text
    assert prepared.stats.datasets[0].chunked == 1 and prepared.stats.datasets[0].rows_out > 2


def test_preprocess_report_writes_the_page_beside_the_cache_and_json_holds_everything(
    report_recipe, cptune_in_process
):
    path, _ = report_recipe()
    done = cptune_in_process("preprocess", str(path), "--report", "--debug", "--rows", "2")
    succeeded(done)
    cache = Path(done.stdout.split("cache: ")[1].split()[0])
    text = (cache / "report.txt").read_text()
    assert text.rstrip("\n") in done.stdout
    assert "=== train row 1 of" in done.stdout and "=== train row 2 of" not in done.stdout
    page = (cache / "report.html").read_text()
    svgs = page.count("<svg ")
    assert svgs == 5  # two datasets and their total, documents per row, attention per rank
    for start in range(svgs):
        chunk = page.split("<svg ")[start + 1].split("</svg>")[0]
        ET.fromstring("<svg " + chunk + "</svg>")  # each chart is well-formed XML
    done = cptune_in_process("preprocess", str(path), "--report", "--debug", "--json")
    succeeded(done)
    data = json.loads(done.stdout)
    assert set(data) == {"stats", "cache", "debug", "report", "report_page"}
    assert (
        len(data["debug"]["rows"]) == 3
        and data["report"]["splits"]["train"]["rows"] == data["stats"]["train"]["rows"]
    )
