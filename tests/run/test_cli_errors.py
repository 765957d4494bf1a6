"""The CLI as a user meets it: the plan ``cptune validate`` prints, and errors only a fresh process shows.

Bad inputs that fail before any work are the catalogue's (tests/reliability/catalogue/, run
in-process and, for a few, through the console script). Here: ``validate``'s plan and its report of
several problems at once, run in-process, and the missing-package errors, which need a process
whose import path hides the package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUICKSTART_DATA, run_cptune


def assert_clean_failure(done, *fragments: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, done.stderr


def test_validate_prints_the_plan_with_patches(write_recipe, cptune_in_process):
    done = cptune_in_process("validate", str(write_recipe(context_parallel_size=2)))
    assert done.returncode == 0, done.stderr
    assert "2 = 1 data-parallel × 2 context-parallel" in done.stdout
    assert "Trainer._prepare_context_parallel_inputs" in done.stdout
    assert "not prepared yet" in done.stdout


@pytest.mark.e2e
def test_ring_flash_attn_not_importable(write_recipe, tmp_path):
    shadow = tmp_path / "shadow" / "ring_flash_attn"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: ring-flash-attn is broken')\n")
    done = run_cptune(
        "train", str(write_recipe(context_parallel_size=2)), env={"PYTHONPATH": str(shadow.parent)}
    )
    assert_clean_failure(done, "needs the ring-flash-attn package", "pip install ring-flash-attn==0.1.8")


@pytest.mark.e2e
def test_deepspeed_not_installed(write_recipe, tmp_path):
    shadow = tmp_path / "shadow" / "deepspeed"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: DeepSpeed is not installed')\n")
    done = run_cptune(
        "train",
        str(write_recipe(context_parallel_size=2, cp_backend="deepspeed")),
        env={"PYTHONPATH": str(shadow.parent)},
    )
    assert_clean_failure(done, "cp_backend: deepspeed needs DeepSpeed", "DS_BUILD_OPS=0 pip install")


def test_validate_reports_every_problem_at_once(write_recipe, cptune_in_process):
    done = cptune_in_process(
        "validate", str(write_recipe(sequnce_len=64, gptq=True, micro_batch_size="x")), "--lora_r=0"
    )
    assert_clean_failure(
        done,
        "has 4 problems",
        "sequnce_len: is not a known key. Did you mean 'sequence_len'?",
        "gptq: is an Axolotl key that cptune does not support",
        "micro_batch_size: Input should be a valid integer",
        "lora_r: Input should be greater than or equal to 1",
    )


def test_validate_shows_the_fsdp2_mesh_and_state_memory_per_rank(
    write_recipe, tiny_model_dir, cptune_in_process
):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from cptune.parallel.memory import OptimizerState, format_bytes, fsdp_state_memory

    recipe = write_recipe(context_parallel_size=2, fsdp_version=2, dp_shard_size=2)
    done = cptune_in_process(
        "validate", str(recipe)
    )  # 4 processes by default: dp_shard_size × context_parallel_size
    assert done.returncode == 0, done.stderr
    assert (
        "processes:  4 = 2 dp_shard × 2 cp; model states sharded (FSDP2) over 4 ranks (dp_shard × cp)"
        in done.stdout
    )
    assert "apply accelerator-state-fsdp-on-cpu" in done.stdout

    # The estimate counts what the run will train: the real model with the recipe's adapter.
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"{total:,} parameters, {trained:,} trained (LoRA adapter), adamw_torch" in done.stdout
    for name, ranks in (("FSDP2 over 4 ranks", 4), ("every rank whole (plain DDP)", 1)):
        memory = fsdp_state_memory(
            total=total,
            trainable=trained,
            optimizer=OptimizerState(2 * trained),
            dtype_bytes=4,
            shard_ranks=ranks,
        )
        row = next(line for line in done.stdout.splitlines() if line.strip().startswith(name))
        cells = " ".join(
            format_bytes(v) for v in (memory.weights, memory.gradients, memory.optimizer, memory.total)
        )
        assert " ".join(row.split()) == f"{name} {cells}", row


def test_validate_reports_missing_and_unreadable_data_with_the_other_problems(
    write_recipe, cptune_in_process, tmp_path, monkeypatch
):
    locked = tmp_path / "locked.jsonl"
    locked.write_bytes(QUICKSTART_DATA.read_bytes())
    access = os.access
    # The tests run as root, for whom no permission bit hides a file: the check asks os.access.
    monkeypatch.setattr(
        os, "access", lambda path, mode, **kw: Path(path) != locked and access(path, mode, **kw)
    )
    recipe = write_recipe(
        datasets=[{"path": str(QUICKSTART_DATA), "type": "alpaca"}, {"path": str(locked), "type": "alpaca"}],
        test_datasets=[{"path": "missing-eval.jsonl", "type": "alpaca"}],
        lora_target_modules=["no_such_proj"],
    )
    done = cptune_in_process("validate", str(recipe), "--datasets.0.path=other.jsonl")
    assert_clean_failure(
        done,
        "has 4 problems",
        "datasets[0].path 'other.jsonl' does not exist",
        f"datasets[1] ({locked}): '{locked}' cannot be read (no read permission for this user)",
        "test_datasets[0].path 'missing-eval.jsonl' does not exist",
        "lora_target_modules:",
    )
    assert done.stdout == ""


def test_validate_names_a_base_model_folder_that_does_not_exist_once(
    write_recipe, cptune_in_process, tmp_path
):
    """The folder gives neither a config nor a tokenizer: one problem, the config's, as train says it."""
    missing = tmp_path / "no-such-model"
    done = cptune_in_process("validate", str(write_recipe(base_model=str(missing))))
    errors = [
        line for line in done.stderr.splitlines() if line.startswith("error:") or line.startswith("  - ")
    ]
    assert done.returncode != 0
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(f"error: base_model: cannot load a model config from '{missing}'"), errors


def test_validate_reports_rows_the_dataset_type_cannot_use_with_the_other_problems(
    write_recipe, cptune_in_process, tmp_path
):
    data = tmp_path / "rows.jsonl"
    first = QUICKSTART_DATA.read_text().splitlines()[:2]
    data.write_text("\n".join([*first, '{"instruction": "Add.", "outpt": "5"}']) + "\n")
    recipe = write_recipe(
        datasets=[{"path": str(data), "type": "alpaca"}], lora_target_modules=["no_such_proj"]
    )
    done = cptune_in_process("validate", str(recipe))
    assert_clean_failure(
        done,
        "has 2 problems",
        f"datasets[0] ({data}), row 2 (line 3): field 'output' is missing.",
        "lora_target_modules:",
    )
    assert done.stdout == ""


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_recipe_error_is_reported_before_torch_datasets_or_transformers_load(command, tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(
        f"base_model: m\nsequnce_len: 5\ndatasets:\n  - path: {QUICKSTART_DATA}\n    type: alpaca\n"
    )
    program = (
        "import sys\n"
        "from cptune.cli import main\n"
        "try:\n"
        f"    main([{command!r}, {str(recipe)!r}])\n"
        "except SystemExit as exited:\n"
        "    print('exit', exited.code)\n"
        "print(sorted(m for m in ('torch', 'datasets', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert "sequnce_len: is not a known key. Did you mean 'sequence_len'?" in done.stderr, done.stderr
    assert done.stdout.splitlines()[-2:] == ["exit 2", "[]"], done.stdout
