"""``precompute_ref_log_probs``: the first pass's reference sums, stored with the prepared data and read back.

The first pass (:mod:`cptune.run.training.reference_pass`) gives every row its reference log-prob sums
(chosen, rejected of each pair of the row, in order). They are written to
``<dataset_prepared_path>/<data fingerprint>/reference_log_probs/<split>-<key digest>.safetensors``, one file
per split (``train``, ``eval``), so a later run, a resumed run and ``cptune evaluate`` of the same data against
the same reference read them instead of running the pass again. They live inside the prepared data's folder:
data prepared again (a changed fingerprint is another folder) never meets the old sums.

What the key holds (:class:`ReferenceKey`), i.e. everything that changes the sums beyond rounding:

- the prepared data's fingerprint (:func:`cptune.data.cache.compute_fingerprint`: the rows, their tokens,
  packing and split, the tokenizer, the seed that also initializes the rows of added tokens' embeddings)
  and the split;
- the reference model: ``base_model`` and ``model_revision`` as written, the identity of its weight files
  (name, size and modification time of each ``*.safetensors``/``*.bin``/``*.pt``/``*.pth`` file and weight
  index, and the name of the file each resolves to: in the hub cache the blob named by its sha256), and its
  config as the run builds it (``overrides_of_model_config`` applied); hashing the weights' bytes would read
  every byte of a large model each run, so a file rewritten in place with its size and modification time
  kept is not seen;
- the dtype the model is loaded in, 4-/8-bit quantization and its settings, TF32 (on CUDA);
- the versions of transformers (the model's code) and torch, and :data:`FORMAT_VERSION`.

Not in the key: the CP backend, ``context_parallel_size``, the data-parallel layout, ``micro_batch_size`` and
the attention kernel the backend picks. They change the order of floating-point sums, not the sums' values
(what the parity tests prove), and the sums are stored per pair in the rows' order, so one file serves every
layout of the same data. LoRA's reference is the adapter disabled, the base model: the adapter's settings are
not in the key either.

A file is used only when its key, its rows' pair counts and the sha256 of its values all match; anything
else (another key, a truncated or edited file) is reported and the pass runs again (:meth:`ReferenceStore.load`
returns None), then the file is written again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cptune.atomic import write_bytes
from cptune.config.recipe import Recipe

__all__ = ["FOLDER", "FORMAT_VERSION", "ReferenceKey", "ReferenceStore", "weight_files_identity"]

log = logging.getLogger("cptune.preference")

FORMAT_VERSION = 1
"""Bump when the stored layout or the way the first pass computes the sums changes: old files stop matching."""

FOLDER = "reference_log_probs"
"""The folder of the stored sums inside the prepared data's folder."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class ReferenceKey:
    """What the stored sums of one split depend on (see the module's docstring); :attr:`digest` names the file."""

    data_fingerprint: str
    split: str
    model: dict[str, Any]

    @classmethod
    def for_recipe(cls, recipe: Recipe, data_fingerprint: str, split: str) -> ReferenceKey:
        """The key of the recipe's reference model (its base model, as a run loads it) on the prepared data."""
        from cptune.models.loading import model_config, torch_dtype

        config = model_config(recipe).to_dict()
        config.pop("transformers_version", None)  # the installed version is in the key itself
        model = {
            "base_model": recipe.base_model,
            "revision": recipe.model_revision,
            "weights": weight_files_identity(recipe.base_model, recipe.model_revision),
            "config": config,
            "dtype": str(torch_dtype(recipe)),
            "quantization": {
                "load_in_4bit": recipe.load_in_4bit,
                "load_in_8bit": recipe.load_in_8bit,
                "bnb": recipe.bnb_config_kwargs.model_dump(mode="json") if recipe.bnb_config_kwargs else None,
                # Only when on, so the keys of caches written before the switch existed stay the same.
                **({"quantize_moe_experts": True} if recipe.quantize_moe_experts else {}),
            },
            "tf32": recipe.tf32 if torch.cuda.is_available() else None,
        }
        return cls(data_fingerprint, split, model)

    def as_json(self) -> str:
        """The key as canonical JSON (sorted keys): stored in the file and compared whole on reading."""
        import transformers

        parts = {
            "format": FORMAT_VERSION,
            "data": self.data_fingerprint,
            "split": self.split,
            "model": self.model,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        }
        return json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.as_json().encode()).hexdigest()


