"""What ``cptune validate`` says about memory per GPU and host RAM, and the host-RAM check before a launch.

The arithmetic is :mod:`cptune.parallel.memory`; this module reads the recipe, the
model's config and the machine (GPU memory, available RAM) and turns the estimate
into lines and into the refusal of a run whose offloaded activations do not fit the
host memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError
from cptune.parallel.layout import ParallelDims
from cptune.parallel.memory import (
    ActivationEstimate,
    ActivationSetup,
    ModelShape,
    StateLayout,
    StateMemory,
    activation_memory,
    format_bytes,
    gathered_in_flight,
    longest_within,
    no_grad_forward_memory,
    offloaded_layers,
    optimizer_state,
    quantized_bytes_per_weight,
    state_memory,
)
from cptune.run.plan import RunPlan

GiB = 1 << 30
# What a process cannot give to tensors on a GPU: the CUDA context, library workspaces (cuBLAS,
# NCCL) and the caching allocator's fragmentation (torch.cuda.max_memory_allocated counts none).
GPU_RESERVE = 2 * GiB
# An H100 80GB as nvidia-smi reports it (81,559 MiB), for estimates on a machine without a GPU.
H100_BYTES = 81_559 * (1 << 20)
CP_SIZES = (1, 2, 4, 8, 16)
# The share of a node's host RAM the offloaded layer inputs may pin: the rest is for the processes'
# own memory (Python, torch, the data, the weights on their way to the GPU) and the system. 90% is what
# check B pinned without trouble on a 128 GB host (docs/benchmarks.md; benchmarks/gpu/run_longest.py).
HOST_PINNABLE_FRACTION = 0.9


@dataclass(frozen=True)
class GpuMemory:
    """The GPU memory the estimate assumes, and where that number comes from.

    Attributes:
        total: Bytes of memory per GPU.
        source: Where ``total`` comes from (the GPU's name, or ``--gpu-memory``).
        assumed: The GPU the estimate plans for when this machine has none and no size was given
            (then the estimate is a plan for that GPU, and says so); None otherwise.
    """

    total: int
    source: str
    assumed: str | None = None

    @classmethod
    def detect(cls, override_gib: float | None = None) -> GpuMemory:
        if override_gib is not None:
            return cls(int(override_gib * GiB), "--gpu-memory")
        if torch.cuda.is_available():
            try:
                props = torch.cuda.get_device_properties(0)
                return cls(props.total_memory, props.name)
            except (RuntimeError, AssertionError):  # a GPU that cannot be queried from this process
                pass
        return cls(
            H100_BYTES,
            "this machine has no GPU; --gpu-memory GIB plans for another size",
            assumed="H100 80GB",
        )


@dataclass(frozen=True)
class HostMemory:
    """The host RAM of a node that the estimate and the refusal before a launch assume, and its source.

    Attributes:
        total: Bytes of RAM on the node for the run (None: unknown, the host is not a limit).
        source: Where ``total`` comes from (``--host-memory``, or this machine's ``MemAvailable``).
    """

    total: int | None
    source: str

    @classmethod
    def detect(cls, override_gib: float | None = None) -> HostMemory:
        """``--host-memory GIB`` (planning for another machine), else the RAM available on this one now."""
        if override_gib is not None:
            return cls(int(override_gib * GiB), "--host-memory")
        available = available_host_memory()
        if available is None:
            return cls(None, "unknown: /proc/meminfo unreadable; --host-memory GIB plans for a size")
        return cls(available, "available on this machine (MemAvailable); --host-memory GIB plans for another")

    @property
    def pinnable(self) -> int | None:
        """Bytes the offloaded layer inputs of a node may take (:data:`HOST_PINNABLE_FRACTION` of the total)."""
        return None if self.total is None else int(HOST_PINNABLE_FRACTION * self.total)


def mixed_precision(recipe: Recipe) -> bool:
    """bf16 or fp16 training (``bf16: auto`` when this machine has a GPU)."""
    return bool(recipe.bf16 is True or recipe.fp16 or (recipe.bf16 == "auto" and torch.cuda.is_available()))


def activation_setup(plan: RunPlan, cp_size: int) -> ActivationSetup:
    """The recipe's precision, adapter, memory features and backend at ``cp_size``, for the activation estimate."""
    recipe = plan.recipe
    return ActivationSetup(
        mixed_precision=mixed_precision(recipe),
        lora=recipe.is_lora,
        gradient_checkpointing=recipe.resolved_gradient_checkpointing,
        offload=recipe.offloads_activations,
        two_level=recipe.two_level_offloading,
        tiled_mlp=recipe.tiled_mlp,
        tiled_mlp_num_shards=recipe.tiled_mlp_num_shards,
        recompute_norms=recipe.recompute_norms,
        head_loss=recipe.resolved_head_loss,
        cp_size=cp_size,
        attention_buffers=functools.partial(plan.backend_at(cp_size).attention_buffer_bytes, recipe)
        if cp_size > 1
        else None,
        # A full fine-tune's reference runs once, before training (precompute_ref_log_probs): see _reference_lines.
        reference_forward=recipe.is_preference
        and recipe.needs_reference
        and not recipe.precompute_ref_log_probs,
    )


def default_attention_buffers(cp_backend: str) -> Callable[[ModelShape, int, int], float]:
    """A backend's K/V buffer bytes with its keys at their defaults (heads_k_stride 1, allgather), for
    estimates without a recipe (the benchmarks' predictions)."""
    from cptune.config.loader import validate_recipe
    from cptune.parallel.backends.table import BACKENDS

    recipe = validate_recipe({"base_model": "-", "datasets": [{"path": "-"}], "cp_backend": cp_backend})
    return functools.partial(BACKENDS[cp_backend].attention_buffer_bytes, recipe)


def state_layout(plan: RunPlan, dims: ParallelDims) -> StateLayout:
    """How ``dims`` (the plan's or another layout of its recipe) spreads the model states: FSDP2, DeepSpeed
    ZeRO (its JSON's stage), or whole."""
    if dims.sharded:
        ranks = dims.shard_group_size // dims.tp_size
        return StateLayout("fsdp", ranks, tp_size=dims.tp_size, offload=dims.offload_params)
    stage = plan.backend_at(dims.cp_size).zero_stage(plan.recipe)
    if stage is not None:
        return StateLayout("zero", dims.world_size, stage)
    return StateLayout()


def states_per_rank(recipe: Recipe, counts: Any, layout: StateLayout) -> StateMemory:
    """Weights, gradients and optimizer state per rank for the recipe's model (``counts``) in ``layout``."""
    quantized_bytes = 0.0
    if counts.quantized:
        options = recipe.bnb_config_kwargs
        quantized_bytes = quantized_bytes_per_weight(
            4 if recipe.load_in_4bit else 8, options.bnb_4bit_use_double_quant if options else True
        )
    return state_memory(
        total=counts.total,
        trainable=counts.trainable,
        optimizer=optimizer_state(recipe.optimizer, counts.trainable_shapes),
        dtype_bytes=counts.dtype_bytes,
        layout=layout,
        lora=recipe.is_lora,
        quantized=counts.quantized,
        quantized_bytes=quantized_bytes,
        quantized_sharded=not (
            recipe.load_in_8bit
            or (recipe.bnb_config_kwargs and recipe.bnb_config_kwargs.bnb_4bit_quant_storage == "uint8")
        ),
        in_flight=gathered_in_flight(
            counts.total, counts.all_layers, counts.largest_layer, counts.dtype_bytes
        ),
    )


def describe_state_memory(plan: RunPlan, config: Any) -> list[str]:
    """Lines estimating each rank's memory for weights, gradients and optimizer state in the plan's layout."""
    from cptune.models.sizing import count_parameters

    recipe, dims = plan.recipe, plan.dims
    try:
        counts = count_parameters(recipe, config)
    except (ValueError, TypeError, RuntimeError, CptuneError) as err:
        # The estimate is a convenience: a model transformers cannot build without weights (on the
        # meta device) still trains, and its real problems are reported where it loads.
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return [f"Memory per rank for model states: no estimate ({first})."]
    layouts = [state_layout(plan, dims)]
    if layouts[0].sharding != "whole":
        layouts.append(StateLayout())
    rows = [(layout.describe(), states_per_rank(recipe, counts, layout)) for layout in layouts]
    width = max(len(name) for name, _ in rows)
    trained = (
        "LoRA adapter" if recipe.is_lora else "unfrozen_parameters" if recipe.unfrozen_parameters else "all"
    )
    if counts.quantized:
        trained += f"; {counts.quantized:,} base weights in {4 if recipe.load_in_4bit else 8} bits"
    lines = [
        f"Memory per rank for model states (estimate from the config: {counts.total:,} parameters, "
        f"{counts.trainable:,} trained ({trained}), {recipe.optimizer}; activations not included):",
        f"  {'layout':<{width}}  {'weights':>10} {'gradients':>10} {'optimizer':>10} {'total':>10}",
    ]
    for name, memory in rows:
        values = (memory.weights, memory.gradients, memory.optimizer, memory.total)
        lines.append(f"  {name:<{width}}  " + " ".join(f"{format_bytes(v):>10}" for v in values))
    if counts.unquantized_experts:
        from cptune.models.loading import torch_dtype

        bits = "load_in_4bit" if recipe.load_in_4bit else "load_in_8bit"
        dtype = str(torch_dtype(recipe)).removeprefix("torch.")
        lines.append(
            f"  {counts.unquantized_experts:,} weights of the experts stay in {dtype} with {bits}: bitsandbytes "
            "quantizes linear layers only, and a mixture of experts keeps its experts in 3D tensors; the weights "
            "above count them so (quantize_moe_experts: true stores them in 4 bits with load_in_4bit)."
        )
    if counts.quantized_experts:
        from cptune.models.loading import torch_dtype

        dtype = str(torch_dtype(recipe)).removeprefix("torch.")
        lines.append(
            f"  quantize_moe_experts: the {counts.quantized_experts:,} weights of the experts are packed in 4 bits "
            f"once the model is loaded; while it loads, the GPU holds them in {dtype} "
            f"({format_bytes(counts.quantized_experts * counts.dtype_bytes)}) beside the other weights."
        )
    if layouts[0].offload:
        host = rows[0][1].host
        lines.append(
            f"  fsdp_config.offload_params: the sharded states take {format_bytes(host)} of host RAM per rank; the "
            "GPU holds only the whole weights of the layers running (FSDP2's root module, with the embeddings and "
            "the output head, and two decoder layers), and the optimizer steps on the CPU."
        )
    elif dims.sharded:
        gathered = 2 * counts.largest_layer * counts.dtype_bytes
        lines.append(
            f"  FSDP2 also gathers whole layers while they run: about {format_bytes(gathered)} more "
            "(two decoder layers in flight)."
        )
    return lines


def host_bytes_per_process(recipe: Recipe, shape: ModelShape, cp_size: int) -> int:
    """Host RAM the offloaded layer inputs of one process take (0 without activation_offloading)."""
    if not recipe.offloads_activations:
        return 0
    dtype_bytes = ActivationSetup(mixed_precision=mixed_precision(recipe), lora=recipe.is_lora).dtype_bytes
    layers = offloaded_layers(shape.layers, recipe.two_level_offloading)
    return int(layers * shape.hidden * dtype_bytes * tokens_per_rank(recipe, cp_size))


def tokens_per_rank(recipe: Recipe, cp_size: int, rows: int | None = None) -> int:
    """Tokens of a micro batch (or of ``rows`` rows) on one rank, at most: its rows of up to ``sequence_len``
    tokens over ``cp_size``.

    A preference pair (both sides together) is at most ``sequence_len`` tokens: packed, a row holds whole
    pairs; without ``sample_packing`` each side is a row of its own padded to the batch's longest side
    (``Recipe.rows_per_micro_batch``: twice the micro batch), which with ``pad_to_sequence_len`` or one long
    side is up to ``sequence_len`` tokens each.
    """
    rows = recipe.rows_per_micro_batch if rows is None else rows
    return -(-rows * recipe.sequence_len // cp_size)


def available_host_memory() -> int | None:
    """Bytes of RAM available to new work on this machine (Linux ``MemAvailable``); None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(
    recipe: Recipe, config: Any, processes_per_node: int, host: HostMemory | None = None
) -> None:
    """Refuse, before any weight is loaded, offloaded activations that do not fit the node's host RAM.

    Args:
        host: The node's RAM (default: :meth:`HostMemory.detect`, what this machine has available now).

    Raises:
        CptuneError: the processes of a node would pin more than :data:`HOST_PINNABLE_FRACTION` of its RAM.
    """
    from cptune.models.sizing import model_shape

    shape = model_shape(config)
    if not recipe.offloads_activations or shape is None:
        return
    host = host or HostMemory.detect()
    per_process = host_bytes_per_process(recipe, shape, recipe.context_parallel_size)
    need = per_process * processes_per_node
    if host.pinnable is None or need <= host.pinnable:
        return
    tokens = tokens_per_rank(recipe, recipe.context_parallel_size)
    layers = offloaded_layers(shape.layers, recipe.two_level_offloading)
    which = f"{layers} of {shape.layers} layers" if layers < shape.layers else f"{layers} layers"
    fix = (
        "Use fewer tokens per process (a larger context_parallel_size, or a shorter sequence_len or "
        "micro_batch_size)"
    )
    if not recipe.two_level_offloading:
        fix += f", or activation_offloading: two_level (pins {format_bytes(-(-need // 2))})"
    raise CptuneError(
        f"activation_offloading: the offloaded layer inputs need {format_bytes(need)} of pinned host RAM on a "
        f"node ({processes_per_node} process(es) x {format_bytes(per_process)}: {which} x {tokens:,} tokens per "
        f"process x hidden {shape.hidden}), more than {HOST_PINNABLE_FRACTION:.0%} of the host's "
        f"{format_bytes(host.total)} [{host.source}]: the host RAM is the limit here, not the GPU. {fix}, "
        "or remove activation_offloading."
    )


def describe_activation_memory(
    plan: RunPlan,
    config: Any,
    counts: Any,
    gpu: GpuMemory,
    processes_per_node: int,
    host: HostMemory | None = None,
) -> list[str]:
    """Lines: the peak per GPU of the plan and the longest sequence per GPU at cp = 1, 2, 4, 8, 16."""
    from cptune.models.sizing import model_shape

    recipe = plan.recipe
    shape = model_shape(config)
    if shape is None:
        return ["Memory per GPU with activations: no estimate (the config lacks a decoder's widths)."]
    usable = gpu.total - GPU_RESERVE
    cp = recipe.context_parallel_size
    tokens = tokens_per_rank(recipe, cp)
    setup = activation_setup(plan, cp)
    states = states_per_rank(recipe, counts, state_layout(plan, plan.dims)).total
    estimate = activation_memory(shape, setup, tokens)
    features = ", ".join(plan.memory_features) or "no memory features"
    checkpointing = "gradient checkpointing" if setup.gradient_checkpointing else "no gradient checkpointing"
    precision = "bf16/fp16 mixed precision" if setup.mixed_precision else "fp32"
    setting = (
        f"{precision}, {'LoRA' if recipe.is_lora else 'full fine-tune'}, {checkpointing}, {features}; "
        f"GPU memory {format_bytes(gpu.total)} [{gpu.source}], {format_bytes(GPU_RESERVE)} of it kept for "
        "CUDA and the allocator"
    )
    # Without a GPU here the numbers are for a GPU the run may later get, not for this machine.
    if gpu.assumed is None:
        head, fits = f"Memory per GPU (estimate from the config: {setting}):", "fits per GPU"
    else:
        head = f"Memory per GPU, a plan for one {gpu.assumed} (estimate from the config: {setting}):"
        fits = f"would fit on one {gpu.assumed}"
    lines = [
        head,
        f"  this recipe: {tokens:,} tokens per GPU -> peak {format_bytes(states + estimate.peak)} "
        f"(model states {format_bytes(states)} + activations {format_bytes(estimate.peak)}, at the "
        f"{estimate.phase})",
    ]
    if recipe.is_preference:
        weights = states_per_rank(recipe, counts, state_layout(plan, plan.dims)).weights
        lines += _preference_lines(recipe, shape, setup, tokens, estimate, states, weights)
    if recipe.has_eval_data and recipe.resolved_eval_batch_size > recipe.micro_batch_size:
        lines += _evaluation_lines(recipe, shape, setup, cp, states, estimate, usable)
    host = host or HostMemory.detect()
    if estimate.host:
        offloaded = offloaded_layers(shape.layers, setup.two_level)
        which = (
            f"{offloaded} of {shape.layers} layers' inputs, two-level"
            if setup.two_level
            else "every layer's input"
        )
        lines.append(
            f"  pinned host RAM for the offloaded layer inputs ({which}): {format_bytes(estimate.host)} per "
            f"process, {format_bytes(estimate.host * processes_per_node)} per node ({processes_per_node} "
            f"process(es)); the node's RAM: {_describe_host(host)}"
        )
    if states + estimate.peak > usable:
        lines.append(
            f"  warning: the estimate exceeds the usable GPU memory ({format_bytes(usable)}); expect "
            "out-of-memory errors. See the longest sequences below."
        )
    bounded = " and the node's host RAM" if setup.offload and host.pinnable is not None else ""
    shared = (
        f"; at cp=c a node runs min(c, {processes_per_node}) process(es) (--nproc-per-node) sharing its RAM"
        if setup.offload and host.pinnable is not None
        else ""
    )
    if recipe.is_preference:
        lines.append(
            f"  longest preference pair that {fits}{bounded} (one pair per step, its chosen and rejected sides "
            f"together, dp=1{shared}):"
        )
        lines.append(
            f"    {'cp':>3} {'tokens per GPU':>15} {'pair':>12} {'each side':>10} {'peak':>10} "
            f"{'host RAM per GPU':>17}  limit"
        )
    else:
        lines.append(f"  longest sequence that {fits}{bounded} (one sequence per step, dp=1{shared}):")
        lines.append(
            f"    {'cp':>3} {'tokens per GPU':>15} {'sequence':>12} {'peak':>10} {'host RAM per GPU':>17}  limit"
        )
    for size in sorted({cp, *CP_SIZES}):
        lines.append("    " + _longest_row(plan, shape, counts, size, usable, host, processes_per_node))
    if recipe.is_preference:
        lines.append(f"    ({_pair_layout_note(recipe)})")
    lines.append(
        "  (activations from per-token costs measured on CPU and checked against H100 runs: docs/benchmarks.md)"
    )
    return lines


def _evaluation_lines(
    recipe: Recipe,
    shape: ModelShape,
    setup: ActivationSetup,
    cp: int,
    states: float,
    estimate: ActivationEstimate,
    usable: int,
) -> list[str]:
    """An evaluation batch of ``eval_batch_size`` rows, more than a training micro batch: one forward without
    gradients over more tokens, which may set the run's peak."""
    rows = recipe.rows_per_eval_batch
    tokens = tokens_per_rank(recipe, cp, rows)
    evaluation = no_grad_forward_memory(shape, setup, tokens)
    peak = states + evaluation
    where = (
        f"above the training step's {format_bytes(states + estimate.peak)}"
        if evaluation > estimate.peak
        else f"below the training step's {format_bytes(states + estimate.peak)}"
    )
    lines = [
        f"  evaluation: eval_batch_size {recipe.resolved_eval_batch_size} ({rows} row(s), {tokens:,} tokens per GPU), "
        f"one forward without gradients: peak {format_bytes(peak)} (model states {format_bytes(states)} + "
        f"activations {format_bytes(evaluation)}), {where}"
    ]
    if peak > usable:
        lines.append(
            f"  warning: the evaluation batch exceeds the usable GPU memory ({format_bytes(usable)}); lower "
            "eval_batch_size (the evaluation loss does not depend on it)."
        )
    return lines


def _pair_layout_note(recipe: Recipe) -> str:
    """What the pair and each-side columns of the longest-pair table mean for the recipe's layout."""
    if recipe.pair_sides_in_own_rows:
        return (
            "pair: prompt + chosen and prompt + rejected, each side a row of its own padded to the longer side, so "
            "each side is at most half the pair"
        )
    return (
        "pair: prompt + chosen and prompt + rejected, in one row; each side: half of it when the sides are as "
        "long, a side may take more when the other is shorter"
    )


def _preference_lines(
    recipe: Recipe,
    shape: ModelShape,
    setup: ActivationSetup,
    tokens: int,
    estimate: ActivationEstimate,
    states: float,
    weights: float,
) -> list[str]:
    """What preference training (``rl``) adds to a step: its pairs, and its reference forward or first pass."""
    if recipe.pair_sides_in_own_rows:
        rows = (
            f"{recipe.rows_per_micro_batch} rows (a row per side, each up to {recipe.sequence_len:,} tokens)"
        )
    else:
        rows = f"{recipe.micro_batch_size} row(s) of up to {recipe.sequence_len:,} tokens, each holding whole pairs"
    lines = [
        f"  rl: {recipe.rl}: a micro batch is {rows}; a pair (both sides, the prompt in each) is at most "
        f"sequence_len ({recipe.sequence_len:,}) tokens"
    ]
    if not recipe.needs_reference:
        lines.append(f"  rl: {recipe.rl} reads no reference model: no reference forward, no first pass")
        return lines
    reference = no_grad_forward_memory(shape, setup, tokens)
    if setup.reference_forward:
        where = (
            "it sets the peak"
            if estimate.phase == "reference forward"
            else f"below the training peak ({format_bytes(estimate.peak)}, at the {estimate.phase})"
        )
        lines.append(
            "  reference forward of each micro batch (the adapter disabled, no gradients, keeps nothing): "
            f"activations {format_bytes(reference)}, {where}"
        )
        return lines
    # Before training: the weights as loaded, no gradients or optimizer state yet (the Trainer builds them at train()).
    lines.append(
        "  precompute_ref_log_probs: before training, one forward without gradients over every pair (no "
        f"reference forward per step): peak {format_bytes(weights + reference)} (weights {format_bytes(weights)} "
        f"+ activations {format_bytes(reference)}), below the training peak ({format_bytes(states + estimate.peak)})"
    )
    return lines


def _longest_row(
    plan: RunPlan,
    shape: ModelShape,
    counts: Any,
    cp: int,
    usable: int,
    host: HostMemory,
    processes_per_node: int,
) -> str:
    recipe = plan.recipe
    if plan.backend_at(cp).splits_heads and shape.heads % cp:
        return f"{cp:>3} {'n/a':>15} {'(heads do not divide by cp)':>41}"
    # one sequence on cp ranks
    alone = ParallelDims(
        world_size=cp, cp_size=cp, fsdp=recipe.is_fsdp, offload_params=plan.dims.offload_params
    )
    memory = states_per_rank(recipe, counts, state_layout(plan, alone))
    states = memory.total
    setup = activation_setup(plan, cp)
    # FSDP2 pins its offloaded states in host memory too: what is left is the layer inputs'.
    host_budget = None if host.pinnable is None else host.pinnable / min(cp, processes_per_node) - memory.host
    longest = longest_within(shape, setup, usable - states, host_budget, step=1024)
    tokens = longest.tokens
    if tokens == 0:
        side = f" {'-':>10}" if recipe.is_preference else ""
        return f"{cp:>3} {'none':>15} {'-':>12}{side} {format_bytes(states):>10} {'-':>17}  {longest.limit}"
    estimate = activation_memory(shape, setup, tokens)
    # offloaded layer inputs and offloaded model states (fsdp_config.offload_params)
    pinned = format_bytes(estimate.host + memory.host) if estimate.host + memory.host else "-"
    peak = format_bytes(states + estimate.peak)
    limit = longest.limit
    if longest.host_tokens is not None:
        other = longest.gpu_tokens if limit == "host RAM" else longest.host_tokens
        limit += f" (the {'GPU' if limit == 'host RAM' else 'host'} allows {other:,})"
    row = tokens * cp // recipe.rows_per_micro_batch
    if recipe.is_preference:
        # A row per side: a pair of two such rows; packed: a pair fills the row.
        pair = 2 * row if recipe.pair_sides_in_own_rows else row
        return f"{cp:>3} {tokens:>15,} {pair:>12,} {pair // 2:>10,} {peak:>10} {pinned:>17}  {limit}"
    return f"{cp:>3} {tokens:>15,} {row:>12,} {peak:>10} {pinned:>17}  {limit}"


def _describe_host(host: HostMemory) -> str:
    if host.total is None:
        return f"not a limit here ({host.source})"
    return (
        f"{format_bytes(host.total)} [{host.source}], {HOST_PINNABLE_FRACTION:.0%} of it for pinned layer "
        "inputs"
    )


def activation_memory_lines(
    plan: RunPlan, config: Any, gpu: GpuMemory, processes_per_node: int, host: HostMemory | None = None
) -> list[str]:
    """:func:`describe_activation_memory`, or one line saying why there is no estimate."""
    from cptune.models.sizing import count_parameters

    try:
        counts = count_parameters(plan.recipe, config)
    except (ValueError, TypeError, RuntimeError, CptuneError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return [f"Memory per GPU with activations: no estimate ({first})."]
    return describe_activation_memory(plan, config, counts, gpu, processes_per_node, host)
