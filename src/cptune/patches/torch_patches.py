"""Patches of torch.distributed (torch 2.13).

Each function returns one :class:`~cptune.patches.core.Patch`; nothing is patched until a
:class:`~cptune.patches.core.PatchSet` applies it. This module imports nothing from torch.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from cptune.patches.core import Patch

# torch's own default for a gloo process group (the binding's ``timeout`` argument).
_GLOO_DEFAULT_TIMEOUT = timedelta(seconds=1800)


def _one_worker_gloo(original: Any) -> Any:
    """A ``ProcessGroupGloo`` whose groups run their collectives on one worker thread."""

    class OneWorkerProcessGroupGloo(original):
        """``ProcessGroupGloo`` with one worker thread; otherwise built as torch's binding builds it.

        The binding's ``(store, rank, size, timeout)`` form makes its options itself (a device per
        interface in ``GLOO_SOCKET_IFNAME``, else the default device; 2 threads per device): the same
        here with 1 thread. The ``(store, rank, size, options)`` form keeps the caller's options, with 1
        thread.
        """

        def __init__(self, store: Any, rank: int, size: int, timeout: Any = _GLOO_DEFAULT_TIMEOUT) -> None:
            if isinstance(timeout, original._Options):
                options = timeout
            else:
                options = original._Options()
                interfaces = os.environ.get("GLOO_SOCKET_IFNAME", "")
                if len(interfaces) > 1:  # the binding's own test: a name of one character is ignored
                    options._devices = [
                        original.create_device(interface=name) for name in interfaces.split(",")
                    ]
                else:
                    options._devices = [original.create_default_device()]
                options._timeout = timeout
            options._threads = 1
            super().__init__(store, rank, size, options)

    OneWorkerProcessGroupGloo.__qualname__ = OneWorkerProcessGroupGloo.__name__
    return OneWorkerProcessGroupGloo


def gloo_one_worker_patch() -> Patch:
    """``distributed_c10d.ProcessGroupGloo`` → a subclass whose process groups have one worker thread.

    torch 2.13's ``ProcessGroupGloo::runLoop`` (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp),
    run by each of a group's worker threads (2 by default), writes the group's status after every
    collective, ``pgStatus_->lastCompletedWorkName = opTypeToString(work->opType_)``, after releasing
    ``workMutex_``: two workers that finish collectives together assign to one ``std::string`` at once.
    A name longer than the string's inline buffer (``ALLGATHER_COALESCED``, 19 characters) lives on
    the heap, so one worker can free that buffer while the other still copies into it, and glibc aborts
    the rank: "malloc(): unaligned tcache chunk detected" (or a double free). ``cp_backend: torch``'s
    ring has two collectives in flight in every layer's backward (the K/V all-gather and the dK/dV
    all-to-all), and the abort hit it at random under load (issue 26; helgrind shows the race,
    ``devtools/gloo_status_race.py`` reproduces it with torch alone). Any two gloo collectives of one
    group that finish together can race.

    ``init_process_group`` does not pass options to gloo (distributed_c10d.py:2163 builds
    ``ProcessGroupGloo(store, rank, size, timeout=...)``), so the class torch builds every gloo group
    with (the world's, a device mesh's, DeepSpeed's) is replaced by one whose groups get one worker
    thread: a group's collectives then run one after another, in the order every rank issues them,
    and no two ``runLoop`` bodies run together. Groups made while the patch is applied keep their one
    worker after it is reverted. ``isinstance(backend, ProcessGroupGloo)`` inside distributed_c10d is
    checked against the subclass while the patch is applied; torch asks it of a backend it has just
    built (true) and in ``_set_pg_timeout`` (only ``torch.distributed.breakpoint`` calls it).
    """
    return Patch(
        name="gloo-one-worker-thread",
        target="torch.distributed.distributed_c10d:ProcessGroupGloo",
        replacement=_one_worker_gloo,
        reason=(
            "A gloo process group's two worker threads write its status string together and corrupt the heap.\n"
            "ProcessGroupGloo::runLoop assigns pgStatus_->lastCompletedWorkName outside workMutex_ (torch 2.13); "
            "two collectives finishing together (torch CP's ring backward) aborted a rank with 'malloc(): "
            "unaligned tcache chunk detected'. Groups are built with one worker thread."
        ),
        remove_when="torch updates a gloo group's status under its lock (or with one writer).",
        requires={"torch": ">=2.13,<2.15"},
    )
