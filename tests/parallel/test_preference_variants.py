"""The reference-free preference losses (``rl: orpo``, ``rl: simpo``): their formulas, and TRL's trainers at cp=1.

Their CP parity (cp=2, cp=4, dp2xcp2 against cp=1, and a bug planted in the cross-rank target count) runs
in the shared parity launches: tests/parallel/test_parity.py and test_ulysses_parity.py.
"""

from __future__ import annotations

import decimal
import importlib.util
import math
import tempfile

import pytest
import torch
import torch.nn.functional as F

from cptune.config.data import DatasetConfig
from cptune.data.collator import PackedCollator
from cptune.data.preference_formats import build_pair_formatter
from cptune.models.head_loss import logits_loss
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.preference import (
    METRICS,
    PairBatch,
    PreferenceLoss,
    log1mexp,
    pair_forward,
    preference_step_loss,
)
from devtools.tiny import GENERIC_CORPUS, build_tiny_model, build_tiny_tokenizer, tiny_llama_config
from tests.numerics import (
    draws_per_tensor,
    float64_scalar_twins_excess,
    float64_twins_excesses,
    relative_errors,
    reorder_bound,
)
from tests.parallel.reorder_twins import sdpa_twin_runs
from tests.parallel.test_preference import LORA, PAIRS, TRL_VERSION, adapter_copy

HAS_TRL = importlib.util.find_spec("trl") is not None
needs_trl = pytest.mark.skipif(
    not HAS_TRL, reason=f"TRL is a test-only dependency (pip install trl=={TRL_VERSION})"
)

SUMS = torch.tensor([-10.0, -12.0, -7.0, -6.5], dtype=torch.float64)
COUNTS = torch.tensor([4, 5, 2, 3])


def test_simpo_is_the_margin_loss_of_per_token_means_plus_the_chosen_nll():
    beta, gamma, alpha = 2.0, 0.6, 0.7
    means = SUMS / COUNTS
    chosen, rejected = means[0::2], means[1::2]
    out = PreferenceLoss("simpo", beta, simpo_gamma=gamma, cpo_alpha=alpha).pair_outputs(SUMS, None, COUNTS)
    want = -torch.log(torch.sigmoid(beta * (chosen - rejected) - gamma)) - alpha * chosen
    assert torch.allclose(out.losses, want)
    plain = PreferenceLoss("simpo", beta, simpo_gamma=gamma, cpo_alpha=0.0).pair_outputs(SUMS, None, COUNTS)
    assert torch.allclose(plain.losses, want + alpha * chosen)
    sums = out.metric_sums()
    assert torch.allclose(sums["rewards/chosen"], beta * chosen.sum())
    assert torch.allclose(sums["logps/rejected"], rejected.sum())
    assert torch.allclose(sums["nll_loss"], -chosen.sum())
    assert set(sums) == {*METRICS, "nll_loss"}


def test_orpo_is_the_chosen_nll_minus_lambda_log_sigmoid_of_the_log_odds():
    lam = 0.25
    means = SUMS / COUNTS
    chosen, rejected = means[0::2], means[1::2]
    out = PreferenceLoss("orpo", lam).pair_outputs(SUMS, None, COUNTS)
    odds = lambda m: torch.exp(m) / (1 - torch.exp(m))  # noqa: E731 - the odds of the mean token probability
    log_odds = torch.log(odds(chosen) / odds(rejected))
    assert torch.allclose(out.losses, -chosen - lam * torch.log(torch.sigmoid(log_odds)))
    sums = out.metric_sums()
    assert torch.allclose(sums["log_odds_chosen"], log_odds.sum())
    assert torch.allclose(sums["log_odds_ratio"], torch.log(torch.sigmoid(log_odds)).sum())
    assert torch.allclose(sums["rewards/margins"], lam * (chosen - rejected).sum())


