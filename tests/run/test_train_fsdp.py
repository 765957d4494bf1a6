"""FSDP2 sharding of the model states together with context parallelism, end to end on CPU/gloo.

The parity runs use 4 processes as dp_shard=2 × cp=2: every weight, gradient and
optimizer state is split over all 4 ranks while each packed row is split over 2.
The reference is one process with micro batch 2 (the rows of the two data-parallel
groups), fp32. Compared: the loss of every step, the weights written to output_dir
(gathered into a standard Hugging Face folder), and the logits of that folder
loaded in a plain single process against the sharded model's own logits.

Optimizers: the parity runs use SGD, whose update is linear in the gradient, so the
weights show any gradient error as it is. AdamW would hide a wrong gradient scale
(its update is invariant to it), and it divides each element by its own gradient
history, which turns fp32 reduction-order noise in near-zero gradients into weight
differences (measured after 4 steps: 5.2e-4 relative on a full fine-tune, 3.3e-4 on
lora_B, the same for plain DDP cp=2 as for FSDP2). The resume test uses AdamW, so
that resuming must restore sharded Adam moments exactly.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cptune.run.training.checkpoints import complete_checkpoints
from tests.collective_audit import EVAL_TOTALS, STEP_TARGETS, THROUGHPUT, auditing
from tests.conftest import (
    QUICKSTART_DATA,
    REPO,
    logged,
    logged_losses,
    max_rel_diff,
    run_cptune,
    shipped_example,
    succeeded,
)
from tests.dist_utils import run_ranks
from tests.numerics import assert_float64_twins_rule, logged_tolerance
from tests.parallel.reorder_twins import sdpa_twin_runs
from tests.run.one_process import one_process_reference
from tests.run.test_resume import WORKER, run_until_killed, step_logs

MAX_STEPS, SAVE_STEPS = 4, 2
# Bound (tests/numerics.py) of the logged losses, gradient norms and eval loss, fp32, SGD: the CPU
# example's rows of 512 tokens, 4 a step (micro batch 1 x dp 2 x accumulation 2), 5 evaluated; the
# LoRA run's rows of 128 tokens, 4 a step. The trained weights: their updates (SGD: the learning rate
# times the gradients summed over the steps) within the gradients' tolerance, to first order in the
# learning rate, relative to each tensor's largest update (a LoRA tensor: its largest element, lora_B
# starts at zero and lora_A moves less than its initialisation).
FULL_TOL, LORA_TOL = logged_tolerance(512, 5), logged_tolerance(128, 4)
EXAMPLE = REPO / "examples" / "cpu" / "fsdp2.yaml"
# Trains as shipped (no FSDP) in the 2-process launch below, which costs it no process start of its own.
SIMPO_EXAMPLE = REPO / "examples" / "cpu" / "simpo.yaml"
EXAMPLES_TRAINED_HERE = (EXAMPLE, SIMPO_EXAMPLE)


def write_recipe(root: Path, model_dir: Path, name: str, **keys) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe_keys(root, model_dir, name, **keys)))
    return path


def recipe_keys(root: Path, model_dir: Path, name: str, **keys) -> dict:
    """The module's recipe of packed 128-token alpaca rows at cp=2 under FSDP2, into ``root / name``."""
    return {
        "base_model": str(model_dir),
        "datasets": [{"path": str(QUICKSTART_DATA), "type": "alpaca_instruct.load_no_prompt"}],
        "dataset_prepared_path": str(root / "prepared"),
        "sequence_len": 128,
        "sample_packing": True,
        "micro_batch_size": 1,
        "max_steps": MAX_STEPS,
        "learning_rate": 0.002,
        "logging_steps": 1,
        "context_parallel_size": 2,
        "fsdp_version": 2,
        "output_dir": str(root / name),
        **keys,
    }


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def weight_diffs(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor: max |difference| / max |expected|."""
    assert sorted(got) == sorted(expected)
    return {
        k: float((got[k] - expected[k]).abs().max() / expected[k].abs().max().clamp_min(1e-30))
        for k in expected
    }


def train_in_one_launch(world_size: int, launch_dir: Path, *recipes: Path) -> dict[str, list[dict]]:
    """Train ``recipes`` one after the other in one launch of ``world_size`` processes.

    Returns each recipe's output_dir name → the reports of its ranks (tests/run/train_worker.py).
    """
    ranks = run_ranks(WORKER, world_size, launch_dir, *map(str, recipes))
    names = [yaml.safe_load(recipe.read_text())["output_dir"] for recipe in recipes]
    return {Path(name).name: [rank["runs"][i] for rank in ranks] for i, name in enumerate(names)}


def four_rank_recipes(root: Path, tiny_model_dir: Path) -> dict[str, dict]:
    """name -> the keys of a 4-process run (dp_shard=2 × cp=2) of :func:`four_rank_runs`, into ``root / name``."""
    sharded = {
        **shipped_example(EXAMPLE, root, "sharded"),
        "max_steps": MAX_STEPS,
        "logging_steps": 1,
        "optimizer": "sgd",
        "learning_rate": 0.05,
        "warmup_steps": 0,
        "val_set_size": 5,
        "eval_steps": MAX_STEPS,
    }
    lora_keys = {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "optimizer": "sgd", "learning_rate": 0.05}
    lora = recipe_keys(root, tiny_model_dir, "lora", gradient_accumulation_steps=2, **lora_keys)
    return {"sharded": sharded, "lora": lora, "dpo": example_dpo_recipe(root)}


ONE_PROCESS_LAYOUT = {"context_parallel_size": 1, "micro_batch_size": 2, "dp_shard_size": None}
"""A 4-process run's recipe in one process: micro batch 2 holds both data-parallel groups' rows."""
NOTHING_TO_SHARD = "fsdp_version: 2 with one process: there is nothing to shard"


@one_process_reference("fsdp-4", "four_rank_runs")
def four_rank_references(folder: Path, tiny_model_dir: Path) -> list[Path]:
    """Each run of :func:`four_rank_recipes` in one process (:data:`ONE_PROCESS_LAYOUT`), into ``folder / name``."""
    recipes = []
    for name, keys in four_rank_recipes(folder, tiny_model_dir).items():
        recipes.append(folder / f"{name}.yaml")
        recipes[-1].write_text(yaml.safe_dump(keys | ONE_PROCESS_LAYOUT))
    return recipes


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory, tiny_model_dir, one_process_runs):
    """The 4-process runs (dp_shard=2 × cp=2) of this module, in one launch, and their one-process references.

    ``sharded``: the CPU example's full fine-tune (SGD, 4 steps). Gradient accumulation 2
    (the example's). Evaluated at the end on 5 held-out samples, which pack into rows that
    do not split evenly over the 2 data-parallel groups: every sharded forward gathers
    weights from all 4 ranks, so the ranks must still run the same number of evaluation
    forwards. This is also the run of ``examples/cpu/fsdp2.yaml`` that
    tests/test_examples.py counts on.

    ``lora``: a LoRA run of the tiny model (SGD, gradient accumulation 2).

    ``dpo``: ``examples/cpu/dpo.yaml`` (DPO of a LoRA adapter, the reference the adapter disabled) at
    dp_shard=2 × cp=2, SGD, 4 steps.

    Each one's reference is the same recipe in one process (:func:`four_rank_references`), trained in the
    session's one process of cp=1 references (tests/run/one_process.py); the 4-process runs read the data
    those runs prepared. Returns (the runs' folder, name -> its ranks' reports, name -> its reference's output_dir).
    """
    references = one_process_runs["fsdp-4"]
    for recipe, log in one_process_runs.run_logs("fsdp-4").items():
        assert NOTHING_TO_SHARD in log, f"{recipe}: FSDP2 in one process did not say it has nothing to shard"
    root = tmp_path_factory.mktemp("fsdp-4")
    recipes = []
    for name, keys in four_rank_recipes(root, tiny_model_dir).items():
        keys["dataset_prepared_path"] = str(references / "prepared")
        # The reference's recipe but for the layout and the output_dir.
        reference = yaml.safe_load((references / f"{name}.yaml").read_text())
        folders = {"output_dir": None}
        assert keys | ONE_PROCESS_LAYOUT | folders == reference | folders, name
        recipes.append(root / f"{name}.yaml")
        recipes[-1].write_text(yaml.safe_dump(keys))
    with auditing(root / "collectives") as audit:
        ranks = train_in_one_launch(4, root / "launch", *recipes)
    audit.check(STEP_TARGETS, THROUGHPUT, EVAL_TOTALS)
    return root, ranks, {name: references / name for name in ranks}


def example_dpo_recipe(root: Path) -> dict:
    """examples/cpu/dpo.yaml at dp_shard=2 × cp=2 under FSDP2: 4 SGD steps, logged at each."""
    return {
        **shipped_example(REPO / "examples" / "cpu" / "dpo.yaml", root, "dpo"),
        "max_steps": MAX_STEPS,
        "optimizer": "sgd",
        "learning_rate": 0.05,
        "warmup_steps": 0,
        "fsdp_version": 2,
        "dp_shard_size": 2,
    }


@pytest.fixture(scope="module")
def full_runs(four_rank_runs):
    """The full fine-tune's output_dir, its ranks' reports and its one-process reference."""
    root, ranks, references = four_rank_runs
    return root / "sharded", ranks["sharded"], references["sharded"]


BF16_KEYS = {"adapter": "lora", "lora_r": 8, "bf16": True, "max_steps": 2}
"""The bf16 LoRA run of :func:`two_rank_runs` (and of its one-process reference)."""


@one_process_reference("fsdp-bf16", "test_lora_in_bf16_computes_in_bf16_and_keeps_fp32_adapter_weights")
def bf16_reference(folder: Path, tiny_model_dir: Path) -> list[Path]:
    """The bf16 run of :func:`two_rank_runs` in one process, into ``folder / "reference"``."""
    return [write_recipe(folder, tiny_model_dir, "reference", **BF16_KEYS, context_parallel_size=1)]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, tiny_model_dir):
    """The 2-process runs (cp=2, FSDP2 over both ranks) of this module, in one launch.

    ``uninterrupted``: AdamW, a checkpoint every SAVE_STEPS, the reference of the resume test.
    ``bf16``: LoRA in bf16, 2 steps.
    ``simpo``: ``examples/cpu/simpo.yaml`` as shipped (cp=2, no FSDP), the run tests/test_examples.py counts on.
    """
    root = tmp_path_factory.mktemp("fsdp-2")
    uninterrupted = write_recipe(root, tiny_model_dir, "uninterrupted", save_steps=SAVE_STEPS)
    bf16 = write_recipe(root, tiny_model_dir, "bf16", **BF16_KEYS)
    simpo = root / "simpo.yaml"
    simpo.write_text(yaml.safe_dump(shipped_example(SIMPO_EXAMPLE, root, "simpo")))
    return root, train_in_one_launch(2, root / "launch", uninterrupted, bf16, simpo)


@pytest.mark.distributed
@pytest.mark.slow
def test_full_finetune_dp_shard2_cp2_equals_one_process(full_runs):
    from transformers import AutoModelForCausalLM

    sharded, ranks, reference = full_runs
    expected = logged_losses(reference)
    assert len(expected) == MAX_STEPS and len(set(expected)) > 1
    losses = max(rel(a, b) for rank in ranks for a, b in zip(rank["losses"], expected, strict=True))
    print("losses, dp_shard=2 x cp=2 vs one process:", losses)
    assert losses <= FULL_TOL, (ranks, expected)
    # The gradient norm of every step (a wrong gradient scale shows here) and the eval loss.
    diffs = {
        key: max_rel_diff(logged(sharded, key), logged(reference, key)) for key in ("grad_norm", "eval_loss")
    }
    print("full fine-tune, dp_shard=2 x cp=2 vs one process:", diffs)
    assert max(diffs.values()) <= FULL_TOL, diffs

    # The final model is gathered into a standard folder, loadable without cptune or FSDP.
    config = json.loads((sharded / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["use_cache"] is True  # as the base model's: training turns the cache off per call
    untrained = load_file(REPO / "examples" / "tiny-llama" / "model.safetensors")
    got, want = (load_file(folder / "model.safetensors") for folder in (sharded, reference))
    diffs = weight_diffs(*({k: w[k] - untrained[k] for k in untrained} for w in (got, want)))
    print("full fine-tune, updates of 4 SGD steps, max rel diff per tensor:", max(diffs.values()))
    assert max(diffs.values()) <= FULL_TOL
    assert max(weight_diffs(want, untrained).values()) > 1e-3

    assert_gives_the_sharded_models_logits(
        AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32), sharded
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_each_of_4_ranks_holds_a_quarter_of_the_weights(full_runs):
    _, ranks, _ = full_runs
    whole = ranks[0]["model_weight_bytes"]
    shares = [rank["weight_bytes"] / whole for rank in ranks]
    print("weights per rank / a plain DDP rank's:", shares)
    # Plain DDP with cp=4 holds every weight whole on each rank.
    assert max(shares) <= 0.3
    # Together the ranks hold the model once (uneven shards are padded a little).
    assert sum(shares) == pytest.approx(1.0, rel=0.01)


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_from_a_sharded_checkpoint_continues_the_loss_curve_exactly(
    two_rank_runs, tmp_path, tiny_model_dir
):
    # AdamW, so the sharded moments must come back exactly; cp=2 on 2 processes, FSDP2 over both.
    keys = {"save_steps": SAVE_STEPS}
    root, runs = two_rank_runs
    for rank in runs["uninterrupted"]:
        # Each rank holds half of the Adam moments (2 per weight).
        assert rank["optimizer_bytes"] == pytest.approx(rank["model_weight_bytes"], rel=0.01)

    # The data the uninterrupted run prepared (the same recipe but for output_dir).
    recipe = write_recipe(
        tmp_path, tiny_model_dir, "interrupted", dataset_prepared_path=str(root / "prepared"), **keys
    )
    interrupted = tmp_path / "interrupted"
    checkpoint = interrupted / f"checkpoint-{SAVE_STEPS}"
    with auditing(tmp_path / "collectives") as audit:
        codes = run_until_killed(recipe, interrupted, world_size=2, crash_saving_step=2 * SAVE_STEPS)
        assert codes == [-9, -9], codes
        assert [step for step, _ in complete_checkpoints(interrupted)] == [SAVE_STEPS]
        # Each rank wrote its own shards of the weights and of the optimizer state.
        for part in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert sorted(p.name for p in (checkpoint / part).glob("*.distcp")) == [
                "__0_0.distcp",
                "__1_0.distcp",
            ]
        done = run_cptune("train", str(recipe), "--resume")
    # Writing sharded checkpoints and resuming from one: cptune's collectives all go through the helper.
    audit.check(STEP_TARGETS, THROUGHPUT)
    succeeded(done)
    assert f"resuming from {checkpoint}" in done.stderr
    expected, resumed = step_logs(root / "uninterrupted", "loss"), step_logs(interrupted, "loss")
    after = [step for step in expected if step > SAVE_STEPS]
    assert after and all(step in resumed for step in after)
    diffs = [rel(resumed[step], expected[step]) for step in after]
    print("resumed vs uninterrupted losses after the checkpoint:", diffs)
    # Exact: the same operations in the same layout, from a state restored bit for bit.
    assert max(diffs) == 0
    final = load_file(interrupted / "model.safetensors")
    assert max(weight_diffs(final, load_file(root / "uninterrupted" / "model.safetensors")).values()) == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_dp_shard2_cp2_equals_one_process_and_saves_the_adapter(four_rank_runs, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, runs, references = four_rank_runs
    ranks, reference, sharded = runs["lora"], references["lora"], root / "lora"
    expected = logged_losses(reference)
    losses = max(rel(a, b) for rank in ranks for a, b in zip(rank["losses"], expected, strict=True))
    print("losses, dp_shard=2 x cp=2 vs one process:", losses)
    assert losses <= LORA_TOL, (ranks, expected)
    grad_norm = max_rel_diff(logged(sharded, "grad_norm"), logged(reference, "grad_norm"))
    print("LoRA, dp_shard=2 x cp=2 vs one process, gradient norms:", grad_norm)
    assert grad_norm <= LORA_TOL

    assert not (sharded / "model.safetensors").exists(), "a LoRA run saves the adapter only"
    adapter = load_file(sharded / "adapter_model.safetensors")
    diffs = weight_diffs(adapter, load_file(reference / "adapter_model.safetensors"))
    print("LoRA adapter after 4 SGD steps, max rel diff per tensor:", max(diffs.values()))
    assert max(diffs.values()) <= LORA_TOL
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert_gives_the_sharded_models_logits(PeftModel.from_pretrained(base, sharded), sharded)


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_in_bf16_computes_in_bf16_and_keeps_fp32_adapter_weights(two_rank_runs, one_process_runs):
    root, runs = two_rank_runs
    recipe, ranks = root / "bf16.yaml", runs["bf16"]
    for rank in ranks:
        # The frozen base stays in bf16; the trained adapter is kept in fp32 and cast to bf16 for compute.
        assert rank["frozen_dtypes"] == ["torch.bfloat16"] and rank["trained_dtypes"] == ["torch.float32"]
        assert rank["fsdp_compute_dtype"] == "torch.bfloat16"
    # The first step's loss (before any update) against one process in bf16, where the adapter
    # computes in fp32. Measured: 1.4e-5 relative. The bf16 reorder floor: on a recipe like this
    # one, FSDP2 and plain DDP at cp=2 landed 1.3e-4 and 1.6e-4 from cp=1 (bf16 sums in another
    # order), and bf16 against fp32 at cp=1 8.7e-4, which the tolerance stays below.
    # The reference trains in the session's one process of cp=1 references (tests/run/one_process.py).
    reference = one_process_runs["fsdp-bf16"] / "reference"
    # The same recipe but for the layout and the folders.
    layout = {"context_parallel_size": 1, "output_dir": None, "dataset_prepared_path": None}
    reference_recipe = reference.with_suffix(".yaml")
    assert (
        yaml.safe_load(recipe.read_text()) | layout == yaml.safe_load(reference_recipe.read_text()) | layout
    )
    expected = logged_losses(reference)
    diff = rel(ranks[0]["losses"][0], expected[0])
    print("bf16, FSDP2 cp=2 vs one process, first loss:", diff)
    assert diff <= 5e-4, (ranks[0]["losses"], expected)
    # The saved adapter holds the fp32 weights it trained.
    assert {str(t.dtype) for t in load_file(root / "bf16" / "adapter_model.safetensors").values()} == {
        "torch.float32"
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_cpu_simpo_example_widens_the_reward_margin_with_cp2(two_rank_runs):
    """examples/cpu/simpo.yaml as shipped: 12 SimPO steps of a full fine-tune at cp=2 (ring-flash-attn).

    No reference model: the first margin is the untrained model's own (β times the difference of the
    two sides' mean log-probs), not 0. Measured: margin -0.23 and loss 1.24 at the first step; over the
    last three logs margin 3.7, accuracy 1.0, loss 0.16. Its exactness against cp=1 is the parity
    launch's (tests/parallel/test_parity.py, SimPO at cp=2 and the variants' TRL check).
    """
    root, _ = two_rank_runs
    out = root / "simpo"
    margins = [v for _, v in sorted(logged(out, "rewards/margins").items())]
    losses = logged_losses(out)
    assert len(margins) == len(losses) == 12, (margins, losses)
    last = slice(-3, None)
    assert sum(margins[last]) / 3 >= margins[0] + 2.0, margins
    assert sum(losses[last]) / 3 <= 0.5 * losses[0], losses
    assert sum(logged(out, "rewards/accuracies")[step] for step in (10, 11, 12)) / 3 >= 0.9
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "nll_loss"):
        assert len(logged(out, name)) == 12, name
    assert (out / "model.safetensors").is_file(), "a full fine-tune saves the whole model"


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_dpo_dp_shard2_cp2_logs_the_one_process_runs_numbers(four_rank_runs):
    """DPO under FSDP2: the reference forward (the adapter disabled) and the policy's gather the same sharded
    base weights; the logged loss, gradient norm, rewards and log-probs of each step equal one process's."""
    from tests.run.test_train_preference import assert_logs_cp1s_numbers, dpo_logs

    root, _, references = four_rank_runs
    expected = dpo_logs(references["dpo"])
    assert len(expected["loss"]) == MAX_STEPS and len(set(expected["loss"].values())) > 1
    assert_logs_cp1s_numbers("LoRA DPO, dp_shard=2 x cp=2", dpo_logs(root / "dpo"), expected)


def assert_gives_the_sharded_models_logits(loaded: torch.nn.Module, sharded: Path) -> None:
    """``loaded`` (the saved folder, in one plain process) gives the logits the sharded model computed.

    Twins rule (tests/numerics.py): the sharded model's logits may land 32x as far from the saved folder's in
    float64 as the farthest of its own fp32 logits in one process and their 2 twins (sdpa's math backend, sdpa
    over the tokens in a strided order: tests/parallel/reorder_twins.py) do.
    """
    from transformers import AutoTokenizer

    from tests.run.train_worker import fixed_input_ids

    ids = fixed_input_ids(AutoTokenizer.from_pretrained(sharded))
    with torch.no_grad():
        logits, logits64 = (
            model.eval()(input_ids=ids).logits for model in (loaded, copy.deepcopy(loaded).double())
        )
        twins = sdpa_twin_runs(loaded, lambda: {"logits": loaded(input_ids=ids).logits})
    got = torch.load(sharded / "logits.pt")
    print("logits, saved folder in one process vs the sharded model:", float((logits - got).abs().max()))
    assert_float64_twins_rule({"logits": got}, [{"logits": logits}, *twins], {"logits": logits64})


# The offload test's runs: LoRA, SGD, one process.
OFFLOAD_KEYS = {
    "adapter": "lora",
    "lora_r": 8,
    "lora_alpha": 16,
    "optimizer": "sgd",
    "learning_rate": 0.05,
    "context_parallel_size": 1,
    "micro_batch_size": 2,
}


@one_process_reference(
    "fsdp-plain", "test_offloaded_states_with_one_process_train_under_fsdp2_like_the_plain_run"
)
def plain_reference(folder: Path, tiny_model_dir: Path) -> list[Path]:
    """The offload test's run without FSDP, into ``folder / "plain"``."""
    return [write_recipe(folder, tiny_model_dir, "plain", fsdp_version=None, **OFFLOAD_KEYS)]


@pytest.mark.distributed
def test_offloaded_states_with_one_process_train_under_fsdp2_like_the_plain_run(
    tmp_path, tiny_model_dir, one_process_runs
):
    """fsdp_config.offload_params with one process: a launched rank shards over a mesh of one (the layout that
    keeps the base weights off a GPU), and trains as the plain one-process run does. On this CPU machine FSDP2
    has nothing to offload to, which the run says; on a GPU the same layout moves the states to host RAM.
    """
    # The plain run trains in the session's one process of cp=1 references (tests/run/one_process.py).
    plain = one_process_runs["fsdp-plain"] / "plain"
    keys = {**OFFLOAD_KEYS, "dataset_prepared_path": str(plain.parent / "prepared")}  # the plain run's data
    offload = write_recipe(tmp_path, tiny_model_dir, "offload", fsdp_config={"offload_params": True}, **keys)
    offloaded = run_cptune("train", str(offload))
    succeeded(offloaded)
    assert "nothing to shard" not in offloaded.stderr
    # Said where the Trainer's FSDP2 arguments are built, which happens only for a sharded layout.
    assert "no GPU here, so the model states are in CPU memory already" in offloaded.stderr
    expected = logged_losses(plain)
    assert len(expected) == MAX_STEPS and len(set(expected)) > 1
    diffs = {
        key: max_rel_diff(logged(tmp_path / "offload", key), logged(plain, key))
        for key in ("loss", "grad_norm")
    }
    print("one process, FSDP2 over a mesh of one vs plain:", diffs)
    assert max(diffs.values()) <= LORA_TOL, diffs
