"""Training a sliding-window model (tiny Mistral) and gpt-oss (sinks, windows, experts) at cp=2 logs what cp=1 logs.

The parity tests (tests/parallel/test_parity.py, test_ulysses_parity.py) hold the sharded attention to
cp=1; this runs the whole training path of ``cptune train``'s ranks (``cptune.run.training.train.train``:
preparing the data, the model checks, the trainer): the model checks accept the windowed models for
ring-flash-attn and deepspeed (Ulysses), the trainer checks every windowed layer passed its window, and the
logged losses and gradient norms (and gpt-oss's router loss) match. Process start-up dominates such short
runs, so the cp=2 runs train one after the other in one launch of two processes (tests/axolotl/train_worker.py),
and the cp=1 references in the session's one process of cp=1 references (tests/run/one_process.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from tests.conftest import logged, max_rel_diff, write_short_run
from tests.dist_utils import run_ranks
from tests.numerics import logged_tolerance
from tests.run.one_process import one_process_reference

WORKER = Path(__file__).parents[1] / "axolotl" / "train_worker.py"
WINDOW = 8  # keys a query sees; the quickstart rows pack documents of tens of tokens, most wider than it
LORA = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8}


def save_tiny(folder, tiny_model_dir, family: str):
    """A tiny Mistral (every layer windowed) or gpt-oss (sinks on every layer; sliding, full; 4 experts, its router
    loss on) with the tiny Llama's tokenizer."""
    from transformers import AutoTokenizer

    from devtools.tiny import build_tiny_gpt_oss, build_tiny_mistral

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    build = {"mistral": build_tiny_mistral, "gpt_oss": build_tiny_gpt_oss}[family]
    model = build(
        len(tokenizer),
        seed=1,
        sliding_window=WINDOW,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@one_process_reference("windowed", "test_windowed_models_train_at_cp2_as_at_cp1")
def cp1_references(folder: Path, tiny_model_dir: Path) -> list[Path]:
    """The tiny Mistral and gpt-oss (saved into ``folder``) and their cp=1 runs' recipes."""
    mistral = save_tiny(folder / "mistral", tiny_model_dir, "mistral")
    gpt_oss = save_tiny(folder / "gpt-oss", tiny_model_dir, "gpt_oss")
    return [
        write_short_run(folder, "mistral-cp1", mistral, **LORA),
        write_short_run(folder, "gpt-oss-cp1", gpt_oss),
    ]


def train_in_one_launch(
    tmp_path: Path, world_size: int, runs: dict[str, tuple[Path, dict]], prepared: Path
) -> None:
    """Train every run (name → model, recipe keys) one after the other in one launch of ``world_size`` processes,
    with the data prepared in ``prepared``."""
    paths = [
        write_short_run(tmp_path, name, model, dataset_prepared_path=str(prepared), **keys)
        for name, (model, keys) in runs.items()
    ]
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
        ranks = run_ranks(
            WORKER, world_size, tmp_path / f"launch-{world_size}", *map(str, paths), timeout=600
        )
    assert all(rank == ranks[0] for rank in ranks)  # every rank logs the same (global) losses


@pytest.mark.distributed
def test_windowed_models_train_at_cp2_as_at_cp1(tmp_path, one_process_runs):
    """Packed rows of 128 tokens, SGD with accumulation 2: loss and gradient norm of every step at cp=1, at cp=2
    with ring-flash-attn (varlen_llama3) and at cp=2 with deepspeed (Ulysses, cptune core attention). Mistral with
    LoRA; gpt-oss fully fine-tuned (its sinks train) on ring-flash-attn, its router loss logged too."""
    references = one_process_runs["windowed"]  # the models, and their cp=1 runs (cp1_references)
    mistral, gpt_oss = references / "mistral", references / "gpt-oss"
    ring, ulysses = {"context_parallel_size": 2}, {"context_parallel_size": 2, "cp_backend": "deepspeed"}
    # DeepSpeed last: its engine's process-wide state is restored after a run, but it is the odd one out.
    cp2 = {
        "mistral-ring": (mistral, {**LORA, **ring}),
        "gpt-oss-ring": (gpt_oss, ring),
        "mistral-ulysses": (mistral, {**LORA, **ulysses}),
    }
    train_in_one_launch(tmp_path, 2, cp2, prepared=references / "prepared")
    for name in cp2:
        model = name.rsplit("-", 1)[0]  # the cp=1 reference: the same model's run
        keys = ("loss", "grad_norm") + (("router_aux_loss",) if model == "gpt-oss" else ())
        expected = {key: logged(references / f"{model}-cp1", key) for key in keys}
        got = {key: logged(tmp_path / name, key) for key in keys}
        assert sorted(expected["loss"]) == [1, 2, 3], expected
        diffs = {key: max_rel_diff(got[key], expected[key]) for key in keys}
        print(f"{name}: {diffs}")
        # Bound (tests/numerics.py): rows of 128 tokens, 4 a step (2 x accumulation 2); a micro batch's router
        # sums (2 rows x 128 tokens x 2 layers = 512 terms of size <= 1) stay within it.
        assert max(diffs.values()) <= logged_tolerance(128, 4), (name, diffs, got, expected)
