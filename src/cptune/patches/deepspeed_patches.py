"""Patches that runs on DeepSpeed's engine need, of DeepSpeed 0.19, accelerate 1.15 and transformers 5.23.

They concern DeepSpeed's engine whatever computes the attention (:func:`deepspeed_engine_patches`:
two for DeepSpeed on CPU, one for the gradient norm under ZeRO-0; the patch registry adds them for every
run on DeepSpeed's engine, Ulysses or ring / torch CP under ZeRO, with an :class:`OnDeepSpeedEngine`
predicate); the patch only Ulysses needs is its backend's
(:mod:`cptune.parallel.backends.deepspeed_ulysses.patches`). Each function returns
one :class:`~cptune.patches.core.Patch`; nothing is imported or patched until a
:class:`~cptune.patches.core.PatchSet` applies it, and the targets' modules
(DeepSpeed's among them) are imported only when a recipe selects these patches.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cptune import versions
from cptune.patches.core import Patch, Predicate


@dataclass(frozen=True)
class OnDeepSpeedEngine:
    """Predicate: DeepSpeed's engine trains the run.

    At ``context_parallel_size > 1``: ``cp_backend`` in ``always`` (a backend that runs its own engine,
    Ulysses), or in ``under_zero`` with ``deepspeed`` or ``zero_stage`` set (ring / torch CP under ZeRO).
    At ``context_parallel_size`` 1, whatever ``cp_backend`` says: ``deepspeed`` or ``zero_stage`` set, when
    ``at_cp1`` (the backend of cp=1 runs trains under ZeRO). The registry fills them from the backends'
    ``runs_own_engine`` and ``runs_under_zero``.
    """

    always: tuple[str, ...]
    under_zero: tuple[str, ...]
    at_cp1: bool = False

    def __call__(self, recipe: Any) -> bool:
        asks = (
            getattr(recipe, "deepspeed", None) is not None or getattr(recipe, "zero_stage", None) is not None
        )
        if recipe.context_parallel_size <= 1:
            return self.at_cp1 and asks
        if recipe.cp_backend in self.always:
            return True
        return recipe.cp_backend in self.under_zero and asks

    def __str__(self) -> str:
        conditions = []
        if self.always:
            conditions.append(f"cp_backend in ({', '.join(self.always)})")
        if self.under_zero:
            conditions.append(
                f"cp_backend in ({', '.join(self.under_zero)}) with deepspeed or zero_stage set"
            )
        above = (
            f"context_parallel_size > 1 and ({', or '.join(conditions)})"
            if len(conditions) > 1
            else f"context_parallel_size > 1 and {conditions[0] if conditions else 'never'}"
        )
        if self.at_cp1:
            return f"{above}, or context_parallel_size 1 with deepspeed or zero_stage set"
        return above


def skip_shm_op_build_patch(applies_to: Predicate) -> Patch:
    """``deepspeed.comm.torch.build_shm_op`` → no shared-memory op on CPU.

    DeepSpeed's ``TorchBackend.__init__`` (deepspeed/comm/torch.py:207) JIT-compiles
    the ``deepspeed_shm_comm`` C++ op with g++ whenever the accelerator is the CPU:
    about 40 s on a cold cache (notes/cpu-measurements.md, D). The op serves only
    ``inference_all_reduce`` (torch.py:292-306), which falls back to
    ``torch.distributed.all_reduce`` without it; training never calls it. On other
    accelerators the original runs unchanged.
    """

    def replacement(original: Callable[[], Any]) -> Callable[[], Any]:
        @functools.wraps(original)
        def build_shm_op() -> Any:
            from deepspeed.accelerator import get_accelerator

            if get_accelerator().device_name() == "cpu":
                return None
            return original()

        return build_shm_op

    return Patch(
        name="deepspeed-skip-cpu-shm-op",
        target="deepspeed.comm.torch:build_shm_op",
        replacement=replacement,
        reason=(
            "Skips a ~40 s g++ build of an inference-only op when DeepSpeed starts on CPU.\n"
            "deepspeed/comm/torch.py:207 builds deepspeed_shm_comm in TorchBackend.__init__; it is used only "
            "by inference_all_reduce (torch.py:292), which falls back to torch.distributed.all_reduce."
        ),
        remove_when="DeepSpeed builds the shared-memory op lazily, on first use by inference_all_reduce.",
        requires=versions.written_for("deepspeed"),
        signature=(),
        applies_to=applies_to,
    )


def _deepspeed_launch_without_device(cpu: bool) -> bool:
    """A DeepSpeed process under a launcher on a machine with no accelerator device accelerate knows."""
    import torch

    return (
        not cpu
        and int(os.environ.get("LOCAL_RANK", -1)) != -1
        and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        and not torch.cuda.is_available()
    )


def deepspeed_cpu_backend_patch(applies_to: Predicate) -> Patch:
    """``PartialState._prepare_backend`` → ``gloo`` for DeepSpeed processes on CPU.

    DeepSpeed on CPU needs ``use_cpu`` off (with it on, accelerate never selects
    DeepSpeed: accelerate/state.py:201 and :974 test ``not cpu``). Then
    ``_prepare_backend`` (state.py:755-815) finds no device backend and returns
    ``None``; DeepSpeed's ``init_distributed`` still creates a gloo process group
    (state.py:204-214), but with ``backend is None`` accelerate records
    ``num_processes = 1`` and ``process_index = 0`` (state.py:287-292), so the
    Trainer reports world_size 1 on every rank (measured, notes D) and every rank
    acts as the main process. The wrapper names the backend DeepSpeed's CPU
    accelerator uses, so the real world size and rank are read from the process group.
    """

    def replacement(original: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
        @functools.wraps(original)
        def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: Any = None):
            found, distributed_type = original(self, cpu, sagemaker_dp, backend)
            if found is None and backend is None and _deepspeed_launch_without_device(cpu):
                return "gloo", distributed_type
            return found, distributed_type

        return _prepare_backend

    return Patch(
        name="accelerate-deepspeed-cpu-world-size",
        target="accelerate.state:PartialState._prepare_backend",
        replacement=replacement,
        reason=(
            "DeepSpeed on CPU: accelerate sees the real world size instead of 1 process.\n"
            "accelerate/state.py:755 _prepare_backend returns no backend on a machine without devices, so "
            "state.py:288 records num_processes=1 although DeepSpeed initialised a gloo group."
        ),
        remove_when="accelerate picks a backend for DeepSpeed processes on CPU-only machines.",
        requires=versions.written_for("accelerate"),
        signature=("self", "cpu", "sagemaker_dp", "backend"),
        applies_to=applies_to,
    )


def zero0_grad_norm_patch(applies_to: Predicate) -> Patch:
    """``DeepSpeedEngine._take_model_step`` → also record the gradient norm when no optimizer wrapper does.

    The engine reports the norm its optimizer wrapper computed (ZeRO 1-3, fp16, bf16:
    ``self._global_grad_norm = self.optimizer._global_grad_norm``, deepspeed/runtime/engine.py:3519),
    and accelerate hands that to the Trainer (``clip_grad_norm_`` under DeepSpeed returns
    ``get_global_grad_norm()``, accelerate/accelerator.py:3023-3027). Under ZeRO-0 in fp32 the engine
    steps the bare optimizer, which has no such attribute: the norm stays None and the Trainer logs no
    ``grad_norm``. The engine also clips (engine.py:3506-3511), steps and zeroes the gradients before the
    Trainer can look, so the wrapper measures the norm first: the gradients are then reduced over every
    rank and whole on each (ZeRO-0 shards nothing), so this is the global norm before clipping, what the
    wrappers and DDP's Trainer report.
    """

    def replacement(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def _take_model_step(self: Any, lr_kwargs: Any) -> Any:
            # A loss-scaled autocast step holds scaled gradients until the engine unscales them.
            if hasattr(self.optimizer, "_global_grad_norm") or self.torch_autocast_z0_gradscaler:
                return original(self, lr_kwargs)
            import torch

            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
            result = original(self, lr_kwargs)
            self._global_grad_norm = norm
            return result

        return _take_model_step

    return Patch(
        name="deepspeed-zero0-grad-norm",
        target="deepspeed.runtime.engine:DeepSpeedEngine._take_model_step",
        replacement=replacement,
        reason=(
            "Gives the Trainer a grad_norm under ZeRO-0 in fp32, as under ZeRO 1-3.\n"
            "deepspeed/runtime/engine.py:3519 takes the norm from the optimizer wrapper only; ZeRO-0 in fp32 "
            "steps the bare optimizer, so get_global_grad_norm() stays None."
        ),
        remove_when="DeepSpeed records the gradient norm when it steps an unwrapped optimizer.",
        requires=versions.written_for("deepspeed"),
        signature=("self", "lr_kwargs"),
        applies_to=applies_to,
    )


def deepspeed_engine_patches(applies_to: Predicate) -> list[Patch]:
    """The patches of DeepSpeed's engine, whatever computes the attention, in the order they are applied.

    Args:
        applies_to: When they apply (the registry passes an :class:`OnDeepSpeedEngine`).
    """
    return [
        skip_shm_op_build_patch(applies_to),
        deepspeed_cpu_backend_patch(applies_to),
        zero0_grad_norm_patch(applies_to),
    ]
