"""The preprocess cache: ``dataset_prepared_path/<fingerprint>/``, built once, never half-written.

The fingerprint is a sha256 over everything that changes the prepared rows:
each dataset entry's settings and the bytes of its local files (for a hub
dataset: id, configuration, revision and split), the tokenizer (vocabulary,
merges, special tokens, chat template), the data keys of the recipe, and
:data:`DATA_FORMAT_VERSION`. A matching folder is reused; a changed input gives
a new fingerprint and therefore a new folder.

Writes are atomic (:func:`cptune.atomic.publish_folder`): a folder is built under a
temporary name beside its final name, its files are flushed, the :data:`BUILT_MARKER`
holding the fingerprint is written last, and only then is it renamed into place; a folder
is a finished build (:func:`is_built`) when that marker names its fingerprint. Several processes (the
ranks of one launch) may start at once: an exclusive ``fcntl.flock`` on a lock
file per fingerprint lets exactly one build while the others wait and then
load. ``flock`` needs a file system that supports it across the processes that
share the folder (local disks do; some network file systems need a mount option).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from cptune.atomic import Marker, publish_folder
from cptune.config.data import DatasetConfig
from cptune.config.recipe import Recipe
from cptune.data.chat_templates import template_text
from cptune.data.sources import ResolvedSource

__all__ = [
    "BUILT_MARKER",
    "DATA_FORMAT_VERSION",
    "build_once",
    "compute_fingerprint",
    "file_sha256",
    "is_built",
    "lock_path",
    "tokenizer_fingerprint",
]

DATA_FORMAT_VERSION = 3
"""Bump when cptune changes how rows are tokenized, packed or stored: old caches then stop matching.

2: the cache holds ``documents.arrow`` (every row's length before the length policy).
3: rows are rendered and trained as Axolotl's (the alpaca preamble, chat content and end tokens, chatml
   without bos, completion rows cut into pieces).
"""

BUILT_MARKER = "COMPLETE"
"""Written last into a cache folder built whole; it holds the fingerprint the folder was built for.

(Not a checkpoint's marker: :data:`cptune.run.training.checkpoints.CHECKPOINT_MARKER` lists files and sizes.)
"""

# Recipe keys that change the prepared rows. dataset_processes is absent on
# purpose: the same rows come out whatever the number of workers.
_RECIPE_KEYS = (
    "sequence_len",
    "sample_packing",
    "pad_to_sequence_len",
    "train_on_inputs",
    "excess_length_strategy",
    "skip_invalid_rows",
    "dataset_exact_deduplication",
    "val_set_size",
    "seed",
    "chat_template",
    "chat_template_jinja",
    "min_sample_len",
    "eot_tokens",
)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over what decides how a tokenizer encodes: its model, specials and chat template.

    For a fast tokenizer this is the serialized ``tokenizers`` JSON (vocabulary,
    merges, normalizer, pre-tokenizer, post-processor, added tokens) without the
    truncation and padding settings, which calls change at run time.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model: Any = json.loads(backend.to_str())
        model.pop("truncation", None)
        model.pop("padding", None)
    else:
        model = sorted(tokenizer.get_vocab().items())
    parts = {
        "class": type(tokenizer).__name__,
        "model": model,
        "special_tokens": {name: str(value) for name, value in tokenizer.special_tokens_map.items()},
        "added_tokens": {str(i): str(token) for i, token in sorted(tokenizer.added_tokens_decoder.items())},
        "chat_template": tokenizer.chat_template,
        # What the Python wrapper adds on top of the backend (bos/eos flags).
        "probe": tokenizer("Hello world\n")["input_ids"],
    }
    return _sha256_json(parts)


def _sha256_json(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _source_identity(config: DatasetConfig, source: ResolvedSource) -> dict[str, Any]:
    identity: dict[str, Any] = {"config": config.model_dump(mode="json"), "kind": source.kind}
    if source.kind == "hub":
        # Without a revision the hub data may change unseen; the id, name,
        # split and data_files are all that can be known offline.
        return identity
    base = Path(os.path.expanduser(config.path))
    identity["files"] = [
        [os.path.relpath(f, base) if base.is_dir() else f.name, file_sha256(f)] for f in source.files
    ]
    return identity


def compute_fingerprint(
    recipe: Recipe,
    tokenizer: PreTrainedTokenizerBase,
    sources: Sequence[tuple[str, DatasetConfig, ResolvedSource]],
) -> str:
    """The cache key of the data that :func:`cptune.data.prepare.prepare_datasets` would build.

    Args:
        recipe: The recipe.
        tokenizer: The model's tokenizer.
        sources: ``(list key, config, resolved source)`` for every entry of
            ``datasets`` and ``test_datasets``, in recipe order.

    Returns:
        A 64-character hex digest.
    """
    parts = {
        "version": DATA_FORMAT_VERSION,
        "recipe": {name: getattr(recipe, name) for name in _RECIPE_KEYS},
        "tokenizer": tokenizer_fingerprint(tokenizer),
        # A template given as a file is part of the data by its text, not its path.
        "chat_template_jinja": template_text("jinja", recipe.chat_template_jinja)
        if recipe.chat_template_jinja is not None
        else None,
        "sources": [[key, _source_identity(config, source)] for key, config, source in sources],
    }
    return _sha256_json(parts)


def lock_path(root: str | os.PathLike[str], fingerprint: str) -> Path:
    """The lock file that serializes building ``root/<fingerprint>``."""
    return Path(root) / f".{fingerprint}.lock"


def is_built(folder: str | os.PathLike[str], fingerprint: str | None = None) -> bool:
    """Whether ``folder`` is a finished build (its :data:`BUILT_MARKER` exists and names ``fingerprint``)."""
    marker = Path(folder) / BUILT_MARKER
    try:
        written = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return fingerprint is None or written.get("fingerprint") == fingerprint


@contextlib.contextmanager
def _exclusive(path: Path, log: Callable[[str], None]) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"Waiting for another process to finish preparing the data (lock {path}).")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        # Closing the descriptor releases the lock. The lock file stays: deleting
        # it would let a waiter and a newcomer lock two different files.
        os.close(fd)


def build_once(
    root: str | os.PathLike[str],
    fingerprint: str,
    build: Callable[[Path], None],
    *,
    log: Callable[[str], None],
) -> tuple[Path, bool]:
    """Return ``root/<fingerprint>``, building it with ``build`` unless a finished copy exists.

    Args:
        root: The recipe's ``dataset_prepared_path``; created if missing.
        fingerprint: From :func:`compute_fingerprint`.
        build: Writes the prepared data into the (empty, temporary) folder it is given.
        log: Receives one line when this process waits for another.

    Returns:
        The folder, and True if this call built it (False: reused).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / fingerprint
    if is_built(final, fingerprint):
        return final, False
    with _exclusive(lock_path(root, fingerprint), log):
        if is_built(final, fingerprint):
            return final, False
        # Holding the lock, nobody else builds this fingerprint: anything under
        # its names is left over from a crash and is removed.
        for leftover in root.glob(f".tmp-{fingerprint}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if final.exists():
            shutil.rmtree(final)
        staging = root / f".tmp-{fingerprint}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            build(staging)
            content = {"fingerprint": fingerprint, "version": DATA_FORMAT_VERSION}
            publish_folder(staging, final, marker=Marker(BUILT_MARKER, content))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return final, True
