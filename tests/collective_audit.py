"""Check that cptune's own collectives reach their process group on its device, during real runs.

On a CPU machine every tensor is on the CPU, so a collective given a CPU tensor
works here and stops every multi-GPU run (NCCL: "No backend type associated
with device type cpu"). The check is therefore about where collectives come
from: every ``torch.distributed`` collective that cptune's code calls must go
through ``cptune.parallel.collectives``, which puts its tensor on the group's
device; and that helper's tensors must be on the device torch picks for the
group. ``audit_site/sitecustomize.py`` records the calls in every process of a
run (launcher, ranks, workers); :meth:`CollectiveAudit.check` reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

AUDIT_SITE = Path(__file__).with_name("audit_site")
VARIABLE = "CPTUNE_TEST_COLLECTIVE_AUDIT"

# Where cptune asks for a collective (the function that calls the helper), by path:function.
STEP_TARGETS = "cptune/parallel/loss.py:step_target_count"
THROUGHPUT = "cptune/run/training/trainer.py:rate"
EVAL_TOTALS = "cptune/run/training/eval_loop.py:all_reduce_totals"


class CollectiveAudit:
    """The collective calls cptune's code made in the processes started while auditing into ``folder``."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def environment(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH", "")
        return {
            VARIABLE: str(self.folder),
            "PYTHONPATH": os.pathsep.join(p for p in (str(AUDIT_SITE), path) if p),
        }

    def records(self) -> list[dict]:
        return [
            json.loads(line)
            for f in sorted(self.folder.glob("*.jsonl"))
            for line in f.read_text().splitlines()
        ]

    def check(self, *asked_by: str) -> None:
        """Fail on a collective cptune called past the helper, or off its group's device.

        Args:
            asked_by: Functions that must have asked the helper for a collective in these runs
                (so the check saw the paths it is meant to cover).
        """
        records = self.records()
        bypassing = sorted(
            {f"{r['collective']} from {r['caller']}" for r in records if not r["through_helper"]}
        )
        assert not bypassing, (
            f"cptune calls torch.distributed collectives past cptune.parallel.collectives: {bypassing}"
        )
        off_device = [r for r in records if not r["on_group_device"]]
        assert not off_device, f"collectives given tensors off their group's device: {off_device}"
        seen = {r["asked_by"] for r in records}
        missing = [site for site in asked_by if site not in seen]
        assert not missing, (
            f"no collective recorded from {missing} (seen: {sorted(seen)}): the audit did not cover them"
        )


@contextlib.contextmanager
def auditing(folder: Path) -> Iterator[CollectiveAudit]:
    """Record the collectives of every process started inside the block (for module-scoped fixtures)."""
    audit = CollectiveAudit(folder)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in audit.environment().items():
            patch.setenv(name, value)
        yield audit
