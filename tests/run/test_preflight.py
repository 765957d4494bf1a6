"""Checks before launching that depend on the machine (a GPU, flash-attn) rather than the recipe."""

from __future__ import annotations

import pytest

# Imported while torch still says there is no GPU: the first import of transformers' Trainer imports
# bitsandbytes, which probes CUDA's C functions when torch.cuda.is_available() is True (as these
# tests pretend) and fails on a CPU build. Run alone, this file otherwise failed at that import.
import transformers.trainer  # noqa: F401

from cptune.config.loader import load_recipe
from cptune.errors import CptuneError
from cptune.parallel.backends.select import check_router_jitter
from cptune.run.launch import preflight as preflight_module
from cptune.run.plan import RunPlan
from tests.conftest import write_short_run


def pretend_gpu_with_flash_attn(monkeypatch) -> None:
    monkeypatch.setattr(preflight_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("cptune.parallel.kernels.flash_attn_available", lambda: True)


def test_fp32_ring_flash_attn_on_a_gpu_is_refused_before_launching(write_recipe, tmp_path, monkeypatch):
    """flash-attn's CUDA kernels take bf16/fp16 only: the refusal comes before data or processes."""
    recipe = load_recipe(write_recipe(context_parallel_size=2))
    pretend_gpu_with_flash_attn(monkeypatch)
    with pytest.raises(CptuneError, match="which support bf16 and fp16 only; set bf16: true"):
        preflight_module.preflight(RunPlan.build(recipe, 2))
    assert not (tmp_path / "prepared").exists()  # refused before the data was prepared


def test_half_precision_ring_flash_attn_on_a_gpu_passes_the_check(write_recipe, monkeypatch):
    recipe = load_recipe(write_recipe(context_parallel_size=2, bf16=True))
    pretend_gpu_with_flash_attn(monkeypatch)
    monkeypatch.setattr(
        "cptune.parallel.backends.ring_flash_attn.sharding.load_ring_flash_attn", lambda: None
    )  # not reached on a CPU machine with the real kernels; the check before it is what is tested
    preflight_module.preflight(RunPlan.build(recipe, 2), prepare_data=False)


def test_validate_without_a_memory_estimate_still_prints_the_plan(write_recipe, monkeypatch):
    """A model transformers cannot build on the meta device gets no estimate, not a traceback."""

    def cannot_build(recipe, config):
        raise ValueError("Unrecognized configuration class for this kind of AutoModel\nmore detail")

    monkeypatch.setattr("cptune.models.sizing.count_parameters", cannot_build)
    recipe = load_recipe(write_recipe(context_parallel_size=2))
    from cptune.run.memory_plan import describe_state_memory

    lines = describe_state_memory(RunPlan.build(recipe, 2), None)
    assert lines == [
        "Memory per rank for model states: no estimate "
        "(Unrecognized configuration class for this kind of AutoModel)."
    ]


STAND_INS = "cptune's pure-PyTorch stand-ins"
TORCH_FLASH = "PyTorch's FlashAttention-2 (aten._flash_attention_forward/backward; flash-attn not installed)"


@pytest.mark.parametrize(
    ("cuda", "flash_attn", "torch_flash_missing", "bf16", "kernels", "warned"),
    [
        (False, False, None, True, f"{STAND_INS} (flash-attn not installed)", False),
        (True, False, None, True, TORCH_FLASH, False),
        (True, False, None, False, f"{STAND_INS} (fp32, and PyTorch's FlashAttention-2 takes bf16/fp16 only)", True),
        (True, False, "torch 2.11 was built without FlashAttention", True,
         f"{STAND_INS} (PyTorch's FlashAttention-2 cannot run here: torch 2.11 was built without FlashAttention)",
         True),
        (True, True, None, True, "flash-attn", False),
    ],
    ids=["cpu", "gpu-torch-flash", "gpu-fp32", "gpu-torch-without-flash", "gpu-with-flash-attn"],
)  # fmt: skip
def test_validate_names_the_ring_kernels_and_warns_of_stand_ins_on_a_gpu(
    write_recipe, monkeypatch, cuda, flash_attn, torch_flash_missing, bf16, kernels, warned
):
    """On a GPU without flash-attn torch's own FlashAttention-2 runs; the ~100x slower stand-ins get a warning."""
    from cptune.parallel.kernels import torch_flash

    monkeypatch.setattr(preflight_module.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr("cptune.parallel.kernels.flash_attn_available", lambda: flash_attn)
    monkeypatch.setattr(torch_flash, "unavailable_reason", lambda: torch_flash_missing)
    plan = preflight_module.describe_plan(
        RunPlan.build(load_recipe(write_recipe(context_parallel_size=2, bf16=bf16)), 2)
    )
    assert f"heads_k_stride=1, kernels: {kernels}\n" in plan, plan
    warning = "  warning:    ring-flash-attn computes attention with cptune's pure-PyTorch stand-in kernels"
    assert (warning in plan) is warned, plan


@pytest.mark.parametrize(
    ("overrides", "layout"),
    [((), "pairs packed in rows"), (("sample_packing=false",), "each side of a pair a row of its own")],
)
def test_validate_says_how_a_preference_recipe_trains(tmp_path, overrides, layout):
    """The dpo example's plan names the loss, β, the rows and the reference (the base with the adapter disabled)."""
    from tests.conftest import REPO

    recipe = load_recipe(
        REPO / "examples" / "cpu" / "dpo.yaml", (f"dataset_prepared_path={tmp_path}", *overrides)
    )
    plan = preflight_module.describe_plan(RunPlan.build(recipe, 2))
    assert (
        f"  training:   rl: dpo, beta 0.1, {layout}; reference: the base model "
        "(adapter disabled), a second forward without gradients"
    ) in plan.splitlines()


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ("rl=simpo", "simpo_gamma=0.8"),
            "rl: simpo, beta 0.1, simpo_gamma 0.8, cpo_alpha 1, pairs packed in rows; no reference model",
        ),
        (
            ("rl=orpo", "rl_beta=null", "orpo_alpha=0.2"),
            "rl: orpo, orpo_alpha 0.2, pairs packed in rows; no reference",
        ),
        (
            ("precompute_ref_log_probs=true",),
            "rl: dpo, beta 0.1, pairs packed in rows; reference: log-prob sums precomputed",
        ),
    ],
)
def test_validate_names_each_losss_parameters_and_its_reference(tmp_path, overrides, line):
    from tests.conftest import REPO

    recipe = load_recipe(
        REPO / "examples" / "cpu" / "dpo.yaml", (f"dataset_prepared_path={tmp_path}", *overrides)
    )
    plan = preflight_module.describe_plan(RunPlan.build(recipe, 2))
    assert any(row.startswith(f"  training:   {line}") for row in plan.splitlines()), plan


