"""DeepSpeed's process-wide state is put back after a run on DeepSpeed's engine (cptune.run.training.deepspeed_state).

The runs themselves, several in one process: tests/run/test_deepspeed_runs.py.
"""

from __future__ import annotations

import contextlib

import pytest

from cptune.run.training.deepspeed_state import deepspeed_state_restored, snapshot

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")


def _same(a: dict, b: dict) -> bool:
    """The same objects in the globals, the same entries in the registries."""
    return a.keys() == b.keys() and all(a[key] is b[key] or a[key] == b[key] for key in a)


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_what_a_run_sets_is_put_back(fails):
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as parallel_state_sp
    import deepspeed.sequence.layer as layer
    import deepspeed.utils.groups as groups
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    before = snapshot()
    kept_alive = []
    with contextlib.suppress(RuntimeError), deepspeed_state_restored(on_deepspeed=True):
        # What a run leaves: accelerate's DeepSpeed plugin keeps the Trainer's config alive after it ...
        kept_alive.append(HfDeepSpeedConfig({"zero_optimization": {"stage": 3}}))
        assert is_deepspeed_zero3_enabled()
        # ... every UlyssesSPAttentionHF registers its group, and accelerate's Ulysses set DeepSpeed's groups.
        layer._all_to_all_groups["finished-run-cp-group"] = object()
        groups.mpu = parallel_state_sp
        parallel_state_sp._SEQUENCE_PARALLEL_GROUP = object()
        parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP = object()
        if fails:
            raise RuntimeError("the run failed")
    assert _same(snapshot(), before)
    # The next run would load its model as the recipe says, not partitioned under zero.Init.
    assert kept_alive and not is_deepspeed_zero3_enabled()
    assert "finished-run-cp-group" not in layer._all_to_all_groups
    assert groups.mpu is before[("deepspeed.utils.groups", "mpu")]


def test_runs_without_deepspeed_leave_it_alone(monkeypatch):
    import cptune.run.training.deepspeed_state as state

    monkeypatch.setattr(state, "snapshot", lambda: pytest.fail("a run without DeepSpeed must not import it"))
    with deepspeed_state_restored(on_deepspeed=False):
        pass
