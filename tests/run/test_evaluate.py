"""Evaluation under CP: cp=2 and cp=4 report the cp=1 eval loss, the exact token mean of the whole set.

The evaluation data has long prompts (label -100) before short answers, so with
micro_batch_size 1 the first CP ranks' shards of some batches hold no target at
all (checked below). The cp=1 reference is computed here, in one process and
independently of cptune's batching and sharding: every sample alone through the
plain model, Σ token losses / Σ target tokens over the whole set. cptune's own
cp=1 path runs too, as dp=2 (each rank evaluates its half of the rows with the
single-rank backend; the halves differ in batch count), and so does dp=2×cp=2.

The same launches evaluate DPO recipes (``rl: dpo``) with a LoRA adapter whose weights are
not the base's: ``eval_loss`` (the mean pair loss) and TRL's metrics at cp=2, dp=2 and
dp=2×cp=2, pairs packed in rows or a row per side, equal the cp=1 values computed here, every
side of every pair a row of its own through the plain model, with the adapter on and off.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.collective_audit import EVAL_TOTALS
from tests.conftest import REPO
from tests.dist_utils import run_ranks
from tests.numerics import float64_scalar_twins_excess, loss_sum_floor, reorder_bound
from tests.parallel.reorder_twins import SDPA_TWIN_DRAWS, sdpa_twin_runs

WORKER = Path(__file__).with_name("eval_worker.py")
TINY_LLAMA = REPO / "examples" / "tiny-llama"  # has a chat template, which the preference type renders with
PAIRS = REPO / "examples" / "data" / "preference.jsonl"
DPO_BETA = 0.5
DPO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)

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
    return _mean_loss(model, rows)


def twin_reference_losses(model_dir: Path, rows: list[dict]) -> list[float]:
    """``reference_loss`` in fp32 through the 2 twins of the model's sdpa attention (sdpa's math backend, sdpa over the tokens in a strided order:
    tests/parallel/reorder_twins.py), the same function with attention's sums in other orders."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [loss for loss, _ in sdpa_twin_runs(model, lambda: _mean_loss(model, rows))]


def _mean_loss(model: torch.nn.Module, rows: list[dict]) -> tuple[float, int]:
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


def write_adapter(folder: Path) -> Path:
    """A LoRA adapter on the tiny Llama with random (not zero) B matrices: its pairs' rewards are not 0."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(TINY_LLAMA), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.2)
    model.save_pretrained(folder)
    return folder


def prepared_eval_rows(recipe_path: Path) -> list[dict]:
    from cptune.config.loader import load_recipe
    from cptune.data.prepare import prepare_datasets
    from cptune.models.loading import load_tokenizer

    recipe = load_recipe(recipe_path)
    return list(prepare_datasets(recipe, load_tokenizer(recipe)).eval)


def dpo_reference(rows: list[dict], adapter: Path, dtype: torch.dtype, twins: bool = False):
    """DPO's eval loss and TRL's metrics (means over pairs), every evaluation pair's sides through the plain model.

    Each side (a document of the prepared row) is a row of its own in one right-padded batch (causal attention:
    the padding after a side never reaches it), with the adapter and with it disabled (the reference); the
    log-prob sums in float64. Also returns ``longest`` (the most targets of a side) and ``magnitude`` (the
    largest |log-prob sum|), the floors' inputs. ``twins``: a list instead, the same through the 2 twins of the
    model's sdpa attention after it (sdpa's math backend, sdpa over the tokens in a strided order: tests/parallel/reorder_twins.py).
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, dtype=dtype)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    documents = []  # (ids, labels) of every side, chosen then rejected of each pair
    for row in rows:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for begin, end in itertools.pairwise(starts):
            documents.append((row["input_ids"][begin:end], row["labels"][begin:end]))
    width = max(len(ids) for ids, _ in documents)
    ids = torch.tensor([d + [0] * (width - len(d)) for d, _ in documents])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in documents])
    mask = torch.tensor([[1] * len(d) + [0] * (width - len(d)) for d, _ in documents])

    def log_prob_sums() -> list[float]:
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].double()
        losses = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")
        return (-losses.sum(-1)).tolist()

    def metrics() -> dict[str, float]:
        with torch.no_grad():
            policy = log_prob_sums()
            with model.disable_adapter():
                reference = log_prob_sums()
        return dpo_metrics(policy, reference, (labels[:, 1:] != -100).sum(-1).tolist())

    return [metrics(), *sdpa_twin_runs(model, metrics)] if twins else metrics()


