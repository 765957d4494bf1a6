"""The deepspeed backend's single-process parts: each rank's slice of a batch, attention, checks, config."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cptune.errors import CptuneError
from cptune.parallel.backends.attention import ATTENTION_KWARG, AttentionCall
from cptune.parallel.backends.deepspeed_ulysses.sharding import (
    DeepSpeedUlyssesBackend,
    check_heads,
    deepspeed_config,
)
from cptune.parallel.backends.document_attention import dense_attend, document_attention_forward
from cptune.parallel.backends.local.sharding import document_mask
from cptune.parallel.shard import TokenBatch
from tests.numerics import assert_float64_twins_rule
from tests.token_orders import (
    TWIN_ORDERS,
    assert_distinct_draws,
    assert_legal_twin,
    put_back,
    take_features,
    token_order,
)

PACKED_POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])


def masked(q, k, v, causal, order=None):
    """SDPA over each whole row of PACKED_POSITIONS with its documents' mask, (batch, tokens, heads, head_dim);
    ``order``: a twin's (tests/token_orders.py), the tokens and the head's features taken in that order and the
    output put back."""
    mask = document_mask(PACKED_POSITIONS)
    if causal:
        mask = mask & torch.ones(11, 11, dtype=torch.bool).tril()
    tokens = token_order(11, order)
    features, (q, k, v) = take_features(order, q[:, :, tokens], k[:, :, tokens], v[:, :, tokens])
    mask = mask[:, :, tokens][..., tokens]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    return put_back(put_back(out, tokens, 2), features, -1).transpose(1, 2)


def with_grads(out, inputs):
    grads = torch.autograd.grad(out.square().sum(), inputs)
    return {"out": out, **dict(zip(("dq", "dk", "dv"), grads, strict=True))}


def masked_references(leaves32, causal):
    """fp32 SDPA over the masked rows in the tokens' own order and 2 others: a reference and its twins."""
    return [with_grads(masked(*leaves32, causal, order), leaves32) for order in (None, *TWIN_ORDERS)]


@pytest.mark.parametrize("causal", [True, False])
def test_document_attention_equals_masked_attention_over_each_row(causal):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 11, 8, requires_grad=True)  # (batch, heads, tokens, head_dim), GQA 4 -> 2
    k = torch.randn(2, 2, 11, 8, requires_grad=True)
    v = torch.randn(2, 2, 11, 8, requires_grad=True)
    call = AttentionCall(attend=dense_attend(causal))
    kwargs = {ATTENTION_KWARG: call, "position_ids": PACKED_POSITIONS}
    out, _ = document_attention_forward(None, q, k, v, None, scaling=0.3, **kwargs)
    assert call.layers_served == 1
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    # Twins rule: per document, or over the masked row in 3 token orders (the references), the same sums in
    # other orders.
    references = masked_references((q, k, v), causal)
    assert_float64_twins_rule(
        with_grads(out, (q, k, v)), references, with_grads(masked(*leaves64, causal), leaves64)
    )


@pytest.mark.parametrize("causal", [True, False])
def test_the_masked_twins_compute_the_reference_function_in_another_order(causal):
    """``masked``'s twins (tests/token_orders.py) are legal: the same function, a noise of their own in every tensor
    (``assert_distinct_draws``)."""
    torch.manual_seed(0)
    leaves64 = [torch.randn(2, n, 11, 8, dtype=torch.float64, requires_grad=True) for n in (4, 2, 2)]
    leaves32 = [t.detach().float().requires_grad_() for t in leaves64]
    ref32, *twins32 = masked_references(leaves32, causal)
    ref64, *twins64 = (with_grads(masked(*leaves64, causal, o), leaves64) for o in (None, *TWIN_ORDERS))
    for order, twin64, twin32 in zip(TWIN_ORDERS, twins64, twins32, strict=True):
        assert_legal_twin(twin64, ref64, twin32, ref32, what=order)
    assert_distinct_draws([ref32, *twins32])