def test_log1mexp_is_accurate_on_both_sides_of_minus_log_2():
    x = torch.tensor([-1e-10, -1e-3, -0.5, -math.log(2), -0.9, -5.0, -40.0], dtype=torch.float64)
    with decimal.localcontext() as exact:  # 50 digits: the reference of log(1 - e^x) itself
        exact.prec = 50
        want = [float((1 - decimal.Decimal(v).exp()).ln()) for v in x.tolist()]
    assert torch.allclose(log1mexp(x), torch.tensor(want, dtype=torch.float64), rtol=4 * 2.0**-52, atol=0)
    # float32 near 0: log(1 - exp(x)) computed naively loses every digit (exp(-1e-7) rounds to 1).
    assert torch.isfinite(log1mexp(torch.tensor([-1e-7]))).all()


# --- equal to TRL at cp=1 --------------------------------------------------------------------------

BETA = 0.1


def _trl_trainer(kind, rows, tokenizer, dtype, **loss_args):
    """TRL's CPOTrainer (``loss_type="simpo"``) or ORPOTrainer on the tiny model with a LoRA adapter moved off zero."""
    from datasets import Dataset
    from peft import LoraConfig

    if kind == "simpo":
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer

        loss_args = {"loss_type": "simpo", **loss_args}
    else:
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    model = build_tiny_model(tiny_llama_config(len(tokenizer)), seed=3).to(dtype)
    args = Config(
        output_dir=tempfile.mkdtemp(),
        beta=BETA,
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=len(rows),
        max_length=4096,
        remove_unused_columns=False,
        seed=5,
        **loss_args,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every LoRA weight off its initial value, so every one gets a gradient
        for name, param in trainer.model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.3)
    return trainer


def _trl_step(trainer, rows, names):
    """TRL's loss, metrics (``names``) and LoRA gradients of one batch of ``rows``."""
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return float(loss.detach()), {n: float(metrics[n]) for n in names}, grads


def _trl_twin_steps(trainer, rows, names):
    """``_trl_step`` of TRL's fp32 trainer and of its twins, each ``(loss, metrics, grads)``: sdpa's math
    backend and sdpa over the tokens in a strided order for the reference's sdpa (tests/parallel/reorder_twins.py's
    ``sdpa_twin_runs``), the same function with attention's sums in other orders. Not the batch's rows in other
    orders (tests/parallel/test_preference.py's twins): the SimPO case of one pair has one row."""
    return [
        _trl_step(trainer, rows, names),
        *sdpa_twin_runs(trainer.model, lambda: _trl_step(trainer, rows, names)),
    ]


