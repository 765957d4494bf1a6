"""One rank of the CP parity check: cptune's sharded path against the cp=1 reference.

Every rank builds the same tiny Llama, the same global batches and computes the
cp=1 reference itself (single process, whole rows, ``LocalBackend``). It then runs
its shard of its data-parallel group's batches through the case's backend
(``backend``: ring-flash-attn, the default, or torch) with the token-weighted
loss, inside the backend's step context as the trainer does, averages gradients
over the world as DDP does (a ``tp`` case: splits the model over ``tp`` ranks with
cptune's tensor parallelism and shards it with FSDP2 over dp_shard × cp, as
``cptune train`` does, on a dp_shard × cp × tp mesh), and reports, per case: the step-0 loss of both
paths, the largest relative gradient difference, and the losses of 3 optimizer
steps (SGD) of both paths; in fp32 also those of the cp=1 reference computed in float64, each
gradient's distance from it, and the same of the reference's fp32 reorder twins (``fp32_twins``, each
computed on one rank and gathered), in bf16 those of the cp=1 reference's reorder twins (``run_case``).

A case's ``inject`` plants a bug in the CP path (``INJECTIONS``): the parity check must fail on it.
A case with ``preference`` (``dpo``, ``ipo``) trains preference pairs instead (preference_case.py).

Usage: parity_worker.py OUT_DIR CP_SIZE CASES_JSON
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from case_features import (  # tests/parallel/case_features.py, next to this script
    WINDOWED_ARCHS,
    grads_digest,
    install_case_features,
    windowed_model,
)
from float64_reference import float64_twin  # tests/parallel/float64_reference.py
from masked_eager import MaskedEagerBackend  # tests/parallel/masked_eager.py
from preference_case import run_preference_case  # tests/parallel/preference_case.py
from reorder_twins import (  # tests/parallel/reorder_twins.py
    TWINS,
    fp32_twins,
    gather_twins,
    grad_norm_rel,
    twins_of_rank,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from cptune.labels import shift_labels_within_documents
from cptune.models.head_loss import logits_loss
from cptune.parallel.backends.attention import register_attention
from cptune.parallel.backends.base import step_context
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.backends.ring_flash_attn.sharding import (
    RingFlashAttnBackend,
    RingKernels,
    load_ring_flash_attn,
)
from cptune.parallel.backends.table import BACKENDS as BACKEND_TABLE
from cptune.parallel.backends.torch_cp.patches import torch_cp_cpu_sdpa_patch
from cptune.parallel.backends.torch_cp.sharding import TorchCpBackend
from cptune.parallel.dropout import use_exact_lora_dropout
from cptune.parallel.kernels.sinks import with_sinks
from cptune.parallel.loss import count_targets
from cptune.parallel.router_loss import RouterBalance
from cptune.parallel.shard import TokenBatch
from cptune.parallel.tensor_parallel import apply_tensor_parallel
from cptune.patches.core import ContextParallelWith, PatchSet
from cptune.patches.torch_patches import gloo_one_worker_patch
from cptune.run.training.distributed import close_process_groups
from cptune.run.training.micro_loss import training_loss
from cptune.run.training.trainer import RouterLossLog
from devtools.tiny import (
    build_tiny_mixtral,
    build_tiny_model,
    build_tiny_qwen3_moe,
    tiny_llama_config,
)
from tests import reorder
from tests.numerics import float64_logits_loss, relative_errors

VOCAB = 97
# SGD: its update is linear in the gradient, so the losses after each step show a gradient error
# as it is (AdamW divides each element by its own history, which turns fp32 reduction-order noise
# in near-zero gradients into 5e-6 differences after 3 steps, and hides a wrong scale).
LEARNING_RATE = 0.5


def make_row(
    generator: torch.Generator, length: int, packed: bool, full: bool = False, long_doc: bool = False
) -> tuple[list[int], list[int], list[int]]:
    """Token ids, labels (prompt tokens masked) and positions of one row of ``length`` tokens.

    ``full``: one document over the whole row (no padding), as torch's bidirectional CP needs.
    ``long_doc`` (packed): 3 short documents in the row's first third, then one long document over
    the rest, wider than the sliding window of the windowed models and crossing every shard boundary.
    """
    if full:
        docs = [length]
    elif packed:
        span = length // 3 if long_doc else length - 1
        cuts = sorted(torch.randperm(span, generator=generator)[:3].add(1).tolist())
        docs = [b - a for a, b in zip([0, *cuts], [*cuts, length], strict=True)]
    else:
        real = int(torch.randint(length // 2, length + 1, (1,), generator=generator))
        docs = [real] + ([length - real] if real < length else [])
    ids = torch.randint(3, VOCAB, (length,), generator=generator)
    labels = ids.clone()
    positions: list[int] = []
    start = 0
    for i, n in enumerate(docs):
        positions += list(range(n))
        prompt = min(n - 1, 2)
        labels[start : start + prompt] = -100  # like a prompt that is not trained
        if not packed and i == 1:
            labels[start : start + n] = -100  # the tail of an unpacked row is padding
        start += n
    return ids.tolist(), labels.tolist(), positions


def make_batches(case: dict, dp_size: int) -> list[list[TokenBatch]]:
    """batches[dp_group][micro] for one optimizer step."""
    generator = torch.Generator().manual_seed(case["seed"])
    out = []
    for _ in range(dp_size):
        micro = []
        for _ in range(case["ga"]):
            rows = [
                make_row(
                    generator,
                    case["seq_len"],
                    case["packed"],
                    case.get("full_rows", False),
                    case.get("long_doc", False),
                )
                for _ in range(case["mbs"])
            ]
            ids = torch.tensor([r[0] for r in rows])
            labels = torch.tensor([r[1] for r in rows])
            positions = torch.tensor([r[2] for r in rows])
            if case.get("empty_shard"):
                labels[:, : case["seq_len"] // 2 + 1] = -100  # rank 0's half has no target
            micro.append(TokenBatch(ids, positions, shift_labels_within_documents(labels, positions)))
        out.append(micro)
    return out


def build_model(case: dict, attn_implementation: str) -> torch.nn.Module:
    config = tiny_llama_config(VOCAB, num_key_value_heads=case.get("kv_heads", 2))
    if case.get("arch") in ("qwen3_moe", "mixtral"):
        # 4 experts, 2 per token, router loss on (output_router_logits, router_aux_loss_coef 0.02).
        build = build_tiny_qwen3_moe if case["arch"] == "qwen3_moe" else build_tiny_mixtral
        model = build(VOCAB, seed=1234, num_key_value_heads=config.num_key_value_heads)
        # The experts as a loop of matrix products: torch's grouped_mm (the default) takes no float64 reference.
        model.set_experts_implementation("eager")
    elif case.get("arch") == "qwen3":
        model = tiny_qwen3(config)
    elif case.get("arch") in WINDOWED_ARCHS:
        model = windowed_model(case, VOCAB)
    else:
        model = build_tiny_model(config, seed=1234)
    dtype = torch.bfloat16 if case.get("bf16") else torch.float32
    model.to(dtype)
    model.set_attn_implementation(attn_implementation)
    if case.get("qlora"):
        from quantized import quantized_4bit  # tests/parallel/quantized.py, beside this script

        model = quantized_4bit(model, attn_implementation, experts=case.get("moe_experts", False))
    if case["lora"]:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(7)
        config = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules="all-linear",
            init_lora_weights=False,
            lora_dropout=case.get("dropout", 0.0),
        )
        model = get_peft_model(model, config)
    return model


def tiny_qwen3(llama: Any) -> torch.nn.Module:
    """A Qwen3 of the tiny Llama's sizes: per-head q_norm/k_norm, which tensor parallelism keeps whole
    on every rank and whose gradients it sums over the tp ranks (``replicated_with_grad_allreduce``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    names += (
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
    )
    config = Qwen3Config(**{name: getattr(llama, name) for name in names})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return Qwen3ForCausalLM(config).to(torch.float32)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient, whole (a sharded one is gathered: a collective)."""
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


@dataclass(frozen=True)
class RouterTerm:
    """A MoE model's router loss as CptuneTrainer adds it: its settings, the step's micro batches
    counted as ``accumulation``, and the CP group its sums are all-reduced over (None: whole rows)."""

    balance: RouterBalance
    accumulation: int
    cp_group: dist.ProcessGroup | None = None


def run_step(
    model,
    backend,
    micro_batches,
    world_size,
    step_targets,
    keys=None,
    loss_fn=logits_loss,
    router: RouterTerm | None = None,
    router_log: RouterLossLog | None = None,
) -> float:
    """Forward/backward of one optimizer step's micro batches; returns the summed scaled loss.

    ``micro_batches`` holds (batch, number of its first row in the data order); with exact
    dropout (``keys``) the masks are keyed as CptuneTrainer keys them. The loss is CptuneTrainer's
    (``training_loss``), with the router loss of ``router``, each micro batch's value kept in ``router_log``.
    """
    total = 0.0
    for batch, first_row in micro_batches:
        with step_context(backend):  # around forward and backward, as CptuneTrainer.training_step
            sharded = backend.shard(batch)
            if keys is not None:
                keys.set_coords(sharded.coords, first_row)
            loss_sum, outputs = loss_fn(model, sharded.model_kwargs, sharded.shift_labels)
            loss, aux = training_loss(
                loss_sum,
                outputs,
                sharded.coords,
                step_targets=step_targets,
                gradient_divisor=world_size,
                router=router and router.balance,
                accumulation=router.accumulation if router else 1,
                cp_group=router and router.cp_group,
            )
            loss.backward()
        if aux is not None and router_log is not None:
            router_log.add(aux)
        total += loss.item()
    return total


@dataclass(frozen=True)
class Groups:
    """This rank's place in the dp × cp layout and its CP group, as a process group and as a mesh."""

    world: int
    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    cp_group: dist.ProcessGroup
    cp_mesh: DeviceMesh
    #: tensor-parallel cases: the dp_shard × cp × tp mesh (dp_shard_cp flattened), else None
    tp_mesh: DeviceMesh | None = None

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_mesh is None else self.tp_mesh["tp"].size()


def tensor_parallel_groups(world: int, cp_size: int, tp_size: int) -> Groups:
    """The layout of a tp case: tp innermost, then cp, as accelerate's mesh lays out ``cptune train``'s ranks."""
    dp_size = world // (cp_size * tp_size)
    mesh = init_device_mesh("cpu", (dp_size, cp_size, tp_size), mesh_dim_names=("dp_shard", "cp", "tp"))
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    cp_mesh = mesh["cp"]
    dp_rank = mesh["dp_shard"].get_local_rank()
    return Groups(
        world, dp_size, dp_rank, cp_size, cp_mesh.get_local_rank(), cp_mesh.get_group(), cp_mesh, mesh
    )


def shard_with_tensor_parallel(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """cptune's tensor parallelism on ``tp``, then FSDP2 over ``dp_shard_cp`` as accelerate's
    ``fsdp2_prepare_model`` wraps a model (each decoder layer, then the root)."""
    from torch.distributed.fsdp import fully_shard

    apply_tensor_parallel(model, mesh["tp"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard_cp"])
    fully_shard(model, mesh=mesh["dp_shard_cp"])


def _torch_backend(case: dict, groups: Groups, kernels) -> TorchCpBackend:
    return TorchCpBackend(
        causal=case["causal"],
        load_balance=case.get("load_balance", case["causal"]),
        comm_strategy=case.get("comm", "allgather"),
        cp_mesh=groups.cp_mesh,
        pad_token_id=0,
    )


def _ring_backend(case: dict, groups: Groups, kernels) -> RingFlashAttnBackend:
    return RingFlashAttnBackend(
        func=case.get("func", "varlen_llama3"),
        causal=case["causal"],
        heads_k_stride=case.get("heads_k_stride", 1),
        cp_size=groups.cp_size,
        cp_rank=groups.cp_rank,
        group=groups.cp_group,
        pad_token_id=0,
        kernels=kernels,
    )


# A case's ``backend`` (ring-flash-attn unless it names one) -> how this worker builds it over its CP group; a
# name not here fails instead of running another backend.
BACKENDS = {"ring-flash-attn": _ring_backend, "torch": _torch_backend}


def make_backend(case: dict, groups: Groups, kernels):
    if case.get("inject") in INJECTIONS:
        kernels = INJECTIONS[case["inject"]](kernels)
    return BACKENDS[case.get("backend", "ring-flash-attn")](case, groups, kernels)


def with_window(kernels: RingKernels) -> RingKernels:
    """Planted bug: a sliding window of 8 keys where the model has none (the call passes window_size=(-1, -1))."""

    def varlen_llama3(*args, **kwargs):
        return kernels.varlen_llama3(*args, **{**kwargs, "window_size": (8, -1)})

    return dataclasses.replace(kernels, varlen_llama3=varlen_llama3)


def without_first_boundary(kernels: RingKernels) -> RingKernels:
    """Planted bug: the first document boundary of the rows dropped from the attention's cu_seqlens."""

    def prepare(cu_seqlens, **kwargs):
        return kernels.prepare_cu_seqlens(torch.cat([cu_seqlens[:1], cu_seqlens[2:]]), **kwargs)

    return dataclasses.replace(kernels, prepare_cu_seqlens=prepare)


def shard_local_window(kernels: RingKernels) -> RingKernels:
    """Planted bug: sliding windows counted in shard-local positions, so no window reaches back across the
    rank's shard boundary (each rank's queries see only keys of its own shard, as if its shard started the
    sequence); full attention through the same kernels stays whole-sequence."""
    gathered: dict[str, Any] = {}

    def prepare(cu_seqlens, *, causal, rank, world_size):
        prepared = kernels.prepare_cu_seqlens(cu_seqlens, causal=causal, rank=rank, world_size=world_size)
        cu_q, _, max_q, _, _ = prepared
        length = int(cu_seqlens[-1]) // world_size
        gathered["local"] = (cu_q, cu_q, max_q, max_q, slice(rank * length, (rank + 1) * length))
        return prepared

    def varlen_llama3(q, k, v, cu_q, cu_k, max_q, max_k, stride, k_slice, **kwargs):
        if kwargs.get("window_size", (-1, -1)) != (-1, -1):
            cu_q, cu_k, max_q, max_k, k_slice = gathered["local"]
        return kernels.varlen_llama3(q, k, v, cu_q, cu_k, max_q, max_k, stride, k_slice, **kwargs)

    return dataclasses.replace(kernels, prepare_cu_seqlens=prepare, varlen_llama3=varlen_llama3)


def dropped_sinks(kernels: RingKernels) -> RingKernels:
    """Planted bug: the layers' sink logits not applied (the ordinary attention of the same kernels)."""

    def sink_attention(attention, q, k, v, sinks):
        return kernels.sink_attention(attention, q, k, v, torch.full_like(sinks, float("-inf")))

    return dataclasses.replace(kernels, sink_attention=sink_attention)


def sinks_per_block(kernels: RingKernels) -> RingKernels:
    """Planted bug: the sink applied to each rank's block of keys before the blocks are merged, so it enters every
    query's softmax once per block (``cp_size`` times, exp(s + log cp) in place of exp(s))."""

    def sink_attention(attention, q, k, v, sinks):
        blocks = dist.get_world_size(attention.group)
        return kernels.sink_attention(attention, q, k, v, sinks + torch.log(torch.tensor(float(blocks))))

    return dataclasses.replace(kernels, sink_attention=sink_attention)


def zigzag_sinks_per_block(kernels: RingKernels) -> RingKernels:
    """Planted bug: on the zigzag ring, the sink put into each block's ``(out, lse)`` as flash-attn returns it, before
    the ring merges the blocks, and not once after: it enters a query's softmax once per block (per ring step and
    key chunk) it sees."""

    def sink_attention(attention, q, k, v, sinks):
        forward, backward = attention.kernels

        def forward_with_sink(**kwargs):
            out, lse, *rest = forward(**kwargs)
            return (*with_sinks(out, lse, sinks.detach()), *rest)

        planted = dataclasses.replace(attention, kernels=(forward_with_sink, backward))
        return kernels.sink_attention(planted, q, k, v, torch.full_like(sinks, float("-inf")))

    return dataclasses.replace(kernels, sink_attention=sink_attention)


def dropped_window(kernels: RingKernels) -> RingKernels:
    """Planted bug: the model's sliding window not passed to the kernel (full attention on windowed layers)."""

    def varlen_llama3(*args, **kwargs):
        return kernels.varlen_llama3(*args, **{**kwargs, "window_size": (-1, -1)})

    return dataclasses.replace(kernels, varlen_llama3=varlen_llama3)


def block_local_zigzag_window(kernels: RingKernels) -> RingKernels:
    """Planted bug: sliding windows handed to ring-flash-attn's zigzag function as flash-attn's window_size,
    which it applies to every block of the ring with the block's own alignment (positions within blocks)."""

    def zigzag_window(q, k, v, scale, window, group):
        return kernels.zigzag(
            q, k, v, softmax_scale=scale, causal=True, window_size=(window - 1, 0), group=group
        )

    return dataclasses.replace(kernels, zigzag_window=zigzag_window)


# Planted bugs in the ring kernels (``inject`` of a case); ``grad_scale`` is planted in run_case.
INJECTIONS = {
    "window": with_window,
    "boundary": without_first_boundary,
    "window_shard_local": shard_local_window,
    "window_dropped": dropped_window,
    "zigzag_window_block_local": block_local_zigzag_window,
    "sinks_dropped": dropped_sinks,
    "sinks_per_block": sinks_per_block,
    "zigzag_sinks_per_block": zigzag_sinks_per_block,
}


def first_rows(case: dict, step: int, dp_size: int) -> list[list[int]]:
    """first_rows[dp_group][micro]: the data-order number of each micro batch's first row.

    accelerate gives batch ``n·dp_size + d`` to group ``d`` as its micro batch ``n``
    (``cptune.parallel.backends.base.batch_number``); the reference takes the same rows.
    """
    ga, mbs = case["ga"], case["mbs"]
    return [[((step * ga + m) * dp_size + d) * mbs for m in range(ga)] for d in range(dp_size)]


def grad_diffs(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest per-tensor max |difference| / max |expected|, and the tensor it was found in."""
    per_tensor = {
        n: float((got[n] - expected[n]).abs().max() / expected[n].abs().max().clamp_min(1e-30))
        for n in expected
    }
    worst = max(per_tensor, key=per_tensor.get)
    return per_tensor[worst], worst


def run_case(case: dict, groups: Groups, kernels) -> dict:
    """3 optimizer steps of the reference and of the CP path; see the module docstring.

    In fp32 the cp=1 reference also runs in float64 (``reference64``, the loss too), and again in fp32
    in the orders of reorder_twins.py's ``FP32_TWINS``, this rank's share of them (``twins_of_rank``):
    the parity check holds the CP path's distance from float64 against the farthest of the fp32
    reference's and its twins' (tests/numerics.py's ``FP32_TWINS_FACTOR``, or ``TWINS_FACTORS``' wider one
    where fewer of them are distinct).
    In bf16 the cp=1 reference runs again in the orders of tests/parallel/reorder_twins.py's
    ``TWINS`` (eager attention, sdpa's math backend, document attention): the same computation
    with the attention's sums in other orders. How far they land from the first is the noise
    floor of bf16 (``baseline_*``, one entry per twin); CP reorders the same sums.
    ``autocast``: the three bf16 models' forwards run under bf16 autocast (LoRA adapters stay fp32), as
    ``cptune train`` runs a bf16 recipe.
    """
    world = groups.world
    torch.manual_seed(0)
    local = LocalBackend(causal=case["causal"])
    if case.get("arch") == "gpt_oss":
        # transformers' eager gpt-oss attention (gpt-oss has no sdpa), the documents' masks given
        local = MaskedEagerBackend(case.get("window", 5))
    reference = build_model(case, local.attn_implementation if case["causal"] else "cptune")
    model = copy.deepcopy(reference)
    model.set_attn_implementation("cptune")
    twins: list = []  # (Twin, model, its cp=1 backend)
    reference64 = None
    reference_attention = reference.config._attn_implementation
    if case.get("bf16"):
        specs = list(TWINS)
    else:
        # fp32: this rank's share of the reference's fp32 twins (gather_twins shares them after the case).
        candidates = fp32_twins(reference_attention)
        fp32_indices = twins_of_rank(candidates, dist.get_rank(), dist.get_world_size())
        specs = [candidates[i] for i in fp32_indices]
        reference64 = float64_twin(reference)
    for twin_spec in specs:
        twin = copy.deepcopy(reference)
        twin.set_attn_implementation(twin_spec.attn_implementation(reference_attention))
        twins.append((twin_spec, twin, twin_spec.backend(case["causal"])))
    if case.get("autocast"):
        # As accelerate prepares a bf16 model: its forward under autocast, the backward outside. After
        # the copies: a copy of a wrapped forward would call the original's.
        for m in (reference, model, *(t[1] for t in twins)):
            m.forward = torch.autocast("cpu", dtype=torch.bfloat16)(m.forward)
    # Exact LoRA dropout, as CptuneTrainer installs it; each model keys its own masks.
    ref_keys, keys = (use_exact_lora_dropout(m, seed=case["seed"]) for m in (reference, model))
    twin_keys = [use_exact_lora_dropout(t[1], seed=case["seed"]) for t in twins]
    ref64_keys = None if reference64 is None else use_exact_lora_dropout(reference64, seed=case["seed"])
    loss_fn = install_case_features(model, case)
    result: dict = {}
    if groups.tp_mesh is not None:
        shard_with_tensor_parallel(model, groups.tp_mesh)
        attention = model.model.layers[0].self_attn
        # How the weights are laid out over (dp_shard_cp, tp): the test checks that tp split them.
        result["placements"] = {
            name: [str(p) for p in getattr(attention, name).weight.placements]
            for name in ("q_proj", "o_proj")
        }
    backend = make_backend(case, groups, kernels)
    ref_router = cp_router = None
    balance = RouterBalance.from_config(reference.config)
    if balance is not None:
        # The reference trains every data-parallel group's micro batches as one step's: the router loss's
        # mean over all of them, as the CP run's mean over its micro batches and DDP's over the groups.
        ref_router = RouterTerm(balance, case["ga"] * groups.dp_size)
        # Planted bug router_local: each rank's router loss from its own shard's sums, not the CP group's.
        cp_group = None if case.get("inject") == "router_local" else groups.cp_group
        cp_router = RouterTerm(balance, case["ga"], cp_group)
    ref_log, cp_log = RouterLossLog(), RouterLossLog()
    optimizers = [
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=LEARNING_RATE)
        for m in (reference, model, *(t[1] for t in twins), reference64)
        if m is not None
    ]
    ref_losses, cp_losses, ref64_losses, step_targets = [], [], [], []
    twin_losses: list[list[float]] = [[] for _ in twins]
    twin_seconds = [0.0 for _ in twins]  # CPU seconds each twin costs (issue 26: its time budget)
    for step in range(3):
        case_step = {**case, "seed": case["seed"] + step}
        batches = make_batches(case_step, groups.dp_size)
        rows = first_rows(case, step, groups.dp_size)
        targets = torch.tensor(sum(int(count_targets(b.shift_labels)) for g in batches for b in g))
        # Reference: every batch of every DP group, one process, mean over all targets.
        ref_batches = [(b, r) for g, r in zip(batches, rows, strict=True) for b, r in zip(g, r, strict=True)]
        step_targets.append(int(targets))
        # The reorder stress accumulates the reference's micro batches the other way (tests/reorder.py).
        ref_losses.append(
            run_step(
                reference,
                local,
                reorder.in_stress_order(ref_batches),
                1,
                targets,
                ref_keys,
                router=ref_router,
                # bf16 (no float64 reference): the router loss cp=1 logs is this reference's.
                router_log=ref_log if reference64 is None else None,
            )
        )
        for i, (twin_spec, twin, twin_backend) in enumerate(twins):
            started = time.process_time()
            with twin_spec.context():
                twin_losses[i].append(
                    run_step(twin, twin_backend, ref_batches, 1, targets, twin_keys[i], router=ref_router)
                )
            twin_seconds[i] += time.process_time() - started
        if reference64 is not None:
            ref64_losses.append(
                run_step(
                    reference64,
                    local,
                    ref_batches,
                    1,
                    targets,
                    ref64_keys,
                    float64_logits_loss,
                    router=ref_router,
                    router_log=ref_log,
                )
            )
        mine_batches = list(zip(batches[groups.dp_rank], rows[groups.dp_rank], strict=True))
        # As CptuneTrainer counts: every rank of a TP group counts its batch too, so the count is tp
        # times the step's, as the world size the loss is scaled by is while FSDP2 averages over world / tp.
        counted = targets * groups.tp_size
        loss = torch.tensor(
            run_step(model, backend, mine_batches, world, counted, keys, loss_fn, cp_router, cp_log)
        )
        if balance is not None:
            # What CptuneTrainer logs as router_aux_loss (a collective), and the float64 cp=1 run's value
            # (in bf16 the bf16 cp=1 run's).
            result.setdefault("cp_router_aux", []).append(cp_log.mean()["router_aux_loss"])
            reference_key = "ref64_router_aux" if reference64 is not None else "ref_router_aux"
            result.setdefault(reference_key, []).append(ref_log.mean()["router_aux_loss"])
        dist.all_reduce(loss)
        cp_losses.append(loss.item() / world)
        # Planted bug grad_scale: gradients averaged over the data-parallel groups only, not the world.
        divisor = world // groups.cp_size if case.get("inject") == "grad_scale" else world
        for p in model.parameters():
            if p.requires_grad and groups.tp_mesh is None:
                if p.grad is None:
                    # An expert no token of this rank's shard was routed to: the eager experts loop (taken for the
                    # float64 reference) skips it, where the default grouped_mm gives it a zero gradient.
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)  # DDP: mean over the world
                p.grad /= divisor
        if step == 0:
            ref_g = grads(reference)
            cp_g = grads(model)
            result["grad_rel"], result["grad_worst"] = grad_diffs(cp_g, ref_g)
            result["grad_nonzero"] = all(float(g.abs().max()) > 0 for g in ref_g.values())
            result["grad_sha"] = grads_digest(cp_g)
            if twins and reference64 is None:
                result["grad_norm_rel"] = grad_norm_rel(cp_g, ref_g)
                twin_g = [grads(twin) for _, twin, _ in twins]
                result["baseline_grad_rel"] = [grad_diffs(g, ref_g)[0] for g in twin_g]
                result["baseline_grad_norm_rel"] = [grad_norm_rel(g, ref_g) for g in twin_g]
            if reference64 is not None:
                ref64_g = grads(reference64)
                result["grad_errors"] = relative_errors(cp_g, ref64_g)
                result["ref_grad_errors"] = relative_errors(ref_g, ref64_g)
                twin_grad_errors = [relative_errors(grads(twin), ref64_g) for _, twin, _ in twins]
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    result.update(ref_losses=ref_losses, cp_losses=cp_losses, targets=step_targets)
    if reference64 is not None:
        result["ref64_losses"] = ref64_losses
        # Every rank's twins, so that each rank's result holds all of them (a collective, every case).
        mine = {
            index: {"name": spec.name, "losses": losses, "grad_errors": errors, "seconds": seconds}
            for index, (spec, _, _), losses, errors, seconds in zip(
                fp32_indices, twins, twin_losses, twin_grad_errors, twin_seconds, strict=True
            )
        }
        result["fp32_twins"] = gather_twins(mine)
    elif twins:
        result.update(
            baseline_losses=twin_losses, twin_seconds=twin_seconds, twins=[t[0].name for t in twins]
        )
    return result


def main() -> None:
    # What `cptune train` applies before any process group exists: gloo groups with one worker thread (two
    # corrupt the heap when collectives finish together, as torch CP's ring backward has them; issue 26).
    with PatchSet([gloo_one_worker_patch()]).applied(None):
        run_launch()


def run_launch() -> None:
    out_dir, cp_size, cases = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    reorder.apply()  # CPTUNE_TEST_REORDER=1: other summation orders (tests/reorder.py)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_size, cp_rank, dp_rank = world // cp_size, rank % cp_size, rank // cp_size
    cp_groups = [dist.new_group(list(range(d * cp_size, (d + 1) * cp_size))) for d in range(dp_size)]
    # cptune's rank layout (cp innermost), so this rank's "cp" submesh holds the ranks of cp_groups[dp_rank].
    cp_mesh = init_device_mesh("cpu", (dp_size, cp_size), mesh_dim_names=("dp", "cp"))["cp"]
    groups = Groups(world, dp_size, dp_rank, cp_size, cp_rank, cp_groups[dp_rank], cp_mesh)
    tp_sizes = sorted({c["tp"] for c in cases if c.get("tp")})
    assert len(tp_sizes) <= 1, "one tensor-parallel size per launch"
    tp_groups = tensor_parallel_groups(world, cp_size, tp_sizes[0]) if tp_sizes else None
    # ring-flash-attn's kernels where a case's backend runs on them (its runtime names the library).
    needs_ring = any(BACKEND_TABLE[c.get("backend", "ring-flash-attn")].runtime().library for c in cases)
    kernels = load_ring_flash_attn() if needs_ring else None
    register_attention()
    # What `cptune train` applies for cp_backend: torch (the CPU SDPA op's CP handlers).
    torch_patches = PatchSet([torch_cp_cpu_sdpa_patch(ContextParallelWith(("torch",)))])
    with torch_patches.applied(SimpleNamespace(context_parallel_size=cp_size, cp_backend="torch")):
        results = {
            case["name"]: run_preference_case(
                case, tp_groups if case.get("tp") else groups, kernels, sys.modules[__name__]
            )
            if case.get("preference")
            else run_case(case, tp_groups if case.get("tp") else groups, kernels)
            for case in cases
        }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    close_process_groups()  # as cptune's own ranks end


if __name__ == "__main__":
    main()
