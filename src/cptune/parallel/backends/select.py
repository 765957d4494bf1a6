"""Choose the context-parallel backend a recipe asks for.

The one place that maps ``cp_backend`` (and cp=1) to a backend implementation;
a new backend adds a branch here and a module beside this one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError
from cptune.parallel.backends.attention import ATTENTION_NAME, check_full_attention, register_attention
from cptune.parallel.backends.base import CpBackend
from cptune.parallel.backends.local import LocalBackend
from cptune.parallel.layout import ParallelDims

log = logging.getLogger("cptune.backends")


@dataclass(frozen=True)
class BackendPlan:
    """How to load the model and, once the accelerator exists, build the backend."""

    attn_implementation: str
    build: Callable[[Any], CpBackend]


def plan_backend(recipe: Recipe, dims: ParallelDims, pad_token_id: int) -> BackendPlan:
    """The backend for this recipe and process layout; imports its dependencies now."""
    if not dims.cp_enabled:
        local = LocalBackend(causal=recipe.causal)
        plan = BackendPlan(local.attn_implementation, lambda accelerator: local)
    elif recipe.cp_backend == "ring-flash-attn":
        plan = _ring_flash_attn(recipe, dims, pad_token_id)
    elif recipe.cp_backend == "torch":
        plan = _torch(recipe, pad_token_id)
    elif recipe.cp_backend == "deepspeed":
        plan = _deepspeed(recipe, dims, pad_token_id)
    else:  # validation refuses backends that have not landed
        raise CptuneError(f"cp_backend: '{recipe.cp_backend}' is not available in this version of cptune.")
    if plan.attn_implementation == ATTENTION_NAME:
        register_attention()
    return plan


def _ring_flash_attn(recipe: Recipe, dims: ParallelDims, pad_token_id: int) -> BackendPlan:
    from cptune.parallel.backends.ring_flash_attn import RingFlashAttnBackend, load_ring_flash_attn
    from cptune.parallel.kernels import flash_attn_available

    cuda, flash_attn = torch.cuda.is_available(), flash_attn_available()
    check_ring_precision(recipe, cuda=cuda, flash_attn=flash_attn)
    choice = describe_ring_kernels(recipe, cuda=cuda, flash_attn=flash_attn)
    if choice.slow_warning is not None:
        log.warning("%s", choice.slow_warning)
    kernels = load_ring_flash_attn()

    def build(accelerator: Any) -> CpBackend:
        cp_mesh = accelerator.torch_device_mesh["cp"]
        return RingFlashAttnBackend(
            func=recipe.resolved_ring_attn_func,
            causal=recipe.causal,
            heads_k_stride=recipe.heads_k_stride,
            cp_size=dims.cp_size,
            cp_rank=cp_mesh.get_local_rank(),
            group=cp_mesh.get_group(),
            pad_token_id=pad_token_id,
            kernels=kernels,
        )

    return BackendPlan(ATTENTION_NAME, build)


def _torch(recipe: Recipe, pad_token_id: int) -> BackendPlan:
    from cptune.parallel.backends.torch_cp import TorchCpBackend

    def build(accelerator: Any) -> CpBackend:
        return TorchCpBackend(
            causal=recipe.causal,
            load_balance=recipe.resolved_cp_load_balance,
            comm_strategy=recipe.resolved_cp_comm_strategy,
            cp_mesh=accelerator.torch_device_mesh["cp"],
            pad_token_id=pad_token_id,
        )

    return BackendPlan(ATTENTION_NAME, build)


def _deepspeed(recipe: Recipe, dims: ParallelDims, pad_token_id: int) -> BackendPlan:
    from cptune.parallel.backends import deepspeed_ulysses as ulysses

    ulysses.load_deepspeed()
    ulysses.check_resume_supported(recipe)
    core = recipe.resolved_ulysses_attn_implementation
    ulysses.check_core_attention_available(core)
    if core == "cptune":
        from cptune.parallel.backends.document_attention import register_document_attention

        register_document_attention()
    stage = ulysses.deepspeed_config(recipe)["zero_optimization"]["stage"]

    def build(accelerator: Any) -> CpBackend:
        if accelerator.num_processes != dims.world_size:
            raise CptuneError(
                f"DeepSpeed reports {accelerator.num_processes} processes, but {dims.world_size} were "
                "launched; the loss would be scaled wrongly. This is a bug in cptune's DeepSpeed setup: "
                "please report it."
            )
        return ulysses.DeepSpeedUlyssesBackend(
            core_attention=core,
            causal=recipe.causal,
            cp_size=dims.cp_size,
            cp_rank=dims.cp_rank(accelerator.process_index),
            gradient_divisor=ulysses.gradient_divisor(stage, dims.world_size, dims.cp_size),
            pad_token_id=pad_token_id,
            fixed_length=ulysses.gloo_fixed_length(recipe.sequence_len, dims.cp_size),
        )

    return BackendPlan(ulysses.CORE_ATTENTION_NAMES[core], build)


def uses_half_precision(recipe: Recipe) -> bool:
    """Whether the model computes in bf16/fp16 (``bf16: auto`` is bf16 on the GPUs cptune targets)."""
    return recipe.bf16 in (True, "auto") or bool(recipe.fp16)


def check_ring_precision(recipe: Recipe, *, cuda: bool, flash_attn: bool) -> None:
    """flash-attn's CUDA kernels take half precision only; the CPU stand-ins take any float.

    Called before launching (preflight) and again where the backend is built. Without flash-attn
    an fp32 run on a GPU falls back to the stand-ins, and :func:`slow_ring_kernels_warning` says so.
    """
    if cuda and flash_attn and not uses_half_precision(recipe):
        raise CptuneError(
            "cp_backend: ring-flash-attn runs flash-attn's CUDA kernels, which support bf16 and fp16 "
            "only; set bf16: true (or fp16: true)."
        )


@dataclass(frozen=True)
class RingKernelChoice:
    """Which kernels compute ring-flash-attn's blocks, and why (for ``cptune validate`` and the log)."""

    name: str
    slow_warning: str | None = None


