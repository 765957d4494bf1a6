"""What a command prints besides its own messages: known upstream noise silenced at its source, bars only on a terminal."""

from __future__ import annotations

import io
import logging
import sys
import warnings

import pytest
import torch.distributed as dist

from cptune.console import progress_bars_on_terminal_only, quiet_upstream_noise


def test_deepspeed_does_not_warn_that_it_chose_the_cpu_on_a_machine_without_a_gpu(monkeypatch):
    """accelerate imports DeepSpeed in every run where it is installed; its accelerator guess warned once per rank."""
    real_accelerator = pytest.importorskip("deepspeed.accelerator.real_accelerator")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(real_accelerator, "ds_accelerator", None)  # guess again, as a fresh process does
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    deepspeed_log = logging.getLogger("DeepSpeed")
    deepspeed_log.addHandler(handler)
    try:
        quiet_upstream_noise()
        assert real_accelerator.get_accelerator().device_name() == "cpu"
        deepspeed_log.warning("something else DeepSpeed says")
    finally:
        deepspeed_log.removeHandler(handler)
    assert seen == ["something else DeepSpeed says"]


def test_torchs_notice_about_slicing_a_flattened_mesh_dim_is_silenced():
    """accelerate slices the flattened dims it made (dp, dp_shard_cp); torch warned 4 times per FSDP2 run."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.fail("a process group was left open by an earlier test")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "cp"))
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # as accelerate's ParallelismConfig builds it
        with warnings.catch_warnings(record=True) as before:
            warnings.simplefilter("always")
            mesh["dp_shard_cp"]
        with warnings.catch_warnings(record=True) as after:
            warnings.simplefilter("always")
            quiet_upstream_noise()
            mesh["dp_shard_cp"]
    finally:
        dist.destroy_process_group()
    assert any("Slicing a flattened dim" in str(w.message) for w in before)  # the notice this silences
    assert [str(w.message) for w in after] == []


def test_progress_bars_are_off_where_stderr_is_not_a_terminal(monkeypatch):
    import datasets
    import huggingface_hub.utils
    import transformers.utils.logging

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    try:
        progress_bars_on_terminal_only()
        assert not datasets.is_progress_bar_enabled()
        assert huggingface_hub.utils.are_progress_bars_disabled()
        assert not transformers.utils.logging.is_progress_bar_enabled()
    finally:
        datasets.enable_progress_bars()
        huggingface_hub.utils.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()
