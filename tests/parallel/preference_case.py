"""A preference (DPO/IPO/ORPO/SimPO) parity case of the shared parity launch: cptune's CP path against cp=1.

Run by parity_worker.py for a case with ``preference`` (``dpo``, ``ipo``, ``orpo`` or ``simpo``). Every rank builds the
same tiny Llama with a LoRA adapter, the same pair batches (through the training collator), and
runs 3 SGD steps three ways: the cp=1 reference in fp32 and in float64 (one process, whole rows,
``LocalBackend``) and its own shard through the case's CP backend, each micro batch through
:func:`cptune.parallel.preference.pair_forward` (reference with the adapter disabled, then the policy)
and :func:`~cptune.parallel.preference.preference_step_loss`, gradients averaged over the world as
DDP does (``fsdp2``: the CP model sharded by FSDP2 over every rank instead). It reports what ``test_parity.check`` reads (losses of the 3 steps, step-0 gradients and
their distances from float64) plus the step-0 metrics and the floors of the preference loss.

``inject`` plants a bug in the cross-rank sum or target count (:data:`PLANTED`): the check must fail on it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from case_features import install_case_features  # tests/parallel/, next to this script
from float64_reference import float64_twin
from reorder_twins import fp32_twins, gather_twins, twins_of_rank

from cptune.data.collator import PackedCollator
from cptune.data.preference_formats import pair_sample
from cptune.labels import IGNORE_INDEX
from cptune.models.head_loss import logits_loss
from cptune.models.reference import adapter_disabled
from cptune.parallel.backends.base import step_context
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.collectives import all_reduce_sum, differentiable_all_reduce_sum
from cptune.parallel.dropout import use_exact_lora_dropout
from cptune.parallel.preference import (
    PairBatch,
    PreferenceLoss,
    pair_forward,
    preference_step_loss,
    reference_log_probs,
)
from cptune.run.training.reference_pass import COLUMN, precompute_reference
from tests.numerics import relative_errors, reorder_bound

BETA = 0.5  # larger than TRL's 0.1: the 3 steps move the rewards well away from 0
SIMPO_GAMMA = 0.3


def case_loss(case: dict) -> PreferenceLoss:
    """The case's loss: ``preference`` with β, and SimPO's γ and ``cpo_alpha`` (the case's, else 1)."""
    return PreferenceLoss(
        case["preference"], BETA, simpo_gamma=SIMPO_GAMMA, cpo_alpha=case.get("cpo_alpha", 1.0)
    )


def value_scale(loss: PreferenceLoss, name: str = "loss") -> float:
    """How much a value (the loss, or a metric ``name``) moves per unit of the per-sequence log-probs behind it.

    DPO/IPO: ``2β`` for the loss and the rewards (two sides), 1 for ``logps``. ORPO/SimPO read per-token means
    ``m``; SimPO's loss moves by ``β`` per side plus ``cpo_alpha`` (its NLL); the log odds by ``1/(1 - e^m)``
    per side, at most 2 where ``m ≤ -log 2`` (the tiny model's means are near ``-log(vocab)``), so ORPO's
    loss by 1 (its NLL) plus λ times 2 per side.
    """
    if name.startswith("logps") or name == "nll_loss":
        return 1.0
    if name.startswith("log_odds"):
        return 2 * 2.0
    if name.startswith("rewards") or loss.needs_reference:
        return 2 * BETA
    if loss.kind == "simpo":
        return 2 * BETA + loss.cpo_alpha
    return 1.0 + 2 * 2.0 * BETA


def _counts_left_local(tensor, group):
    """Planted bug: the sums completed over the group, each sequence's target count left as this rank's."""
    completed = differentiable_all_reduce_sum(tensor, group)
    half = tensor.shape[0] // 2  # sums, then counts (pair_forward's layout)
    return torch.cat([completed[:half], tensor[half:]])


class _SumForwardOnly(torch.autograd.Function):
    """Planted bug: the sum completed in the forward, but the gradient not summed back over the group."""

    @staticmethod
    def forward(ctx, tensor, group):
        return all_reduce_sum(tensor, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


PLANTED = {
    # Each rank keeps the sums of its own shard: the pair losses are those of partial sequences.
    "pair_sum_local": lambda tensor, group: tensor.clone(),
    # The forward sums over the group, the backward does not: each rank's tokens get 1/cp of the gradient.
    "pair_sum_backward": lambda tensor, group: _SumForwardOnly.apply(tensor, group),
    # The per-token means divide complete sums by this rank's share of the targets (ORPO, SimPO, IPO).
    "pair_count_local": _counts_left_local,
}


def _pair(generator: torch.Generator, vocab: int) -> dict[str, list[int]]:
    """A random pair: a prompt of 2-5 tokens, responses of 2-7 tokens (ids 3..vocab-1)."""

    def tokens(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high + 1, (1,), generator=generator))
        return torch.randint(3, vocab, (length,), generator=generator).tolist()

    sample = pair_sample(tokens(2, 5), tokens(2, 7), tokens(2, 7))
    return {"input_ids": sample.input_ids, "labels": sample.labels, "position_ids": sample.position_ids}


def pair_collator(case: dict) -> PackedCollator:
    """The training collator of the case's rows (an unpacked pair's sides each in a row, as ``cptune train``)."""
    return PackedCollator(pad_token_id=0, preference=True, pair_sides_in_own_rows=not case["packed"])


def make_pair_rows(case: dict, dp_size: int, vocab: int) -> list[list[list[dict]]]:
    """rows[dp_group][micro] of one optimizer step: ``mbs`` prepared rows of 2 pairs each (packed) or 1 pair."""
    generator = torch.Generator().manual_seed(case["seed"])
    per_row = 2 if case["packed"] else 1
    out = []
    for _ in range(dp_size):
        micro = []
        for _ in range(case["ga"]):
            rows = []
            for _ in range(case["mbs"]):
                pairs = [_pair(generator, vocab) for _ in range(per_row)]
                rows.append({key: [v for pair in pairs for v in pair[key]] for key in pairs[0]})
            micro.append(rows)
        out.append(micro)
    return out


def make_pair_batches(case: dict, dp_size: int, vocab: int) -> list[list[PairBatch]]:
    """batches[dp_group][micro] of one optimizer step: :func:`make_pair_rows` through the training collator."""
    return collate_pair_rows(case, make_pair_rows(case, dp_size, vocab))


def collate_pair_rows(case: dict, rows: list[list[list[dict]]]) -> list[list[PairBatch]]:
    """rows[dp_group][micro] through the case's training collator."""
    collate = pair_collator(case)
    return [[PairBatch.from_inputs(collate(micro)) for micro in group] for group in rows]


def first_pass_reference(case, step_rows, model, backend, shard_loss, groups):
    """The CP model's reference sums of every batch of ``step_rows`` (steps[t][dp_group][micro] rows) through
    cptune's first pass (``precompute_reference``, as ``PreferenceTrainer`` runs it: each data-parallel group
    runs its share of the batches over its CP group, one rank of each CP and TP group keeps the sums, one
    all-reduce gives every rank all of them), then this rank's data-parallel group's batches carrying them."""
    collate = pair_collator(case)
    flat = [row for step in step_rows for group in step for micro in group for row in micro]
    tp_group = groups.tp_mesh["tp"].get_group() if groups.tp_mesh is not None else None
    sums = iter(  # precompute_reference enters the backend's step context around each forward itself
        precompute_reference(
            flat,
            collate,
            model,
            backend,
            shard_loss,
            rows_per_batch=case["mbs"],
            dp_rank=groups.dp_rank,
            dp_size=groups.dp_size,
            cp_group=groups.cp_group,
            tp_group=tp_group,
        )
    )

    def carrying(rows):
        return PairBatch.from_inputs(collate([{**row, COLUMN: next(sums)} for row in rows]))

    out = []
    for step in step_rows:
        batches = [[carrying(rows) for rows in group] for group in step]  # every group's, to keep the order
        out.append([g if d == groups.dp_rank else [] for d, g in enumerate(batches)])
    return out


def with_reference(steps, model, backend, shard_loss, group):
    """``steps`` (steps[t][dp_group][micro]) with each batch's reference sums from ``model`` as it is now."""

    def attach(batch):
        with step_context(backend):
            sums = reference_log_probs(model, backend, shard_loss, batch, group)
        return dataclasses.replace(batch, reference_logps=sums)

    return [[[attach(b) for b in group_batches] for group_batches in step] for step in steps]


def float64_segment_loss(model, model_kwargs, shift_labels, segments):
    """``logits_loss`` per segment with the cross-entropy in float64 (cptune's is fp32) for the float64 model."""
    outputs = model(**model_kwargs, use_cache=False)
    logits = outputs.logits.reshape(-1, outputs.logits.shape[-1]).double()
    labels = shift_labels.reshape(-1)
    ids, count = segments
    ids = ids.reshape(-1)
    per_token = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    kept = labels != IGNORE_INDEX
    return per_token.new_zeros(count).index_add(0, ids[kept], per_token[kept]), outputs


def _run_step(model, backend, micro, world, cp_size, group, step_pairs, loss, shard_loss, keys, complete):
    """One optimizer step's micro batches: forward, scaled loss, backward. Returns (loss, metric sums, magnitude)."""
    total, sums, magnitude = 0.0, dict.fromkeys(loss.metric_names, 0.0), 0.0
    for batch, first_row in micro:

        def on_shard(sharded, first_row=first_row):
            if keys is not None:
                keys.set_coords(sharded.coords, first_row)

        kwargs = {"complete": complete} if complete is not None else {}
        # A batch with precomputed reference sums runs no reference forward (the context is then unused).
        needs_forward = loss.needs_reference and batch.reference_logps is None
        context = adapter_disabled(model) if needs_forward else contextlib.nullcontext
        with step_context(backend):
            outputs = pair_forward(
                model,
                model,
                backend,
                shard_loss,
                batch,
                loss,
                group,
                reference_context=context,
                on_shard=on_shard,
                **kwargs,
            )
            scaled = preference_step_loss(outputs, step_pairs, cp_size, world)
            scaled.backward()
        total += scaled.item()
        for name, value in outputs.metric_sums().items():
            sums[name] += float(value)
        magnitude = max(magnitude, float((outputs.chosen_logps.abs() + outputs.rejected_logps.abs()).max()))
    return total, sums, magnitude


def shard_over_the_world(model: torch.nn.Module, world: int) -> None:
    """FSDP2 over every rank (dp_shard × cp), as accelerate's ``fsdp2_prepare_model`` wraps a model for
    ``fsdp_version: 2``: each decoder layer, then the root. Every weight, LoRA's too, is split over the world;
    the gradients are averaged over it (a reduce-scatter), as DDP averages them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a LoRA adapter
    layer_classes = set(base._no_split_modules or ())  # what accelerate's auto wrap policy wraps
    for layer in [m for m in model.modules() if type(m).__name__ in layer_classes]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def is_sharded(parameter: torch.Tensor) -> bool:
    """FSDP2 holds ``parameter`` as a DTensor split over the ranks (its first dim)."""
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(parameter, DTensor) and parameter.placements == (Shard(0),)


def run_preference_case(case: dict, groups: Any, kernels: Any, worker: Any) -> dict:
    """3 SGD steps of the cp=1 references (fp32, float64) and of this rank's CP path; see the module docstring.

    ``worker``: the parity worker's helpers (``build_model``, ``make_backend``, ``grads``, ``grad_diffs``,
    ``first_rows``, ``VOCAB``, ``LEARNING_RATE``), so both kinds of case build and compare alike.
    """
    world, cp_size = groups.world, groups.cp_size
    torch.manual_seed(0)
    reference = worker.build_model(case, "sdpa")
    model = copy.deepcopy(reference)
    model.set_attn_implementation("cptune")
    reference64 = float64_twin(reference)
    # This rank's share of the reference's fp32 twins (tests/parallel/reorder_twins.py), shared after the case.
    candidates = fp32_twins("sdpa")
    indices = twins_of_rank(candidates, dist.get_rank(), dist.get_world_size())
    twins = [Fp32Twin(candidates[i], reference, case) for i in indices]
    keys = [use_exact_lora_dropout(m, seed=case["seed"]) for m in (reference, reference64, model)]
    shard_loss = install_case_features(model, case)
    if groups.tp_mesh is not None:  # a tp case: split over tp, then FSDP2 over dp_shard × cp, as cptune train
        worker.shard_with_tensor_parallel(model, groups.tp_mesh)
    elif case.get("fsdp2"):
        shard_over_the_world(model, groups.world)
    local = LocalBackend(causal=True)
    backend = worker.make_backend(case, groups, kernels)
    loss = case_loss(case)
    complete = PLANTED.get(case.get("inject"))
    optimizers = [
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=worker.LEARNING_RATE)
        for m in (reference, reference64, model, *(t.model for t in twins))
    ]
    result: dict = {}
    if case.get("fsdp2"):  # every parameter split over the ranks, the frozen base's and LoRA's
        result["whole_parameters"] = [n for n, p in model.named_parameters() if not is_sharded(p)]
    ref_losses, ref64_losses, cp_losses, floors = [], [], [], []
    step_rows = [
        make_pair_rows({**case, "seed": case["seed"] + t}, groups.dp_size, worker.VOCAB) for t in range(3)
    ]
    steps = [collate_pair_rows(case, rows) for rows in step_rows]
    ref_steps = ref64_steps = cp_steps = steps
    if case.get("precompute"):
        # precompute_ref_log_probs: each model's reference sums of every batch from its weights before step 0,
        # the CP model's through its backend over its CP group (its own data-parallel group's batches).
        ref_steps = with_reference(steps, reference, local, logits_loss, None)
        for twin in twins:
            with twin.running():
                twin.steps = with_reference(steps, twin.model, twin.backend, logits_loss, None)
        ref64_steps = with_reference(steps, reference64, local, float64_segment_loss, None)
        cp_steps = first_pass_reference(case, step_rows, model, backend, shard_loss, groups)
    for step in range(3):
        batches = steps[step]
        rows = worker.first_rows(case, step, groups.dp_size)
        step_pairs = torch.tensor(sum(b.pairs for g in batches for b in g))
        everything = [(b, r) for g, r in zip(batches, rows, strict=True) for b, r in zip(g, r, strict=True)]
        longest = max(int(b.target_counts().max()) for b, _ in everything)

        def flat(with_sums, rows=rows):
            return [(b, r) for g, r in zip(with_sums, rows, strict=True) for b, r in zip(g, r, strict=True)]

        ref_loss, ref_sums, _ = _run_step(
            reference, local, flat(ref_steps[step]), 1, 1, None, step_pairs, loss, logits_loss, keys[0], None
        )
        for twin in twins:
            twin.run_step(flat((twin.steps or steps)[step]), step_pairs, loss, first=step == 0)
        ref64_loss, ref64_sums, magnitude = _run_step(
            reference64,
            local,
            flat(ref64_steps[step]),
            1,
            1,
            None,
            step_pairs,
            loss,
            float64_segment_loss,
            keys[1],
            None,
        )
        mine = list(zip(cp_steps[step][groups.dp_rank], rows[groups.dp_rank], strict=True))
        cp_loss, cp_sums, _ = _run_step(
            model,
            backend,
            mine,
            world,
            cp_size,
            groups.cp_group,
            # As PreferenceTrainer counts: every rank of a TP group counts its group's pairs too, so the count is
            # tp times the step's, as the world size the loss is scaled by is while FSDP2 averages over world / tp.
            step_pairs * groups.tp_size,
            loss,
            shard_loss,
            keys[2],
            complete,
        )
        total = torch.tensor([cp_loss, *cp_sums.values()], dtype=torch.float64)
        dist.all_reduce(total)
        ref_losses.append(ref_loss)
        ref64_losses.append(ref64_loss)
        cp_losses.append(float(total[0]) / world)
        # Luck floor of the loss: the reorder bound of the log-prob sums behind it (the longest sequence's
        # targets; the sums' magnitudes times β), relative to the loss.
        floors.append(reorder_bound(longest, value_scale(loss) * magnitude) / abs(ref64_loss))
        for p in model.parameters():
            if p.requires_grad and not case.get("fsdp2") and groups.tp_mesh is None:  # FSDP2 averaged them
                dist.all_reduce(p.grad)  # DDP: mean over the world
                p.grad /= world
        if step == 0:
            pairs = float(step_pairs)
            # Each CP (and TP) rank holds its group's pairs: the world's sums count every pair cp × tp times.
            names = loss.metric_names
            copies = pairs * cp_size * groups.tp_size
            result["cp_metrics"] = {n: float(total[1 + i]) / copies for i, n in enumerate(names)}
            result["ref_metrics"] = {n: v / pairs for n, v in ref_sums.items()}
            result["ref64_metrics"] = {n: v / pairs for n, v in ref64_sums.items()}
            result["metric_floors"] = {
                n: reorder_bound(longest, value_scale(loss, n) * magnitude) / max(abs(v), 1e-30)
                for n, v in result["ref64_metrics"].items()
            }
            ref_g, cp_g, ref64_g = worker.grads(reference), worker.grads(model), worker.grads(reference64)
            result["grad_rel"], result["grad_worst"] = worker.grad_diffs(cp_g, ref_g)
            result["grad_nonzero"] = all(float(g.abs().max()) > 0 for g in ref_g.values())
            result["grad_errors"] = relative_errors(cp_g, ref64_g)
            result["ref_grad_errors"] = relative_errors(ref_g, ref64_g)
            for twin in twins:
                twin.grad_errors = relative_errors(worker.grads(twin.model), ref64_g)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    result.update(
        ref_losses=ref_losses,
        cp_losses=cp_losses,
        ref64_losses=ref64_losses,
        loss_floors=floors,
        targets=[0] * 3,
    )
    result["fp32_twins"] = gather_twins({i: twin.result() for i, twin in zip(indices, twins, strict=True)})
    return result


class Fp32Twin:
    """One fp32 twin of the cp=1 reference of a preference case: its model, backend, dropout keys and results."""

    def __init__(self, spec: Any, reference: torch.nn.Module, case: dict, keyed: bool = True) -> None:
        self.spec = spec
        self.model = copy.deepcopy(reference)
        self.model.set_attn_implementation(spec.attn_implementation("sdpa"))
        self.backend = spec.backend(causal=True)
        # Exact LoRA dropout keyed as the reference's (``keyed``: where the reference's is)
        self.keys = use_exact_lora_dropout(self.model, seed=case["seed"]) if keyed else None
        self.steps: list | None = None  # the steps with this twin's precomputed reference sums
        self.losses: list[float] = []
        self.metrics: dict[str, float] = {}
        self.grad_errors: dict[str, float] = {}
        self.seconds = 0.0  # CPU seconds the twin costs (issue 26: its time budget)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around the twin's work: its order's context (sdpa's math backend), its time counted."""
        started = time.process_time()
        with self.spec.context():
            yield
        self.seconds += time.process_time() - started

    def run_step(
        self, flat_batches: list, step_pairs: torch.Tensor, loss: PreferenceLoss, first: bool
    ) -> None:
        """One step of the twin on whole rows (its own precomputed sums where it has them): its loss, and at the
        first step its metrics."""
        with self.running():
            twin_loss, twin_sums, _ = _run_step(
                self.model,
                self.backend,
                flat_batches,
                1,
                1,
                None,
                step_pairs,
                loss,
                logits_loss,
                self.keys,
                None,
            )
        self.losses.append(twin_loss)
        if first:
            self.metrics = {n: v / float(step_pairs) for n, v in twin_sums.items()}

    def result(self) -> dict:
        return {
            "name": self.spec.name,
            "losses": self.losses,
            "metrics": self.metrics,
            "grad_errors": self.grad_errors,
            "seconds": self.seconds,
        }
