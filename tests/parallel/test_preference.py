"""The preference losses: per-sequence sums, the per-pair loss, and equality with TRL's DPOTrainer at cp=1.

The CP parity of the same code (cp=2 against cp=1, with a bug planted in the cross-rank sum) runs in
the shared parity launch: tests/parallel/test_parity.py, ``PREFERENCE_CASES``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import tempfile

import pytest
import torch
import torch.nn.functional as F

from cptune.config.data import DatasetConfig
from cptune.data.collator import PackedCollator
from cptune.data.preference_formats import build_pair_formatter
from cptune.models.head_loss import logits_loss
from cptune.models.reference import adapter_disabled
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.collectives import differentiable_all_reduce_sum
from cptune.parallel.loss import head_token_loss_sum, token_loss_sum
from cptune.parallel.preference import (
    METRICS,
    PairBatch,
    PreferenceLoss,
    pair_forward,
    preference_step_loss,
)
from cptune.parallel.shard import shard_contiguous, shard_zigzag
from devtools.tiny import GENERIC_CORPUS, build_tiny_model, build_tiny_tokenizer, tiny_llama_config
from tests.conftest import REPO
from tests.numerics import (
    EPS32,
    draws_per_tensor,
    float64_scalar_twins_excess,
    float64_twins_excesses,
    relative_errors,
    reorder_bound,
)
from tests.token_orders import TWIN_ORDERS, token_order

TRL_VERSION = "1.16.0"
HAS_TRL = importlib.util.find_spec("trl") is not None


# --- the per-sequence sums ------------------------------------------------------------------------


def test_segment_sums_are_each_sequences_cross_entropy_sum_chunked_or_not():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 11, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 9), generator=generator)
    labels[0, :2] = labels[1, 7:] = -100
    ids = torch.tensor([[0] * 5 + [1] * 4, [2] * 3 + [3] * 6])
    per_token = F.cross_entropy(
        logits.reshape(-1, 11), labels.reshape(-1), reduction="none", ignore_index=-100
    )
    expected = torch.zeros(4, dtype=torch.float64).index_add(0, ids.reshape(-1), per_token)
    for chunk in (11 * 18, 11 * 4, 11):  # whole, in chunks of 4 tokens, token by token
        got = token_loss_sum(logits, labels, chunk_elements=chunk, segments=(ids, 4))
        assert torch.allclose(got, expected.float(), rtol=4 * 18 * EPS32), chunk  # bound: 18-term fp32 sums
    # The chunked head loss: the same sums from hidden states and the head.
    head = torch.nn.Linear(5, 11, bias=False).double()
    hidden = torch.randn(2, 9, 5, generator=generator, dtype=torch.float64)
    from_head = head_token_loss_sum(head, hidden, labels, 11, chunk_elements=11 * 3, segments=(ids, 4))
    from_logits = token_loss_sum(head(hidden), labels, segments=(ids, 4))
    assert torch.allclose(from_head, from_logits, rtol=4 * 18 * EPS32)
    # Without segments: the scalar of before, and the sum of the segments.
    assert torch.allclose(token_loss_sum(logits, labels), expected.sum().float(), rtol=4 * 18 * EPS32)


@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_shard_segments_number_each_token_of_a_shard_padded_to_split_evenly(split):
    # One pair as a row per side (5 and 3 tokens, padded to 5): torch's and DeepSpeed's sharders pad each row
    # to a multiple of cp (2·cp for zigzag); that padding has row -1 and columns past the rows' end.
    pair = {"input_ids": [5, 6, 7, 8, 9, 5, 6, 4], "labels": [-100, 6, 7, 8, 9, -100, 6, 4]}
    pair["position_ids"] = [0, 1, 2, 3, 4, 0, 1, 2]
    batch = PairBatch.from_inputs(PackedCollator(0, preference=True, pair_sides_in_own_rows=True)([pair]))
    whole = batch.sequence_ids
    for rank in range(2):
        shard = (shard_contiguous if split == "contiguous" else shard_zigzag)(batch.tokens, 2, rank, 0)
        ids, count = batch.shard_segments(shard.coords, shard.tokens.shift_labels)
        expected = [
            [int(whole[r, c]) if r >= 0 else -1 for r, c in zip(rows, columns, strict=True)]
            for rows, columns in zip(shard.coords.rows.tolist(), shard.coords.columns.tolist(), strict=True)
        ]
        assert count == 2 and ids.tolist() == expected
        assert (shard.coords.columns >= whole.shape[-1]).any() or (split == "contiguous" and rank == 0)


def test_the_differentiable_sum_is_the_tensor_itself_in_one_process():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = differentiable_all_reduce_sum(x)
    (y * torch.tensor([3.0, 4.0])).sum().backward()
    assert y.tolist() == [1.0, 2.0] and x.grad.tolist() == [3.0, 4.0]


# --- the per-pair loss -----------------------------------------------------------------------------


def test_pair_losses_are_the_dpo_and_ipo_formulas():
    policy = torch.tensor([-10.0, -12.0, -7.0, -6.5], dtype=torch.float64)
    reference = torch.tensor([-11.0, -11.5, -7.5, -6.0], dtype=torch.float64)
    targets = torch.tensor([4, 5, 2, 3])
    chosen, rejected = policy[0::2] - reference[0::2], policy[1::2] - reference[1::2]
    beta, eps = 0.2, 0.1
    s = beta * (chosen - rejected)
    sigmoid = torch.sigmoid
    dpo = PreferenceLoss("dpo", beta).pair_outputs(policy, reference, targets)
    assert torch.allclose(dpo.losses, -torch.log(sigmoid(s)))
    smoothed = PreferenceLoss("dpo", beta, eps).pair_outputs(policy, reference, targets)
    assert torch.allclose(smoothed.losses, -(1 - eps) * torch.log(sigmoid(s)) - eps * torch.log(sigmoid(-s)))
    ipo = PreferenceLoss("ipo", beta).pair_outputs(policy, reference, targets)
    x = chosen / targets[0::2] - rejected / targets[1::2]
    assert torch.allclose(ipo.losses, (x - 1 / (2 * beta)) ** 2)
    sums = dpo.metric_sums()
    assert torch.allclose(sums["rewards/chosen"], beta * chosen.sum())
    assert torch.allclose(sums["rewards/margins"], beta * (chosen - rejected).sum())
    assert sums["rewards/accuracies"] == float((chosen > rejected).sum())
    assert sums["logps/rejected"] == policy[1::2].sum()
    assert set(sums) == set(METRICS)


# --- equal to TRL at cp=1 --------------------------------------------------------------------------

PAIRS = [
    json.loads(line) for line in (REPO / "examples" / "data" / "preference.jsonl").read_text().splitlines()
]
BETA = 0.1


LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora_dropout": 0.0}


def _trl_trainer(rows, tokenizer, dtype, loss_type):
    """TRL's DPOTrainer on the tiny model (a fresh LoRA adapter), its adapter then moved off zero."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    model = build_tiny_model(tiny_llama_config(len(tokenizer)), seed=3).to(dtype)
    args = DPOConfig(
        output_dir=tempfile.mkdtemp(),
        beta=BETA,
        loss_type=[loss_type],
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=len(rows),
        seed=5,
    )
    lora = LoraConfig(**LORA)
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=lora,
    )
    # A fresh adapter's B is zero (policy = reference, rewards 0): set every LoRA weight, so the
    # policy differs from the reference and every adapter weight gets a gradient.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.3)
    return trainer