def test_document_attention_refuses_calls_without_metadata_or_with_a_mask():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(CptuneError, match="position_ids and per-batch metadata"):
        document_attention_forward(None, q, q, q, None)
    call = AttentionCall(attend=dense_attend(True))
    with pytest.raises(CptuneError, match="bug in cptune"):
        document_attention_forward(
            None,
            q,
            q,
            q,
            torch.ones(1, 1, 4, 4),
            **{ATTENTION_KWARG: call, "position_ids": torch.arange(4)[None]},
        )


def backend(core: str = "sdpa", cp_rank: int = 1, micro_batch_size: int = 2) -> DeepSpeedUlyssesBackend:
    return DeepSpeedUlyssesBackend(
        core_attention=core,
        causal=True,
        cp_size=2,
        cp_rank=cp_rank,
        micro_batch_size=micro_batch_size,
        pad_token_id=0,
    )


def test_each_rank_gets_its_contiguous_slice_of_every_row_padded_to_a_multiple_of_cp():
    ids = torch.arange(10, 20).reshape(2, 5)
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    labels = torch.tensor([[11, 12, -100, 14, -100], [16, 17, 18, 19, -100]])
    sharded = backend(cp_rank=1).shard(TokenBatch(ids, positions, labels))
    # Rows padded to 6 tokens (the padding a document of its own, no targets); rank 1 holds tokens 3-5.
    assert sharded.model_kwargs["input_ids"].tolist() == [[13, 14, 0], [18, 19, 0]]
    assert sharded.model_kwargs["position_ids"].tolist() == [[0, 1, 0], [3, 4, 0]]
    assert sharded.shift_labels.tolist() == [[14, -100, -100], [19, -100, -100]]
    assert sharded.call is None  # sdpa: no cptune metadata
    # Where each token sits in the batch, for exact dropout: the padding is nowhere.
    assert sharded.coords.rows.tolist() == [[0, 0, -1], [1, 1, -1]]
    assert sharded.coords.columns.tolist() == [[3, 4, 5], [3, 4, 5]]
    # Every rank of a CP group trains the group's batches, in accelerate's order (as ring-flash-attn).
    assert [backend().batch_number(n, dp_rank=1, dp_size=2) for n in range(3)] == [1, 3, 5]
    assert ATTENTION_KWARG in backend("cptune").shard(TokenBatch(ids, positions, labels)).model_kwargs


def test_a_short_batch_gets_rows_of_padding_up_to_the_micro_batch_size():
    """DeepSpeed's Ulysses module reshapes with the micro batch size; the last evaluation batch may be short."""
    one_row = TokenBatch(torch.arange(1, 5)[None], torch.arange(4)[None], torch.tensor([[2, 3, 4, -100]]))
    sharded = backend(cp_rank=0, micro_batch_size=3).shard(one_row)
    assert sharded.model_kwargs["input_ids"].tolist() == [[1, 2], [0, 0], [0, 0]]
    assert sharded.model_kwargs["position_ids"].tolist() == [[0, 1], [0, 1], [0, 1]]
    assert (sharded.shift_labels[1:] == -100).all()
    assert sharded.coords.rows.tolist() == [[0, 0], [-1, -1], [-1, -1]]


def text_config(heads=4, kv_heads=2, **extra):
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, **extra)


def test_heads_must_split_evenly_and_the_message_says_what_to_choose():
    check_heads(text_config(), 2, "cptune")
    check_heads(text_config(), 4, "cptune")  # 2 key/value heads replicated over 4 ranks
    with pytest.raises(CptuneError, match=r"does not divide the model's 4 query heads.*\[2, 4\]"):
        check_heads(text_config(), 3, "cptune")
    with pytest.raises(
        CptuneError, match=r"neither divides nor is a multiple of the model's 3 key/value heads"
    ):
        check_heads(text_config(heads=6, kv_heads=3), 2, "cptune")