def test_validate_lists_the_patches_applied_around_the_backends_import(write_recipe):
    """A run logs them first ("patched ... ring-flash-attn-import-compat"); validate showed only the run's set."""
    recipe = load_recipe(write_recipe(context_parallel_size=2, cp_backend="ring-flash-attn"))
    described = preflight_module.describe_plan(RunPlan.build(recipe, 2))
    section = described.split(
        "Patches applied while ring_flash_attn is imported (and reverted right after):\n"
    )[1]
    assert section.splitlines()[1].startswith(
        "    apply ring-flash-attn-import-compat: "
        "transformers.modeling_flash_attention_utils:is_flash_attn_greater_or_equal_2_10"
    )


def test_router_jitter_under_context_parallelism_is_refused_before_loading():
    """Mixtral's router noise is drawn per process: a CP run would draw other noise than cp=1."""
    from devtools.tiny import build_tiny_mixtral

    jittered = build_tiny_mixtral(97, seed=1, router_jitter_noise=0.01).config
    with pytest.raises(CptuneError) as refused:
        check_router_jitter(2, jittered)
    assert str(refused.value).startswith(
        "overrides_of_model_config: the model's router_jitter_noise is 0.01: its router noise is drawn per process"
    ), str(refused.value)
    check_router_jitter(1, jittered)  # at cp=1 there is nothing to match
    check_router_jitter(2, build_tiny_mixtral(97, seed=1).config)  # no jitter (the default)


@pytest.mark.parametrize(
    ("keys", "refusal"),
    [
        (
            {"overrides_of_model_config": {"router_jitter_noise": 0.01}},
            "overrides_of_model_config: the model's router_jitter_noise is 0.01: its router noise is drawn",
        ),
        (
            {
                "overrides_of_model_config": {"output_router_logits": True},
                "cp_backend": "torch",
                "sample_packing": False,
                "micro_batch_size": 2,
            },
            "micro_batch_size: 2",
        ),
    ],
    ids=["router-jitter", "torch-router-padding"],
)
def test_a_rank_started_without_cptunes_launcher_refuses_before_loading(
    keys, refusal, tmp_path, tiny_model_dir, monkeypatch
):
    """A rank under torchrun runs no preflight: train() itself refuses the model's config before it writes,
    prepares or loads anything (rank 0 of 2, in this process: the refusal comes before any process group)."""
    from cptune.run.training import train as train_module
    from tests.run.test_train_moe import save_tiny_moe

    moe = save_tiny_moe(tmp_path / "mixtral", tiny_model_dir, family="mixtral")
    recipe = load_recipe(write_short_run(tmp_path, "run", moe, context_parallel_size=2, **keys))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def loaded(*args, **kwargs):
        raise AssertionError("the data or the model was loaded before the refusal")

    monkeypatch.setattr(train_module, "load_model", loaded)
    monkeypatch.setattr("cptune.data.prepare.prepare_datasets", loaded)
    with pytest.raises(CptuneError) as refused:
        train_module.train(recipe)
    assert str(refused.value).startswith(refusal), str(refused.value)
    assert not (tmp_path / "run").exists() and not (tmp_path / "prepared").exists()
