"""Recomputed norms (``recompute_norms: true``): the same bits, the bf16 input kept instead of an fp32 copy.

The tiny Llama of tests/models/test_memory_features.py in fp32, and in bf16 as accelerate runs a bf16
recipe (tests/models/test_memory_features_bf16.py: the forward under bf16 autocast, the backward
outside it, LoRA adapters in fp32), each with and without the recomputed norms.
"""

from __future__ import annotations

import pytest
import torch

from cptune.errors import CptuneError
from cptune.models.head_loss import HeadLoss
from cptune.models.offload import enable_activation_offloading
from cptune.models.recomputed_norms import decoder_norms, enable_recomputed_norms
from cptune.models.tiled_mlp import enable_tiled_mlp
from tests import reorder
from tests.models import test_memory_features as fp32_case
from tests.models import test_memory_features_bf16 as bf16_case
from tests.models.test_memory_features import TOKENS, batch, step

ROWS, HIDDEN = 2, 64  # batch(): 2 rows; the tiny Llama's width
BF16 = torch.bfloat16


def build(precision: str, lora: bool, checkpointing: bool = True) -> torch.nn.Module:
    case = bf16_case if precision == "bf16" else fp32_case
    return case.build(lora, checkpointing)


def assert_bit_identical(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert got[1].keys() == want[1].keys()
    differ = [n for n, g in want[1].items() if not torch.equal(got[1][n], g)]
    assert not differ, f"not bit-identical: {differ}"


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "not-checkpointed"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recomputed_norms_change_no_bit(precision, lora, checkpointing, monkeypatch):
    """The backward recomputes the norm's own forward on the same values: losses and every gradient
    (the norms' weights included in a full fine-tune) bit for bit those of the norms run as they are.
    In fp32 the norms run as they are (their upcast is no copy)."""
    from cptune.models import recomputed_norms

    plain = step(build(precision, lora, checkpointing))
    model = build(precision, lora, checkpointing)
    hooks = enable_recomputed_norms(model)
    assert len(hooks) == 4  # 2 layers x input and post-attention norms
    calls: list[torch.dtype] = []
    original = recomputed_norms.tiled_mlp

    def counted(run, x, tiles, params):
        calls.append(x.dtype)
        return original(run, x, tiles, params)

    monkeypatch.setattr(recomputed_norms, "tiled_mlp", counted)
    assert_bit_identical(step(model), plain)
    # bf16: every norm call with autograd on (the checkpointed layers' forward and their recomputation)
    assert calls == ([torch.bfloat16] * 4 * (1 + checkpointing) if precision == "bf16" else [])
    for hook in hooks:
        hook.remove()
    assert_bit_identical(step(model), plain)  # and the hooks come off


def norm_weight_magnitudes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Σ|terms| of each decoder norm's weight gradient, in float64: Σ over tokens of |grad_output| x
    |normalised input| (the bf16 operands of the weight's product). ``model`` is built without
    checkpointing, so each norm runs once."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, norm in model.named_modules():
        if name.endswith("layernorm"):

            def hook(module, args, out, name=name):
                x = args[0].float()
                normalised = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).to(
                    BF16
                )

                def keep(grad: torch.Tensor) -> None:
                    terms = grad.double().abs() * normalised.double().abs()
                    seen[f"{name}.weight"] = terms.reshape(-1, terms.shape[-1]).sum(0)

                out.register_hook(keep)

            handles.append(norm.register_forward_hook(hook))
    step(model)
    for handle in handles:
        handle.remove()
    return seen


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "not-checkpointed"])
def test_norms_recompute_in_tiles_of_tokens(lora, checkpointing, monkeypatch):
    """The recomputation runs over tiles of the tokens (ceil(tokens / width) of them; 40 tokens at width 64
    make one, so this test asks for more): per token the same bits, so every gradient is bit-identical
    but, in a full fine-tune, the norms' own weights', which the tiles sum in parts."""
    from cptune.models import recomputed_norms

    plain = step(build("bf16", lora, checkpointing))
    model = build("bf16", lora, checkpointing)
    enable_recomputed_norms(model)
    tiles = reorder.tiles(3)
    asked: list[int] = []
    monkeypatch.setattr(recomputed_norms, "mlp_tiles", lambda rows, width: asked.append(rows) or tiles)
    got = step(model)
    assert asked == [TOKENS] * 4 * (1 + checkpointing)
    norm_weights = set() if lora else {n for n in plain[1] if n.endswith("layernorm.weight")}
    assert len(norm_weights) == (0 if lora else 4)
    bf16_case.assert_bit_identical(got, plain, except_=norm_weights)
    if norm_weights:
        magnitudes = norm_weight_magnitudes(build("bf16", lora, checkpointing=False))
        assert set(magnitudes) == norm_weights
        # Bound: the same as the tiled MLP's weights (assert_within_split_sums): the whole sum rounds once
        # to bf16, the tiled one each tile's sum and each addition of the tiles' sums.
        bf16_case.assert_within_split_sums(got[1], plain[1], magnitudes, tiles, "recomputed norms")


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_recomputed_norms_with_every_memory_feature_in_bf16_change_no_bit(lora):
    def run(norms: bool):
        model = build("bf16", lora)
        enable_activation_offloading(model)
        enable_tiled_mlp(model, num_shards=reorder.tiles(3))
        if norms:
            enable_recomputed_norms(model)
        return step(model, HeadLoss(model))

    assert_bit_identical(run(True), run(False))