def weight_files_identity(base_model: str, revision: str | None) -> list[list[Any]] | None:
    """``[name, size, mtime_ns, resolved name]`` of every weight file of ``base_model``; None where none is found.

    A local folder is read as it is; a hub id through the local hub cache (the snapshot the model was
    loaded from), whose files link to blobs named by their sha256.
    """
    folder = Path(base_model).expanduser()
    if not folder.is_dir():
        folder = _hub_snapshot(base_model, revision)
        if folder is None:
            return None
    entries = []
    for path in sorted(folder.iterdir()):
        if not (path.suffix in _WEIGHT_SUFFIXES or path.name.endswith(".index.json")):
            continue
        resolved = path.resolve()
        stat = resolved.stat()
        entries.append([path.name, stat.st_size, stat.st_mtime_ns, resolved.name])
    return entries


def _hub_snapshot(model_id: str, revision: str | None) -> Path | None:
    try:
        from transformers.utils import cached_file

        found = cached_file(model_id, "config.json", revision=revision, local_files_only=True)
    except (OSError, ValueError):
        return None
    return Path(found).parent if found else None


@dataclass(frozen=True)
class ReferenceStore:
    """The stored reference sums of a run's prepared data (``prepared/<fingerprint>/``) against its reference.

    Args:
        data_folder: The prepared data's folder (:attr:`cptune.data.prepare.PreparedData.path`); its name is the
            data's fingerprint.
        keys: The :class:`ReferenceKey` of each split.
    """

    data_folder: Path
    keys: dict[str, ReferenceKey]

    @classmethod
    def for_recipe(cls, recipe: Recipe, data_folder: Path) -> ReferenceStore:
        fingerprint = Path(data_folder).name
        keys = {split: ReferenceKey.for_recipe(recipe, fingerprint, split) for split in ("train", "eval")}
        return cls(Path(data_folder), keys)

    def path(self, split: str) -> Path:
        """The file of ``split``'s sums."""
        return self.data_folder / FOLDER / f"{split}-{self.keys[split].digest}.safetensors"

    def load(self, split: str, pair_counts: Sequence[int]) -> list[list[float]] | None:
        """``split``'s stored sums, one list per row, if a file matches the key and rows; else None (logged why).

        Args:
            split: ``train`` or ``eval``.
            pair_counts: The pairs of every row of the split, in order
                (:func:`cptune.run.training.reference_pass.row_pair_counts`).
        """
        path = self.path(split)
        if not path.is_file():
            return None
        problem, sums = _read(path, self.keys[split].as_json(), list(pair_counts))
        if problem is not None:
            log.warning(
                "precompute_ref_log_probs: the stored reference sums %s are not used (%s); the first pass "
                "computes them again and replaces the file.",
                path,
                problem,
            )
            return None
        return sums

    def save(self, split: str, sums: Sequence[Sequence[float]]) -> Path:
        """Write ``split``'s sums (one list per row, chosen and rejected of each pair) whole; returns the file."""
        from safetensors.torch import save

        counts = torch.tensor([len(row) // 2 for row in sums], dtype=torch.int64)
        values = torch.tensor([value for row in sums for value in row], dtype=torch.float64)
        metadata = {"key": self.keys[split].as_json(), "sha256": _checksum(counts, values)}
        path = self.path(split)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, save({"pairs": counts, "sums": values}, metadata=metadata))
        return path


def _checksum(counts: torch.Tensor, values: torch.Tensor) -> str:
    digest = hashlib.sha256(counts.numpy().tobytes())
    digest.update(values.numpy().tobytes())
    return digest.hexdigest()


def _read(path: Path, key: str, pair_counts: list[int]) -> tuple[str | None, list[list[float]]]:
    """``(problem, sums)``: problem None when the file at ``path`` holds whole sums of ``key`` for these rows."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            counts = handle.get_tensor("pairs")
            values = handle.get_tensor("sums")
    except (OSError, SafetensorError, KeyError, ValueError) as err:
        return f"unreadable: {err}", []
    if metadata.get("key") != key:
        return "written for another key", []
    if (
        counts.dtype != torch.int64
        or values.dtype != torch.float64
        or metadata.get("sha256") != _checksum(counts, values)
    ):
        return "its values do not match their checksum", []
    if counts.tolist() != pair_counts:
        return "written for other rows", []
    if int(counts.sum()) * 2 != values.numel():
        return "its values do not match its pair counts", []
    flat = values.tolist()
    offsets = [0]
    for count in pair_counts:
        offsets.append(offsets[-1] + 2 * count)
    return None, [flat[offsets[i] : offsets[i + 1]] for i in range(len(pair_counts))]
