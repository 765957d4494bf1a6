"""A preference (DPO/IPO/ORPO/SimPO) case of the deepspeed backend's parity launch: Ulysses + DeepSpeed's engine against cp=1.

Run by ulysses_parity_worker.py for a case with ``preference``. The cp=1 references (fp32 and float64, one
process, whole rows) are those of tests/parallel/preference_case.py; the deepspeed side runs what
``cptune train`` runs for ``rl`` with ``cp_backend: deepspeed``: DeepSpeed's ``UlyssesSPAttentionHF``
around the core attention over the CP group, each rank's contiguous slice of its group's pair batches
(:class:`~cptune.parallel.backends.deepspeed_ulysses.sharding.DeepSpeedUlyssesBackend`, built for the
collated batch's rows: two per pair when the sides have rows of their own), every micro batch through
:func:`cptune.parallel.preference.pair_forward` (the reference: the engine's module with its adapter
disabled, without gradients) and :func:`~cptune.parallel.preference.preference_step_loss`, backpropagated
by the engine, whose reduction over all ranks gives the gradients compared. Reports what
``test_parity.check`` and ``preference_metric_failures`` read.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from case_features import install_case_features  # tests/parallel/, next to this script
from float64_reference import float64_twin
from preference_case import (
    Fp32Twin,
    _run_step,
    case_loss,
    float64_segment_loss,
    make_pair_batches,
    value_scale,
    with_reference,
)
from reorder_twins import fp32_twins, gather_twins, twins_of_rank

from cptune.models.head_loss import logits_loss
from cptune.models.reference import adapter_disabled
from cptune.parallel.backends.base import step_context
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.preference import (
    PairBatch,
    pair_forward,
    preference_step_loss,
    reference_log_probs,
)
from tests.numerics import relative_errors, reorder_bound


def run_ulysses_preference_case(case: dict, worker: Any) -> dict:
    """3 SGD steps of the cp=1 references and of the deepspeed backend on DeepSpeed's engine.

    ``worker``: the Ulysses parity worker's helpers (``build_model``, ``cp_backend``, ``engine_grads``,
    ``VOCAB``, ``LEARNING_RATE``).
    """
    import deepspeed

    rank, world, cp = dist.get_rank(), dist.get_world_size(), case["cp"]
    dp, dp_rank, ga = world // cp, rank // cp, case["ga"]
    rows_per_batch = case["mbs"] * (1 if case["packed"] else 2)
    loss = case_loss(case)
    steps = [make_pair_batches({**case, "seed": case["seed"] + t}, dp, worker.VOCAB) for t in range(3)]
    # The cp=1 references first: DeepSpeed's wrapper replaces the core attention (sdpa too) in transformers'
    # registry when the backend is built, until the case's scope patch reverts.
    torch.manual_seed(0)
    reference = worker.build_model(case, "sdpa")
    reference64 = float64_twin(reference)
    # This rank's share of the reference's fp32 twins (tests/parallel/reorder_twins.py), shared after the case.
    candidates = fp32_twins("sdpa")
    indices = twins_of_rank(candidates, rank, world)
    twins = [Fp32Twin(candidates[i], reference, case, keyed=False) for i in indices]
    local = LocalBackend(causal=True)
    optimizers = [
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=worker.LEARNING_RATE)
        for m in (reference, reference64, *(t.model for t in twins))
    ]
    result: dict = {}
    ref_losses, ref64_losses, floors = [], [], []
    ref_steps = ref64_steps = steps
    if case.get("precompute"):  # a full fine-tune: each reference model's sums from its weights before step 0
        ref_steps = with_reference(steps, reference, local, logits_loss, None)
        ref64_steps = with_reference(steps, reference64, local, float64_segment_loss, None)
        for twin in twins:
            with twin.running():
                twin.steps = with_reference(steps, twin.model, twin.backend, logits_loss, None)
    for t, batches in enumerate(steps):
        step_pairs = torch.tensor(sum(b.pairs for g in batches for b in g))
        everything = [(b, None) for g in batches for b in g]
        longest = max(int(b.target_counts().max()) for b, _ in everything)
        ref_loss, ref_sums, _ = _run_step(
            reference, local, _flat(ref_steps[t]), 1, 1, None, step_pairs, loss, logits_loss, None, None
        )
        for twin in twins:
            twin.run_step(_flat((twin.steps or steps)[t]), step_pairs, loss, first=t == 0)
        ref64_loss, ref64_sums, magnitude = _run_step(
            reference64,
            local,
            _flat(ref64_steps[t]),
            1,
            1,
            None,
            step_pairs,
            loss,
            float64_segment_loss,
            None,
            None,
        )
        ref_losses.append(ref_loss)
        ref64_losses.append(ref64_loss)
        floors.append(reorder_bound(longest, value_scale(loss) * magnitude) / abs(ref64_loss))
        if t == 0:
            pairs = float(step_pairs)
            result["ref_metrics"] = {n: v / pairs for n, v in ref_sums.items()}
            result["ref64_metrics"] = {n: v / pairs for n, v in ref64_sums.items()}
            result["metric_floors"] = {
                n: reorder_bound(longest, value_scale(loss, n) * magnitude) / max(abs(v), 1e-30)
                for n, v in result["ref64_metrics"].items()
            }
            ref_g, ref64_g = _grads(reference), _grads(reference64)
            for twin in twins:
                twin.grad_errors = relative_errors(_grads(twin.model), ref64_g)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    core = case.get("core", "cptune")
    model = worker.build_model(case, worker.CORE_ATTENTION_NAMES[core])
    shard_loss = install_case_features(model, case)
    trainable = [p for p in model.parameters() if p.requires_grad]
    config = {
        "train_micro_batch_size_per_gpu": case["mbs"],
        "gradient_accumulation_steps": ga,
        "train_batch_size": case["mbs"] * ga * world,
        "zero_optimization": {"stage": case.get("stage", 0)},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(trainable, lr=worker.LEARNING_RATE), config=config
    )
    backend = worker.cp_backend({**case, "mbs": rows_per_batch}, model)
    cp_group = backend_group(cp)
    if case.get("precompute"):
        # precompute_ref_log_probs: the engine's model as built gives its group's batches their reference sums.
        steps = [
            [
                _with_reference(g, engine.module, backend, shard_loss, cp_group) if d == dp_rank else g
                for d, g in enumerate(s)
            ]
            for s in steps
        ]
    cp_losses = []
    for t, batches in enumerate(steps):
        step_pairs = torch.tensor(sum(b.pairs for g in batches for b in g))
        total = torch.zeros(1 + len(loss.metric_names), dtype=torch.float64)
        for i, batch in enumerate(batches[dp_rank]):
            total += _engine_micro_step(
                engine, backend, batch, loss, cp_group, step_pairs, cp, world, shard_loss
            )
            if t == 0 and i == ga - 1:  # DeepSpeed has reduced the step's gradients; not yet stepped
                grads = worker.engine_grads(engine, ref_g)
            engine.step()
        dist.all_reduce(total)
        cp_losses.append(float(total[0]) / world)  # the Trainer logs the mean over processes
        if t == 0:
            pairs = float(step_pairs)
            # Each CP rank holds its group's pairs: the world's sums count every pair cp times.
            names = loss.metric_names
            result["cp_metrics"] = {n: float(total[1 + i]) / (pairs * cp) for i, n in enumerate(names)}
            relative = {
                n: float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                for n, g in ref_g.items()
            }
            result["grad_worst"] = max(relative, key=relative.get)
            result["grad_rel"] = relative[result["grad_worst"]]
            result["grad_nonzero"] = all(float(g.abs().max()) > 0 for g in ref_g.values())
            result["grad_errors"] = relative_errors(grads, ref64_g)
            result["ref_grad_errors"] = relative_errors(ref_g, ref64_g)
    result.update(
        ref_losses=ref_losses,
        cp_losses=cp_losses,
        ref64_losses=ref64_losses,
        loss_floors=floors,
        targets=[0] * 3,
    )
    result["fp32_twins"] = gather_twins({i: twin.result() for i, twin in zip(indices, twins, strict=True)})
    return result


def _flat(step):
    return [(b, None) for g in step for b in g]


def _with_reference(batches, model, backend, shard_loss, cp_group):
    def attach(batch):
        with step_context(backend):
            sums = reference_log_probs(model, backend, shard_loss, batch, cp_group)
        return dataclasses.replace(batch, reference_logps=sums)

    return [attach(b) for b in batches]


def _engine_micro_step(engine, backend, batch: PairBatch, loss, cp_group, step_pairs, cp, world, shard_loss):
    """One micro batch as PreferenceTrainer trains it under DeepSpeed; returns (scaled loss, metric sums...)."""
    with step_context(backend):
        outputs = pair_forward(
            engine,
            engine.module,
            backend,
            shard_loss,
            batch,
            loss,
            cp_group,
            reference_context=adapter_disabled(engine.module)
            if loss.needs_reference and batch.reference_logps is None
            else nullcontext,
            attention_layers=2 if backend.core_attention == "cptune" else None,
        )
        scaled = preference_step_loss(outputs, step_pairs, cp, world)
        engine.backward(scaled, scale_wrt_gas=False)
    sums = outputs.metric_sums()
    return torch.tensor([scaled.item(), *(float(sums[n]) for n in loss.metric_names)], dtype=torch.float64)


def backend_group(cp: int) -> dist.ProcessGroup:
    """This rank's CP group (consecutive ranks, as the worker's ``cp_backend`` builds its mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))["cp"].get_group()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
