"""Exact dropout: a token's mask depends on where it sits in the data, never on how its row is split."""

from __future__ import annotations

import pytest
import torch

from cptune.parallel.dropout import (
    DropoutKeys,
    TokenKeyedDropout,
    drop_mask,
    token_keys,
    use_exact_lora_dropout,
)
from cptune.parallel.shard import (
    TokenBatch,
    contiguous_coords,
    full_coords,
    shard_varlen,
    shard_zigzag,
)
from tests.parallel.unshard import unshard_contiguous, unshard_zigzag

SEED, P = 42, 0.1


def full_mask(rows: int, tokens: int, features: int, layer: int = 0, first_row: int = 0) -> torch.Tensor:
    coords = full_coords(torch.Size((rows, tokens)))
    keys = token_keys(SEED, coords.rows + first_row, coords.columns)
    return drop_mask(keys, layer, features, P).view(rows, tokens, features)


def shard_mask(coords, features: int, first_row: int = 0) -> torch.Tensor:
    keys = DropoutKeys(SEED)
    keys.set_coords(coords, first_row)
    x = torch.ones((*coords.rows.shape, features))
    return drop_mask(keys.keys_for(x), 0, features, P).view(x.shape)


def test_drop_rate_and_independence():
    mask = full_mask(4, 512, 96).float()
    assert mask.mean().item() == pytest.approx(P, abs=0.005)  # 196,608 elements: sd 0.0007
    # Neighbouring features, tokens and rows are not correlated (sd of each estimate ~0.004).
    flat = mask.reshape(-1, 96) - P
    for a, b in ((flat[:, :-1], flat[:, 1:]), (flat[:-1], flat[1:]), (mask[0] - P, mask[1] - P)):
        assert (a * b).mean().item() / (P * (1 - P)) == pytest.approx(0, abs=0.03)
    # Another layer, seed or row number draws other masks.
    assert (full_mask(4, 512, 96, layer=1).float() != mask).float().mean() > 0.15
    assert (full_mask(4, 512, 96, first_row=4).float() != mask).float().mean() > 0.15


def test_every_layout_draws_the_slice_of_the_cp1_mask():
    rows, tokens, features, cp = 3, 37, 16, 4
    expected = full_mask(rows, tokens, features, first_row=6)
    batch = TokenBatch(*(torch.zeros((rows, tokens), dtype=torch.long) for _ in range(3)))

    # varlen: rows laid end to end, padded to a multiple of cp, contiguous slices.
    parts = [shard_mask(shard_varlen(batch, cp, r, 0).coords, features, 6) for r in range(cp)]
    joined = unshard_contiguous(parts, dim=1)[0]
    assert torch.equal(joined[: rows * tokens].view(rows, tokens, features), expected)
    # zigzag (ring-flash-attn batch_zigzag, torch's load balancing): chunks r and 2C-1-r.
    parts = [shard_mask(shard_zigzag(batch, cp, r, 0).coords, features, 6) for r in range(cp)]
    assert torch.equal(unshard_zigzag(parts, dim=1)[:, :tokens], expected)
    # contiguous slices (torch without load balancing; DeepSpeed's Ulysses adapter).
    parts = [shard_mask(contiguous_coords(batch.shape, cp, r), features, 6) for r in range(cp)]
    assert torch.equal(unshard_contiguous(parts, dim=1)[:, :tokens], expected)
    # Data parallelism: group d's micro batch of one row is row d of the dp=1 batch of rows.
    for d in range(rows):
        assert torch.equal(shard_mask(full_coords(torch.Size((1, tokens))), features, 6 + d)[0], expected[d])


def test_module_drops_scales_and_passes_the_gradient_through_the_mask():
    keys = DropoutKeys(SEED)
    dropout = TokenKeyedDropout(P, layer=3, keys=keys)
    coords = full_coords(torch.Size((2, 5)))
    keys.set_coords(coords, first_row=0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = dropout(x)
    drop = drop_mask(token_keys(SEED, coords.rows, coords.columns), 3, 8, P).view(2, 5, 8)
    assert torch.equal(out, x.masked_fill(drop, 0) * (1 / (1 - P)))
    out.sum().backward()
    assert torch.equal(x.grad, (~drop).float() / (1 - P))
    # A recomputed forward (gradient checkpointing) draws the same mask.
    assert torch.equal(dropout(x), out)
    dropout.eval()
    assert dropout(x) is x


def test_refuses_inputs_that_are_not_the_batch_tokens_and_calls_outside_the_trainer():
    keys = DropoutKeys(SEED)
    dropout = TokenKeyedDropout(P, layer=0, keys=keys)
    with pytest.raises(RuntimeError, match="cptune's Trainer sets before each training forward"):
        dropout(torch.ones(1, 4, 8))
    keys.set_coords(full_coords(torch.Size((1, 4))), first_row=0)
    with pytest.raises(RuntimeError, match="does not hold the 4 tokens of the batch"):
        dropout(torch.ones(1, 6, 8))


def test_swaps_peft_lora_dropout_and_leaves_zero_dropout_alone():
    from peft import LoraConfig, get_peft_model

    from devtools.tiny import build_tiny_model, tiny_llama_config

    def lora(p: float):
        model = build_tiny_model(tiny_llama_config(64), seed=0)
        return get_peft_model(model, LoraConfig(r=2, lora_dropout=p, target_modules=["q_proj", "v_proj"]))

    model = lora(P)
    keys = use_exact_lora_dropout(model, SEED)
    swapped = [m for m in model.modules() if isinstance(m, TokenKeyedDropout)]
    assert keys is not None and len(swapped) == 4  # 2 layers x q_proj, v_proj
    assert [m.layer for m in swapped] == [0, 1, 2, 3] and all(m.keys is keys for m in swapped)
    assert not any(type(m) is torch.nn.Dropout for m in model.modules())
    assert use_exact_lora_dropout(lora(0.0), SEED) is None


def test_micro_batches_are_numbered_from_the_optimizer_step_so_resumed_runs_draw_the_same_masks():
    from cptune.parallel.backends.base import batch_number
    from cptune.parallel.backends.local.sharding import LocalBackend
    from cptune.run.training.trainer import MicroBatchCounter

    counter = MicroBatchCounter()
    assert [counter.next(step, accumulation=2) for step in (0, 0, 1, 1, 2)] == [0, 1, 2, 3, 4]
    resumed = MicroBatchCounter()  # a run resumed at optimizer step 1
    assert [resumed.next(step, accumulation=2) for step in (1, 1, 2)] == [2, 3, 4]
    # accelerate gives batch n*dp + d to data-parallel group d as its n-th micro batch.
    backend = LocalBackend(causal=True)
    assert [batch_number(backend, n, dp_rank=1, dp_size=2) for n in range(3)] == [1, 3, 5]
