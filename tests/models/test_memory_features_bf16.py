"""Memory features at cp=1 in bf16, as ``cptune train`` runs a bf16 recipe, each on against off.

The tiny Llama of tests/models/test_memory_features.py loaded in bf16, LoRA adapters in fp32 (peft's
``autocast_adapter_dtype``), the model's forward under bf16 autocast and the backward outside it, as
accelerate prepares a bf16 model for the Trainer. The fp32 tests cannot see what only autocast
changes: the tiled MLP's backward once recomputed its tiles outside the forward's autocast, so a
LoRA branch ran in fp32 in the backward, in bf16 in the forward.

Each feature only reorders sums whose order it changes, so everything else is bit for bit the
same: the losses and the gradients of every parameter the feature does not compute, compared with
torch.equal. The parameters it does compute (the MLP's under tiles, the head's under the chunked
loss) are sums over tokens that the feature adds in parts; their bound is stated where it is used.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from cptune.models.head_loss import HeadLoss
from cptune.models.offload import enable_activation_offloading
from cptune.models.tiled_mlp import decoder_mlps, enable_tiled_mlp
from tests import reorder
from tests.models.test_memory_features import TARGETS, TOKENS, VOCAB, step
from tests.models.test_memory_features import build as build_model
from tests.numerics import assert_within, reorder_bound

BF16 = torch.bfloat16
ROWS = 2  # batch(): 2 rows of TOKENS tokens


def build(lora: bool, checkpointing: bool = True, targets="all-linear", **config) -> torch.nn.Module:
    """The tiny Llama in bf16 (LoRA adapters in fp32), its forward under bf16 autocast."""
    model = build_model(lora, checkpointing, targets, dtype=BF16, **config)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad) or not lora
    # What accelerate's prepare_model does for mixed_precision bf16: only the forward is autocast.
    model.forward = torch.autocast("cpu", dtype=BF16)(model.forward)
    return model


def gradient_magnitudes(model: torch.nn.Module, linears: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """Σ|terms| of the weight gradient of every ``nn.Linear`` whose name ``linears`` accepts, in float64.

    A linear layer's weight gradient is Σ over tokens of grad_output ⊗ input: here Σ |grad_output| ⊗
    |input| with the operands the bf16 product saw (its input cast to bf16, as autocast casts it).
    ``model`` is built without checkpointing, so each layer runs once.
    """
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []

    def keep(name: str):
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            x = args[0].to(BF16).double().abs().reshape(-1, args[0].shape[-1])

            def keep_grad(grad: torch.Tensor) -> None:
                seen[name] = (x, grad.double().abs().reshape(-1, grad.shape[-1]))

            out.register_hook(keep_grad)

        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and linears(name):
            handles.append(module.register_forward_hook(keep(name)))
    step(model)
    for handle in handles:
        handle.remove()
    return {f"{name}.weight": g.T @ x for name, (x, g) in seen.items()}


def assert_bit_identical(got: tuple, want: tuple, except_: set[str] = frozenset()) -> None:
    loss, grads = got
    assert torch.equal(loss, want[0]), (loss, want[0])
    differ = [n for n, g in want[1].items() if n not in except_ and not torch.equal(grads[n], g)]
    assert not differ, f"not bit-identical: {differ}"


def assert_within_split_sums(got: dict, want: dict, magnitudes: dict, parts: int, what: str) -> None:
    """Weight gradients that one path sums over all tokens at once and the other in ``parts`` parts.

    Bound: a bf16 GEMM accumulates its sum over tokens in fp32 and rounds it once to bf16 (torch's CPU
    and CUDA GEMMs do). The whole sum rounds once; the split one rounds each part's sum, then adds the
    parts in the parameter's dtype (fp32 for LoRA, bf16 in a full fine-tune, one rounding per addition).
    Each rounded partial sum is at most Σ|terms|, so the two differ by at most parts + 1 bf16 roundings
    of Σ|terms| (``reorder_bound(parts + 1, ., bf16)``), plus the two fp32 accumulations of the
    ROWS x TOKENS products in another order (``reorder_bound(tokens, ., fp32)``).
    """
    for name, magnitude in magnitudes.items():
        limit = reorder_bound(parts + 1, magnitude, BF16) + reorder_bound(ROWS * TOKENS, magnitude)
        assert_within(got[name], want[name], limit, f"{what}: gradient of {name}")


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_tiled_mlp_in_bf16_changes_only_the_mlp_weight_gradients(lora):
    """The tiles recompute under the forward's autocast: every other gradient is bit-identical.

    Before the fix the tiles' recomputation ran outside autocast: the attention's LoRA gradients of
    this test differed from the untiled run by about 1e-2 of their largest element.
    """
    untiled = step(build(lora))
    model = build(lora)
    tiles = reorder.tiles(3)
    enable_tiled_mlp(model, num_shards=tiles)
    tiled = step(model)
    mlp_names = {n for n in untiled[1] if ".mlp." in n}
    assert mlp_names and len(mlp_names) < len(untiled[1])
    # A GEMM's row does not depend on how many rows it is given: per token, the tiles compute what
    # the untiled MLP computes, so its output and its input's gradient are the same bits.
    assert_bit_identical(tiled, untiled, except_=mlp_names)
    magnitudes = gradient_magnitudes(build(lora, checkpointing=False), lambda name: ".mlp." in name)
    magnitudes = {n: m for n, m in magnitudes.items() if n in mlp_names}
    assert set(magnitudes) == mlp_names
    assert_within_split_sums(tiled[1], untiled[1], magnitudes, tiles, "tiled MLP")


def test_tiled_mlp_recomputes_under_the_forwards_autocast():
    """The tiles' recomputation sees the forward's autocast, even when the backward runs outside any."""
    model = build(lora=True, checkpointing=False)
    calls: list[tuple[int, torch.dtype]] = []
    mlp = decoder_mlps(model)[0]
    lora_a = mlp.gate_proj.lora_A["default"]
    lora_a.register_forward_hook(lambda m, args, out: calls.append((out.shape[-2], out.dtype)))
    enable_tiled_mlp(model, num_shards=2)
    step(model)
    # The MLP's own forward sees no tokens; then 2 tiles of 20 tokens, and the same 2 recomputed.
    assert calls == [(0, BF16)] + [(TOKENS // 2, BF16)] * 4


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_offloading_in_bf16_is_bit_exact(lora):
    plain = step(build(lora))
    model = build(lora)
    enable_activation_offloading(model)
    assert_bit_identical(step(model), plain)


@pytest.mark.parametrize(
    ("lora", "targets"),
    [(True, "all-linear"), (False, None), (True, ["q_proj", "lm_head"])],
    ids=["lora", "full", "lora-on-lm-head"],
)
def test_head_loss_in_bf16_changes_only_the_head_gradients(lora, targets):
    """The chunks run under the model's forward autocast, as the logits path's head does.

    Before that, a LoRA on ``lm_head`` ran in fp32 in the chunks (the Trainer computes the loss outside
    the model's autocast forward) and in bf16 in the logits path: every gradient differed.
    """
    whole = step(build(lora, targets=targets))
    model = build(lora, targets=targets)
    head_loss = HeadLoss(model)
    chunked = step(model, head_loss)
    head_names = {n for n in whole[1] if "lm_head" in n}
    # Bound of the loss: the same fp32 token losses, added in another order (chunk by chunk).
    assert_within(chunked[0], whole[0], reorder_bound(TARGETS, whole[0]), "loss")
    assert_bit_identical((whole[0], chunked[1]), whole, except_=head_names)
    if head_names:
        magnitudes = gradient_magnitudes(build(lora, False, targets), lambda name: "lm_head" in name)
        magnitudes = {n: m for n, m in magnitudes.items() if n in head_names}
        assert set(magnitudes) == head_names
        chunks = -(-TARGETS // max(1, head_loss.chunk_elements // VOCAB))
        assert_within_split_sums(chunked[1], whole[1], magnitudes, chunks, "head loss")


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_all_memory_features_in_bf16(lora):
    """Offloading, tiles and the chunked loss together: only the MLP's and the head's gradients move."""
    plain = step(build(lora))
    model = build(lora)
    enable_activation_offloading(model)
    tiles = reorder.tiles(3)
    enable_tiled_mlp(model, num_shards=tiles)
    head_loss = HeadLoss(model)
    got = step(model, head_loss)
    assert_within(got[0], plain[0], reorder_bound(TARGETS, plain[0]), "loss")
    moved = {n for n in plain[1] if ".mlp." in n or "lm_head" in n}
    assert_bit_identical((plain[0], got[1]), plain, except_=moved)
    magnitudes = gradient_magnitudes(build(lora, False), lambda name: ".mlp." in name or "lm_head" in name)
    chunks = -(-TARGETS // max(1, head_loss.chunk_elements // VOCAB))
    magnitudes = {n: m for n, m in magnitudes.items() if n in moved}
    assert set(magnitudes) == moved
    assert_within_split_sums(got[1], plain[1], magnitudes, max(tiles, chunks), "all features")
