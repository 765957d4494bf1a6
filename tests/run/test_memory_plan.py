"""What cptune validate says about memory per GPU and host RAM, and the host-RAM check before loading."""

from __future__ import annotations

import re

import pytest

from cptune.config.loader import load_recipe
from cptune.errors import CptuneError
from cptune.models.loading import model_config
from cptune.run import memory_plan
from cptune.run.launch.preflight import describe_plan
from cptune.run.plan import RunPlan


def test_validate_prints_the_peak_and_the_longest_sequence_per_cp(write_recipe):
    recipe = load_recipe(
        write_recipe(
            context_parallel_size=2, gradient_checkpointing=True, activation_offloading=True, tiled_mlp=True
        )
    )
    plan = describe_plan(RunPlan.build(recipe, 2), gpu_memory_gib=3.0)
    assert (
        "Memory per GPU (estimate from the config: fp32, LoRA, gradient checkpointing, activation_offloading, "
        in plan
    )
    assert "GPU memory 3 GiB [--gpu-memory]" in plan
    assert "  longest sequence that fits per GPU and the node's host RAM (one sequence per step, dp=1" in plan
    assert re.search(r"this recipe: 128 tokens per GPU -> peak [\d.]+ \w?i?B \(model states", plan)
    assert (
        "pinned host RAM for the offloaded layer inputs (every layer's input): 64 KiB per process, 128 KiB per "
        "node (2 process(es))" in plan
    )
    rows = re.findall(
        r"^\s+(\d+)\s+([\d,]+)\s+([\d,]+)\s+[\d.]+ \w?i?B\s+[\d.]+ \w?i?B  GPU memory", plan, re.M
    )
    assert [int(cp) for cp, _, _ in rows] == [1, 2, 4, 8, 16]
    for cp, per_gpu, sequence in rows:  # the sequence is the tokens per GPU times cp (micro batch 2)
        assert int(sequence.replace(",", "")) == int(per_gpu.replace(",", "")) * int(cp) // 2
    assert "warning" not in plan
    # 1 GiB less cptune's 2 GiB reserve leaves nothing: the estimate warns and nothing fits.
    small = describe_plan(RunPlan.build(recipe, 2), gpu_memory_gib=1.0)
    assert "warning: the estimate exceeds the usable GPU memory (-1 GiB)" in small
    assert re.search(r"^\s+1\s+none\s+-", small, re.M)


def test_without_a_gpu_the_table_is_a_plan_for_the_named_gpu(write_recipe, monkeypatch):
    monkeypatch.setattr(memory_plan.torch.cuda, "is_available", lambda: False)
    plan = describe_plan(RunPlan.build(load_recipe(write_recipe()), 1))
    assert (
        "Memory per GPU, a plan for one H100 80GB (estimate from the config: fp32, LoRA, " in plan
        and "GPU memory 79.6 GiB [this machine has no GPU; --gpu-memory GIB plans for another size]" in plan
    ), plan
    assert "  longest sequence that would fit on one H100 80GB (one sequence per step, dp=1)" in plan
    assert "fits per GPU" not in plan


def test_host_ram_check_refuses_offloading_that_does_not_fit(write_recipe, monkeypatch):
    recipe = load_recipe(
        write_recipe(gradient_checkpointing=True, activation_offloading=True, sequence_len=4096)
    )
    config = model_config(recipe)
    per_process = 2 * 4096 * 64 * 4 * 2  # layers x (micro batch 2 x 4096 tokens) x hidden x fp32
    # Pinned memory may take 90% of the RAM available: 4 processes' inputs do not fit, 3 do.
    monkeypatch.setattr(memory_plan, "available_host_memory", lambda: int(4 * per_process / 0.9) - 1)
    memory_plan.check_host_memory(recipe, config, processes_per_node=3)
    with pytest.raises(
        CptuneError,
        match=r"need 16 MiB of pinned host RAM on a node \(4 process\(es\) x 4 MiB: 2 layers x 8,192 tokens",
    ):
        memory_plan.check_host_memory(recipe, config, processes_per_node=4)
    # Without offloading there is nothing to check.
    plain = load_recipe(write_recipe(gradient_checkpointing=True, sequence_len=4096))
    memory_plan.check_host_memory(plain, config, processes_per_node=4)


