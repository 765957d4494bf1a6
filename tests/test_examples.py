"""Every shipped example recipe validates; every CPU example trains; GPU examples fit Llama-3.1-8B.

* Every YAML under ``examples/`` passes the schema and the cross-key rules (``load_recipe``).
* GPU recipes (``examples/gpu/``) are also checked against Llama-3.1-8B's architecture (heads,
  KV heads, attention layers) without loading weights or reaching the hub, and their header says
  which hardware, how to launch and how much memory to expect.
* CPU examples run through ``cptune train`` like a user would: the quickstart and the torch
  example until they learn, the others for 2 steps.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import yaml

from cptune.config.loader import load_recipe
from cptune.parallel.backends.table import BACKENDS
from tests.conftest import REPO, logged, logged_losses, run_cptune
from tests.quiet_log import assert_quiet

EXAMPLES_DIR = REPO / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.rglob("*.yaml"))
GPU_EXAMPLES = sorted((EXAMPLES_DIR / "gpu").glob("*.yaml"))
CPU_EXAMPLES = [EXAMPLES_DIR / "quickstart.yaml", *sorted((EXAMPLES_DIR / "cpu").glob("*.yaml"))]
# Trained until they learn by the tests below; the others get a 2-step run, except those trained
# (with overrides such as max_steps) by another test, named here.
LEARNING_EXAMPLES = {
    EXAMPLES_DIR / "quickstart.yaml",
    EXAMPLES_DIR / "cpu" / "torch.yaml",
    EXAMPLES_DIR / "cpu" / "dpo.yaml",
}
TRAINED_ELSEWHERE = {
    EXAMPLES_DIR / "cpu" / "fsdp2.yaml": "tests.run.test_train_fsdp",
    EXAMPLES_DIR / "cpu" / "simpo.yaml": "tests.run.test_train_fsdp",  # in a launch of its 2-process runs
}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _name(path: Path) -> str:
    return str(path.relative_to(EXAMPLES_DIR))


def test_examples_cover_every_backend_on_cpu_and_gpu():
    assert set(EXAMPLES) == set(CPU_EXAMPLES) | set(GPU_EXAMPLES), "an example outside examples/{cpu,gpu}/"
    for group in (CPU_EXAMPLES, GPU_EXAMPLES):
        recipes = [load_recipe(path) for path in group]
        assert {r.cp_backend for r in recipes if r.context_parallel_size > 1} == {
            "ring-flash-attn",
            "torch",
            "deepspeed",
        }
        assert any(not r.causal for r in recipes), "no bidirectional example"


@pytest.mark.parametrize("path", EXAMPLES, ids=_name)
def test_example_recipe_validates(path: Path):
    recipe = load_recipe(path)
    if path in CPU_EXAMPLES:
        # Runs offline from the repository root: the model and the data ship in the repository.
        assert (REPO / recipe.base_model / "config.json").is_file()
        for dataset in recipe.datasets:
            assert (REPO / dataset.path).is_file(), dataset.path


def _header(path: Path) -> str:
    """The recipe's comment lines as one line of text, so phrases may wrap."""
    return " ".join(
        line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")
    )


@pytest.mark.parametrize("path", CPU_EXAMPLES, ids=_name)
def test_cpu_example_says_hardware_and_memory(path: Path):
    assert re.search(r"Hardware: .*?\d+(\.\d+)? GB .*?per process", _header(path)), "hardware and RAM"


