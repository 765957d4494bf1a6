"""prepare_datasets end to end: splits, packing, stats, cache reuse and invalidation, crashes, concurrency."""

from __future__ import annotations

import copy
import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

import cptune
from cptune.config.recipe import Recipe
from cptune.data import prepare as prepare_module
from cptune.data.cache import BUILT_MARKER, compute_fingerprint, is_built, lock_path
from cptune.data.prepare import cached_stats, prepare_datasets, resolve_sources
from cptune.errors import DataError
from devtools.tiny import build_tiny_tokenizer

MakeRecipe = Callable[..., Recipe]


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return path


def alpaca_rows(count: int) -> list[dict[str, Any]]:
    return [
        {
            "instruction": f"Add {i} and {i + 1}.",
            "input": "" if i % 3 else f"Numbers: {i}, {i + 1}",
            "output": f"The sum is {2 * i + 1}." + " Done." * (i % 5),
        }
        for i in range(count)
    ]


def chat_rows(count: int) -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"It is {2 * i}."},
                {"role": "user", "content": "Are you sure?"},
                {"role": "assistant", "content": "Yes." * (1 + i % 4)},
            ]
        }
        for i in range(count)
    ]


def quiet(_: str) -> None:
    pass


@pytest.fixture
def data(tmp_path: Path) -> dict[str, str]:
    return {
        "alpaca": str(write_jsonl(tmp_path / "data" / "alpaca.jsonl", alpaca_rows(40))),
        "chat": str(write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(30))),
    }


def fingerprint(recipe: Recipe, tokenizer: PreTrainedTokenizerFast) -> str:
    return compute_fingerprint(recipe, tokenizer, resolve_sources(recipe))


def test_packed_train_and_validation_split(
    make_recipe: MakeRecipe, data: dict[str, str], tokenizer: PreTrainedTokenizerFast
) -> None:
    recipe = make_recipe(
        [{"path": data["alpaca"], "type": "alpaca"}, {"path": data["chat"], "type": "chat_template"}],
        sample_packing=True,
        sequence_len=256,  # the alpaca rows open with Axolotl's preamble
        val_set_size=0.2,
    )
    prepared = prepare_datasets(recipe, tokenizer, log=quiet)
    stats = prepared.stats
    assert prepared.train.column_names == ["input_ids", "labels", "position_ids"]
    assert [d.rows_in for d in stats.datasets] == [40, 30]
    assert stats.eval is not None and prepared.eval is not None
    assert stats.train.samples + stats.eval.samples == 70
    assert stats.eval.samples == 14  # ceil(0.2 * 70)
    assert stats.train.rows == len(prepared.train) < stats.train.samples
    assert stats.train.tokens + stats.eval.tokens == sum(d.tokens for d in stats.datasets)
    for split in (prepared.train, prepared.eval):
        for row in split:
            assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"]) <= 256
    tokens = sum(len(r) for r in prepared.train["input_ids"])
    assert tokens == stats.train.tokens
    assert stats.train.packing_efficiency == pytest.approx(tokens / (len(prepared.train) * 256))
    documents = sum(p.count(0) for p in prepared.train["position_ids"])
    assert documents == stats.train.samples
    text = stats.format()
    assert "datasets[1]" in text and "packed into" in text and "efficiency" in text


def test_unpacked_rows_and_test_datasets(
    make_recipe: MakeRecipe, data: dict[str, str], tokenizer: PreTrainedTokenizerFast
) -> None:
    recipe = make_recipe(
        [{"path": data["alpaca"], "type": "alpaca"}],
        test_datasets=[{"path": data["chat"], "type": "chat_template"}],
    )
    prepared = prepare_datasets(recipe, tokenizer, log=quiet)
    assert len(prepared.train) == 40 and prepared.eval is not None and len(prepared.eval) == 30
    for row in prepared.train:
        assert row["position_ids"] == list(range(len(row["input_ids"])))
    assert prepared.stats.datasets[1].label.startswith("test_datasets[0]")