def _trl_step(trainer, rows, order=None):
    """TRL's loss, metrics and LoRA gradients of one batch of ``rows``; ``order``: the rows in another order
    (tests/token_orders.py), a twin of the step: the same function, its sums over the batch (the loss's and the
    metrics' means over pairs, each gradient's sum over the batch's tokens) in another order."""
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    batch = trainer.data_collator([trainer.train_dataset[int(i)] for i in token_order(len(rows), order)])
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    metrics = {name: trainer._metrics["train"][name][-1] for name in METRICS}
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return float(loss.detach()), metrics, grads


def adapter_copy(trainer, tokenizer) -> torch.nn.Module:
    """The tiny Llama (seed 3, as TRL's trainer got it) with a LoRA adapter holding the trainer's adapter weights,
    in fp32, in training mode."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_tiny_model(tiny_llama_config(len(tokenizer)), seed=3), LoraConfig(**LORA))
    adapter = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(adapter[name].float())
    return model.train()


def _cptune_step(trainer, rows, tokenizer, kind):
    """cptune's loss, metrics and LoRA gradients on the same pairs, the same base and adapter weights."""
    model = adapter_copy(trainer, tokenizer)
    format_row = build_pair_formatter(
        DatasetConfig(path="pairs", type="passthrough.default"), tokenizer, None, "pairs"
    )
    samples = [format_row(row) for row in rows]
    for sample, trl_row in zip(samples, trainer.train_dataset, strict=False):
        # The same tokens as TRL's tokenization of the same text.
        prompt, chosen, rejected = trl_row["prompt_ids"], trl_row["chosen_ids"], trl_row["rejected_ids"]
        assert sample.input_ids == prompt + chosen + prompt + rejected
    # All pairs packed into one row: four pairs, eight documents.
    packed = {"input_ids": [], "labels": [], "position_ids": []}
    for sample in samples:
        packed["input_ids"] += sample.input_ids
        packed["labels"] += sample.labels
        packed["position_ids"] += sample.position_ids
    batch = PairBatch.from_inputs(
        PackedCollator(pad_token_id=tokenizer.pad_token_id, preference=True)([packed])
    )
    outputs = pair_forward(
        model,
        model,
        LocalBackend(causal=True),
        logits_loss,
        batch,
        PreferenceLoss(kind, BETA),
        None,
        reference_context=adapter_disabled(model),
    )
    loss = preference_step_loss(outputs, torch.tensor(len(rows)), cp_size=1, gradient_divisor=1)
    loss.backward()
    metrics = {name: float(value) / len(rows) for name, value in outputs.metric_sums().items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    magnitude = float((outputs.chosen_logps.abs() + outputs.rejected_logps.abs()).mean())
    return float(loss), metrics, grads, magnitude, int(batch.target_counts().max())


def trl_twins_excesses(ours, twins32, trl64, longest: int, floor: float) -> dict[str, float]:
    """The twins rule (tests/numerics.py) on cptune's step ``ours`` = ``(loss, metrics, grads)`` against TRL's
    float64 step ``trl64``, TRL's fp32 step and its twins ``twins32`` (``_trl_step``'s orders) setting the limit.

    Floors against TRL's fp32 landing on float64 by luck: the log-prob metrics are sums of ``longest`` terms of
    one sign (Σ|terms| is the sum itself); the loss and the other metrics come from those sums times β (``floor``:
    their reorder bound, absolute); gradients, 2 ulps.
    """
    (loss, metrics, grads), (loss64, metrics64, grads64) = ours, trl64
    sums = reorder_bound(longest, 1.0)
    scalars = {"loss": (loss, [t[0] for t in twins32], loss64)}
    scalars |= {n: (metrics[n], [t[1][n] for t in twins32], metrics64[n]) for n in metrics64}
    draws = draws_per_tensor([t[2] for t in twins32])
    excesses = {  # a scalar takes the most distinct draws of any gradient tensor (tests/numerics.py)
        name: float64_scalar_twins_excess(
            abs(value - ref64) / abs(ref64),
            [abs(r - ref64) / abs(ref64) for r in refs32],
            sums if "logps" in name else floor / abs(ref64),
            max(draws.values()),
        )
        for name, (value, refs32, ref64) in scalars.items()
        if name != "rewards/accuracies"
    }
    twin_errors = [relative_errors(t[2], grads64) for t in twins32]
    return excesses | float64_twins_excesses(relative_errors(grads, grads64), twin_errors, draws=draws)


@pytest.mark.skipif(not HAS_TRL, reason=f"TRL is a test-only dependency (pip install trl=={TRL_VERSION})")
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_metrics_and_lora_gradients_equal_trls_dpo_trainer_at_cp1(loss_type):
    """cptune's DPO (TRL's ``sigmoid``) and IPO against TRL 1.16.0's DPOTrainer on the same 4 pairs and reference.

    The same tiny model and adapter weights; TRL tokenizes the text itself and cptune's passthrough.default
    gives the same tokens (asserted). TRL runs its own padded batch of 8 sequences; cptune packs the 4 pairs into
    one row of 8 documents. Tolerance, the twins rule (tests/numerics.py): TRL also runs in float64; cptune's fp32
    loss, each metric and each LoRA gradient tensor land at most 32x as far from TRL's float64 value as the farthest
    of TRL's own fp32 run and its 2 twins (the batch's rows in other orders, ``_trl_step``; wider where fewer of
    those are distinct, tests/numerics.py's ``TWINS_FACTORS``), plus a floor against those landing on float64 by
    luck: the reorder bound of the log-prob sums behind the value (the longest sequence's targets, the magnitude of
    the sums times β, relative to the value; 2 ulps for gradients).
    """
    import trl

    assert trl.__version__ == TRL_VERSION, f"written against TRL {TRL_VERSION}, found {trl.__version__}"
    tokenizer = build_tiny_tokenizer(GENERIC_CORPUS)
    rows = PAIRS[:4]
    trl32 = _trl_trainer(rows, tokenizer, torch.float32, loss_type)
    trl64 = _trl_trainer(rows, tokenizer, torch.float64, loss_type)
    twins32 = [_trl_step(trl32, rows, order) for order in (None, *TWIN_ORDERS)]
    loss32, metrics32, _ = twins32[0]
    loss64, metrics64, grads64 = _trl_step(trl64, rows)
    kind = "ipo" if loss_type == "ipo" else "dpo"  # TRL's sigmoid is rl: dpo
    loss, metrics, grads, magnitude, longest = _cptune_step(trl32, rows, tokenizer, kind)
    assert metrics["rewards/accuracies"] == metrics64["rewards/accuracies"] == metrics32["rewards/accuracies"]
    assert 0 < metrics64["rewards/accuracies"] < 1, "the adapter moves some pairs each way: a real test"

    floor = reorder_bound(longest, 2 * BETA * magnitude)
    excesses = trl_twins_excesses(
        (loss, metrics, grads), twins32, (loss64, metrics64, grads64), longest, floor
    )
    worst = max(excesses, key=excesses.get)
    print(
        f"{loss_type}: loss {loss:.9g} (TRL fp32 {loss32:.9g}, fp64 {loss64:.12g}); "
        f"worst {worst} at {excesses[worst]:.3g} of its tolerance"
    )
    assert excesses[worst] <= 1, (worst, excesses[worst])
    assert math.isfinite(loss) and len(grads) == len(grads64) > 0


# --- a full fine-tune against precomputed reference sums (precompute_ref_log_probs) ------------------


def _trl_full_trainer(rows, tokenizer, dtype):
    """TRL's DPOTrainer fully fine-tuning the tiny model with ``precompute_ref_log_probs`` (its reference sums
    computed at construction from the weights as built), the weights then moved so the policy differs."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model = build_tiny_model(tiny_llama_config(len(tokenizer)), seed=3).to(dtype)
    args = DPOConfig(
        output_dir=tempfile.mkdtemp(),
        beta=BETA,
        loss_type=["sigmoid"],
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=len(rows),
        precompute_ref_log_probs=True,
        seed=5,
    )
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    assert "ref_chosen_logps" in trainer.train_dataset.column_names
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=torch.float64).to(dtype) * 0.05)
    return trainer


def _cptune_full_step(trainer, rows, tokenizer):
    """cptune's loss, metrics and gradients with the reference sums computed from the model as built (cp=1)."""
    from cptune.run.training.reference_pass import precompute_reference, with_reference_column

    model = build_tiny_model(tiny_llama_config(len(tokenizer)), seed=3)
    format_row = build_pair_formatter(
        DatasetConfig(path="pairs", type="passthrough.default"), tokenizer, None, "pairs"
    )
    samples = [format_row(row) for row in rows]
    keys = ("input_ids", "labels", "position_ids")
    # Two rows of two pairs each, so the first pass and the training batch both hold several rows.
    stored = [{k: [v for s in samples[i : i + 2] for v in getattr(s, k)] for k in keys} for i in (0, 2)]
    from datasets import Dataset

    collate = PackedCollator(pad_token_id=tokenizer.pad_token_id, preference=True)
    sums = precompute_reference(
        stored,
        collate,
        model,
        LocalBackend(causal=True),
        logits_loss,
        rows_per_batch=1,
        dp_rank=0,
        dp_size=1,
        cp_group=None,
    )
    dataset = with_reference_column(Dataset.from_list(stored), sums)
    policy = {n: p for n, p in trainer.model.named_parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(policy[name].float())
    model.train()
    batch = PairBatch.from_inputs(collate([dataset[0], dataset[1]]))
    assert batch.reference_logps is not None and batch.reference_logps.shape == (8,)
    outputs = pair_forward(
        model, model, LocalBackend(causal=True), logits_loss, batch, PreferenceLoss("dpo", BETA), None
    )
    loss = preference_step_loss(outputs, torch.tensor(len(rows)), cp_size=1, gradient_divisor=1)
    loss.backward()
    metrics = {name: float(value) / len(rows) for name, value in outputs.metric_sums().items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    magnitude = float((outputs.chosen_logps.abs() + outputs.rejected_logps.abs()).mean())
    return float(loss), metrics, grads, magnitude, int(batch.target_counts().max())


@pytest.mark.skipif(not HAS_TRL, reason=f"TRL is a test-only dependency (pip install trl=={TRL_VERSION})")
def test_full_fine_tune_with_precomputed_reference_equals_trls_dpo_trainer_at_cp1():
    """A full fine-tune's DPO step against reference sums precomputed from the weights as built (cptune's
    precompute_ref_log_probs first pass) equals TRL 1.16.0's DPOTrainer with ``precompute_ref_log_probs=True``:
    the loss, the metrics and the gradient of every weight, by the twins rule of the LoRA test above (TRL also
    run in float64; cptune's fp32 values at most 32x as far from it as the farthest of TRL's fp32 values and
    its 2 twins' (wider where fewer of those are distinct), plus the reorder floor of the log-prob sums).

    One tensor is weaker than the rest: TRL's fused LM head (trl/kernels/chunked_logprob.py) projects and sums in
    fp32 tiles whatever the model's dtype, so TRL's float64 run has ``lm_head.weight``'s gradient only to fp32
    accuracy (its row-order twins differ there by about 6e-7 relative in float64, every other tensor by 2e-15).
    That noise is in each fp32 path's distance from it, the limit's included: a looser check of that tensor,
    not a false failure."""
    import trl

    assert trl.__version__ == TRL_VERSION, f"written against TRL {TRL_VERSION}, found {trl.__version__}"
    tokenizer = build_tiny_tokenizer(GENERIC_CORPUS)
    rows = PAIRS[:4]
    trl32, trl64 = (_trl_full_trainer(rows, tokenizer, dtype) for dtype in (torch.float32, torch.float64))
    twins32 = [_trl_step(trl32, rows, order) for order in (None, *TWIN_ORDERS)]
    loss32, metrics32, _ = twins32[0]
    loss64, metrics64, grads64 = _trl_step(trl64, rows)
    loss, metrics, grads, magnitude, longest = _cptune_full_step(trl32, rows, tokenizer)
    assert metrics["rewards/accuracies"] == metrics64["rewards/accuracies"] == metrics32["rewards/accuracies"]
    assert 0 < metrics64["rewards/accuracies"] < 1, "the moved weights move some pairs each way: a real test"

    floor = reorder_bound(longest, 2 * BETA * magnitude)
    excesses = trl_twins_excesses(
        (loss, metrics, grads), twins32, (loss64, metrics64, grads64), longest, floor
    )
    worst = max(excesses, key=excesses.get)
    print(
        f"full: loss {loss:.9g} (TRL fp32 {loss32:.9g}, fp64 {loss64:.12g}); worst {worst} at {excesses[worst]:.3g}"
    )
    assert excesses[worst] <= 1, (worst, excesses[worst])
    assert len(grads) == len(grads64) > 0
