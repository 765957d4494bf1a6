"""The adapter onto PyTorch's FlashAttention-2 on a CUDA GPU (skipped without one: CI has none).

The checks are ``benchmarks/gpu/check_kernels.py``'s (the lease script runs them and records the
numbers): forward, LSE and gradients of the real ``aten._flash_attention_forward/backward``
through the adapter, in bf16 and fp16, against float64 attention and the stand-ins. A skip here
proves nothing; the CPU side of the same logic is tests/parallel/kernel_tests/test_torch_flash.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_kernels_match_float64_attention_on_the_gpu():
    from benchmarks.gpu import check_kernels

    rows = check_kernels.run_checks()
    failed = [row for row in rows if not row["ok"]]
    assert not failed, failed


def test_dispatcher_picks_torch_flash_for_cuda_half_tensors_and_the_stand_ins_for_fp32():
    from cptune.parallel.kernels import dispatch, flash_attn_cpu, torch_flash

    half = torch.zeros(8, 4, 64, device="cuda", dtype=torch.bfloat16)
    assert torch_flash.unavailable_reason() is None
    assert (
        dispatch.implementation("_flash_attn_varlen_forward", half) is torch_flash._flash_attn_varlen_forward
    )
    assert (
        dispatch.implementation("_flash_attn_varlen_forward", half.float())
        is flash_attn_cpu._flash_attn_varlen_forward
    )
