"""cp_backend: deepspeed through ``cptune.run.training.train.train``, four runs one after the other in one launch.

Two processes (cp=2) train the same LoRA recipe with a new pad token (``special_tokens``, which
grows the embeddings), SGD, gradient accumulation 2, for one epoch of 11 packed rows, which
do not divide over the 2 processes:

1. ``zero0``: DeepSpeed Ulysses, ZeRO-0, saving a checkpoint at step 2;
2. ``zero3``: the same under ZeRO-3, partitioning every parameter (``stage3_param_persistence_threshold:
   0``; the default keeps all of a tiny model's parameters whole);
3. ``resumed``: ``zero0`` resumed from its checkpoint of step 2;
4. ``ring``: ring-flash-attn without DeepSpeed, the reference, after the DeepSpeed runs;
5. ``dpo-zero3``: ``examples/cpu/dpo.yaml`` (DPO of a LoRA adapter, its reference the adapter disabled) with
   DeepSpeed Ulysses under ZeRO-3, every parameter partitioned, SGD, 4 steps;
6. ``dpo-ring``: the same without DeepSpeed (ring-flash-attn), its reference;
7. ``zero3-cp1``: the LoRA recipe at context_parallel_size 1 (two data-parallel processes, whole rows each)
   under ZeRO-3, as Axolotl's ``deepspeed: zero3.json`` recipes without CP train;
8. ``ddp-cp1``: the same with plain DDP, its reference.

In one process, as ``cptune.run.training.train.train`` called several times from a notebook: no run may
leave DeepSpeed's process-wide state behind (before the fix the second Ulysses run stopped at
"sequence parallel group is already initialized", and a run after a ZeRO-3 run loaded its model
partitioned). Compared with the ring run: the loss, the gradient norm and the epoch the Trainer
logs at every step, and the saved adapter, whose grown embeddings ZeRO-3 once left out.

Tolerances: fp32 runs whose sums differ in order only (DeepSpeed's all-reduce against DDP's, the
Ulysses all-to-all against the ring), bounded by tests/numerics.py's ``logged_tolerance`` for rows of
128 tokens, 2 a step: the logged losses and gradient norms; the adapter weights after SGD, whose
update is the learning rate times the summed gradients, within that tolerance to first order,
relative to each tensor's largest element (lora_B starts at zero, lora_A moves less than its
initialisation; as in tests/run/test_train_fsdp.py). The embedding rows are frozen: they must be
equal bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import QUICKSTART_DATA, REPO, max_rel_diff
from tests.dist_utils import run_ranks
from tests.numerics import logged_tolerance

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("deepspeed_worker.py")
WORLD, GA = 2, 2
LOSS_TOL = ADAPTER_TOL = logged_tolerance(128, GA)  # bound (tests/numerics.py): 128-token rows, GA a step
# The first 22 quickstart samples pack into 11 rows of 128 tokens with the tiny model's tokenizer.
SAMPLES = 22
RUNS = ("zero0", "zero3", "resumed", "ring", "dpo-zero3", "dpo-ring", "zero3-cp1", "ddp-cp1")
DPO_KEYS = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> tuple[Path, dict[str, dict]]:
    """The runs' output folders' root, and each run's report from rank 0 (both ranks report the same)."""
    root = tmp_path_factory.mktemp("deepspeed-runs")
    data = root / "data.jsonl"
    data.write_text("\n".join(QUICKSTART_DATA.read_text().splitlines()[:SAMPLES]) + "\n")
    zero3 = root / "zero3.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    common = {
        "base_model": str(tiny_model_dir),
        "datasets": [{"path": str(data), "type": "alpaca_instruct.load_no_prompt"}],
        "dataset_prepared_path": str(root / "prepared"),
        "sequence_len": 128,
        "sample_packing": True,
        "special_tokens": {"pad_token": "<|new_pad|>"},
        "adapter": "lora",
        "lora_r": 8,
        "lora_alpha": 16,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": GA,
        "num_epochs": 1,
        "optimizer": "sgd",
        "learning_rate": 0.05,
        "warmup_steps": 0,
        "logging_steps": 1,
        "context_parallel_size": WORLD,
    }
    ulysses = {"cp_backend": "deepspeed", "ring_attn_func": None}
    recipes = {
        "zero0": {**ulysses, "zero_stage": 0, "save_steps": 2},
        "zero3": {**ulysses, "deepspeed": str(zero3)},
        "resumed": {
            **ulysses,
            "zero_stage": 0,
            "resume_from_checkpoint": str(root / "zero0" / "checkpoint-2"),
        },
        "ring": {"cp_backend": "ring-flash-attn"},
        "zero3-cp1": {"context_parallel_size": 1, "deepspeed": str(zero3)},
        "ddp-cp1": {"context_parallel_size": 1},
    }
    example = yaml.safe_load((REPO / "examples" / "cpu" / "dpo.yaml").read_text())
    dpo = {
        **example,
        "base_model": str(REPO / example["base_model"]),
        "datasets": [{**d, "path": str(REPO / d["path"])} for d in example["datasets"]],
        "dataset_prepared_path": str(root / "dpo-prepared"),
        "max_steps": 4,
        "optimizer": "sgd",
        "learning_rate": 0.05,
        "warmup_steps": 0,
        "context_parallel_size": WORLD,
    }
    recipes["dpo-zero3"] = {**dpo, **ulysses, "deepspeed": str(zero3)}
    recipes["dpo-ring"] = dpo
    paths = []
    for name in RUNS:
        paths.append(root / f"{name}.yaml")
        base = {} if name.startswith("dpo") else common
        paths[-1].write_text(yaml.safe_dump({**base, **recipes[name], "output_dir": str(root / name)}))
    ranks = run_ranks(WORKER, WORLD, root / "launch", *map(str, paths), timeout=400, bitsandbytes=False)
    assert ranks[0].keys() == set(RUNS)
    for name, key in [(name, key) for name in RUNS for key in ("loss", "grad_norm", "epoch")]:
        assert steps(ranks[1][name], key) == steps(ranks[0][name], key), (name, key)  # global numbers
    return root, ranks[0]


