"""Atomic publishing (cptune.atomic): bytes on disk, and what a crash half-way leaves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cptune import atomic
from cptune.atomic import Marker, discard_folder, publish_folder, write_bytes, write_text
from cptune.run.training.checkpoints import CHECKPOINT_MARKER, is_complete_checkpoint


class Crash(Exception):
    pass


def tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def staged(parent: Path, files: dict[str, str]) -> Path:
    staging = parent / ".out.partial"
    for name, text in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_text(text)
    return staging


def test_write_text_replaces_the_file_whole_and_leaves_no_staging(tmp_path):
    target = tmp_path / "log.json"
    target.write_text("old")
    write_text(target, "new é\n")
    assert target.read_bytes() == "new é\n".encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.json"]


def test_a_crash_before_the_rename_of_a_file_leaves_the_old_bytes(tmp_path, monkeypatch):
    target = tmp_path / "log.json"
    target.write_text("old")

    def crash(src, dst):
        raise Crash

    monkeypatch.setattr(atomic.os, "replace", crash)
    with pytest.raises(Crash):
        write_text(target, "new")
    assert target.read_bytes() == b"old"


def test_write_bytes_replaces_the_file_whole_and_a_crash_before_the_rename_leaves_the_old_bytes(
    tmp_path, monkeypatch
):
    target = tmp_path / "sums.safetensors"
    write_bytes(target, b"old")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [target.name]

    def crash(src, dst):
        raise Crash

    monkeypatch.setattr(atomic.os, "replace", crash)
    with pytest.raises(Crash):
        write_bytes(target, b"new")
    # The staging file (named per call, so that writers of one file on several nodes never share it) is gone too.
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_publish_folder_writes_the_marker_last_with_every_file_and_its_size(tmp_path):
    staging = staged(tmp_path, {"a.bin": "12345", "sub/b.txt": "xy"})
    final = tmp_path / "out"
    publish_folder(staging, final, marker=Marker("DONE", {"step": 7}, list_files=True))
    assert not staging.exists()
    assert json.loads((final / "DONE").read_text()) == {"step": 7, "files": {"a.bin": 5, "sub/b.txt": 2}}
    assert tree(final)["a.bin"] == b"12345"
    publish_folder(staged(tmp_path, {"c": "1"}), tmp_path / "plain", marker=Marker("M", {"fingerprint": "f"}))
    assert json.loads((tmp_path / "plain" / "M").read_bytes()) == {"fingerprint": "f"}


def test_publishing_over_a_folder_replaces_it_whole(tmp_path):
    final = tmp_path / "out"
    publish_folder(staged(tmp_path, {"a": "first", "stale": "x"}), final)
    publish_folder(staged(tmp_path, {"a": "second"}), final)
    assert tree(final) == {"a": b"second"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the replaced folder is gone


@pytest.mark.parametrize("crash_at", [1, 2])
def test_a_crash_between_the_renames_leaves_the_old_folder_or_none_never_a_mix(
    tmp_path, monkeypatch, crash_at
):
    final = tmp_path / "out"
    publish_folder(staged(tmp_path, {"a": "old", "b": "old"}), final)
    staging = staged(tmp_path, {"a": "new"})
    calls = []
    rename = Path.rename

    def crashing_rename(self, target):
        calls.append(target)
        if len(calls) == crash_at:
            raise Crash
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", crashing_rename)
    with pytest.raises(Crash):
        publish_folder(staging, final, marker=Marker("DONE"))
    monkeypatch.undo()
    if crash_at == 1:  # before the old folder moved aside: it is untouched
        assert tree(final) == {"a": b"old", "b": b"old"}
    else:  # old folder aside, new one not yet in place: nothing at the final name
        assert not final.exists()
    assert tree(staging)["a"] == b"new"  # the new data is still whole under its temporary name


def test_discard_folder_leaves_nothing_at_either_name(tmp_path):
    doomed = staged(tmp_path, {"a": "x"})
    discard_folder(doomed, tmp_path / "trash")
    assert list(tmp_path.iterdir()) == []


def test_fsync_dir_skips_a_folder_it_cannot_open(tmp_path):
    atomic.fsync_dir(tmp_path / "missing")  # no error: a platform that cannot open folders skips the flush
    atomic.fsync_dir(tmp_path)


def test_a_checkpoint_written_by_the_previous_version_is_still_complete(tmp_path):
    # Bytes as cptune wrote them before the marker code moved to cptune.atomic (same name, same fields).
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    (folder / "optimizer.pt").write_bytes(b"0123456789")
    (folder / "rng_state_0.pth").write_bytes(b"abc")
    (folder / "cptune_checkpoint_complete.json").write_text(
        '{\n "step": 5,\n "files": {\n  "optimizer.pt": 10,\n  "rng_state_0.pth": 3\n }\n}'
    )
    assert CHECKPOINT_MARKER == "cptune_checkpoint_complete.json"
    assert is_complete_checkpoint(folder)
    os.truncate(folder / "rng_state_0.pth", 1)
    assert not is_complete_checkpoint(folder)
