"""``CPTUNE_TEST_REORDER=1``: the numerical tests with other summation orders, on one machine (issue 26).

A tolerance set at the error one machine measured fails on a CPU that adds in another order. With
the variable set, every process the tests start (it inherits the variable; tests/conftest.py, the
parity workers and the ring kernels' launcher call :func:`apply`) changes the orders it controls:

- threads: the pytest process runs 2 torch threads instead of its default 1 (tests/conftest.py);
  a process the tests start goes to 1 where it had several, so parallel reductions split their
  sums elsewhere (more threads than a process was given would only oversubscribe: the parity
  workers run 2-4 processes of one thread each and keep it);
- attention blocks: cptune's CPU attention kernels (``cptune.parallel.kernels.blockwise``)
  take query rows two at a time, so dk and dv add over many blocks;
- loss chunks: the token loss (``token_loss_sum``, the chunked head loss) in chunks of
  :data:`LOSS_CHUNK_ELEMENTS` logits, so the token losses add chunk by chunk;
- tiles: tests that tile an MLP use :func:`tiles` (twice their tiles);
- reference order: the parity workers' cp=1 references run the micro batches of a step in
  reverse (:func:`in_stress_order`), so gradient accumulation adds them the other way.

Runs through the CLI (``cptune train`` in tests/run) do not import this module and already run
one thread per process: the stress leaves them as they are.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch

VARIABLE = "CPTUNE_TEST_REORDER"
#: Logits per chunk of the token loss under the stress: 3 tokens of the tests' 97-token vocabulary.
LOSS_CHUNK_ELEMENTS = 3 * 97
#: Query rows per block of the CPU attention kernels under the stress.
QUERY_ROWS_PER_BLOCK = 2

T = TypeVar("T")


def active() -> bool:
    """Whether this process runs under the reorder stress."""
    return os.environ.get(VARIABLE, "") not in ("", "0")


def apply(threads: bool = True) -> None:
    """Put this process's summation orders under the stress (nothing without the variable); never undone.

    Args:
        threads: lower torch's threads to 1 (a process the tests start); the pytest process sets
            its own (tests/conftest.py).
    """
    if not active():
        return
    if threads and torch.get_num_threads() > 1:
        torch.set_num_threads(1)

    from cptune.models import head_loss
    from cptune.parallel import loss
    from cptune.parallel.kernels import blockwise

    # The chunk size is a default argument, bound when the functions were defined.
    for function in (loss.token_loss_sum, loss.head_token_loss_sum, head_loss.HeadLoss.__init__):
        _set_default(function, "chunk_elements", LOSS_CHUNK_ELEMENTS)
    if not getattr(blockwise._blocks, "reorder_stress", False):
        blockwise._blocks = _split_rows(blockwise._blocks)


def _set_default(function, name: str, value: object) -> None:
    """Replace the default of ``function``'s positional parameter ``name``, keeping its other defaults."""
    code = function.__code__
    names = code.co_varnames[: code.co_argcount]
    defaults = list(function.__defaults__)
    defaults[names.index(name) - (len(names) - len(defaults))] = value
    function.__defaults__ = tuple(defaults)


def _split_rows(blocks):
    """``blockwise._blocks`` with every block cut into blocks of QUERY_ROWS_PER_BLOCK query rows.

    A block keeps its key range and its rows of the visibility mask: a row that sees none of
    those keys gets the kernels' dead-row treatment, as a skipped block's rows do.
    """

    def split(q, k, left, right) -> Iterator[tuple[slice, slice, torch.Tensor | None]]:
        for rows, keys, visible in blocks(q, k, left, right):
            for start in range(rows.start, rows.stop, QUERY_ROWS_PER_BLOCK):
                stop = min(rows.stop, start + QUERY_ROWS_PER_BLOCK)
                part = None if visible is None else visible[start - rows.start : stop - rows.start]
                yield slice(start, stop), keys, part

    split.reorder_stress = True
    return split


def tiles(count: int) -> int:
    """An MLP's tile count in a test: twice ``count`` under the stress."""
    return 2 * count if active() else count


def in_stress_order(items: Sequence[T]) -> list[T]:
    """``items`` reversed under the stress (a sum over them adds in the other order), else as they are."""
    return list(items)[::-1] if active() else list(items)
