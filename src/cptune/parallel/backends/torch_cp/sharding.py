"""The torch backend: PyTorch's native context-parallel attention, with cptune's sharding around it.

**How torch CP is driven.** cptune shards each batch itself, as for every backend
(shift before split, padding, global positions: :mod:`cptune.parallel.shard`).
With load balancing the layout is torch's head-tail order
(``_HeadTailLoadBalancer``: rank ``r`` keeps chunks ``r`` and ``2C-1-r`` of
``2C``), which is cptune's zigzag (:func:`~cptune.parallel.shard.zigzag_indices`);
without it, contiguous slices, as torch's ``Shard(seq_dim)``. Attention goes
through cptune's attention function: ``attend`` wraps this rank's query, key and
value as DTensors sharded on the sequence dim of the CP mesh and calls
``F.scaled_dot_product_attention``, which torch's CP dispatcher turns into its
ring attention (K/V exchanged by all-gather or all-to-all).
:meth:`TorchCpBackend.step_context` switches that dispatcher on, with this
backend's load-balance and rotate options, around each micro batch's forward
*and* backward: autograd dispatches the SDPA backward through the same DTensor
handlers, and torch's ring templates read the same options there.

**Why not accelerate's ``maybe_context_parallel``** (torch's ``context_parallel``):
it needs the batch when it is entered, but the trainer enters the step context
before :meth:`~TorchCpBackend.shard` sees the batch; it re-shards its buffers in
place with a load-balance choice taken from the length alone (on whenever it
divides by ``2C``, which torch then refuses for bidirectional attention); and it
replaces ``F.scaled_dot_product_attention`` for every caller in the process,
where cptune routes only the model's attention layers (and counts them).

**Masks are checked, never dropped.** cptune's batches carry no attention mask:
documents are delimited by ``position_ids`` restarts (packed samples, padding),
and torch's CP attention takes no mask. :func:`check_batch` therefore accepts a
batch only where the attention torch computes equals the document-masked
attention on every trained token, and otherwise raises, naming ring-flash-attn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from cptune.errors import CptuneError
from cptune.labels import IGNORE_INDEX, document_starts
from cptune.parallel.backends.attention import ATTENTION_KWARG, ATTENTION_NAME, AttentionCall
from cptune.parallel.backends.base import SameBatchForEveryCpRank, ShardedInputs
from cptune.parallel.shard import TokenBatch, shard_contiguous, shard_zigzag

COMM_STRATEGIES = ("allgather", "alltoall")

RING_FLASH_ATTN_HINT = (
    "Use cp_backend: ring-flash-attn (its varlen_llama3 attention keeps packed samples and padding apart)"
)


class UnmaskableBatchError(CptuneError):
    """A batch whose documents or padding torch's context-parallel attention cannot keep apart."""


def check_batch(batch: TokenBatch, *, causal: bool, cp_size: int) -> None:
    """Raise unless attention without a mask is exact for this batch.

    * causal: every target lies in the first document of its row. What follows
      (trailing padding, or documents without targets) comes after every trained
      token, so causal attention never shows it to one, and its own outputs carry
      no loss. The padding :class:`TorchCpBackend` adds to split the row evenly is
      such a segment too.
    * bidirectional: one document per row and a length that splits evenly over the
      CP ranks, since every token would attend to padding or to another document.

    Raises:
        UnmaskableBatchError: The batch is packed or padded in a way this backend
            would silently train wrong.
    """
    starts = document_starts(batch.position_ids)
    starts[..., 0] = False
    after_first = starts.cumsum(dim=-1) > 0
    if causal:
        trained_later = after_first & (batch.shift_labels != IGNORE_INDEX)
        if trained_later.any():
            row, token = (int(i) for i in trained_later.nonzero()[0])
            first_restart = int(starts[row].nonzero()[0])
            raise UnmaskableBatchError(
                "cp_backend: torch cannot mask packed documents: its context-parallel attention is "
                f"plain causal attention over each row, but row {row} of this batch starts a new document "
                f"at token {first_restart} (position_ids restart) and trains on token {token} after it, "
                f"which would attend across the document boundary. {RING_FLASH_ATTN_HINT}, or set "
                "sample_packing: false."
            )
        return
    if starts.any():
        row = int(starts.any(dim=-1).nonzero()[0])
        first_restart = int(starts[row].nonzero()[0])
        raise UnmaskableBatchError(
            "cp_backend: torch cannot mask padding or packed documents with causal: false: its "
            f"context-parallel attention lets every token of a row see every other, but row {row} of this "
            f"batch starts a new document (padding or a packed sample) at token {first_restart}. "
            f"{RING_FLASH_ATTN_HINT}, or give every row the same length without padding "
            "(micro_batch_size: 1, sample_packing: false, pad_to_sequence_len: false)."
        )
    length = batch.shape[-1]
    if length % cp_size:
        raise UnmaskableBatchError(
            f"cp_backend: torch cannot mask padding with causal: false, and this batch's {length} tokens per "
            f"row do not split evenly over context_parallel_size={cp_size} ranks without padding. "
            f"{RING_FLASH_ATTN_HINT}, or use rows whose length is a multiple of {cp_size}."
        )