def _cptune_step(trainer, rows, tokenizer, loss):
    """cptune's loss, metrics and LoRA gradients on the same pairs (one packed row), base and adapter weights."""
    model = adapter_copy(trainer, tokenizer)
    format_row = build_pair_formatter(
        DatasetConfig(path="pairs", type="passthrough.default"), tokenizer, None, "pairs"
    )
    packed = {"input_ids": [], "labels": [], "position_ids": []}
    for row, trl_row in zip(rows, trainer.train_dataset, strict=False):
        sample = format_row(row)
        # The same tokens as TRL's tokenization of the same text.
        assert sample.input_ids == trl_row["chosen_input_ids"] + trl_row["rejected_input_ids"]
        for key in packed:
            packed[key] += getattr(sample, key)
    batch = PairBatch.from_inputs(
        PackedCollator(pad_token_id=tokenizer.pad_token_id, preference=True)([packed])
    )
    outputs = pair_forward(model, model, LocalBackend(causal=True), logits_loss, batch, loss, None)
    step = preference_step_loss(outputs, torch.tensor(len(rows)), cp_size=1, gradient_divisor=1)
    step.backward()
    metrics = {name: float(value) / len(rows) for name, value in outputs.metric_sums().items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return float(step.detach()), metrics, grads, int(batch.target_counts().max())


def _excesses(scalars, longest, scale, draws: int):
    """The twins rule of tests/parallel/test_preference.py on each scalar (see the test's docstring); ``scalars``:
    name -> (cptune's value, [TRL's fp32 value and its twins'], TRL's float64 value); ``draws``: the most distinct
    draws of any gradient tensor among those runs (tests/numerics.py's ``float64_scalar_twins_excess``)."""

    def rel(a: float, b: float) -> float:
        return abs(a - b) / abs(b)

    # Floor: the reorder bound of a per-token mean (Σ|terms| / n = |mean|, over the longest sequence's targets),
    # times the value's scale, relative to the value.
    return {
        name: float64_scalar_twins_excess(
            rel(ours, ref64),
            [rel(ref32, ref64) for ref32 in refs32],
            reorder_bound(longest, scale(name)) / max(abs(ref64), 1e-30),
            draws,
        )
        for name, (ours, refs32, ref64) in scalars.items()
        if name != "rewards/accuracies"
    }


@needs_trl
@pytest.mark.parametrize(
    ("pairs", "cpo_alpha"),
    # cpo_alpha 0: SimPO alone, 4 pairs in a batch. cpo_alpha 1 (TRL's and Axolotl's default): TRL's NLL term is
    # one token-mean over its batch's chosen tokens and cptune's a mean over pairs of each pair's token-mean,
    # the same for a batch of one pair; pairs 2 and 3 have chosen sides of unequal length (the means differ).
    [(4, 0.0), (1, 1.0)],
)
def test_simpo_loss_metrics_and_lora_gradients_equal_trls_cpo_trainer_at_cp1(pairs, cpo_alpha):
    """cptune's rl: simpo against TRL 1.16.0's CPOTrainer (``loss_type="simpo"``) on the shipped pairs.

    The same tiny model, adapter weights and tokens (asserted). Tolerance, the twins rule (tests/numerics.py) as in
    the DPO comparison: TRL also runs in float64; cptune's fp32 loss, each metric and each LoRA gradient tensor land
    at most 32x as far from TRL's float64 value as the farthest of TRL's own fp32 run and its 2 twins
    (``_trl_twin_steps``; wider where fewer of those are distinct, ``TWINS_FACTORS``), plus a floor (the reorder
    bound of the per-token means behind the value; 2 ulps for gradients).
    """
    import trl

    assert trl.__version__ == TRL_VERSION, f"written against TRL {TRL_VERSION}, found {trl.__version__}"
    tokenizer = build_tiny_tokenizer(GENERIC_CORPUS)
    rows = PAIRS[:pairs] if pairs > 1 else PAIRS[2:3]
    gamma = 0.3
    names = (*METRICS, "nll_loss") if cpo_alpha else METRICS  # TRL logs nll_loss 0 without the NLL term
    loss_args = {"simpo_gamma": gamma, "cpo_alpha": cpo_alpha}
    trl32 = _trl_trainer("simpo", rows, tokenizer, torch.float32, **loss_args)
    trl64 = _trl_trainer("simpo", rows, tokenizer, torch.float64, **loss_args)
    twins32 = _trl_twin_steps(trl32, rows, names)
    metrics32 = twins32[0][1]
    loss64, metrics64, grads64 = _trl_step(trl64, rows, names)
    ours = PreferenceLoss("simpo", BETA, simpo_gamma=gamma, cpo_alpha=cpo_alpha)
    loss, metrics, grads, longest = _cptune_step(trl32, rows, tokenizer, ours)
    assert metrics["rewards/accuracies"] == metrics64["rewards/accuracies"] == metrics32["rewards/accuracies"]
    if pairs > 1:
        assert 0 < metrics64["rewards/accuracies"] < 1, "the adapter moves some pairs each way: a real test"
    magnitude = max(abs(metrics64["logps/chosen"]), abs(metrics64["logps/rejected"]))
    scalars = {"loss": (loss, [t[0] for t in twins32], loss64)}
    scalars |= {n: (metrics[n], [t[1][n] for t in twins32], metrics64[n]) for n in names}
    draws = draws_per_tensor([t[2] for t in twins32])
    excesses = _excesses(
        scalars, longest, lambda n: magnitude * (BETA if "rewards" in n else 1.0), max(draws.values())
    )
    twin_errors = [relative_errors(t[2], grads64) for t in twins32]
    excesses |= float64_twins_excesses(relative_errors(grads, grads64), twin_errors, draws=draws)
    worst = max(excesses, key=excesses.get)
    print(
        f"simpo pairs={pairs} cpo_alpha={cpo_alpha}: loss {loss:.9g} (TRL fp32 {twins32[0][0]:.9g}, "
        f"fp64 {loss64:.12g}); "
        f"|ours - TRL fp64| / TRL fp64 = {abs(loss - loss64) / abs(loss64):.3g}; "
        f"worst {worst} at {excesses[worst]:.3g} of its tolerance"
    )
    assert excesses[worst] <= 1, (worst, excesses[worst], scalars.get(worst))
    assert math.isfinite(loss) and len(grads) == len(grads64) > 0


@needs_trl
def test_orpo_metrics_equal_trls_orpo_trainer_at_cp1():
    """cptune's rl: orpo against TRL 1.16.0's ORPOTrainer on 4 shipped pairs: the rewards, log-probs and the odds
    ratio's metrics (``log_odds_ratio``, ``log_odds_chosen``), same rule as above.

    The loss and gradients are not compared: TRL's ORPO NLL is one token-mean over the prompt and the
    response of every chosen sequence of the batch, cptune's the mean over pairs of each chosen response's
    own token-mean (the prompt is never trained, as in every rl of cptune; docs/preference-training.md).
    The odds-ratio term's share of both is checked instead: TRL's loss minus its nll_loss against cptune's
    loss minus its nll_loss.
    """
    import trl

    assert trl.__version__ == TRL_VERSION, f"written against TRL {TRL_VERSION}, found {trl.__version__}"
    tokenizer = build_tiny_tokenizer(GENERIC_CORPUS)
    rows = PAIRS[:4]
    names = (*METRICS, "log_odds_ratio", "log_odds_chosen", "nll_loss")
    trl32 = _trl_trainer("orpo", rows, tokenizer, torch.float32)
    trl64 = _trl_trainer("orpo", rows, tokenizer, torch.float64)
    twins32 = _trl_twin_steps(trl32, rows, names)
    loss64, metrics64, _ = _trl_step(trl64, rows, names)
    loss, metrics, _, longest = _cptune_step(trl32, rows, tokenizer, PreferenceLoss("orpo", BETA))
    assert metrics["rewards/accuracies"] == metrics64["rewards/accuracies"]
    assert 0 < metrics64["rewards/accuracies"] < 1, "the adapter moves some pairs each way: a real test"
    odds_terms32 = [loss32 - metrics32["nll_loss"] for loss32, metrics32, _ in twins32]
    scalars = {
        "odds ratio term": (loss - metrics["nll_loss"], odds_terms32, loss64 - metrics64["nll_loss"]),
        **{n: (metrics[n], [t[1][n] for t in twins32], metrics64[n]) for n in names[:-1]},
    }
    magnitude = max(abs(metrics64["logps/chosen"]), abs(metrics64["logps/rejected"]))
    # The log odds amplify a mean's error by at most 1/(1 - e^m) on each side (d/dm of m - log(1 - e^m)).
    amplify = 2 / (1 - math.exp(-magnitude))
    draws = max(draws_per_tensor([t[2] for t in twins32]).values())
    excesses = _excesses(
        scalars,
        longest,
        lambda n: magnitude * (1.0 if "logps" in n else BETA if "rewards" in n else amplify),
        draws,
    )
    worst = max(excesses, key=excesses.get)
    print(
        f"orpo: worst {worst} at {excesses[worst]:.3g} of its tolerance; TRL nll {metrics64['nll_loss']:.9g}"
    )
    assert excesses[worst] <= 1, (worst, excesses[worst], scalars.get(worst))
    assert F.logsigmoid(torch.tensor(metrics64["log_odds_chosen"])) < 0
