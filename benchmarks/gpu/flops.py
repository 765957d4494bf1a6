"""Training FLOPs per token and MFU, counting attention (``notes/field.md`` section 4).

Per token, a training step (forward + backward) costs ``6·P`` for the weights and
``12·L·h·S`` for attention over a sequence of ``S`` tokens (``h`` = query heads x
head dim), halved for causal attention: ``6P + 6·L·h·S``. Recomputation
(activation checkpointing) is not counted, as is customary, so MFU stays
comparable across settings. ``6P`` is kept for LoRA too, as published MFU figures
do; the hardware does less (no weight gradients of frozen weights), which
:func:`hardware_flops_per_token` reports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs to know about a decoder-only transformer."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False

    @property
    def attention_width(self) -> int:
        """``h`` of the attention term: query heads x head dim."""
        return self.heads * self.head_dim

    @property
    def parameters(self) -> int:
        """Weights of a Llama-style model (embeddings and output head included, biases none)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attention + mlp + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embeddings + self.hidden


LLAMA_31_8B = ModelShape(
    name="Llama-3.1-8B",
    layers=32,
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=14336,
    vocab=128256,
)

H100_BF16_DENSE_FLOPS = 989e12
"""Peak dense bf16 FLOP/s of an H100 SXM (and H200), the usual MFU denominator."""


def attention_flops_per_token(shape: ModelShape, seq_len: int, causal: bool = True) -> float:
    """Forward + backward attention FLOPs per token: ``12·L·h·S``, halved when causal."""
    full = 12.0 * shape.layers * shape.attention_width * seq_len
    return full / 2 if causal else full


def model_flops_per_token(shape: ModelShape, seq_len: int, causal: bool = True) -> float:
    """``6P`` plus attention: the numerator of MFU."""
    return 6.0 * shape.parameters + attention_flops_per_token(shape, seq_len, causal)


def hardware_flops_per_token(
    shape: ModelShape, seq_len: int, trainable_parameters: int, causal: bool = True
) -> float:
    """What a LoRA step computes: forward ``2P``, input gradients ``2P``, weight gradients of the adapter only."""
    weights = 4.0 * shape.parameters + 2.0 * trainable_parameters
    return weights + attention_flops_per_token(shape, seq_len, causal)


def mfu(tokens_per_second_per_gpu: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s per GPU over the GPU's peak."""
    return tokens_per_second_per_gpu * flops_per_token / peak_flops


def lora_parameters(shape: ModelShape, rank: int) -> int:
    """Adapter weights of LoRA on every linear layer of every block (``lora_target_linear``)."""
    q_out, kv_out = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    shapes = [
        (shape.hidden, q_out),
        (shape.hidden, kv_out),
        (shape.hidden, kv_out),
        (q_out, shape.hidden),
        (shape.hidden, shape.intermediate),
        (shape.hidden, shape.intermediate),
        (shape.intermediate, shape.hidden),
    ]
    return shape.layers * sum(rank * (fan_in + fan_out) for fan_in, fan_out in shapes)
