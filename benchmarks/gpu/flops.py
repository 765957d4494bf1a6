"""Training FLOPs per token and utilization, counted two ways (``notes/field.md`` section 4).

Conventions (PaLM's appendix B, which torchtitan and Megatron follow): a matrix product of
``m x k`` by ``k x n`` costs ``2mkn``; per token, a weight matrix of ``P`` elements costs ``2P``
forward, ``2P`` for the input gradient and ``2P`` for its own gradient; attention over ``S``
tokens costs ``4·L·h·S`` forward (``QK^T`` and ``PV``, ``h`` = query heads x head dim) and twice
that backward, each halved for causal attention.

* **Model FLOPs** (MFU): what the training step must compute, without recomputation. A full
  fine-tune needs ``6P`` plus attention (:func:`full_model_flops_per_token`, the figure published
  MFU numbers use). A LoRA run freezes the base: its weights need the forward and the input
  gradient only, ``4P``, and the adapter ``6·P_lora``, plus the same attention
  (:func:`lora_model_flops_per_token`). Counting ``6P`` for LoRA credits the GPU with weight
  gradients it never computes (about a third more).
* **Hardware FLOPs** (HFU): what the GPU actually executes, recomputation included. With
  activation checkpointing every decoder layer's forward runs twice: one more ``2·P_layers``
  (the layers' weights, not the embeddings or the output head), ``2·P_lora`` and the attention
  forward (:func:`hardware_flops_per_token`).

Utilization = achieved FLOP/s per GPU over the GPU's dense bf16 peak (989 TFLOP/s for H100
SXM and H200, the usual denominator).
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
    def layer_parameters(self) -> int:
        """Weights of the decoder layers (attention, MLP, norms): what checkpointing recomputes."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp + 2 * self.hidden)

    @property
    def parameters(self) -> int:
        """Weights of a Llama-style model (embeddings and output head included, biases none)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layer_parameters + embeddings + self.hidden


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


def full_model_flops_per_token(shape: ModelShape, seq_len: int, causal: bool = True) -> float:
    """``6P`` plus attention: the model FLOPs of a full fine-tune (published MFU figures use it)."""
    return 6.0 * shape.parameters + attention_flops_per_token(shape, seq_len, causal)


def lora_model_flops_per_token(
    shape: ModelShape, seq_len: int, lora_parameters: int, causal: bool = True
) -> float:
    """``4P + 6·P_lora`` plus attention: the model FLOPs of a LoRA run (frozen base)."""
    weights = 4.0 * shape.parameters + 6.0 * lora_parameters
    return weights + attention_flops_per_token(shape, seq_len, causal)


def hardware_flops_per_token(
    shape: ModelShape, seq_len: int, lora_parameters: int, *, recompute: bool, causal: bool = True
) -> float:
    """LoRA model FLOPs plus, with activation checkpointing, the second forward of every layer."""
    flops = lora_model_flops_per_token(shape, seq_len, lora_parameters, causal)
    if recompute:
        attention_forward = attention_flops_per_token(shape, seq_len, causal) / 3
        flops += 2.0 * shape.layer_parameters + 2.0 * lora_parameters + attention_forward
    return flops


def mfu(tokens_per_second_per_gpu: float, flops_per_token: float, peak_flops: float) -> float:
    """Utilization: achieved FLOP/s per GPU (by the given count) over the GPU's peak."""
    return tokens_per_second_per_gpu * flops_per_token / peak_flops


def utilization(
    shape: ModelShape,
    seq_len: int,
    tokens_per_second_per_gpu: float,
    lora_parameters: int,
    *,
    recompute: bool,
    peak_flops: float = H100_BF16_DENSE_FLOPS,
) -> dict[str, float]:
    """The two figures every GPU result reports (and the 6P one, for comparison with published MFU)."""
    lora = lora_model_flops_per_token(shape, seq_len, lora_parameters)
    hardware = hardware_flops_per_token(shape, seq_len, lora_parameters, recompute=recompute)
    full = full_model_flops_per_token(shape, seq_len)
    return {
        "model_tflops_per_gpu": tokens_per_second_per_gpu * lora / 1e12,
        "mfu": mfu(tokens_per_second_per_gpu, lora, peak_flops),
        "hardware_tflops_per_gpu": tokens_per_second_per_gpu * hardware / 1e12,
        "hfu": mfu(tokens_per_second_per_gpu, hardware, peak_flops),
        "mfu_6p": mfu(tokens_per_second_per_gpu, full, peak_flops),
        "attention_share": attention_flops_per_token(shape, seq_len) / lora,
    }


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