def test_longest_sequence_grows_with_each_feature(write_recipe):
    """The tiny recipe's limit on a 3 GiB GPU: the chunked loss and then the tiles raise it."""
    from cptune.models.sizing import count_parameters, model_shape
    from cptune.parallel.memory import StateLayout, activation_memory, longest_tokens

    def longest(**keys) -> int:
        recipe = load_recipe(write_recipe(gradient_checkpointing=True, **keys))
        config = model_config(recipe)
        counts = count_parameters(recipe, config)
        budget = (
            3 * memory_plan.GiB
            - memory_plan.GPU_RESERVE
            - memory_plan.states_per_rank(recipe, counts, StateLayout()).total
        )
        setup = memory_plan.activation_setup(RunPlan.build(recipe, 1), 1)
        tokens = longest_tokens(model_shape(config), setup, budget)
        assert activation_memory(model_shape(config), setup, tokens).peak <= budget
        return tokens

    today = longest()
    assert longest(cut_cross_entropy=True) > today
    assert longest(cut_cross_entropy=True, tiled_mlp=True) > longest(cut_cross_entropy=True)
    # The tiny model has 2 layers and offloading keeps two layers' inputs on the device (measured,
    # benchmarks/memory_coefficients.py): here it saves nothing. Its gain on Llama-3.1-8B (30 of 32
    # layers) is tested in tests/parallel/test_activation_memory.py.
    assert longest(cut_cross_entropy=True, tiled_mlp=True, activation_offloading=True) == longest(
        cut_cross_entropy=True, tiled_mlp=True
    )


def test_offloaded_fsdp2_states_at_one_process_leave_the_gpu(write_recipe, monkeypatch):
    """fsdp_config.offload_params with one process: FSDP2 over a mesh of one, the states counted in host RAM."""
    monkeypatch.setattr(memory_plan.torch.cuda, "is_available", lambda: False)
    keep = load_recipe(write_recipe(gradient_checkpointing=True, fsdp_version=2))
    offload = load_recipe(
        write_recipe(gradient_checkpointing=True, fsdp_version=2, fsdp_config={"offload_params": True})
    )
    assert not RunPlan.build(keep, 1).dims.sharded and RunPlan.build(offload, 1).dims.sharded
    plan = describe_plan(RunPlan.build(offload, 1), gpu_memory_gib=3.0)
    row = re.search(
        r"^  FSDP2 over 1 rank, offloaded to host RAM\s+([\d.]+ \w?i?B)\s+0 B\s+0 B\s+([\d.]+ \w?i?B)$",
        plan,
        re.M,
    )
    assert row and row.group(1) == row.group(2), plan
    assert "fsdp_config.offload_params: the sharded states take" in plan

    # The longest sequence grows by what the states no longer take; their host RAM shows in the table.
    def first_row(text: str) -> tuple[int, str]:
        found = re.search(r"^\s+1\s+([\d,]+)\s+[\d,]+\s+[\d.]+ \w?i?B\s+(-|[\d.]+ \w?i?B)  ", text, re.M)
        return int(found.group(1).replace(",", "")), found.group(2)

    kept_tokens, kept_host = first_row(describe_plan(RunPlan.build(keep, 1), gpu_memory_gib=3.0))
    offloaded_tokens, offloaded_host = first_row(plan)
    assert offloaded_tokens >= kept_tokens and kept_host == "-" and offloaded_host != "-"


def test_validate_refuses_offloading_the_stated_host_cannot_hold(write_recipe, cptune_in_process):
    """``--host-memory`` plans for another node: 2 layers x 256 tokens x hidden 64 x fp32 = 128 KiB of pinned
    inputs per process; a node of 128 KiB may pin 90% of it. Two-level checkpointing pins half and fits."""
    recipe = write_recipe(gradient_checkpointing=True, activation_offloading=True)
    host_gib = str(128 / (1 << 20))  # 128 KiB
    done = cptune_in_process("validate", str(recipe), "--host-memory", host_gib)
    assert done.returncode != 0
    assert (
        "activation_offloading: the offloaded layer inputs need 128 KiB of pinned host RAM on a node (1 process(es) "
        "x 128 KiB: 2 layers x 256 tokens per process x hidden 64), more than 90% of the host's 128 KiB "
        "[--host-memory]: the host RAM is the limit here, not the GPU." in done.stderr
    ), done.stderr
    assert "or activation_offloading: two_level (pins 64 KiB)" in done.stderr
    two_level = write_recipe(gradient_checkpointing=True, activation_offloading="two_level")
    done = cptune_in_process("validate", str(two_level), "--host-memory", host_gib)
    assert done.returncode == 0, done.stderr
    assert (
        "pinned host RAM for the offloaded layer inputs (1 of 2 layers' inputs, two-level): 64 KiB per process"
        in done.stdout
    )
    assert "the node's RAM: 128 KiB [--host-memory], 90% of it for pinned layer inputs" in done.stdout