def ring_kernel_choice(
    *, cuda: bool, flash_attn: bool, half: bool, torch_flash_missing: str | None = None
) -> RingKernelChoice:
    """The kernels ring-flash-attn will run (:mod:`cptune.parallel.kernels.dispatch` decides the same per call).

    Args:
        cuda: A CUDA device is present.
        flash_attn: The flash-attn package is installed.
        half: The model computes in bf16/fp16.
        torch_flash_missing: Why PyTorch's FlashAttention-2 cannot run here
            (``torch_flash.unavailable_reason()``), ``None`` when it can.
    """
    if flash_attn:
        return RingKernelChoice("flash-attn")
    if cuda and half and torch_flash_missing is None:
        return RingKernelChoice(
            "PyTorch's FlashAttention-2 (aten._flash_attention_forward/backward; flash-attn not installed)"
        )
    if not cuda:
        return RingKernelChoice("cptune's pure-PyTorch stand-ins (flash-attn not installed)")
    why = (
        "fp32, and PyTorch's FlashAttention-2 takes bf16/fp16 only"
        if not half
        else f"PyTorch's FlashAttention-2 cannot run here: {torch_flash_missing}"
    )
    # Measured on one H100 (bf16, causal, 32 query / 8 KV heads of 128, forward and backward of one
    # 16384-token sequence): the stand-ins 1500 ms, PyTorch's flash SDPA 13.9 ms, and twice the memory.
    fix = "set bf16: true" if not half else "install flash-attn (pip install -e '.[flash-attn]')"
    warning = (
        f"ring-flash-attn computes attention with cptune's pure-PyTorch stand-in kernels ({why}); they "
        "are exact but about 100x slower than flash attention on a GPU (measured on an H100 at 16K "
        f"tokens) and use twice its memory. To run fused kernels, {fix}, or use cp_backend: torch."
    )
    return RingKernelChoice(f"cptune's pure-PyTorch stand-ins ({why})", warning)


def describe_ring_kernels(recipe: Recipe, *, cuda: bool, flash_attn: bool) -> RingKernelChoice:
    """:func:`ring_kernel_choice` for this recipe on this machine."""
    from cptune.parallel.kernels import torch_flash

    return ring_kernel_choice(
        cuda=cuda,
        flash_attn=flash_attn,
        half=uses_half_precision(recipe),
        torch_flash_missing=torch_flash.unavailable_reason() if cuda else None,
    )


def uses_cptune_attention(recipe: Recipe, dims: ParallelDims) -> bool:
    """Whether cptune's own attention function computes the model's attention in this layout.

    It does at cp > 1 (ring-flash-attn, torch, and deepspeed with its ``cptune`` core attention)
    and for bidirectional attention at cp = 1 (:class:`LocalBackend`).
    """
    if not dims.cp_enabled:
        return not recipe.causal
    if recipe.cp_backend == "deepspeed":
        return recipe.resolved_ulysses_attn_implementation == "cptune"
    return True


def sequence_split(recipe: Recipe) -> str:
    """How the backend splits a row's tokens over the ranks, for ``cptune preprocess --report``.

    ``contiguous`` (one slice per rank), ``zigzag`` (chunks r and 2C-1-r), or ``heads`` (DeepSpeed
    Ulysses: every rank attends over the whole row for its share of the heads, so the causal work
    is even whatever the documents).
    """
    if recipe.cp_backend == "deepspeed":
        return "heads"
    if recipe.cp_backend == "torch":
        return "zigzag" if recipe.resolved_cp_load_balance else "contiguous"
    return "zigzag" if recipe.resolved_ring_attn_func == "batch_zigzag" else "contiguous"


# Config keys of dropouts on hidden states (and GPT-2-style attention probabilities) in transformers'
# decoder models. Llama, Qwen2/3 and Mistral have none of them (only attention_dropout).
HIDDEN_DROPOUT_KEYS = (
    "hidden_dropout",
    "hidden_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "embedding_dropout",
    "residual_dropout",
    "activation_dropout",
    "ffn_dropout",
    "dropout",
)


