"""Compressed text data files: ``rows.jsonl.zst``, ``rows.json.gz``, ``rows.csv.xz`` ...

Axolotl's long-context recipes name zstd-compressed JSON Lines in ``data_files``. ``datasets``
decompresses such files itself when it builds a dataset from them (into its cache folder); this module
says which compressions that covers and gives cptune's own checks (the UTF-8 check of text files) the
decompressed bytes. zstd needs the ``zstandard`` package, a dependency of cptune; the others are in
Python's standard library.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from cptune.errors import DataError


def _zstd(path: Path) -> BinaryIO:
    try:
        import zstandard
    except ImportError as error:  # cptune depends on it; a broken install still gets one line
        raise DataError(
            f"'{path}' is zstd-compressed and the zstandard package is not installed: "
            f"`pip install zstandard`, or decompress the file first (`zstd -d {path.name}`)."
        ) from error
    # read_across_frames: files written by `zstd` in several frames (or concatenated) read as a whole.
    reader = zstandard.ZstdDecompressor().stream_reader(path.open("rb"), read_across_frames=True)
    return io.BufferedReader(reader)  # type: ignore[arg-type]


# Each opener reads the decompressed bytes (the standard library's open() functions default to "rb").
COMPRESSIONS: dict[str, Callable[[Path], BinaryIO]] = {
    ".gz": gzip.open,  # type: ignore[dict-item]
    ".zst": _zstd,
    ".bz2": bz2.open,  # type: ignore[dict-item]
    ".xz": lzma.open,  # type: ignore[dict-item]
}
"""Compression suffix -> how to open the file's decompressed bytes (``datasets`` reads all four)."""


def compression(path: Path) -> str | None:
    """The compression suffix of ``path`` (``.zst``), or None for a plain file."""
    suffix = path.suffix.lower()
    return suffix if suffix in COMPRESSIONS else None


def format_suffix(path: Path) -> str:
    """The suffix naming the file's format, under any compression: ``.jsonl`` for ``rows.jsonl.zst``."""
    if compression(path) is None:
        return path.suffix.lower()
    return Path(path.stem).suffix.lower()


def open_decompressed(path: Path) -> BinaryIO:
    """The file's bytes, decompressed when its suffix says it is compressed."""
    opener = COMPRESSIONS.get(path.suffix.lower())
    return opener(path) if opener is not None else path.open("rb")
