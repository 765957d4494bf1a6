"""Finding and loading dataset sources: files by extension, folders, save_to_disk folders, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest

from cptune.config.data import DatasetConfig
from cptune.data.sources import load_source, resolve_source
from cptune.errors import DataError

ROWS = [{"text": f"row {i}", "n": i} for i in range(5)]


def load(path: Path | str, tmp_path: Path, **config: object) -> datasets.Dataset:
    dataset_config = DatasetConfig(path=str(path), type="completion", **config)
    source = resolve_source(dataset_config, "datasets", 0)
    return load_source(source, dataset_config, cache_dir=tmp_path / "hf-cache")


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        dataset = datasets.Dataset.from_list(rows)
        {".csv": dataset.to_csv, ".parquet": dataset.to_parquet}[suffix](str(path))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_local_files_load_by_extension(tmp_path: Path, suffix: str) -> None:
    path = write(tmp_path / f"data{suffix}", ROWS)
    loaded = load(path, tmp_path)
    assert loaded["text"] == [r["text"] for r in ROWS]
    source = resolve_source(DatasetConfig(path=str(path)), "datasets", 0)
    assert (source.kind, source.files) == ("files", (path,))


def test_folder_of_files_and_data_files(tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    write(folder / "a.jsonl", ROWS[:2])
    write(folder / "sub" / "b.jsonl", ROWS[2:])
    (folder / "README.md").write_text("not data")
    assert load(folder, tmp_path)["n"] == [0, 1, 2, 3, 4]
    assert load(folder, tmp_path, data_files="sub/*.jsonl")["n"] == [2, 3, 4]
    with pytest.raises(DataError, match=r"datasets\[0\].data_files entry 'nope/\*.jsonl' matches no file"):
        load(folder, tmp_path, data_files=("nope/*.jsonl",))


def test_folder_mixing_formats_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "mixed" / "a.jsonl", ROWS)
    write(tmp_path / "mixed" / "b.csv", ROWS)
    with pytest.raises(DataError, match="the files mix formats"):
        load(tmp_path / "mixed", tmp_path)


def test_save_to_disk_folders(tmp_path: Path) -> None:
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert resolve_source(DatasetConfig(path=str(tmp_path / "saved")), "datasets", 0).kind == "saved"
    assert load(tmp_path / "saved", tmp_path)["n"] == [0, 1, 2, 3, 4]
    both = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    )
    both.save_to_disk(str(tmp_path / "dict"))
    assert len(load(tmp_path / "dict", tmp_path, split="test")) == 1
    with pytest.raises(DataError, match=r"has no split 'dev' \(it has test, train\)"):
        load(tmp_path / "dict", tmp_path, split="dev")


@pytest.mark.parametrize("path", ["data/missing.jsonl", "./missing", "/no/such/folder"])
def test_missing_local_path_names_the_key_and_path(path: str) -> None:
    with pytest.raises(DataError) as error:
        resolve_source(DatasetConfig(path=path), "datasets", 2)
    message = str(error.value)
    assert message.startswith(f"datasets[2] ({path}): datasets[2].path '{path}' does not exist")


def test_hub_ids_are_not_taken_for_missing_files() -> None:
    source = resolve_source(DatasetConfig(path="tatsu-lab/alpaca"), "datasets", 0)
    assert source.kind == "hub"


def test_empty_dataset_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"datasets\[0\] \(.*empty.jsonl\)"):
        load(tmp_path / "empty.jsonl", tmp_path)


@pytest.mark.parametrize(
    ("name", "content", "split"),
    [
        ("header.csv", "text,n\n", "train"),  # a CSV file with only its header line
        ("none.json", "[]", "train"),
        ("rows.jsonl", json.dumps(ROWS[0]) + "\n", "train[:0]"),  # a slice that selects nothing
    ],
)
def test_data_without_rows_says_so(tmp_path: Path, name: str, content: str, split: str) -> None:
    # datasets reports these as 'Instruction "train" corresponds to no data!', which reads like a wrong split.
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=rf"split '{re.escape(split)}' has no rows \(the data holds none"):
        load(tmp_path / name, tmp_path, split=split)


def test_unreadable_file_type(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("hello")
    with pytest.raises(DataError, match=r"cannot read files of type \.txt"):
        resolve_source(DatasetConfig(path=str(tmp_path / "data.txt")), "test_datasets", 0)


def test_ds_type_names_the_format_the_extension_does_not(tmp_path: Path) -> None:
    """Axolotl's ds_type: the loader for a file whatever its name (utils/data/shared.py, axolotl 0.21.0)."""
    rows = tmp_path / "rows.data"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert load(rows, tmp_path, ds_type="json")["n"] == [0, 1, 2, 3, 4]
    lines = tmp_path / "notes.txt"
    lines.write_text("first line\nsecond line\n")
    assert load(lines, tmp_path, ds_type="text")["text"] == ["first line", "second line"]
    # In a folder: the files of that format, or those data_files selects.
    folder = tmp_path / "folder"
    write(folder / "a.jsonl", ROWS[:2])
    write(folder / "b.csv", ROWS[2:])
    assert load(folder, tmp_path, ds_type="csv")["n"] == [2, 3, 4]
    (folder / "c.rows").write_text(json.dumps(ROWS[0]) + "\n")
    assert load(folder, tmp_path, ds_type="json", data_files="*.rows")["n"] == [0]
    with pytest.raises(DataError, match=r"the folder holds no parquet files by their extension"):
        load(folder, tmp_path, ds_type="parquet")