def test_the_longest_sequence_names_the_host_when_it_binds(write_recipe):
    """A node of 32 MiB: 90% of it holds 58,982 tokens of the tiny model's two fp32 layer inputs (512 bytes
    per token), fewer than a 3 GiB GPU allows; with two-level checkpointing it holds twice as many, more
    than the GPU allows, and the GPU binds."""
    from cptune.models.sizing import count_parameters, model_shape
    from cptune.parallel.memory import StateLayout, longest_tokens

    rows = {}
    for value in (True, "two_level"):
        recipe = load_recipe(
            write_recipe(gradient_checkpointing=True, activation_offloading=value, tiled_mlp=True)
        )
        plan = describe_plan(RunPlan.build(recipe, 1), gpu_memory_gib=3.0, host_memory_gib=32 / 1024)
        rows[value] = re.search(r"^\s+1\s+([\d,]+)\s+[\d,]+\s+.+B  (.+)$", plan, re.M).groups()
    config = model_config(recipe)
    budget = (
        3 * memory_plan.GiB
        - memory_plan.GPU_RESERVE
        - memory_plan.states_per_rank(recipe, count_parameters(recipe, config), StateLayout()).total
    )
    setup = memory_plan.activation_setup(RunPlan.build(recipe, 1), 1)
    gpu_tokens = longest_tokens(model_shape(config), setup, budget)  # offloading one layer or two: the same
    pinnable = int(0.9 * (32 << 20))
    plain_tokens = pinnable // (2 * 64 * 4) // 1024 * 1024
    two_level_tokens = pinnable // (64 * 4) // 1024 * 1024
    assert plain_tokens < gpu_tokens < two_level_tokens  # the premise
    assert rows[True] == (f"{plain_tokens:,}", f"host RAM (the GPU allows {gpu_tokens:,})")
    assert rows["two_level"] == (f"{gpu_tokens:,}", f"GPU memory (the host allows {two_level_tokens:,})")


def test_validate_counts_recompute_norms(write_recipe):
    """recompute_norms reaches the activation estimate and the plan's feature list."""
    recipe = load_recipe(
        write_recipe(
            gradient_checkpointing=True, activation_offloading=True, tiled_mlp=True, recompute_norms=True
        )
    )
    plan = RunPlan.build(recipe, 1)
    assert memory_plan.activation_setup(plan, 1).recompute_norms
    described = describe_plan(plan, gpu_memory_gib=3.0)
    assert "gradient checkpointing, activation_offloading, tiled_mlp, recompute_norms" in described


