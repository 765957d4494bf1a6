"""The torch backend without a process group: batch checks, layout, step context, the CPU patch.

Parity with cp=1 through real gloo processes is in tests/parallel/test_parity.py;
refusals through ``cptune train`` are in tests/run/test_train_torch_cp.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cptune.errors import CptuneError
from cptune.labels import IGNORE_INDEX
from cptune.parallel.backends.torch_cp.patches import torch_cp_cpu_sdpa_patch
from cptune.parallel.backends.torch_cp.sharding import (
    TorchCpBackend,
    UnmaskableBatchError,
    check_batch,
)
from cptune.parallel.shard import TokenBatch, zigzag_indices
from cptune.patches.core import ContextParallelWith, PatchSet

TORCH_RECIPE = SimpleNamespace(context_parallel_size=2, cp_backend="torch")


def batch(positions: list[list[int]], labels: list[list[int]] | None = None) -> TokenBatch:
    position_ids = torch.tensor(positions)
    shift_labels = torch.tensor(labels) if labels is not None else torch.full_like(position_ids, 5)
    input_ids = torch.arange(position_ids.numel()).view_as(position_ids) + 3
    return TokenBatch(input_ids=input_ids, position_ids=position_ids, shift_labels=shift_labels)


X = IGNORE_INDEX


def test_causal_accepts_one_document_and_trailing_segments_without_targets():
    check_batch(batch([[0, 1, 2, 3, 4, 5]]), causal=True, cp_size=2)
    # padding (positions restart) with no targets after the only trained document
    check_batch(batch([[0, 1, 2, 3, 0, 1]], [[5, 5, 5, X, X, X]]), causal=True, cp_size=2)
    # a second document without targets is as harmless as padding under causal attention
    check_batch(batch([[0, 1, 2, 0, 1, 2]], [[5, 5, X, X, X, X]]), causal=True, cp_size=4)


def test_causal_refuses_targets_after_a_document_boundary():
    packed = batch([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]], [[5] * 6, [5, 5, X, 5, 5, X]])
    with pytest.raises(UnmaskableBatchError) as refused:
        check_batch(packed, causal=True, cp_size=2)
    message = str(refused.value)
    assert message.startswith("cp_backend: torch cannot mask packed documents")
    assert "row 1 of this batch starts a new document at token 3" in message
    assert "cp_backend: ring-flash-attn" in message and "sample_packing: false" in message


def test_bidirectional_refuses_padding_and_packed_rows():
    padded = batch([[0, 1, 2, 3, 0, 1]], [[5, 5, 5, X, X, X]])
    with pytest.raises(UnmaskableBatchError) as refused:
        check_batch(padded, causal=False, cp_size=2)
    message = str(refused.value)
    assert message.startswith("cp_backend: torch cannot mask padding or packed documents with causal: false")
    assert "at token 4" in message and "cp_backend: ring-flash-attn" in message


def test_bidirectional_needs_a_length_that_splits_without_padding():
    check_batch(batch([[0, 1, 2, 3, 4, 5]]), causal=False, cp_size=2)
    with pytest.raises(UnmaskableBatchError, match="do not split evenly over context_parallel_size=4"):
        check_batch(batch([[0, 1, 2, 3, 4, 5]]), causal=False, cp_size=4)


def test_zigzag_is_torchs_head_tail_order():
    """torch's load balancer rearranges the sequence, then Shard(seq) cuts it: that must be our zigzag."""
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

    for cp_size, length in ((2, 8), (4, 32), (3, 18)):
        order = _HeadTailLoadBalancer(length, cp_size, "cpu")._generate_indices()[0]
        for rank, part in enumerate(order.chunk(cp_size)):
            assert torch.equal(part, zigzag_indices(length, cp_size, rank)), (cp_size, rank)


class FakeMesh:
    """The parts of a 1-D DeviceMesh that the backend reads outside attention."""

    device_type = "cpu"

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def backend(rank: int, *, causal=True, load_balance=True, cp_size=2) -> TorchCpBackend:
    return TorchCpBackend(
        causal=causal,
        load_balance=load_balance,
        comm_strategy="allgather",
        cp_mesh=FakeMesh(cp_size, rank),
        pad_token_id=0,
    )