def compress(path: Path, suffix: str) -> Path:
    """``path`` compressed next to it as ``path`` + ``suffix`` (the plain file removed)."""
    import bz2
    import gzip
    import lzma

    import zstandard

    raw = path.read_bytes()
    packed = {
        ".gz": gzip.compress,
        ".zst": zstandard.ZstdCompressor().compress,
        ".bz2": bz2.compress,
        ".xz": lzma.compress,
    }[suffix](raw)
    target = path.with_name(path.name + suffix)
    target.write_bytes(packed)
    path.unlink()
    return target


@pytest.mark.parametrize(
    "name", ["rows.jsonl.zst", "rows.json.zst", "rows.jsonl.gz", "rows.csv.xz", "rows.jsonl.bz2"]
)
def test_compressed_text_files_load_as_their_format(tmp_path: Path, name: str) -> None:
    """Axolotl's ALST recipes read `data_files: [pretrain/rp_sub.jsonl.zst]`."""
    plain, suffix = name.rsplit(".", 1)
    path = compress(write(tmp_path / "hub" / "pretrain" / plain, ROWS), "." + suffix)
    assert load(path, tmp_path)["text"] == [r["text"] for r in ROWS]
    # In a folder, by data_files (the recipe's way) or found by the folder scan.
    assert load(tmp_path / "hub", tmp_path, data_files=[f"pretrain/{name}"])["n"] == [0, 1, 2, 3, 4]
    assert load(tmp_path / "hub", tmp_path)["n"] == [0, 1, 2, 3, 4]


def test_compressed_files_are_checked_for_utf8_and_compressed_binaries_refused(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl\.zst' is not UTF-8 text \(line 2\)"):
        load(compress(latin1, ".zst"), tmp_path)
    parquet = compress(write(tmp_path / "rows.parquet", ROWS), ".gz")
    with pytest.raises(DataError, match=r"cannot read files of type \.parquet\.gz\. Supported: .*\.jsonl"):
        resolve_source(DatasetConfig(path=str(parquet)), "datasets", 0)


def test_zstd_without_zstandard_says_how_to_decompress(tmp_path: Path, monkeypatch) -> None:
    import sys

    path = compress(write(tmp_path / "rows.jsonl", ROWS), ".zst")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import fails as when it is not installed
    with pytest.raises(DataError, match=r"zstandard package is not installed: `pip install zstandard`, or "):
        load(path, tmp_path)
