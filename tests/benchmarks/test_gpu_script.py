"""The pure parts of the GPU script: FLOP counting, MFU, run planning and recipe building."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.backends import discover
from benchmarks.gpu import config
from benchmarks.gpu.flops import (
    LLAMA_31_8B,
    attention_flops_per_token,
    full_model_flops_per_token,
    hardware_flops_per_token,
    lora_model_flops_per_token,
    lora_parameters,
    mfu,
    utilization,
)

from cptune.config.loader import validate_recipe


def test_llama_31_8b_has_8_billion_parameters():
    assert LLAMA_31_8B.parameters == pytest.approx(8.03e9, rel=2e-3)


def test_flops_reproduce_the_torchtitan_figures_of_the_field_notes():
    # notes/field.md: 3,890 tokens/s/GPU at 32K -> ~288 TFLOP/s, attention 35% of the FLOPs.
    per_token = full_model_flops_per_token(LLAMA_31_8B, 32768)
    assert 3890 * per_token / 1e12 == pytest.approx(288, rel=0.01)
    assert attention_flops_per_token(LLAMA_31_8B, 32768) / per_token == pytest.approx(0.35, abs=0.01)
    # 548 tokens/s/GPU at 262,144 tokens -> ~139 TFLOP/s, attention 81%.
    per_token = full_model_flops_per_token(LLAMA_31_8B, 262144)
    assert 548 * per_token / 1e12 == pytest.approx(139, rel=0.01)
    assert attention_flops_per_token(LLAMA_31_8B, 262144) / per_token == pytest.approx(0.81, abs=0.01)


def test_causal_attention_is_half_of_bidirectional_and_lora_does_less_than_6p():
    s = 4096
    full = attention_flops_per_token(LLAMA_31_8B, s, causal=False)
    assert attention_flops_per_token(LLAMA_31_8B, s) == full / 2 == 6 * 32 * 4096 * s
    lora = lora_parameters(LLAMA_31_8B, 16)
    assert 40e6 < lora < 43e6  # r=16 on all linear layers of Llama-3.1-8B: ~42M
    p = LLAMA_31_8B.parameters
    attention = attention_flops_per_token(LLAMA_31_8B, s)
    assert lora_model_flops_per_token(LLAMA_31_8B, s, lora) == 4 * p + 6 * lora + attention
    # Checkpointing runs each layer's forward again: its weights (not the embeddings), LoRA, attention.
    recomputed = 2 * LLAMA_31_8B.layer_parameters + 2 * lora + attention / 3
    assert hardware_flops_per_token(LLAMA_31_8B, s, lora, recompute=True) == pytest.approx(
        lora_model_flops_per_token(LLAMA_31_8B, s, lora) + recomputed
    )
    assert hardware_flops_per_token(LLAMA_31_8B, s, lora, recompute=False) == lora_model_flops_per_token(
        LLAMA_31_8B, s, lora
    )
    assert LLAMA_31_8B.parameters - LLAMA_31_8B.layer_parameters == 2 * 128256 * 4096 + 4096
    assert mfu(1000.0, 989e9, 989e12) == pytest.approx(1.0)


def test_the_published_cp1_measurement_is_26_6_percent_mfu_for_lora_not_35_9():
    """The page quoted 35.9% at 16K tokens (5,819 tokens/s/GPU): 6P counted for a LoRA run."""
    figures = utilization(LLAMA_31_8B, 16384, 5819, lora_parameters(LLAMA_31_8B, 16), recompute=True)
    assert figures["mfu_6p"] == pytest.approx(0.359, abs=5e-4)
    assert figures["mfu"] == pytest.approx(0.266, abs=5e-4)
    assert figures["hfu"] == pytest.approx(0.374, abs=5e-4)


def base_recipe(tmp_path: Path) -> dict:
    plan = config.RunPlan(None, (), 1, 8192)
    return config.build_recipe(
        config.load_template(),
        plan,
        base_model="meta-llama/Llama-3.1-8B",
        data_path=tmp_path / "rows.jsonl",
        prepared_path=tmp_path / "prepared",
        output_dir=tmp_path / "out",
        steps=5,
        gradient_checkpointing=True,
    )


def test_every_planned_run_builds_a_valid_recipe(tmp_path):
    base = base_recipe(tmp_path)
    variants, _ = discover(base, cp_size=8, precisions=("bf16",))
    assert variants, "no backend can run the GPU template"
    plans = config.plan_sweep(variants, [1, 2, 8], [8192])
    assert len(plans) == 1 + 2 * len(variants)
    for plan in plans:
        recipe = config.build_recipe(
            config.load_template(),
            plan,
            base_model="m",
            data_path=tmp_path / "d.jsonl",
            prepared_path=tmp_path / "p",
            output_dir=tmp_path / "o",
            steps=4,
            gradient_checkpointing=False,
        )
        validated = validate_recipe(recipe)
        assert validated.sequence_len == plan.cp_size * 8192
        assert validated.context_parallel_size == plan.cp_size
        assert validated.bf16 is True and validated.is_lora and not validated.gradient_checkpointing


def test_run_metrics_and_weak_scaling():
    one = config.run_metrics(LLAMA_31_8B, config.RunPlan(None, (), 1, 8192), 2.0, 40 << 30, 989e12, 16)
    assert one["mfu"] < one["hfu"] and one["mfu"] < one["mfu_6p"]
    eight = config.run_metrics(LLAMA_31_8B, config.RunPlan("x", (), 8, 65536), 20.0, 60 << 30, 989e12, 16)
    assert one["tokens_per_second_per_gpu"] == 4096
    assert eight["tokens_per_second_per_gpu"] == pytest.approx(65536 / 20 / 8)
    assert one["peak_gib"] == 40
    rows = [one, eight]
    config.weak_scaling(rows)
    assert one["weak_scaling_efficiency"] == 1.0
    assert eight["weak_scaling_efficiency"] == pytest.approx(eight["mfu"] / one["mfu"])
    table = config.markdown_table(rows, {"x cp=8": {"fits": 131072, "fails": 139264}})
    assert "131072" in table and "| x cp=8 S=65536 |" in table


def test_max_length_search_doubles_then_bisects():
    assert config.next_length(65536, None, 8192) == 131072
    assert config.next_length(131072, 262144, 8192) == 196608
    assert config.next_length(131072, 139264, 8192) is None
    assert config.next_length(None, 65536, 8192) == 32768
    assert config.next_length(None, 8192, 8192) is None
    assert config.is_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")


def test_kernel_check_script_runs_on_cpu_over_the_reference_op():
    """The GPU kernel checks' plumbing, with the float64 op standing in for torch's CUDA ones."""
    from benchmarks.gpu import check_kernels
    from benchmarks.gpu.reference_ops import substituted

    with substituted():
        rows = check_kernels.run_checks(device="cpu", size=1, head_dim=8, dtypes=("bfloat16",))
    assert len(rows) == 15 and all(row["ok"] for row in rows), rows
    assert {"out", "lse", "dq", "dk", "dv"} <= rows[0].keys()
    sinks = next(row for row in rows if row["case"] == check_kernels.SINKS_CASE)
    assert 0 < sinks["dsinks"] < check_kernels.TOLERANCE["bfloat16"] / 2, sinks
    for window in (None, 12):  # size 1: the window n(96) is 12 tokens, chunks of n(192) = 24
        zigzag = next(row for row in rows if row["case"] == check_kernels._zigzag_sinks_name(window))
        assert 0 < zigzag["dsinks"] < check_kernels.TOLERANCE["bfloat16"] / 2, zigzag
    heads = next(row for row in rows if row["case"] == check_kernels.HEAD_GROUPS_CASE)
    assert heads["bit_identical"] == {"out": True, "dq": True, "dk": True, "dv": True}
    assert heads["default_order"]["dq_repeat_bit_identical"] and "deterministic" not in heads  # CUDA only
    # The rounding of bf16 inputs and outputs, and nothing near the pass mark.
    assert all(1e-4 < row["dq"] < check_kernels.TOLERANCE["bfloat16"] / 2 for row in rows if "dq" in row)


def test_multirank_verdicts_apply_the_stated_limits():
    from benchmarks.gpu import multirank

    result = {
        "attention": {"llama3 causal": {"out": 1e-3, "dq": 3e-2}, "zigzag causal": {"out": 2e-3, "dq": 3e-3}},
        "model tiny varlen_llama3": {
            "ref_losses": [4.0],
            "cp_losses": [4.0001],
            "loss_rel": 2.5e-5,
            "grad_rel": 0.02,
        },
        "model tiny batch_zigzag": {
            "ref_losses": [4.0],
            "cp_losses": [4.1],
            "loss_rel": 0.025,
            "grad_rel": 0.02,
        },
    }
    assert multirank.verdicts(result) == {
        "attention llama3 causal": False,  # dq 3e-2 > 2e-2
        "attention zigzag causal": True,
        "model tiny varlen_llama3": True,
        "model tiny batch_zigzag": False,  # a loss 2.5% off
    }
    table = multirank.markdown(
        {"cp": {"2": {**result, "ok": multirank.verdicts(result)}, "4": {"error": "rank exit codes [1, 0]"}}}
    )
    assert "| 2 | model tiny batch_zigzag |" in table and "| 4 | all | rank exit codes [1, 0] | no |" in table


def test_multirank_summarises_a_cp_size_skipped_for_the_budget(tmp_path, monkeypatch, capsys):
    """A later cp size skipped because --budget ran out is reported as skipped, not counted, and does not crash the
    summary (it has no verdicts); the run passes on the cp size that ran."""
    from benchmarks.gpu import multirank

    monkeypatch.setattr(
        multirank, "run", lambda cp, work, settings: {"attention": {"zigzag causal": {"out": 1e-3}}}
    )
    out = tmp_path / "multirank.json"
    assert multirank.main(["--device", "cpu", "--cp-sizes", "2,4", "--budget", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "multirank parity: 1 passed, 0 failed" in printed, printed
    assert "skipped" in json.loads(out.read_text())["cp"]["4"]


def test_gpu_section_is_rendered_from_the_committed_json_with_mfu_two_ways():
    from benchmarks.gpu.docs import gpu_section, load_gpu_results

    section = gpu_section(load_gpu_results())
    # tokens/s as measured; MFU counts 4P for the frozen base, HFU adds the recomputed forward, 6P for comparison.
    assert "| sdpa | 16,384 | 5,819 | 1.000 | 26.6% | 37.4% | 35.9% | 35.9 |" in section
    page = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    assert section.rstrip() in page, "docs/benchmarks.md is stale: python -m benchmarks --render-only"


def test_lease_report_turns_the_lease_files_into_a_page_entry(tmp_path, monkeypatch):
    import json

    from benchmarks.gpu import docs, lease_report

    # env.json holds no commit, so the entry asks git for this checkout's: answered here, in process.
    monkeypatch.setattr(lease_report, "commit", lambda: "0123abc")

    files = {
        "env.json": {"device": "NVIDIA H100 80GB HBM3", "gpus": 1, "torch": "2.11.0+cu130", "cuda": "13.0",
                     "transformers": "5.23.0", "accelerate": "1.15.0", "peft": "0.21.2", "date": "2026-12-01"},
        "kernels.json": {"environment": {"kernels": "torch kernels"},
                         "checks": [{"case": "dense causal", "dtype": "bfloat16", "ok": True, "out": 3e-3, "dq": 4e-3}],
                         "timing": {"tokens": 16384, "adapter_ms": 14.0, "sdpa_flash_ms": 13.9, "ratio": 1.007}},
        "paths.json": {"kernels": "cptune.parallel.kernels.torch_flash._flash_attn_varlen_forward",
                       "settings": {"layers": 32},
                       "lengths": {"8192": {"ring-flash-attn (torch kernels)": {"tokens_per_second_per_gpu": 6200.0, "peak_gib": 26.0},
                                            "sdpa": {"tokens_per_second_per_gpu": 6329.0, "peak_gib": 25.9}},
                                   "65536": {"sdpa": {"error": "out of memory"}}}},
    }  # fmt: skip
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    run = lease_report.entry([tmp_path], "test")
    assert run["commit"] == "0123abc"
    assert run["machine"]["torch"] == "2.11.0+cu130" and run["kernels"].startswith(
        "cptune.parallel.kernels.torch_flash"
    )
    text = docs.gpu_section({"runs": [run], "not_measured": []})
    assert "| ring-flash-attn (torch kernels) | 8,192 | 6,200 | 0.980 |" in text
    assert "| sdpa | 65536 | out of memory |" in text
    assert "1 of 1 passed" in text and "1.007x" in text


def test_lease_report_puts_the_two_level_files_in_one_table_with_the_peak_at_32_layers(tmp_path):
    """lease.sh --two-level writes two_level.json and half_million.json (and a later call longer.json): one
    memory table on the page, each row with its measured and predicted peak at 32 layers and pinned host."""
    import json

    from benchmarks.gpu import docs, lease_report

    def row(setting, length, peak, full, host):
        return {"setting": setting, "length": length, "tokens_per_second_per_gpu": 2400.0, "mfu": 0.28, "hfu": 0.37,
                "peak_gib": peak, "predicted_peak_gib": peak - 1, "peak_gib_full_depth": full,
                "predicted_peak_gib_full_depth": full + 0.5, "host_gib": host / 4, "host_gib_full_depth": host}  # fmt: skip

    model = "Llama-3.1-8B, 8 layers"
    files = {
        "env.json": {"device": "NVIDIA H200", "commit": "ab21804ed3d8", "date": "2026-11-27", "cuda": "13.0"},
        "two_level.json": {"model": model, "rows": [row("trainer_two_level", 98304, 16.0, 26.22, 12.0)]},
        "half_million.json": {"model": model, "rows": [row("trainer_two_level", 524288, 61.78, 72.0, 64.0)]},
    }  # fmt: skip
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    run = lease_report.entry([tmp_path], "two-level")
    assert [r["length"] for r in run["memory_features"]["rows"]] == [98304, 524288]
    text = docs.gpu_section({"runs": [run], "not_measured": []})
    assert "at 32 layers: peak GiB | predicted GiB | pinned host GiB |" in text
    assert (
        "| trainer_two_level | 524,288 | 2,400 | 28.0% | 37.0% | 61.8 | 60.8 | 72.0 | 72.5 | 64.0 |" in text
    )


def test_check_b_results_render_with_the_fit_and_the_long_step():
    from benchmarks.gpu import docs

    row = {"tokens_per_second_per_gpu": 1000.0, "mfu": 0.25, "hfu": 0.35, "peak_gib": 30.0,
           "predicted_peak_gib": 29.0, "setting": "everything"}  # fmt: skip
    features = {
        "model": "Llama-3.1-8B, 32 layers",
        "rows": [row | {"length": 65536}, row | {"length": 131072, "peak_gib": 40.0}],
        "longest": {
            "fitted_candidate": 311296,
            "host_limit_tokens": 400000,
            "usable_gib": 79.6,
            "fit_points_gib": {"65536": 30.0, "131072": 40.0},
            "memory_model_longest": 314368,
            "step": row | {"length": 311296, "error": "out of memory"},
        },
    }
    text = "\n".join(docs._memory_features(features, "Check B"))
    assert "| everything, longest by the fit | 311,296 | out of memory |" in text
    assert "**Longest by the fit:** 311,296 tokens (peaks at 65,536: 30.0 GiB, 131,072: 40.0 GiB" in text
    assert "the memory model says 314,368" in text
    # The first lease's file (one length, settings by name) still renders.
    old = {"model": "m", "length": 65536, "settings": {"today": row, "everything": row | {"peak_gib": 29.4}}}
    assert "| everything | 65,536 | 1,000 | 25.0% | 35.0% | 29.4 | 29.0 |" in "\n".join(
        docs._memory_features(old)
    )