def test_sliding_window_layers_need_a_core_attention_that_takes_the_window():
    windowed = text_config(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    with pytest.raises(CptuneError, match="sdpa cannot compute exactly: DeepSpeed's Ulysses wrapper drops"):
        check_heads(windowed, 2, "sdpa")
    with pytest.raises(CptuneError, match="sliding windows are causal only"):
        check_heads(windowed, 2, "cptune", causal=False)
    check_heads(windowed, 2, "cptune")  # causal windows within documents (document_attention)
    check_heads(windowed, 2, "flash_attention_2")


def recipe(**keys):
    base = {"deepspeed": None, "zero_stage": None, "micro_batch_size": 2, "gradient_accumulation_steps": 1}
    return SimpleNamespace(**{**base, "max_grad_norm": 1.0, **keys})


def test_deepspeed_config_defaults_to_zero_0_and_leaves_recipe_values_to_the_trainer():
    config = deepspeed_config(recipe())
    assert config["zero_optimization"] == {"stage": 0}
    assert config["train_micro_batch_size_per_gpu"] == config["gradient_clipping"] == "auto"
    assert deepspeed_config(recipe(zero_stage=2))["zero_optimization"]["stage"] == 2


def test_deepspeed_json_is_merged_and_checked_against_the_recipe(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"zero_optimization": {"stage": 3, "overlap_comm": True}, "gradient_clipping": 1.0})
    )
    config = deepspeed_config(recipe(deepspeed=str(path)))
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    with pytest.raises(CptuneError, match=r"contradicts zero_optimization\.stage: 3"):
        deepspeed_config(recipe(deepspeed=str(path), zero_stage=2))
    for bad, message in [
        ({"train_micro_batch_size_per_gpu": 4}, "micro_batch_size is 2"),
        ({"optimizer": {"type": "Adam"}}, "'optimizer' section"),
        ({"train_batch_size": 16}, "train_batch_size"),
    ]:
        path.write_text(json.dumps(bad))
        with pytest.raises(CptuneError, match=message):
            deepspeed_config(recipe(deepspeed=str(path)))
    path.write_text("{not json")
    with pytest.raises(CptuneError, match="not valid JSON"):
        deepspeed_config(recipe(deepspeed=str(path)))
    with pytest.raises(CptuneError, match="cannot read"):
        deepspeed_config(recipe(deepspeed=str(tmp_path / "missing.json")))


@pytest.mark.parametrize("causal", [True, False])
def test_document_attention_on_gpu_kernels_is_one_varlen_call_equal_to_the_per_document_loop(
    causal, monkeypatch
):
    """Where PyTorch's FlashAttention-2 runs, every document of every row goes through one varlen call.

    Its CUDA op is replaced by the float64 reference with the same contract (the GPU check script
    runs the real one).
    """
    from benchmarks.gpu.reference_ops import REFERENCE_OPS

    from cptune.parallel.kernels import torch_flash

    torch.manual_seed(0)
    q = torch.randn(2, 4, 11, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 11, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 11, 8, dtype=torch.float64, requires_grad=True)
    kwargs = {ATTENTION_KWARG: AttentionCall(attend=dense_attend(causal)), "position_ids": PACKED_POSITIONS}
    loop, _ = document_attention_forward(None, q, k, v, None, scaling=0.3, **kwargs)
    leaves32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    kwargs[ATTENTION_KWARG] = AttentionCall(attend=dense_attend(causal))
    loop32, _ = document_attention_forward(None, *leaves32, None, scaling=0.3, **kwargs)
    calls = []
    monkeypatch.setattr(torch_flash, "runs", lambda q: True)
    monkeypatch.setattr(
        torch_flash,
        "flash_ops",
        lambda: torch_flash.FlashOps(lambda *a, **kw: calls.append(a[3]) or REFERENCE_OPS.forward(*a, **kw),
                                     REFERENCE_OPS.backward),
    )  # fmt: skip
    kwargs[ATTENTION_KWARG] = AttentionCall(attend=dense_attend(causal))
    varlen, _ = document_attention_forward(None, q, k, v, None, scaling=0.3, **kwargs)

    assert [c.tolist() for c in calls] == [[0, 4, 7, 9, 11, 17, 22]]  # both rows' documents, end to end

    # Twins rule: the ops keep the LSE in fp32, so the varlen path may land as far from the float64 loop as
    # the loop computed wholly in fp32, or SDPA over the masked rows in 2 token orders (its twins), lands.
    twins = masked_references([t.detach().float().requires_grad_() for t in (q, k, v)], causal)[1:]
    assert_float64_twins_rule(
        with_grads(varlen, (q, k, v)), [with_grads(loop32, leaves32), *twins], with_grads(loop, (q, k, v))
    )