def test_validation_split_is_seeded(
    make_recipe: MakeRecipe, data: dict[str, str], tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    datasets_ = [{"path": data["alpaca"], "type": "alpaca"}]
    first = prepare_datasets(make_recipe(datasets_, val_set_size=5), tokenizer, log=quiet)
    again = prepare_datasets(
        make_recipe(datasets_, val_set_size=5, dataset_prepared_path=str(tmp_path / "other")),
        tokenizer,
        log=quiet,
    )
    other_seed = prepare_datasets(make_recipe(datasets_, val_set_size=5, seed=7), tokenizer, log=quiet)
    assert first.eval is not None and len(first.eval) == 5
    assert first.eval["input_ids"] == again.eval["input_ids"]
    assert first.eval["input_ids"] != other_seed.eval["input_ids"]
    with pytest.raises(DataError, match=r"val_set_size: 40.0 asks for 40 of the 40 training samples"):
        prepare_datasets(make_recipe(datasets_, val_set_size=40), tokenizer, log=quiet)


def test_matching_cache_is_reused_without_tokenizing(
    make_recipe: MakeRecipe,
    data: dict[str, str],
    tokenizer: PreTrainedTokenizerFast,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recipe = make_recipe([{"path": data["alpaca"], "type": "alpaca"}], sample_packing=True)
    assert cached_stats(recipe, tokenizer) is None
    calls: list[str] = []
    tokenize = prepare_module.tokenize_dataset

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["label"])
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "tokenize_dataset", counting)
    built = prepare_datasets(recipe, tokenizer, log=quiet)
    reused = prepare_datasets(recipe, tokenizer, log=quiet)
    assert len(calls) == 1
    assert (built.stats.from_cache, reused.stats.from_cache) == (False, True)
    assert reused.path == built.path and reused.train["input_ids"] == built.train["input_ids"]
    assert reused.stats.train == built.stats.train
    summary = cached_stats(recipe, tokenizer)
    assert summary is not None and "loaded from cache" in summary and str(built.path) in summary
    # dataset_processes does not change the rows, so it does not change the key.
    assert prepare_datasets(
        recipe.model_copy(update={"dataset_processes": 2}), tokenizer, log=quiet
    ).stats.from_cache


def test_fingerprint_follows_every_input(
    make_recipe: MakeRecipe,
    data: dict[str, str],
    tokenizer: PreTrainedTokenizerFast,
    tokenizer_texts: tuple[str, ...],
) -> None:
    recipe = make_recipe([{"path": data["alpaca"], "type": "alpaca"}])
    base = fingerprint(recipe, tokenizer)
    assert fingerprint(make_recipe([{"path": data["alpaca"], "type": "alpaca"}]), tokenizer) == base
    assert fingerprint(recipe, copy.deepcopy(tokenizer)) == base
    changed = [
        fingerprint(recipe.model_copy(update={"sequence_len": 512}), tokenizer),
        fingerprint(recipe.model_copy(update={"train_on_inputs": True}), tokenizer),
        fingerprint(
            make_recipe([{"path": data["alpaca"], "type": "alpaca", "field_input": "context"}]), tokenizer
        ),
        fingerprint(recipe, build_tiny_tokenizer(tokenizer_texts, vocab_size=300)),
    ]
    other_template = copy.deepcopy(tokenizer)
    other_template.chat_template = "{{ messages[0]['content'] }}"
    changed.append(fingerprint(recipe, other_template))
    # Same name and size, different bytes.
    text = Path(data["alpaca"]).read_text()
    Path(data["alpaca"]).write_text(text.replace("Add 1 and", "Add 9 and"))
    changed.append(fingerprint(recipe, tokenizer))
    assert len({base, *changed}) == len(changed) + 1


def test_changed_data_rebuilds(
    make_recipe: MakeRecipe, data: dict[str, str], tokenizer: PreTrainedTokenizerFast
) -> None:
    recipe = make_recipe([{"path": data["alpaca"], "type": "alpaca"}])
    first = prepare_datasets(recipe, tokenizer, log=quiet)
    write_jsonl(Path(data["alpaca"]), alpaca_rows(12))
    second = prepare_datasets(recipe, tokenizer, log=quiet)
    assert not second.stats.from_cache and second.path != first.path and len(second.train) == 12


