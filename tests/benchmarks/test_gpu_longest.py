"""The pure parts of the longest-sequence GPU script (benchmarks/gpu/longest.py, predict.py).

The script itself runs on a GPU (or ``--dry-run`` on CPU, not in CI: it launches seven trainings).
"""

from __future__ import annotations

import dataclasses

import pytest
from benchmarks.gpu import longest, predict


def test_the_plan_compares_today_and_everything_then_fits():
    probes = longest.first_probes([49152, 65536], [65536, 131072])
    assert [(p.setting, p.seq_len, p.steps, p.purpose) for p in probes] == [
        ("today", 49152, 2, "compare"),
        ("today", 65536, 2, "compare"),
        ("everything", 49152, 2, "compare"),
        ("everything", 65536, 2, "fit"),
        ("everything", 131072, 1, "fit"),
    ]
    assert probes[-1].keys == {"activation_offloading": True, "tiled_mlp": True, "cut_cross_entropy": True}
    assert probes[0].keys == {}


def test_the_candidate_comes_from_a_line_through_two_peaks():
    gib = 1 << 30
    points = {65536: 30 * gib, 131072: 45 * gib}  # 15 GiB per 64K tokens, 15 GiB at zero
    assert longest.fit_line(points) == (15 * gib, 15 * gib / 65536)
    # 78 GiB usable: (78 - 15) / 15 x 64K = 275,251 -> 262,144 at a 16K resolution
    assert longest.candidate_length(points, 78 * gib, 16384, None) == 262144
    assert longest.candidate_length(points, 78 * gib, 16384, host_limit=200000) == 196608
    with pytest.raises(ValueError, match="did not grow"):
        longest.candidate_length({1: 2.0, 2: 2.0}, 10.0, 1, None)


def test_step_time_projection_and_the_bracketing_search():
    # a*S + b*S^2 through (64K, 20 s) and (128K, 60 s): at 256K, 200 s
    assert longest.step_seconds_at({65536: 20.0, 131072: 60.0}, 262144) == pytest.approx(200.0)
    assert longest.next_length(262144, None, 16384) == 278528
    assert longest.next_length(None, 262144, 16384) == 245760
    assert longest.next_length(245760, 262144, 16384) is None
    assert longest.next_length(196608, 262144, 16384) == 229376


def test_predictions_match_what_validate_prints_for_the_8b_recipe():
    today, everything = (
        predict.longest(predict.SETTINGS["today"]),
        predict.longest(predict.SETTINGS["everything"]),
    )
    assert 49152 <= today.tokens_per_gpu < 65536  # the H100 measured 48K trained, 64K did not
    assert everything.phase == "layer backward" and everything.host_gib > 70
    assert everything.tokens_per_gpu > 6 * today.tokens_per_gpu
    # Sharding the states with FSDP2 over 8 GPUs leaves more room per GPU than replicating them.
    assert (
        predict.longest(predict.SETTINGS["everything"], cp_size=8, shard_ranks=8).tokens_per_gpu
        > predict.longest(predict.SETTINGS["everything"], cp_size=8).tokens_per_gpu
    )


def test_the_results_table_names_each_run_and_the_longest():
    results = {
        "runs": [
            {
                "setting": "today",
                "seq_len": 65536,
                "status": "out of memory",
                "predicted_peak_gib": 90.0,
                "predicted_phase": "loss",
                "predicted_host_gib": 0.0,
            },
            {
                "setting": "everything",
                "seq_len": 327680,
                "status": "trained",
                "tokens_per_second": 1100.0,
                "peak_gib": 76.5,
                "predicted_peak_gib": 77.6,
                "predicted_phase": "layer backward",
                "predicted_host_gib": 80.0,
            },
        ],
        "longest": {"fits": 327680, "fails": 344064, "fitted": 327680, "predicted": 327680},
    }
    table = longest.markdown(results)
    assert "| today | 65,536 | out of memory |  |  | 90 GiB (loss) | 0 B |" in table
    assert (
        "| everything | 327,680 | trained | 1,100 | 76.5 GiB | 77.6 GiB (layer backward) | 80 GiB |" in table
    )
    assert "**327680** tokens trained, 344064 ran out of memory" in table


def test_the_long_step_is_capped_to_the_time_a_lease_has_left():
    """From check B's step (281.2 s at 294,912 tokens), a 400 s budget allows sqrt(400/281.2) of the length."""
    assert longest.length_within_time(294912, 281.2, 400, 16384) == 344064  # 351,733 rounded down
    assert longest.length_within_time(294912, 281.2, 281.2, 16384) == 294912
    assert longest.length_within_time(294912, 281.2, 1, 16384) == 16384  # never below one resolution step


def test_the_trainer_setting_runs_the_lora_projections_on_the_bf16_input():
    """'trainer' applies cptune's patch (lora_A receives the bf16 input under autocast); 'everything' does not."""
    import torch
    from benchmarks.gpu.feature_speed import setting_patches
    from peft import LoraConfig, get_peft_model

    from devtools.tiny import build_tiny_model, tiny_llama_config

    model = get_peft_model(
        build_tiny_model(tiny_llama_config(64), seed=0).to(torch.bfloat16),
        LoraConfig(r=4, target_modules=["q_proj"]),
    )
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.data = parameter.data.float()  # peft's fp32 adapters of a bf16 model
    seen = []
    for name, module in model.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda module, args, out: seen.append(args[0].dtype))
    ids = torch.randint(0, 50, (1, 8))
    dtypes = {}
    for setting in ("everything", "trainer"):
        seen.clear()
        with setting_patches(setting), torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids)
        dtypes[setting] = set(seen)
    assert dtypes == {"everything": {torch.float32}, "trainer": {torch.bfloat16}}


@pytest.mark.e2e
def test_two_level_rows_halve_the_pinned_inputs_and_give_the_peak_at_full_depth(tmp_path):
    """feature_speed's dry run (CPU, the tiny Llama) of lease.sh --two-level's settings: two_level holds half
    the offloaded inputs one-level holds, at every length, and regenerates the others; with --layers below 32
    each row adds the left-out layers' states to its peak and scales the host memory to 32 layers."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks.gpu.flops import LLAMA_31_8B

    repo = Path(__file__).resolve().parents[2]
    # This checkout's cptune (src) before whichever one is installed, and the repository for benchmarks/.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo)]),
    }
    out = tmp_path / "two_level.json"
    command = [sys.executable, "-m", "benchmarks.gpu.feature_speed", "--dry-run", "--layers", "8",
               "--settings", "trainer_norms,trainer_two_level", "--steps", "1", "--warmup", "0", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {(row["setting"], row["length"]): row for row in json.loads(out.read_text())["rows"]}
    lengths = sorted({length for _, length in rows})
    assert len(rows) == 4 and len(lengths) == 2
    left_out = predict.lora_states(LLAMA_31_8B) - predict.lora_states(
        dataclasses.replace(LLAMA_31_8B, layers=8)
    )
    for length in lengths:
        one, two = rows["trainer_norms", length], rows["trainer_two_level", length]
        assert one["host_gib"] > 0 and two["host_gib"] * 2 == one["host_gib"]
        assert one["regenerated_inputs"] == 0 and two["regenerated_inputs"] >= 1
        for row in (one, two):
            assert row["peak_gib_full_depth"] == row["peak_gib"] + left_out / 2**30
            assert row["host_gib_full_depth"] == row["host_gib"] * 4
            assert row["predicted_host_gib_full_depth"] == 4 * row["predicted_host_gib"]
        assert two["predicted_host_gib"] * 2 == one["predicted_host_gib"]