def test_validate_plans_an_evaluation_batch_larger_than_the_micro_batch(write_recipe):
    """eval_batch_size 8 over micro_batch_size 1: one forward without gradients over 8 rows, whose peak
    (the model states + the no-grad forward's activations over 8 x 128 tokens) is printed beside the step's;
    with eval_batch_size at the micro batch, or no evaluation data, no line."""
    from cptune.models.sizing import model_shape
    from cptune.parallel.memory import format_bytes, no_grad_forward_memory

    recipe = load_recipe(write_recipe(eval_batch_size=8, val_set_size=0.25, gradient_checkpointing=True))
    plan = RunPlan.build(recipe, 1)
    described = describe_plan(plan, gpu_memory_gib=3.0)
    lines = [line for line in described.splitlines() if "evaluation: eval_batch_size" in line]
    assert len(lines) == 1, described
    shape = model_shape(model_config(recipe))
    activations = no_grad_forward_memory(shape, memory_plan.activation_setup(plan, 1), 8 * 128)
    assert f"8 row(s), {8 * 128:,} tokens per GPU" in lines[0]
    assert f"+ activations {format_bytes(activations)})" in lines[0], lines[0]
    for keys in ({"eval_batch_size": 1, "val_set_size": 0.25}, {"eval_batch_size": 8}):
        plain = describe_plan(
            RunPlan.build(load_recipe(write_recipe("other.yaml", **keys)), 1), gpu_memory_gib=3.0
        )
        assert "evaluation: eval_batch_size" not in plain


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "a-row-per-side"])
def test_validate_prints_the_longest_preference_pair_and_the_reference_forward(write_recipe, packed):
    """rl: dpo: the table gives the longest pair (both sides) per cp; without packing each side is a row of its
    own, so a micro batch of 2 pairs is 4 rows of up to 128 tokens: 256 tokens per GPU at cp=2, twice SFT's."""
    from tests.conftest import REPO

    pairs = [
        {
            "path": str(REPO / "examples" / "data" / "preference.jsonl"),
            "type": "chat_template.default",
            "field_messages": "prompt",
        }
    ]
    keys = {"base_model": str(REPO / "examples" / "tiny-llama"), "context_parallel_size": 2}
    keys |= {"gradient_checkpointing": True, "sample_packing": packed}
    dpo = load_recipe(write_recipe("dpo.yaml", datasets=pairs, rl="dpo", **keys))
    sft = load_recipe(write_recipe("sft.yaml", **keys))
    plan = describe_plan(RunPlan.build(dpo, 2), gpu_memory_gib=3.0)
    tokens = 2 * 2 * 128 // 2 if not packed else 2 * 128 // 2  # rows x sequence_len / cp
    this = re.search(r"this recipe: ([\d,]+) tokens per GPU -> peak ([\d.]+ \w?i?B)", plan)
    assert int(this[1].replace(",", "")) == tokens, plan
    rows = "4 rows (a row per side, each up to 128 tokens)" if not packed else "2 row(s) of up to 128 tokens"
    assert f"rl: dpo: a micro batch is {rows}" in plan
    assert "a pair (both sides, the prompt in each) is at most sequence_len (128) tokens" in plan
    assert re.search(
        r"reference forward of each micro batch \(the adapter disabled, no gradients, keeps nothing\): "
        r"activations [\d.]+ \w?i?B, below the training peak",
        plan,
    )
    assert (
        "  longest preference pair that fits per GPU (one pair per step, its chosen and rejected sides together, "
        "dp=1):" in plan
    )
    table = re.findall(
        r"^\s+(\d+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+[\d.]+ \w?i?B\s+-  GPU memory", plan, re.M
    )
    assert [int(cp) for cp, *_ in table] == [1, 2, 4, 8, 16]
    for cp, per_gpu, pair, side in table:
        per_gpu, pair, side = (int(v.replace(",", "")) for v in (per_gpu, pair, side))
        # Micro batch 2: packed, 2 rows each holding a pair; a row per side, 4 rows, two of them a pair.
        assert pair == (per_gpu * int(cp) // 2 if packed else 2 * (per_gpu * int(cp) // 4)), (
            cp,
            per_gpu,
            pair,
        )
        assert side == pair // 2
    # The reference forward keeps nothing: at the same tokens per GPU the SFT recipe peaks as high.
    if packed:
        plain = describe_plan(RunPlan.build(sft, 2), gpu_memory_gib=3.0)
        assert f"this recipe: {this[1]} tokens per GPU -> peak {this[2]}" in plain
    # A full fine-tune's reference runs once before training, on the weights alone.
    full = load_recipe(
        write_recipe(
            "full.yaml", datasets=pairs, rl="dpo", adapter=None, precompute_ref_log_probs=True, **keys
        )
    )
    described = describe_plan(RunPlan.build(full, 2), gpu_memory_gib=3.0)
    assert "reference forward of each micro batch" not in described
    assert re.search(
        r"precompute_ref_log_probs: before training, one forward without gradients over every pair \(no reference "
        r"forward per step\): peak [\d.]+ \w?i?B \(weights [\d.]+ \w?i?B \+ activations [\d.]+ \w?i?B\), below the "
        r"training peak",
        described,
    )


def test_validate_plans_no_reference_pass_for_the_reference_free_losses(write_recipe):
    """rl: simpo (and orpo) read no reference model: no reference forward per step, no first pass."""
    from tests.conftest import REPO

    pairs = [
        {
            "path": str(REPO / "examples" / "data" / "preference.jsonl"),
            "type": "chat_template.default",
            "field_messages": "prompt",
        }
    ]
    keys = {"base_model": str(REPO / "examples" / "tiny-llama"), "gradient_checkpointing": True}
    simpo = load_recipe(write_recipe("simpo.yaml", datasets=pairs, rl="simpo", **keys))
    plan = RunPlan.build(simpo, 1)
    assert not memory_plan.activation_setup(plan, 1).reference_forward
    described = describe_plan(plan, gpu_memory_gib=3.0)
    assert "rl: simpo reads no reference model: no reference forward, no first pass" in described
    assert "reference forward of each micro batch" not in described
    assert "before training, one forward without gradients" not in described
