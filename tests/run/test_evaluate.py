"""Evaluation under CP: cp=2 and cp=4 report the cp=1 eval loss, the exact token mean of the whole set.

The evaluation data has long prompts (label -100) before short answers, so with
micro_batch_size 1 the first CP ranks' shards of some batches hold no target at
all (checked below). The cp=1 reference is computed here, in one process and
independently of cptune's batching and sharding: every sample alone through the
plain model, Σ token losses / Σ target tokens over the whole set. cptune's own
cp=1 path runs too, as dp=2 (each rank evaluates its half of the rows with the
single-rank backend; the halves differ in batch count), and so does dp=2×cp=2.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.collective_audit import EVAL_TOTALS
from tests.dist_utils import run_ranks
from tests.numerics import float64_excess, loss_sum_floor

WORKER = Path(__file__).with_name("eval_worker.py")

# (length, prompt tokens without a target); the answer is the rest of the sample.
EVAL_SAMPLES = [(120, 100), (64, 50), (37, 10), (90, 5), (23, 22), (51, 30), (16, 3), (77, 60), (101, 90)]


def write_eval_data(path: Path, vocab: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for length, prompt in EVAL_SAMPLES:
        ids = [rng.randrange(5, vocab) for _ in range(length)]
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def reference_loss(
    model_dir: Path, rows: list[dict], dtype: torch.dtype = torch.float32
) -> tuple[float, int]:
    """Σ token losses / Σ targets, every sample alone through the model (in ``dtype``; the sums in float64)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
            targets = torch.tensor(row["labels"][1:])
            total += float(F.cross_entropy(logits[:-1].double(), targets, ignore_index=-100, reduction="sum"))
            count += int((targets != -100).sum())
    return total / count, count


def shards_without_targets(recipe_path: Path, cp_size: int) -> int:
    """How many (batch, rank) shards of the prepared evaluation data hold no target."""
    from cptune.config.loader import load_recipe
    from cptune.data.collator import PackedCollator
    from cptune.data.prepare import prepare_datasets
    from cptune.models.loading import load_tokenizer
    from cptune.parallel.loss import count_targets
    from cptune.parallel.shard import TokenBatch, shard_varlen

    recipe = load_recipe(recipe_path)
    tokenizer = load_tokenizer(recipe)
    rows = prepare_datasets(recipe, tokenizer).eval
    collate = PackedCollator(pad_token_id=tokenizer.pad_token_id)
    empty = 0
    for row in rows:
        batch = collate([row])
        tokens = TokenBatch(batch["input_ids"], batch["position_ids"], batch["shift_labels"])
        for rank in range(cp_size):
            shard = shard_varlen(tokens, cp_size, rank, tokenizer.pad_token_id)
            empty += int(count_targets(shard.tokens.shift_labels)) == 0
    return empty


# Launch size -> (name, context_parallel_size) of the recipes evaluated in that launch.
LAUNCHES = {2: [("cp2", 2), ("dp2", 1)], 4: [("cp4", 4), ("dp2xcp2", 2)]}


@pytest.mark.distributed
@pytest.mark.slow
def test_eval_loss_with_cp2_and_cp4_equals_the_cp1_token_mean(
    write_recipe, tmp_path, tiny_model_dir, collective_audit
):
    from transformers import AutoTokenizer

    rows = write_eval_data(tmp_path / "eval.jsonl", len(AutoTokenizer.from_pretrained(tiny_model_dir)))
    expected, expected_tokens = reference_loss(tiny_model_dir, rows)
    expected64, _ = reference_loss(tiny_model_dir, rows, torch.float64)
    recipes: dict[int, list[Path]] = {world: [] for world in LAUNCHES}
    for world, runs in LAUNCHES.items():
        for name, cp in runs:
            for layout in ("packed", "unpacked"):
                recipes[world].append(
                    write_recipe(
                        f"{layout}-{name}.yaml",
                        test_datasets=[{"path": str(tmp_path / "eval.jsonl"), "type": "pretokenized"}],
                        sample_packing=layout == "packed",
                        micro_batch_size=1,
                        context_parallel_size=cp,
                    )
                )
    for layout in ("packed", "unpacked"):
        for cp in (2, 4):
            recipe = tmp_path / f"{layout}-cp{cp}.yaml"
            assert shards_without_targets(recipe, cp) >= 1, "some CP rank must get a shard without targets"
    got: dict[str, list[dict]] = {}
    for world, paths in recipes.items():
        for rank_result in run_ranks(WORKER, world, tmp_path / f"ranks-{world}", *map(str, paths)):
            for name, metrics in rank_result.items():
                got.setdefault(name, []).append(metrics)
    rel = {name: max(abs(m["eval_loss"] - expected) / expected for m in ranks) for name, ranks in got.items()}
    print(f"eval parity: reference {expected:.9f} over {expected_tokens} targets; max rel diff per run {rel}")
    assert len(rel) == 8
    for name, ranks in got.items():
        for metrics in ranks:
            assert metrics["eval_tokens"] == expected_tokens, name
            assert math.isclose(metrics["eval_perplexity"], math.exp(metrics["eval_loss"]), rel_tol=1e-12)
        # Float64 reference (tests/numerics.py): 8x as far from it as the fp32 reference, plus the
        # reorder bound of the sum of the set's token losses.
        errors = [abs(m["eval_loss"] - expected64) / expected64 for m in ranks]
        reference_error = abs(expected - expected64) / expected64
        excess = float64_excess(max(errors), reference_error, floor=loss_sum_floor(expected_tokens))
        assert excess <= 1, (name, ranks, expected, expected64)
    collective_audit.check(EVAL_TOTALS)
