"""The reorder stress (tests/reorder.py) changes the loss's chunk size and nothing else of its signature."""

from __future__ import annotations

import inspect

import torch

from cptune.models import head_loss
from cptune.parallel import loss
from cptune.parallel.kernels import blockwise
from tests import reorder


def test_the_stress_sets_the_loss_chunk_and_keeps_the_other_defaults(monkeypatch):
    """``token_loss_sum`` gained ``segments=None`` after its chunk size; setting the defaults by position made
    ``chunk_elements`` required, and every parity worker under ``CPTUNE_TEST_REORDER=1`` failed."""
    for function in (loss.token_loss_sum, loss.head_token_loss_sum, head_loss.HeadLoss.__init__):
        monkeypatch.setattr(function, "__defaults__", function.__defaults__)  # restored after the test
    monkeypatch.setattr(blockwise, "_blocks", blockwise._blocks)
    monkeypatch.setenv(reorder.VARIABLE, "1")
    reorder.apply(threads=False)

    for function in (loss.token_loss_sum, loss.head_token_loss_sum, head_loss.HeadLoss.__init__):
        parameters = inspect.signature(function).parameters
        assert parameters["chunk_elements"].default == reorder.LOSS_CHUNK_ELEMENTS, function
    assert inspect.signature(loss.token_loss_sum).parameters["segments"].default is None
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 8, 97, generator=generator)
    labels = torch.randint(0, 97, (1, 8), generator=generator)
    chunked = loss.token_loss_sum(logits, labels, reorder.LOSS_CHUNK_ELEMENTS, None)
    assert torch.equal(loss.token_loss_sum(logits, labels), chunked)