def saved_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors one decoder layer saves for its backward (weights not counted)."""
    # The last layer: under LoRA the first one's input needs no gradient, so its first norm keeps nothing.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer = base.model.layers[-1]
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
    layer.register_forward_pre_hook(lambda module, args: hooks.__enter__())
    layer.register_forward_hook(lambda module, args, out: hooks.__exit__(None, None, None))
    kwargs, _ = batch()
    model(**kwargs)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for pointer, size in storages.items() if pointer not in weights)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_bf16_layer_keeps_each_norms_bf16_input_instead_of_its_fp32_copy(lora):
    """Per token and norm, transformers' RMSNorm saves its input upcast to fp32 (4 bytes x width) and its
    fp32 reciprocal root (4 bytes), and in a full fine-tune its bf16 output for the weight's gradient
    (2 bytes x width); recomputed, it saves its bf16 input (2 bytes x width). Two norms per layer."""
    plain = saved_bytes(build("bf16", lora, checkpointing=False))
    model = build("bf16", lora, checkpointing=False)
    enable_recomputed_norms(model)
    kept = 4 * HIDDEN + 4 + (0 if lora else 2 * HIDDEN)
    assert plain - saved_bytes(model) == ROWS * TOKENS * 2 * (kept - 2 * HIDDEN)


def test_a_model_without_rmsnorm_in_its_layers_is_refused_before_loading(monkeypatch):
    from cptune.config.loader import validate_recipe
    from cptune.models.memory_features import check_memory_features
    from devtools.tiny import tiny_llama_config

    recipe = validate_recipe(
        {"base_model": "unused", "datasets": [{"path": "d.jsonl"}], "recompute_norms": True}
    )
    assert recipe.memory_features == ("recompute_norms",)
    check_memory_features(recipe, tiny_llama_config(97))  # a Llama has them
    with pytest.raises(ValueError, match="no RMSNorm"):
        decoder_norms(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    # A model whose layers hold no RMSNorm, as the meta-device copy the check builds.
    monkeypatch.setattr("cptune.models.loading.meta_model", lambda recipe, config: torch.nn.Linear(2, 2))
    with pytest.raises(CptuneError, match="recompute_norms: Linear has nothing to recompute"):
        check_memory_features(recipe, tiny_llama_config(97))


def test_qwen3s_per_head_query_and_key_norms_are_recomputed_too():
    """Qwen3 normalises each head of q and k (a (rows, tokens, heads, head_dim) input): the same bits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def build_qwen3() -> torch.nn.Module:
        config = Qwen3Config(
            vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, use_cache=False,
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model = Qwen3ForCausalLM(config).to(torch.bfloat16)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
        return model

    plain = step(build_qwen3())
    model = build_qwen3()
    assert len(enable_recomputed_norms(model)) == 8  # per layer: input, post-attention, q and k norms
    assert_bit_identical(step(model), plain)