def check_hidden_dropout(text_config: Any) -> None:
    """Refuse a model's own dropout under CP: its masks come from each rank's generator.

    torch's dropout draws masks element by element from the process's generator, so CP
    rank ``r`` would draw the bits rank 0 draws, not its slice of the masks a cp=1 run
    draws. LoRA dropout is made exact (:mod:`cptune.parallel.dropout`); a model's own
    dropout runs inside its code, where cptune cannot key it.

    Raises:
        CptuneError: the config enables one (checked before any weight is loaded).
    """
    for key in HIDDEN_DROPOUT_KEYS:
        value = getattr(text_config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            raise CptuneError(
                f"base_model: its config sets {key}: {value}, a dropout inside the model whose masks cptune "
                "cannot split exactly across context-parallel ranks (each rank would draw its own instead of "
                f"its slice of the cp=1 masks). Set {key} to 0 in the model's config.json (fine-tunes rarely "
                "use it; lora_dropout is exact under CP), or use context_parallel_size: 1."
            )


def check_model_config(recipe: Recipe, dims: ParallelDims, config: Any, model_class: type | None) -> None:
    """Refuse a model whose attention the chosen backend cannot split (before loading weights)."""
    text = config.get_text_config()
    if not dims.cp_enabled and recipe.causal:
        return  # transformers' own attention (sdpa) runs: nothing of cptune's to refuse
    # What computes the attention, for the messages.
    computed_by = (
        f"cp_backend: {recipe.cp_backend}" if dims.cp_enabled else "cptune's bidirectional attention"
    )
    if not (dims.cp_enabled and recipe.cp_backend == "deepspeed"):
        # cptune's own attention function runs here (cp > 1, or bidirectional at cp=1); DeepSpeed's
        # core attention has its own check (check_heads), as flash_attention_2 keeps windows there.
        check_full_attention(text, computed_by)
    # What avoids cptune's attention: cp=1, and causal: true where bidirectional attention brings it in.
    fallback = "context_parallel_size: 1" if recipe.causal else "context_parallel_size: 1 with causal: true"
    if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
        need = (
            "its attention cannot be split across context-parallel ranks"
            if dims.cp_enabled
            else "cptune cannot give it bidirectional attention (causal: false)"
        )
        raise CptuneError(
            f"base_model: {model_class.__name__} does not route its attention through transformers' "
            f"AttentionInterface, so {need}. Use a model that does (e.g. Llama, Qwen2/3, Mistral), "
            f"or {fallback}."
        )
    dropout = getattr(text, "attention_dropout", 0.0) or 0.0
    if dropout and uses_cptune_attention(recipe, dims):
        # Checked here, not only in the attention function, where it would surface at the first step.
        raise CptuneError(
            f"base_model: its config sets attention_dropout: {dropout}, but {computed_by} computes "
            "attention without dropout (cptune's attention does not support attention dropout). Set "
            f"attention_dropout to 0 in the model's config.json, or use {fallback}."
        )
    if not dims.cp_enabled:
        return
    check_hidden_dropout(text)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if recipe.cp_backend == "ring-flash-attn" and recipe.resolved_ring_attn_func == "varlen_llama3":
        from cptune.parallel.backends.ring_flash_attn import check_heads_k_stride

        check_heads_k_stride(kv_heads, recipe.heads_k_stride)
    if recipe.cp_backend == "deepspeed":
        from cptune.parallel.backends.deepspeed_ulysses import check_heads

        check_heads(text, dims.cp_size, recipe.resolved_ulysses_attn_implementation)


def check_prepared_rows(recipe: Recipe, prepared: Any) -> None:
    """Refuse prepared data that the recipe's backend would stop on at its first batch.

    cp_backend: torch with ``causal: false`` takes rows of one document whose length splits
    evenly over the CP ranks and, with more than one row per batch, rows of one length
    (:func:`~cptune.parallel.backends.torch_cp.check_bidirectional_rows`).

    Args:
        recipe: The validated recipe.
        prepared: Its :class:`~cptune.data.prepare.PreparedData`.
    """
    if recipe.context_parallel_size == 1 or recipe.cp_backend != "torch" or recipe.causal:
        return
    if recipe.pad_to_sequence_len:
        return  # batches are not the rows as prepared; the recipe rules refuse this with causal: false
    import pyarrow.compute as pc

    from cptune.parallel.backends.torch_cp import check_bidirectional_rows

    for split, rows in (("training", prepared.train), ("evaluation", prepared.eval)):
        if rows is None or len(rows) == 0:
            continue
        lengths = pc.list_value_length(rows.with_format("arrow")["input_ids"]).to_pylist()
        check_bidirectional_rows(
            lengths,
            split=split,
            cp_size=recipe.context_parallel_size,
            micro_batch_size=recipe.micro_batch_size,
        )