def _llama31_8b_config():
    """Llama-3.1-8B's architecture (its config.json on the hub), built locally."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
    )


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=_name)
def test_gpu_example_fits_llama31_8b_and_says_what_it_needs(path: Path):
    from transformers import LlamaForCausalLM

    from cptune.run.plan import RunPlan

    recipe = load_recipe(path)
    assert recipe.base_model.startswith("meta-llama/Llama-3.1-8B")
    plan = RunPlan.build(recipe, recipe.default_process_count)
    plan.check_model(_llama31_8b_config(), LlamaForCausalLM)
    # A full fine-tune of an 8B model does not fit a GPU unless its states are sharded.
    assert recipe.bf16 is True and recipe.gradient_checkpointing and (recipe.is_lora or plan.dims.sharded)

    header = _header(path)
    assert "Hardware:" in header
    assert f"cptune train examples/gpu/{path.name}" in header
    assert re.search(r"Expected memory per GPU: about \d+ GB \(an estimate", header), "memory estimate"
    # Says that the recipe itself has not run on its GPUs (a one-GPU measurement may be quoted beside).
    assert re.search(r"not (been )?run on (\d+ )?GPUs", header), "says it has not run on GPUs"


def test_gpu_ring_example_is_128k_on_8_gpus():
    recipe = load_recipe(EXAMPLES_DIR / "gpu" / "llama31-8b-lora-ring-flash-attn-128k.yaml")
    assert (recipe.cp_backend, recipe.sequence_len, recipe.context_parallel_size) == (
        "ring-flash-attn",
        131072,
        8,
    )


def _train(path: Path, tmp_path: Path, *overrides: str):
    out = tmp_path / "out"
    done = run_cptune(
        "train",
        str(path.relative_to(REPO)),
        *overrides,
        f"--output_dir={out}",
        f"--dataset_prepared_path={tmp_path / 'prepared'}",
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done, out


def test_examples_trained_elsewhere_are_the_ones_those_tests_train():
    import importlib

    for path, module in TRAINED_ELSEWHERE.items():
        assert path in importlib.import_module(module).EXAMPLES_TRAINED_HERE


@pytest.mark.distributed
@pytest.mark.parametrize(
    "path", [p for p in CPU_EXAMPLES if p not in LEARNING_EXAMPLES and p not in TRAINED_ELSEWHERE], ids=_name
)
def test_cpu_example_trains_two_steps(path: Path, tmp_path):
    recipe = load_recipe(path)
    if BACKENDS[recipe.cp_backend].runs_own_engine and not HAS_DEEPSPEED:  # DeepSpeed's engine trains it
        pytest.skip("the deepspeed extra is not installed (DS_BUILD_OPS=0 pip install -e '.[deepspeed]')")
    done, out = _train(path, tmp_path, "--max_steps=2", "--logging_steps=1")
    losses = logged_losses(out)
    assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses), losses
    assert_quiet(done)
    if recipe.is_lora:
        assert json.loads((out / "adapter_config.json").read_text())["r"] == recipe.lora_r
    else:
        assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


@pytest.mark.distributed
def test_quickstart_halves_its_loss_with_cp2(quickstart_run):
    done, out = quickstart_run  # shared with tests/run/test_inference.py, which tries the adapter
    assert done.returncode == 0, done.stderr[-3000:]
    losses = logged_losses(out)
    assert losses[-1] <= 0.5 * losses[0], losses
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 16
    assert (out / "tokenizer.json").is_file()


@pytest.mark.distributed
def test_quickstart_log_is_quiet(quickstart_run):
    """No upstream noise, no progress bar redraws in a log file, each patch announced once (issue 33)."""
    done, _ = quickstart_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert_quiet(done)
    assert done.stderr.count("(ring-flash-attn-import-compat)") == 1
    assert "{'loss': '6.227'" in done.stdout  # each logged step, one line: the Trainer's PrinterCallback


@pytest.mark.distributed
def test_fsdp2_example_log_is_quiet(tmp_path):
    """One step of the FSDP2 example on 4 processes (its training is tested in tests/run/test_train_fsdp.py)."""
    done, _ = _train(EXAMPLES_DIR / "cpu" / "fsdp2.yaml", tmp_path, "--max_steps=1")
    assert_quiet(done)


@pytest.mark.distributed
def test_quickstart_resume_continues_from_its_last_checkpoint(quickstart_page_run, quickstart_run, tmp_path):
    """``cptune train examples/quickstart.yaml --resume``, as scripts/quickstart.sh advertises it.

    A copy of the session's finished quickstart run (the original is shared with other tests), less
    its final checkpoint, stands for a run stopped between two saves: it continues from the newest
    checkpoint left and trains the steps after it to the same end.
    """
    done, finished = quickstart_run
    assert done.returncode == 0, done.stderr[-3000:]
    first = logged(finished, "loss")
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    checkpoints = sorted((p for p in out.glob("checkpoint-*")), key=lambda p: int(p.name.split("-")[1]))
    assert len(checkpoints) == 2, (
        f"the quickstart keeps 2 checkpoints: {sorted(p.name for p in out.iterdir())}"
    )
    shutil.rmtree(checkpoints.pop())  # the one the end of training wrote
    newest = int(checkpoints[-1].name.split("-")[1])
    resumed = run_cptune(
        "train",
        "examples/quickstart.yaml",
        "--resume",
        f"--output_dir={out}",
        f"--dataset_prepared_path={quickstart_page_run.folder / 'prepared'}",  # the finished run's data
        cwd=REPO,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {checkpoints[-1]}" in resumed.stderr, resumed.stderr[-3000:]
    again = logged(out, "loss")
    after = [step for step in first if step > newest]
    assert sorted(again) == sorted(first) and after, (again, first)
    # Exact: the resumed steps repeat the finished run's operations, in the same layout on the same
    # machine, from a state restored bit for bit (as tests/run/test_resume.py shows for a killed run).
    assert {step: again[step] for step in after} == {step: first[step] for step in after}


@pytest.mark.distributed
def test_cpu_torch_example_learns(tmp_path):
    """examples/cpu/torch.yaml, cut to 80 of its 150 steps to keep the test short."""
    done, out = _train(EXAMPLES_DIR / "cpu" / "torch.yaml", tmp_path, "--max_steps=80")
    assert "torch-cp-cpu-sdpa-handlers" in done.stderr
    losses = logged_losses(out)
    # Measured: 6.23 at the first step, 2.25 averaged over the last three logs (one sample per row is noisy).
    assert sum(losses[-3:]) / 3 <= 0.6 * losses[0], losses


@pytest.mark.distributed
def test_cpu_dpo_example_widens_the_reward_margin_with_cp2(tmp_path):
    """examples/cpu/dpo.yaml as shipped: 30 DPO steps at cp=2 (ring-flash-attn), logged with TRL's metric names.

    The adapter starts at zero (policy = reference: margin 0, loss ln 2) and the first step's learning
    rate is 0 (warmup), so the first two margins are exactly 0. Measured over the last five logs: margin
    about 5.0, accuracy 1.0, loss 0.067.
    """
    _, out = _train(EXAMPLES_DIR / "cpu" / "dpo.yaml", tmp_path)
    margins = [v for _, v in sorted(logged(out, "rewards/margins").items())]
    losses = logged_losses(out)
    assert len(margins) == len(losses) == 30, (margins, losses)
    assert margins[:2] == [0.0, 0.0] and abs(losses[0] - math.log(2)) < 1e-4, (margins, losses)
    last = slice(-5, None)
    assert sum(margins[last]) / 5 >= 2.0, margins
    assert sum(losses[last]) / 5 <= 0.5 * math.log(2), losses
    assert min(logged(out, "rewards/accuracies").values()) >= 0.0
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert len(logged(out, name)) == 30, name


def test_docs_yaml_recipes_validate():
    """Every YAML block in README.md and docs/ that is a recipe (has base_model) passes validation."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = 0
    for page in pages:
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and "base_model" in data:
                from cptune.config.loader import validate_recipe

                validate_recipe(data, source=str(page.relative_to(REPO)))
                found += 1
    assert found >= 2


def test_mntp_data_matches_its_script_and_hides_every_target():
    """examples/data/mntp.jsonl: a trained token is always masked in the input (no target leaks)."""
    import importlib.util as util

    spec = util.spec_from_file_location("make_mntp_data", REPO / "scripts" / "make_mntp_data.py")
    assert spec is not None and spec.loader is not None
    script = util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.OUTPUT.read_text(encoding="utf-8") == script.expected_text(), (
        "examples/data/mntp.jsonl is stale: run python scripts/make_mntp_data.py"
    )
    from transformers import AutoTokenizer

    mask = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny-llama").convert_tokens_to_ids(
        script.MASK_TOKEN
    )
    for line in script.OUTPUT.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        trained = [i for i, label in enumerate(row["labels"]) if label != -100]
        assert trained and 0 not in trained
        assert all(row["input_ids"][i] == mask != row["labels"][i] for i in trained)
