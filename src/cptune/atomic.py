"""Files and folders that appear whole or not at all, and survive a power loss once they have appeared.

Every writer of something another process (or a later run) reads goes through here:
the data cache (:mod:`cptune.data.cache`), checkpoints (:mod:`cptune.run.training.checkpoints`),
the merged model (:mod:`cptune.run.commands.merge`), the train log, the data report and the stored
reference sums of preference training (:mod:`cptune.run.training.reference_cache`).

The recipe is always the same: write under a temporary name beside the final one (same
folder, so same file system), flush the data to disk (``fsync``), ``rename`` into place
(atomic on POSIX), then flush the parent folder so that the rename itself is on disk.
A crash at any point leaves either the old state or the new one, plus a leftover under
a temporary name that the next writer removes.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Marker",
    "discard_folder",
    "fsync_dir",
    "publish_folder",
    "write_bytes",
    "write_marker",
    "write_text",
]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (names created, renamed or deleted in it) to disk.

    A rename is durable only once its folder is flushed. Not every platform can open a
    folder for reading; there the flush is skipped.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Replace the file ``path`` by ``text`` (UTF-8) whole: a reader sees the old file or the new one.

    Written to ``.<name>.partial`` beside it, flushed, renamed over it, and the folder flushed.
    """
    path = Path(path)
    staging = path.with_name(f".{path.name}.partial")
    with open(staging, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)
    fsync_dir(path.parent)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace the file ``path`` by ``data`` whole: a reader sees the old file or the new one.

    Staged under a name of this call's own (``.<name>.<pid>-<random>.partial``), so that writers of the
    same file in several processes at once (one per node, on a shared file system) never write into each
    other's staging file: each rename puts a whole file in place.
    """
    path = Path(path)
    staging = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(staging, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@dataclass(frozen=True)
class Marker:
    """A JSON file written last into a folder before it is published, saying that it is whole.

    Args:
        name: The file's name inside the folder.
        content: What it holds (e.g. the cache's fingerprint, the checkpoint's step).
        list_files: Also record every other file of the folder with its size under ``"files"``, so
            a reader can tell a folder that lost or truncated a file after it was published.
    """

    name: str
    content: dict[str, Any] = field(default_factory=dict)
    list_files: bool = False


def write_marker(folder: Path, marker: Marker) -> None:
    """Flush every file of ``folder``, then write ``marker`` into it (itself flushed, replaced whole)."""
    files: dict[str, int] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != marker.name):
        _fsync_file(path)
        files[path.relative_to(folder).as_posix()] = path.stat().st_size
    content = dict(marker.content)
    if marker.list_files:
        content["files"] = files
    write_text(folder / marker.name, json.dumps(content, indent=1))


def publish_folder(
    staging: Path, final: Path, *, marker: Marker | None = None, aside: Path | None = None
) -> None:
    """Make the fully written folder ``staging`` appear at ``final`` in one rename, durably.

    Every file of ``staging`` is flushed to disk, ``marker`` (if given) is written last, and
    ``staging`` is renamed to ``final``; then ``final``'s parent folder is flushed. A folder
    already at ``final`` is first renamed to ``aside`` (default ``.<name>.replaced`` beside it)
    and deleted once the new one is in place, so ``final`` is never half-replaced: a crash
    between the two renames leaves it absent, never mixed.

    Args:
        staging: The folder written under a temporary name, on the same file system as ``final``.
        final: Where it appears.
        marker: Written into the folder just before the rename (see :class:`Marker`).
        aside: Where an existing ``final`` waits while it is replaced.
    """
    if marker is not None:
        write_marker(staging, marker)
    else:
        for path in (p for p in staging.rglob("*") if p.is_file()):
            _fsync_file(path)
    fsync_dir(staging)
    old = None
    if final.exists():
        old = aside if aside is not None else final.with_name(f".{final.name}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    staging.rename(final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard_folder(path: Path, aside: Path) -> None:
    """Delete the folder ``path`` so that it is never seen half-deleted: rename it to ``aside``, then delete."""
    shutil.rmtree(aside, ignore_errors=True)
    path.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)