def dpo_metrics(policy: list[float], reference: list[float], targets: list[int]) -> dict[str, float]:
    """DPO's loss and TRL's metrics (means over pairs) of every side's log-prob sums, chosen then rejected."""
    sides = list(zip(policy, reference, targets, strict=True))
    totals = dict.fromkeys(("loss", *DPO_METRICS), 0.0)
    for (pc, rc, _), (pr, rr, _) in zip(sides[0::2], sides[1::2], strict=True):
        chosen, rejected = DPO_BETA * (pc - rc), DPO_BETA * (pr - rr)
        values = {
            "loss": -F.logsigmoid(torch.tensor(chosen - rejected, dtype=torch.float64)).item(),
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected,
            "rewards/accuracies": float(chosen > rejected),
            "logps/chosen": pc,
            "logps/rejected": pr,
        }
        for name, value in values.items():
            totals[name] += value
    pairs = len(sides) // 2
    means = {name: value / pairs for name, value in totals.items()}
    return {
        **means,
        "pairs": pairs,
        "longest": max(targets for *_, targets in sides),
        "magnitude": max(abs(v) for side in sides for v in side[:2]),
    }


def dpo_eval_failures(got: dict[str, list[dict]], adapter: Path, recipe: Path) -> dict[str, float]:
    """Each DPO run's eval metrics on every rank against the cp=1 values by the twins rule (tests/numerics.py:
    the cp=1 values through the plain model and through its 2 twins set the limit).

    Returns the runs and metrics over the rule's limit (empty: all within). Accuracy (a share of pairs)
    must be equal.
    """
    rows = prepared_eval_rows(recipe)
    expected, *twins = dpo_reference(rows, adapter, torch.float32, twins=True)
    expected64 = dpo_reference(rows, adapter, torch.float64)
    assert 0 < expected["rewards/accuracies"] < 1 and abs(expected["rewards/margins"]) > 1e-3, expected
    print(f"dpo eval reference: {expected}")
    failures, worst = {}, {}
    for name, ranks in got.items():
        for metrics in ranks:
            assert metrics["eval_pairs"] == expected["pairs"], (name, metrics)
            for key in ("loss", *DPO_METRICS):
                value, want, want64 = metrics[f"eval_{key}"], expected[key], expected64[key]
                if key == "rewards/accuracies":
                    if value != want:
                        failures[f"{name} {key}"] = value
                    continue
                # Floor: the reorder bound of the log-prob sums behind the value (the longest side's targets,
                # the sums' magnitude; times 2β for a reward or the loss), relative to the value.
                scale = 1.0 if key.startswith("logps") else 2 * DPO_BETA
                floor = reorder_bound(expected["longest"], scale * expected["magnitude"]) / abs(want64)
                rel = abs(value - want64) / abs(want64)
                twin_errors = [abs(x - want64) / abs(want64) for x in (want, *(t[key] for t in twins))]
                excess = float64_scalar_twins_excess(rel, twin_errors, floor, SDPA_TWIN_DRAWS)
                worst[name] = max(worst.get(name, 0.0), excess)
                if excess > 1:
                    failures[f"{name} {key}"] = excess
    print(f"dpo eval: worst share of the twins-rule tolerance per run {worst}")
    return failures


# Launch size -> (name, context_parallel_size) of the recipes evaluated in that launch.
LAUNCHES = {2: [("cp2", 2), ("dp2", 1)], 4: [("cp4", 4), ("dp2xcp2", 2)]}
# Launch size -> (name, context_parallel_size, sample_packing) of the DPO recipes evaluated in that launch.
DPO_LAUNCHES = {
    2: [("dpo-packed-cp2", 2, True), ("dpo-unpacked-dp2", 1, False)],
    4: [("dpo-packed-dp2xcp2", 2, True)],
}