def steps(report: dict, key: str) -> dict[int, float]:
    return {entry["step"]: entry[key] for entry in report["history"] if key in entry and "loss" in entry}


def test_deepspeed_runs_equal_the_run_without_deepspeed_step_by_step(runs):
    _, reports = runs
    ring = reports["ring"]
    # The epoch's rows do not divide over the processes (where DeepSpeed's Ulysses loader once trained a
    # repeated row and counted the epoch in other micro batches): step 1 is GA of its 11 rows.
    rows = round(GA / steps(ring, "epoch")[1])
    assert rows % WORLD and len(steps(ring, "loss")) == -(-rows // GA)
    for name in ("zero0", "zero3"):
        for key in ("loss", "grad_norm"):  # ZeRO-0 in fp32 once logged no grad_norm at all
            assert max_rel_diff(steps(reports[name], key), steps(ring, key)) <= LOSS_TOL, (name, key)
        assert steps(reports[name], "epoch") == steps(ring, "epoch"), name
        (final,) = [entry for entry in reports[name]["history"] if "train_loss" in entry]
        (expected,) = [entry for entry in ring["history"] if "train_loss" in entry]
        assert final["epoch"] == expected["epoch"] == 1.0
        assert abs(final["train_loss"] - expected["train_loss"]) <= LOSS_TOL * abs(expected["train_loss"])


def test_zero3_without_cp_equals_ddp_step_by_step(runs):
    """Axolotl's ZeRO recipes without context parallelism: two data-parallel processes under ZeRO-3, every
    parameter partitioned, log DDP's numbers at every step (fp32: the sums differ in order only, by the same
    bound) and save its adapter."""
    root, reports = runs
    got, expected = reports["zero3-cp1"], reports["ddp-cp1"]
    # dp=2: a step sums GA rows on each of the WORLD processes (tests/numerics.py's bound for its rows)
    tolerance = logged_tolerance(128, GA * WORLD)
    assert got["parameters"] > 0 and got["whole_parameters"] == []
    assert "whole_parameters" not in expected
    assert len(steps(expected, "loss")) >= 3
    for key in ("loss", "grad_norm"):
        assert max_rel_diff(steps(got, key), steps(expected, key)) <= tolerance, key
    assert steps(got, "epoch") == steps(expected, "epoch")
    adapter = load_file(root / "zero3-cp1" / "adapter_model.safetensors")
    reference = load_file(root / "ddp-cp1" / "adapter_model.safetensors")
    assert sorted(adapter) == sorted(reference)
    worst = max(float((adapter[k] - reference[k]).abs().max() / reference[k].abs().max()) for k in reference)
    assert worst <= tolerance


def test_runs_in_one_process_leave_no_deepspeed_state_behind(runs):
    _, reports = runs
    # A second Ulysses run (zero3, resumed) and a plain run after ZeRO-3 (ring) trained, compared above.
    assert {name: reports[name]["state_left"] for name in RUNS} == {name: [] for name in RUNS}


def test_zero3_partitions_every_parameter(runs):
    _, reports = runs
    assert reports["zero3"]["parameters"] > 0 and reports["zero3"]["whole_parameters"] == []
    assert "whole_parameters" not in reports["zero0"]


def test_zero3_adapter_holds_the_grown_embeddings_as_without_deepspeed(runs):
    root, _ = runs
    got = load_file(root / "zero3" / "adapter_model.safetensors")
    expected = load_file(root / "ring" / "adapter_model.safetensors")
    assert sorted(got) == sorted(expected)
    embeddings = [key for key in expected if "lora_" not in key]
    assert sorted(embeddings) == [
        "base_model.model.lm_head.weight",
        "base_model.model.model.embed_tokens.weight",
    ]
    for key in embeddings:  # frozen, grown with the recipe's seed: equal bit for bit
        assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key]), key
    worst = max(float((got[k] - expected[k]).abs().max() / expected[k].abs().max()) for k in expected)
    assert worst <= ADAPTER_TOL


