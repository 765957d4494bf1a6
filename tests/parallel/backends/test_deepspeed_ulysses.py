"""The deepspeed backend's single-process parts: batches for DeepSpeed's adapter, attention, checks, config."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cptune.data.collator import PackedCollator, shift_labels_within_documents
from cptune.errors import CptuneError
from cptune.parallel.backends.attention import ATTENTION_KWARG, AttentionCall
from cptune.parallel.backends.deepspeed_ulysses.sharding import (
    DeepSpeedUlyssesBackend,
    UlyssesCollator,
    check_heads,
    check_resume_supported,
    deepspeed_config,
    gradient_divisor,
    labels_for_plain_shift,
)
from cptune.parallel.backends.document_attention import dense_attend, document_attention_forward
from cptune.parallel.backends.local.sharding import document_mask
from cptune.parallel.shard import TokenBatch
from tests.numerics import assert_float64_rule

PACKED_POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])


def deepspeed_adapter_shift(labels: torch.Tensor) -> torch.Tensor:
    """What UlyssesSPDataLoaderAdapter.refill does to labels (deepspeed ulysses_sp.py:712-714)."""
    return F.pad(labels, (0, 1), value=-100)[..., 1:]


def test_adapter_shift_of_cptune_labels_gives_per_document_targets():
    labels = torch.randint(3, 50, PACKED_POSITIONS.shape)
    shift_labels = shift_labels_within_documents(labels, PACKED_POSITIONS)
    assert torch.equal(deepspeed_adapter_shift(labels_for_plain_shift(shift_labels)), shift_labels)
    # Fed plain labels, the adapter would train the end of each document on the next one.
    assert not torch.equal(deepspeed_adapter_shift(labels), shift_labels)


def rows(*lengths: int) -> list[dict]:
    return [{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))} for n in lengths]


def test_collator_pads_to_a_multiple_of_cp_and_fits_the_adapter():
    collate = UlyssesCollator(PackedCollator(pad_token_id=0), cp_size=4, pad_token_id=0)
    batch = collate(rows(9, 6))
    assert set(batch) == {"input_ids", "position_ids", "shift_labels", "labels", "num_tokens"}
    assert all(batch[k].shape == (2, 12) for k in ("input_ids", "position_ids", "shift_labels", "labels"))
    assert batch["num_tokens"] == 15 and isinstance(batch["num_tokens"], int)  # passed through unsharded
    assert batch["position_ids"][0].tolist() == [*range(9), 0, 1, 2]  # padding is a document of its own
    assert (batch["shift_labels"][:, 8:] == -100).all()
    assert torch.equal(deepspeed_adapter_shift(batch["labels"]), batch["shift_labels"])


def test_collator_pads_to_a_fixed_length_for_gloo():
    collate = UlyssesCollator(PackedCollator(pad_token_id=0), cp_size=2, pad_token_id=0, fixed_length=14)
    assert collate(rows(3))["input_ids"].shape == (1, 14)
    with pytest.raises(ValueError, match="longer than 14"):
        collate(rows(15))


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
    mask = document_mask(PACKED_POSITIONS)
    if causal:
        mask = mask & torch.ones(11, 11, dtype=torch.bool).tril()

    def masked(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True).transpose(
            1, 2
        )

    def with_grads(out, inputs):
        grads = torch.autograd.grad(out.square().sum(), inputs)
        return {"out": out, **dict(zip(("dq", "dk", "dv"), grads, strict=True))}

    expected = masked(q, k, v)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    # Float64 reference: per document or over the masked row, the same sums in other orders.
    assert_float64_rule(
        with_grads(out, (q, k, v)), with_grads(expected, (q, k, v)), with_grads(masked(*leaves64), leaves64)
    )


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


def test_backend_passes_the_loader_shard_through():
    backend = DeepSpeedUlyssesBackend(
        core_attention="sdpa", causal=True, cp_size=2, cp_rank=1, gradient_divisor=1, pad_token_id=0
    )
    batch = TokenBatch(torch.arange(6)[None], torch.arange(6)[None], torch.arange(6)[None])
    sharded = backend.shard(batch)
    assert backend.batch_is_sharded and sharded.call is None
    assert sharded.model_kwargs["input_ids"] is batch.input_ids and sharded.shift_labels is batch.shift_labels
    # Rank 1 holds the second half of each row (the adapter's contiguous slice), for exact dropout.
    assert sharded.coords.columns.tolist() == [[6, 7, 8, 9, 10, 11]] and sharded.coords.rows.tolist() == [
        [0] * 6
    ]
    # A group's C ranks load batches k·W + r; the group trains them one per micro step.
    assert [backend.batch_number(n, dp_rank=1, dp_size=2) for n in range(4)] == [2, 3, 6, 7]
    assert (
        DeepSpeedUlyssesBackend(
            core_attention="cptune", causal=True, cp_size=2, cp_rank=0, gradient_divisor=1, pad_token_id=0
        )
        .shard(batch)
        .model_kwargs[ATTENTION_KWARG]
        is not None
    )


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


def test_sliding_window_layers_need_flash_attention():
    windowed = text_config(layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(CptuneError, match="sliding-window"):
        check_heads(windowed, 2, "sdpa")
    check_heads(windowed, 2, "flash_attention_2")


def test_gradient_divisor_follows_deepspeed_zero_stage():
    assert [gradient_divisor(stage, world_size=8, cp_size=2) for stage in range(4)] == [4, 4, 4, 8]


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
        ({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, "reduce_scatter"),
    ]:
        path.write_text(json.dumps(bad))
        with pytest.raises(CptuneError, match=message):
            deepspeed_config(recipe(deepspeed=str(path)))
    path.write_text("{not json")
    with pytest.raises(CptuneError, match="not valid JSON"):
        deepspeed_config(recipe(deepspeed=str(path)))
    with pytest.raises(CptuneError, match="cannot read"):
        deepspeed_config(recipe(deepspeed=str(tmp_path / "missing.json")))


def test_resuming_is_refused_with_the_reason():
    check_resume_supported(SimpleNamespace(resume_from_checkpoint=None))
    with pytest.raises(CptuneError, match="UlyssesSPDataLoaderAdapter"):
        check_resume_supported(SimpleNamespace(resume_from_checkpoint=True))


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

    def with_grads(out, inputs):
        grads = torch.autograd.grad(out.square().sum(), inputs)
        return {"out": out, **dict(zip(("dq", "dk", "dv"), grads, strict=True))}

    # Float64 reference: the ops keep the LSE in fp32, so the varlen path may land as far from the
    # float64 loop as the loop computed wholly in fp32 does (the float64-reference rule).
    assert_float64_rule(
        with_grads(varlen, (q, k, v)), with_grads(loop32, leaves32), with_grads(loop, (q, k, v))
    )
