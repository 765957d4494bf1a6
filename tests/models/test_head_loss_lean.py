"""The lean loss phase of the chunked loss: the final norm inside each chunk, the kept rows gathered per chunk.

Against the chunked loss as it was before (``todays_head_loss``: the model's final norm over the
whole sequence, the kept rows copied out by a boolean index, then the same chunks), in fp32 and in
bf16 under autocast: the same losses and gradients bit for bit -- the same operations per token,
the same chunks. One sum changes order: a trained final norm's weight gradient (a full fine-tune),
summed over the whole sequence at once before and chunk by chunk now; its bound is stated below.
And the memory it was for: the loss keeps nothing of the sequence's size for its backward, and its
backward's peak is the gradient it hands back (benchmarks/loss_phase.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from cptune.models.autocast_state import AutocastState
from cptune.models.head_loss import HeadLoss
from cptune.parallel.row_gather import RowGather
from tests.models import test_memory_features as fp32_case
from tests.models import test_memory_features_bf16 as bf16_case
from tests.models.test_memory_features import TARGETS, TOKENS, VOCAB, step
from tests.numerics import assert_within, reorder_bound

NORM_WEIGHT = "model.norm.weight"


def todays_head_loss(chunk_elements: int):
    """The chunked loss before the lean loss phase (commit fe26f61), as a shard loss function."""

    def loss(model: torch.nn.Module, model_kwargs: dict, shift_labels: torch.Tensor):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        head, seen = base.get_output_embeddings(), {}

        def keep(module, args, output):
            seen["hidden"] = output.last_hidden_state
            seen["autocast"] = AutocastState.capture(output.last_hidden_state.device)

        handle = base.get_decoder().register_forward_hook(keep)
        try:
            outputs = model(**model_kwargs, use_cache=False, logits_to_keep=1)
        finally:
            handle.remove()
        hidden = seen["hidden"]
        flat_labels = shift_labels.reshape(-1)
        kept = flat_labels != -100
        rows, labels = hidden.reshape(-1, hidden.shape[-1])[kept], flat_labels[kept]
        size = max(1, chunk_elements // VOCAB)

        def chunk(x, y):
            return F.cross_entropy(head(x).float(), y, ignore_index=-100, reduction="sum")

        with seen["autocast"].entered():
            parts = [
                checkpoint(chunk, x, y, use_reentrant=False)
                for x, y in zip(rows.split(size), labels.split(size), strict=True)
            ]
        return torch.stack(parts).sum(), outputs

    return loss


CASES = [(True, "all-linear", False), (False, None, False), (True, ["q_proj", "lm_head"], False)]
CASES += [(False, None, True)]


@pytest.mark.parametrize("chunk_tokens", [None, 5], ids=["default-chunks", "chunks-of-5"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("lora", "targets", "tied"), CASES, ids=["lora", "full", "lora-on-lm-head", "full-tied-embeddings"]
)
def test_lean_loss_phase_is_bit_identical_to_todays(lora, targets, tied, bf16, chunk_tokens):
    build = (bf16_case if bf16 else fp32_case).build
    probe = HeadLoss(build(lora, targets=targets, tie_word_embeddings=tied))
    chunk_elements = chunk_tokens * VOCAB if chunk_tokens else probe.chunk_elements
    before = step(build(lora, targets=targets, tie_word_embeddings=tied), todays_head_loss(chunk_elements))
    model = build(lora, targets=targets, tie_word_embeddings=tied)
    head_loss = HeadLoss(model, chunk_elements)
    assert head_loss.norm is model.get_base_model().model.norm if lora else model.model.norm
    lean = step(model, head_loss)
    assert torch.equal(lean[0], before[0]), (lean[0], before[0])
    differ = [n for n, g in before[1].items() if n != NORM_WEIGHT and not torch.equal(lean[1][n], g)]
    assert not differ, f"not bit-identical: {differ}"
    if NORM_WEIGHT in before[1]:
        # Bound: the norm's weight gradient is a sum over the 68 target tokens (the others add zeros),
        # accumulated in fp32 by torch's reductions and rounded to the weight's dtype; now in `chunks`
        # parts, each rounded, added in that dtype. Before: one rounding; now one per part and per
        # addition: at most chunks + 1 roundings of Σ|terms| in that dtype (as for the tiles of
        # test_memory_features_bf16.py), plus two fp32 accumulations in other orders.
        dtype = torch.bfloat16 if bf16 else torch.float32
        chunks = -(-TARGETS // max(1, chunk_elements // VOCAB))
        magnitude = norm_weight_magnitude(build(lora, checkpointing=False, tie_word_embeddings=tied))
        limit = reorder_bound(chunks + 1, magnitude, dtype) + reorder_bound(2 * TOKENS, magnitude)
        assert_within(lean[1][NORM_WEIGHT], before[1][NORM_WEIGHT], limit, "final norm's weight gradient")


def norm_weight_magnitude(model: torch.nn.Module) -> torch.Tensor:
    """Σ over tokens of |grad_output · normalised input|: Σ|terms| of the final norm's weight gradient, in float64."""
    norm, seen = model.model.norm, {}

    def keep(module, args, output):
        x = args[0].float()
        normalised = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).to(x.dtype)
        output.register_hook(lambda grad: seen.update(terms=(grad.double() * normalised.double()).abs()))

    handle = norm.register_forward_hook(keep)
    step(model)
    handle.remove()
    return seen["terms"].reshape(-1, seen["terms"].shape[-1]).sum(0)


def test_row_gather_matches_a_boolean_index_and_hands_back_one_gradient():
    """Rows and gradients bit for bit those of ``source[kept]``; the gradient is one buffer, zeros elsewhere."""
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(12, 4, generator=generator, requires_grad=True)
    weight = torch.randn(4, 3, generator=generator)
    kept = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 0], dtype=torch.bool)
    positions = kept.nonzero().squeeze(1)
    (source[kept] @ weight).square().sum().backward()
    expected, source.grad = source.grad, None
    gather = RowGather()
    tracked = gather.track(source)

    def part(tracked, at):
        return (gather.rows(tracked, at) @ weight).square().sum()

    parts = [checkpoint(part, tracked, at, use_reentrant=False) for at in positions.split(3)]
    assert torch.equal(
        torch.stack([p.detach() for p in parts]), torch.stack([part(source, at) for at in positions.split(3)])
    )
    torch.stack(parts).sum().backward()
    assert torch.equal(source.grad, expected)
    assert gather._grad is None  # handed on, not kept


def test_the_loss_phase_keeps_nothing_of_the_sequences_size():
    """The 8B-shaped scaled model of benchmarks/loss_phase.py (hidden 512, bf16), per token between 512 and 1,024 tokens.

    Bound: the loss keeps per token only integers -- the targets' positions and labels (int64), their
    mask -- and each chunk's scalars and checkpoint state, spread over its 128 tokens: under an eighth
    of one bf16 row of the hidden states (1,024 bytes), so a tensor of the hidden width kept per token
    fails. Its peak adds the gradient it hands back to the last layer, one bf16 row per token. Before
    the lean loss phase: 2,100 bytes held and 11,264 at the peak per token.
    """
    from benchmarks.loss_phase import SHAPE, measure, per_token

    slope = per_token(measure(512, chunk_tokens=128), measure(1024, chunk_tokens=128))
    row = 2 * SHAPE["hidden_size"]
    assert slope["held"] <= row / 8, slope
    assert slope["peak"] <= row + row / 8, slope