def test_lora_dpo_under_zero3_logs_the_ring_runs_numbers(runs):
    """DPO with Ulysses under ZeRO-3: the reference forward (the adapter disabled) gathers the partitioned base
    weights as the policy's does; every step's loss, gradient norm, rewards and log-probs equal the run
    without DeepSpeed (which equals cp=1: tests/parallel/test_parity.py)."""
    _, reports = runs
    got, expected = reports["dpo-zero3"], reports["dpo-ring"]
    assert reports["dpo-zero3"]["whole_parameters"] == []
    assert len(steps(expected, "loss")) == 4 and steps(expected, "rewards/margins")[1] == 0.0
    assert steps(got, "rewards/margins")[1] == 0.0
    diffs = {
        key: max_rel_diff(steps(got, key), steps(expected, key)) for key in DPO_KEYS if "rewards" not in key
    }
    # A reward is β times a difference of log-prob sums, 0 at step 1: its error is relative to the sums.
    beta = 0.1  # examples/cpu/dpo.yaml's rl_beta
    for key in ("rewards/chosen", "rewards/rejected"):
        sums = steps(expected, key.replace("rewards", "logps"))
        diffs[key] = max(
            abs(steps(got, key)[s] - v) / (beta * abs(sums[s])) for s, v in steps(expected, key).items()
        )
    print("LoRA DPO, Ulysses ZeRO-3 vs ring, cp=2:", diffs)
    # Bound (tests/numerics.py): the example's rows of at most 512 tokens, 2 a step.
    assert max(diffs.values()) <= logged_tolerance(512, 2), diffs


def test_resumed_run_continues_the_uninterrupted_one(runs):
    _, reports = runs
    uninterrupted, resumed = steps(reports["zero0"], "loss"), steps(reports["resumed"], "loss")
    assert sorted(resumed) == sorted(uninterrupted) and len(resumed) > 2
    # The same computation on the same machine after step 2: equal bit for bit.
    assert {s: resumed[s] for s in resumed if s > 2} == {s: uninterrupted[s] for s in uninterrupted if s > 2}