def check_bidirectional_rows(
    lengths: list[int],
    *,
    split: str,
    cp_size: int,
    micro_batch_size: int,
    batch_key: str = "micro_batch_size",
) -> None:
    """Refuse prepared rows that :func:`check_batch` would stop on mid-run, with causal: false.

    Checked on the prepared data before anything starts (cptune train, evaluate and preprocess),
    so a bad row does not stop a run at the first batch that holds it.

    Args:
        lengths: Token count of every prepared row of the split, in order.
        split: ``training`` or ``evaluation``, for the message.
        cp_size: Ranks that split each row.
        micro_batch_size: Rows per batch; more than one pads rows to the longest of their batch.
        batch_key: The recipe key that sets it (``eval_batch_size`` for evaluation batches), for the message.

    Raises:
        CptuneError: A row does not split evenly over the ranks, or rows a batch may hold together
            differ in length.
    """
    uneven = next((i for i, n in enumerate(lengths) if n % cp_size), None)
    if uneven is not None:
        raise CptuneError(
            f"cp_backend: torch with causal: false cannot split row {uneven} of the prepared {split} data: its "
            f"{lengths[uneven]} tokens are not a multiple of context_parallel_size={cp_size}, and torch's "
            "context-parallel attention takes no padding mask to pad it with. "
            f"{RING_FLASH_ATTN_HINT}, or data whose samples are multiples of {cp_size} tokens long."
        )
    other = next((i for i, n in enumerate(lengths) if n != lengths[0]), None)
    if micro_batch_size > 1 and other is not None:
        raise CptuneError(
            f"cp_backend: torch with causal: false and {batch_key}: {micro_batch_size} would pad rows of "
            f"different lengths in one batch (prepared {split} data: row 0 has {lengths[0]} tokens, row "
            f"{other} has {lengths[other]}), and torch's context-parallel attention takes no padding mask. "
            f"Use {batch_key}: 1"
            + (" (with more gradient_accumulation_steps)" if batch_key == "micro_batch_size" else "")
            + ", or cp_backend: ring-flash-attn, which masks padding."
        )


class TorchCpBackend(SameBatchForEveryCpRank):
    """Shards batches for one CP group and attends with torch's context-parallel ring attention."""

    attn_implementation = ATTENTION_NAME

    def __init__(
        self, *, causal: bool, load_balance: bool, comm_strategy: str, cp_mesh: Any, pad_token_id: int
    ):
        if load_balance and not causal:
            raise ValueError("torch's load balancing is for causal attention only")
        if comm_strategy not in COMM_STRATEGIES:
            raise ValueError(f"comm_strategy must be one of {COMM_STRATEGIES}, got {comm_strategy!r}")
        self.causal = causal
        self.load_balance = load_balance
        self.comm_strategy = comm_strategy
        self.cp_mesh = cp_mesh
        self.cp_size = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()
        self.pad_token_id = pad_token_id

    def shard(self, batch: TokenBatch) -> ShardedInputs:
        check_batch(batch, causal=self.causal, cp_size=self.cp_size)
        split = shard_zigzag if self.load_balance else shard_contiguous
        shard = split(batch, self.cp_size, self.cp_rank, self.pad_token_id)
        tokens, coords = shard.tokens, shard.coords
        call = AttentionCall(attend=self._attend)
        kwargs = {"input_ids": tokens.input_ids, "position_ids": tokens.position_ids, ATTENTION_KWARG: call}
        return ShardedInputs(model_kwargs=kwargs, shift_labels=tokens.shift_labels, call=call, coords=coords)

    def _attend(self, query, key, value, scale):
        from torch.distributed.tensor import DTensor, Shard

        # (batch, tokens, heads, head_dim) -> SDPA's (batch, heads, tokens, head_dim), sharded on
        # tokens. run_check=False: every rank holds a different shard by design (the check would
        # broadcast rank 0's), and the shard layout is the one torch's ring expects (module docstring).
        q, k, v = (
            DTensor.from_local(t.transpose(1, 2), self.cp_mesh, [Shard(2)], run_check=False)
            for t in (query, key, value)
        )
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.to_local().transpose(1, 2)

    @contextlib.contextmanager
    def step_context(self) -> Iterator[None]:
        """torch's CP dispatch with this backend's options, for one micro batch's forward and backward.

        Everything it sets is process-global in torch (the DTensor op handlers, the
        CP sharding rules, ``_cp_options``), so it is put back on exit.
        """
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental import _context_parallel as torch_cp

        if self.cp_mesh.device_type == "cpu":
            _check_cpu_handlers(torch_cp._attention.custom_ops)
        options = torch_cp._cp_options
        dispatcher = DTensor._op_dispatcher
        saved = (options.enable_load_balance, options.rotate_method, dispatcher._custom_op_handlers)
        options.enable_load_balance = self.load_balance
        # Not set_rotate_method(): it logs on every call and is meant as a process-wide setting.
        options.rotate_method = {
            "allgather": torch_cp._RotateMethod.ALL_GATHER,
            "alltoall": torch_cp._RotateMethod.ALL_TO_ALL,
        }[self.comm_strategy]
        torch_cp._enable_context_parallel_dispatcher()
        try:
            yield
        finally:
            torch_cp._disable_context_parallel_dispatcher()
            # _disable resets the handlers to those torch saw at import; restore what was there.
            options.enable_load_balance, options.rotate_method, dispatcher._custom_op_handlers = saved


def _check_cpu_handlers(custom_ops: dict[Any, Any]) -> None:
    if torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in custom_ops:
        raise CptuneError(
            "cp_backend: torch on CPU needs cptune's patch 'torch-cp-cpu-sdpa-handlers' (torch has no "
            "context-parallel handler for the CPU attention op); it is applied by `cptune train`. Apply "
            "PatchSet(cptune.parallel.backends.torch_cp.runtime.RUNTIME.training_patches()) around your own loop."
        )
