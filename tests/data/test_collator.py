"""The collator: padding is its own document, targets never cross a document, packed loss is exact."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.masking_utils import find_packed_sequence_indices

from cptune.data.collator import PackedCollator
from cptune.data.packing import pack_samples
from cptune.labels import IGNORE_INDEX, document_starts, shift_labels_within_documents
from devtools.tiny import build_tiny_model, tiny_llama_config
from tests.numerics import float64_scalar_twins_excess, loss_sum_floor
from tests.parallel.reorder_twins import SDPA_TWIN_DRAWS, sdpa_twin_runs


def test_shift_labels_stop_at_document_ends() -> None:
    labels = torch.tensor([[10, 11, 12, 20, 21, -100, 30]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 0]])
    shifted = shift_labels_within_documents(labels, positions)
    assert shifted.tolist() == [[11, 12, -100, 21, -100, -100, -100]]
    assert labels.tolist() == [[10, 11, 12, 20, 21, -100, 30]]  # input untouched


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(min_value=-100, max_value=50), min_size=1, max_size=12), min_size=1, max_size=6
    )
)
def test_shift_labels_never_cross_a_document(documents: list[list[int]]) -> None:
    labels = torch.tensor([[t for doc in documents for t in doc]])
    positions = torch.tensor([[p for doc in documents for p in range(len(doc))]])
    shifted = shift_labels_within_documents(labels, positions)[0].tolist()
    offset = 0
    for doc in documents:
        # Inside a document: the next label; at its last token: nothing.
        assert shifted[offset : offset + len(doc)] == [*doc[1:], IGNORE_INDEX]
        offset += len(doc)


def test_collator_pads_as_its_own_document() -> None:
    rows = [
        pack_samples(
            [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
        ),
        {"input_ids": [4, 4, 4], "labels": [-100, 4, 4], "position_ids": [0, 1, 2]},
    ]
    batch = PackedCollator(pad_token_id=0)(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids", "shift_labels", "num_tokens"}
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [4, 4, 4, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, 8, 9], [-100, 4, 4, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1]]
    assert batch["shift_labels"].tolist() == [[6, 7, -100, 9, -100], [4, 4, -100, -100, -100]]
    assert batch["num_tokens"].item() == 8
    # transformers sees the same documents, padding included as a separate one.
    segments = find_packed_sequence_indices(batch["position_ids"])
    assert segments.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    assert (
        document_starts(batch["position_ids"]) == (torch.diff(segments, prepend=segments[:, :1] - 1) != 0)
    ).all()


def test_collator_without_position_ids_and_lengths() -> None:
    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]
    assert PackedCollator(pad_token_id=0)(rows)["position_ids"].tolist() == [[0, 1, 2]]
    padded = PackedCollator(pad_token_id=0, sequence_len=8, pad_to_sequence_len=True)(rows)
    assert padded["input_ids"].shape == (1, 8)
    assert padded["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    multiple = PackedCollator(pad_token_id=None, pad_to_multiple_of=4)(rows)
    assert multiple["input_ids"].tolist() == [[1, 2, 3, 0]]
    both = PackedCollator(pad_token_id=0, sequence_len=5, pad_to_sequence_len=True, pad_to_multiple_of=4)
    assert both.padded_length(3) == 8
    with pytest.raises(ValueError):
        PackedCollator(pad_token_id=0, pad_to_sequence_len=True)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_loss_equals_separate_samples(attn_implementation: str) -> None:
    vocab = 97
    config = tiny_llama_config(vocab, use_cache=False)
    model = build_tiny_model(config, seed=0)
    model.config._attn_implementation = attn_implementation
    model.eval()
    generator = torch.Generator().manual_seed(0)
    samples = []
    for length in (7, 12, 5, 9, 3):
        ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
        labels = [IGNORE_INDEX if k < length // 3 else t for k, t in enumerate(ids)]
        samples.append({"input_ids": ids, "labels": labels})

    def summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )

    rows = [pack_samples(samples[:3]), pack_samples(samples[3:])]  # two rows, one padded
    batch = PackedCollator(pad_token_id=0, pad_to_multiple_of=8)(rows)

    @torch.no_grad()
    def separate_loss(model: torch.nn.Module) -> float:
        """The samples' loss summed one by one."""
        separate = 0.0
        for sample in samples:
            ids = torch.tensor([sample["input_ids"]])
            labels = torch.tensor([sample["labels"]])
            logits = model(input_ids=ids, use_cache=False).logits
            separate += summed_loss(logits[:, :-1], labels[:, 1:]).item()
        return separate

    @torch.no_grad()
    def losses(model: torch.nn.Module) -> tuple[float, float, float]:
        """The samples' loss summed one by one, in packed rows, and in packed rows without positions."""
        separate = separate_loss(model)
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
        packed = summed_loss(logits, batch["shift_labels"]).item()
        # Without the restarting positions the documents would see each other.
        crossing = summed_loss(
            model(input_ids=batch["input_ids"], use_cache=False).logits, batch["shift_labels"]
        )
        return separate, packed, crossing.item()

    separate, packed, crossing = losses(model)
    separate64, _, _ = losses(copy.deepcopy(model).double())
    # The reference's twins: the samples one by one through sdpa's math backend and sdpa over the tokens in a strided order
    # (tests/parallel/reorder_twins.py's sdpa_twin_runs), the same function with attention's sums in other orders;
    # for the eager reference plain sdpa instead of the math backend, which rounds as eager does on CPU.
    twin = copy.deepcopy(model)
    twin.config._attn_implementation = "sdpa"
    math, strided_tokens = sdpa_twin_runs(twin, lambda: separate_loss(twin))
    twins = [math if attn_implementation == "sdpa" else separate_loss(twin), strided_tokens]
    targets = sum(sum(t != IGNORE_INDEX for t in s["labels"][1:]) for s in samples)
    assert int((batch["shift_labels"] != IGNORE_INDEX).sum()) == targets

    def excess(loss: float) -> float:
        """Twins rule: packed rows add the same token losses in other orders (tests/numerics.py); the reference
        and its twins are 3 draws of the logits (SDPA_TWIN_DRAWS)."""
        error, *reference_errors = (abs(x - separate64) / separate64 for x in (loss, separate, *twins))
        return float64_scalar_twins_excess(error, reference_errors, loss_sum_floor(targets), SDPA_TWIN_DRAWS)

    assert excess(packed) <= 1
    assert excess(crossing) > 1  # the check above can fail