@pytest.mark.distributed
@pytest.mark.slow
def test_eval_loss_and_dpo_eval_metrics_with_cp2_and_cp4_equal_cp1(
    write_recipe, tmp_path, tiny_model_dir, collective_audit
):
    from transformers import AutoTokenizer

    rows = write_eval_data(tmp_path / "eval.jsonl", len(AutoTokenizer.from_pretrained(tiny_model_dir)))
    expected, expected_tokens = reference_loss(tiny_model_dir, rows)
    expected64, _ = reference_loss(tiny_model_dir, rows, torch.float64)
    twins = twin_reference_losses(tiny_model_dir, rows)
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
        if world == 2:
            # eval_batch_size 4: rows of different lengths padded into one batch, split over the CP ranks
            recipes[world].append(
                write_recipe(
                    "unpacked-cp2-eval-batch-4.yaml",
                    test_datasets=[{"path": str(tmp_path / "eval.jsonl"), "type": "pretokenized"}],
                    sample_packing=False,
                    micro_batch_size=1,
                    eval_batch_size=4,
                    context_parallel_size=2,
                )
            )
    for layout in ("packed", "unpacked"):
        for cp in (2, 4):
            recipe = tmp_path / f"{layout}-cp{cp}.yaml"
            assert shards_without_targets(recipe, cp) >= 1, "some CP rank must get a shard without targets"
    adapter = write_adapter(tmp_path / "dpo-adapter")
    pairs = [{"path": str(PAIRS), "type": "chat_template.default", "field_messages": "prompt"}]
    dpo_recipes = {}
    for world, runs in DPO_LAUNCHES.items():
        for name, cp, packed in runs:
            dpo_recipes[name] = write_recipe(
                f"{name}.yaml",
                base_model=str(TINY_LLAMA),
                datasets=pairs,
                val_set_size=8,  # 8 of the 32 pairs, the same 8 in every layout (split before packing)
                sequence_len=512,
                sample_packing=packed,
                rl="dpo",
                rl_beta=DPO_BETA,
                context_parallel_size=cp,
            )
            recipes[world].append(Path(f"{dpo_recipes[name]}::{adapter}"))
    got: dict[str, list[dict]] = {}
    for world, paths in recipes.items():
        launched = run_ranks(WORKER, world, tmp_path / f"ranks-{world}", *map(str, paths), bitsandbytes=False)
        for rank_result in launched:
            for name, metrics in rank_result.items():
                got.setdefault(name, []).append(metrics)
    seconds = {name: round(max(m["worker_seconds"] for m in ranks), 1) for name, ranks in got.items()}
    print(f"seconds per recipe in its launch: {seconds}")
    dpo_got = {name: got.pop(name) for name in dpo_recipes}
    failures = dpo_eval_failures(dpo_got, adapter, dpo_recipes["dpo-packed-cp2"])
    assert not failures, (failures, dpo_got)
    rel = {name: max(abs(m["eval_loss"] - expected) / expected for m in ranks) for name, ranks in got.items()}
    print(f"eval parity: reference {expected:.9f} over {expected_tokens} targets; max rel diff per run {rel}")
    assert len(rel) == 9
    for name, ranks in got.items():
        for metrics in ranks:
            assert metrics["eval_tokens"] == expected_tokens, name
            assert math.isclose(metrics["eval_perplexity"], math.exp(metrics["eval_loss"]), rel_tol=1e-12)
        # Twins rule (tests/numerics.py): 32x as far from float64 as the farthest of the fp32 reference and its 2
        # twins (SDPA_TWIN_DRAWS), each known to within its last rounding, plus the reorder bound of the sum of
        # the set's token losses.
        errors = [abs(m["eval_loss"] - expected64) / expected64 for m in ranks]
        reference_errors = [abs(x - expected64) / expected64 for x in (expected, *twins)]
        excess = float64_scalar_twins_excess(
            max(errors), reference_errors, loss_sum_floor(expected_tokens), SDPA_TWIN_DRAWS
        )
        assert excess <= 1, (name, ranks, expected, expected64)
    collective_audit.check(EVAL_TOTALS)