def test_shard_pads_and_keeps_global_positions_in_torchs_layout():
    row = batch([list(range(7))], [[5, 6, 7, 8, 9, 10, X]])
    balanced = [backend(r).shard(row) for r in range(2)]
    # padded to 8 = 2·cp_size: rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    assert balanced[0].model_kwargs["position_ids"].tolist() == [[0, 1, 6, 0]]
    assert balanced[1].model_kwargs["position_ids"].tolist() == [[2, 3, 4, 5]]
    assert balanced[0].shift_labels.tolist() == [[5, 6, X, X]]
    contiguous = [backend(r, load_balance=False).shard(row) for r in range(2)]
    assert contiguous[0].model_kwargs["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert contiguous[1].shift_labels.tolist() == [[9, 10, X, X]]
    assert all(s.call is s.model_kwargs["cp_attention"] for s in balanced + contiguous)


def test_shard_checks_the_batch_before_anything_else():
    with pytest.raises(UnmaskableBatchError):
        backend(0).shard(batch([[0, 1, 0, 1]], [[5, X, 5, X]]))


def test_load_balancing_needs_causal_attention():
    with pytest.raises(ValueError, match="causal"):
        backend(0, causal=False, load_balance=True)


def test_step_context_needs_the_cpu_patch_and_restores_torchs_globals():
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _cp_options

    cp = backend(0)
    with pytest.raises(CptuneError, match="torch-cp-cpu-sdpa-handlers"), cp.step_context():
        pass
    before = (
        _cp_options.enable_load_balance,
        _cp_options.rotate_method,
        DTensor._op_dispatcher._custom_op_handlers,
    )
    cpu_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    with (
        PatchSet([torch_cp_cpu_sdpa_patch(ContextParallelWith(("torch",)))]).applied(TORCH_RECIPE),
        backend(0, causal=False, load_balance=False).step_context(),
    ):
        assert cpu_op in DTensor._op_dispatcher._custom_op_handlers
        assert _cp_options.enable_load_balance is False
    after = (
        _cp_options.enable_load_balance,
        _cp_options.rotate_method,
        DTensor._op_dispatcher._custom_op_handlers,
    )
    assert after[:2] == before[:2] and after[2] is before[2]


def test_cpu_patch_adds_handlers_to_a_new_dict_and_reverts():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    original = _attention.custom_ops
    patch_set = PatchSet([torch_cp_cpu_sdpa_patch(ContextParallelWith(("torch",)))])
    assert patch_set.plan(TORCH_RECIPE).ok
    with patch_set.applied(TORCH_RECIPE):
        assert _attention.custom_ops is not original
        assert original.items() <= _attention.custom_ops.items()
        assert (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
            in _attention.custom_ops
        )
    assert _attention.custom_ops is original
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in original


def test_prepared_bidirectional_rows_are_checked_before_the_run():
    from cptune.parallel.backends.torch_cp.sharding import check_bidirectional_rows

    # Rows that split evenly, one per batch or all of one length: the batches will pass check_batch.
    check_bidirectional_rows([4, 8, 6], split="training", cp_size=2, micro_batch_size=1)
    check_bidirectional_rows([8, 8], split="training", cp_size=4, micro_batch_size=2)
    with pytest.raises(CptuneError, match="cannot split row 2 of the prepared evaluation data: its 7 tokens"):
        check_bidirectional_rows([4, 8, 7], split="evaluation", cp_size=2, micro_batch_size=1)
    with pytest.raises(CptuneError, match="row 0 has 4 tokens, row 1 has 8"):
        check_bidirectional_rows([4, 8], split="training", cp_size=2, micro_batch_size=2)


def test_evaluation_rows_are_checked_at_the_evaluation_batch_size(tmp_path):
    """eval_batch_size 4 over micro_batch_size 1: evaluation rows of different lengths would share a batch, so the
    prepared evaluation split is refused naming eval_batch_size (training rows, one per batch, pass)."""
    from types import SimpleNamespace

    from datasets import Dataset

    from cptune.config.loader import validate_recipe
    from cptune.parallel.backends.torch_cp.runtime import TorchCpRuntime

    recipe = validate_recipe(
        {"base_model": "m", "datasets": [{"path": "d.jsonl"}], "context_parallel_size": 2, "cp_backend": "torch",
         "causal": False, "eval_batch_size": 4, "val_set_size": 0.5}
    )  # fmt: skip
    rows = Dataset.from_dict({"input_ids": [[1] * 4, [1] * 8]})
    prepared = SimpleNamespace(train=rows, eval=rows)
    with pytest.raises(
        CptuneError, match=r"causal: false and eval_batch_size: 4 would pad rows .*\(prepared evaluation data"
    ):
        TorchCpRuntime().check_prepared_rows(recipe, prepared)
    TorchCpRuntime().check_prepared_rows(recipe.model_copy(update={"eval_batch_size": 1}), prepared)