def test_leftovers_of_a_crash_are_ignored_and_rebuilt(
    make_recipe: MakeRecipe,
    data: dict[str, str],
    tokenizer: PreTrainedTokenizerFast,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recipe = make_recipe([{"path": data["alpaca"], "type": "alpaca"}], sample_packing=True)
    key = fingerprint(recipe, tokenizer)
    root = Path(recipe.dataset_prepared_path)
    # A crash in the middle of a build leaves nothing that looks complete.
    monkeypatch.setattr(
        prepare_module, "pack_table", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    with pytest.raises(RuntimeError, match="boom"):
        prepare_datasets(recipe, tokenizer, log=quiet)
    assert not (root / key).exists() and not list(root.glob(".tmp-*"))
    monkeypatch.undo()
    # Leftovers of a process killed outright: a staging folder, and a final
    # folder without its marker (e.g. written by hand or by an older version).
    (root / f".tmp-{key}-12345-deadbeef" / "train").mkdir(parents=True)
    (root / key / "train").mkdir(parents=True)
    (root / key / "stats.json").write_text("{}")
    assert not is_built(root / key, key)
    prepared = prepare_datasets(recipe, tokenizer, log=quiet)
    assert not prepared.stats.from_cache and is_built(root / key, key)
    assert not list(root.glob(".tmp-*"))
    assert json.loads((root / key / BUILT_MARKER).read_text())["fingerprint"] == key


CHILD = """
import hashlib, json, sys
from cptune.config.recipe import Recipe
from cptune.data.prepare import prepare_datasets
from devtools.tiny import build_tiny_tokenizer

recipe = Recipe.model_validate_json(sys.argv[1])
tokenizer = build_tiny_tokenizer(json.loads(sys.argv[2]))
prepared = prepare_datasets(recipe, tokenizer, log=lambda line: print("LOG", line, flush=True))
rows = json.dumps([prepared.train[:], prepared.eval[:]], sort_keys=True)
print("RESULT", json.dumps({"from_cache": prepared.stats.from_cache, "digest": hashlib.sha256(rows.encode()).hexdigest()}))
"""


@pytest.mark.distributed
def test_concurrent_processes_prepare_once(
    make_recipe: MakeRecipe,
    data: dict[str, str],
    tokenizer: PreTrainedTokenizerFast,
    tokenizer_texts: tuple[str, ...],
    tmp_path: Path,
) -> None:
    recipe = make_recipe(
        [{"path": data["alpaca"], "type": "alpaca"}, {"path": data["chat"], "type": "chat_template"}],
        sample_packing=True,
        val_set_size=0.1,
    )
    root = Path(recipe.dataset_prepared_path)
    root.mkdir(parents=True)
    repo = Path(__file__).resolve().parents[2]  # cptune (src) and devtools (the root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(cptune.__file__).parents[1]), str(repo)])}
    command = [sys.executable, "-c", CHILD, recipe.model_dump_json(), json.dumps(tokenizer_texts)]
    # Hold the lock so that both processes are certainly waiting at the same time.
    lock = os.open(lock_path(root, fingerprint(recipe, tokenizer)), os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    children = []
    try:
        for n in range(2):
            stderr = open(tmp_path / f"child{n}.err", "w")  # noqa: SIM115 - closed below
            children.append(
                (subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env), stderr)
            )
        for child, _ in children:
            line = child.stdout.readline()
            assert line.startswith("LOG Waiting for another process"), line
    finally:
        os.close(lock)
    results = []
    for n, (child, stderr) in enumerate(children):
        out, _ = child.communicate(timeout=120)
        stderr.close()
        assert child.returncode == 0, (tmp_path / f"child{n}.err").read_text()[-3000:]
        results.append(
            json.loads(next(x for x in out.splitlines() if x.startswith("RESULT"))[len("RESULT ") :])
        )
    assert sorted(r["from_cache"] for r in results) == [False, True]
    assert results[0]["digest"] == results[1]["digest"]
    assert not list(root.glob(".tmp-*"))


def test_the_stats_lines_write_counts_with_thousands_separators() -> None:
    from cptune.data.stats import DatasetStats, PrepStats, SplitStats

    stats = PrepStats(
        datasets=[
            DatasetStats(
                label="datasets[0] (big.jsonl)",
                rows_in=1_200_000,
                rows_out=1_187_654,
                skipped={"field 'output' is empty": 1_234},
                dropped_too_long=11_112,
                tokens=3_456_789_012,
                trained_tokens=1_234_567_890,
            )
        ],
        train=SplitStats(
            samples=1_187_654,
            rows=105_500,
            tokens=3_456_789_012,
            trained_tokens=1_234_567_890,
            packing_efficiency=0.9994,
        ),
        eval=None,
        sequence_len=32768,
        sample_packing=True,
        seconds=812.34,
        fingerprint="0123456789abcdef",
    )
    assert stats.format().splitlines() == [
        "Data 0123456789ab (prepared in 812.3 s), sequence_len 32768:",
        "  datasets[0] (big.jsonl): 1,200,000 rows -> 1,187,654 samples, 3,456,789,012 tokens "
        "(1,234,567,890 trained); 11,112 too long (dropped), 1,234 skipped: field 'output' is empty",
        "  train: 1,187,654 samples, 3,456,789,012 tokens (1,234,567,890 trained) packed into 105,500 rows, "
        "efficiency 99.9%",
    ]


def test_axolotls_dataset_num_proc_reaches_reading_and_tokenizing(
    make_recipe: MakeRecipe,
    data: dict[str, str],
    tokenizer: PreTrainedTokenizerFast,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recipe = make_recipe([{"path": data["alpaca"], "type": "alpaca"}], dataset_num_proc=3)
    asked: dict[str, Any] = {}
    load, tokenize = prepare_module.load_source, prepare_module.tokenize_dataset

    def loading(*args: Any, num_proc: Any, **kwargs: Any) -> Any:
        asked["read"] = num_proc
        return load(*args, num_proc=None, **kwargs)  # in this process: the test starts no workers

    def tokenizing(*args: Any, num_proc: Any, **kwargs: Any) -> Any:
        asked["tokenize"] = num_proc
        return tokenize(*args, num_proc=None, **kwargs)

    monkeypatch.setattr(prepare_module, "load_source", loading)
    monkeypatch.setattr(prepare_module, "tokenize_dataset", tokenizing)
    prepare_datasets(recipe, tokenizer, log=quiet)
    assert asked == {"read": 3, "tokenize": 3}
