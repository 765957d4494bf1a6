"""What one rank of the one-GPU multi-rank harness checks (:mod:`benchmarks.gpu.multirank` launches it).

Every rank builds the same inputs and the same model from fixed seeds, computes the cp=1
reference itself, and runs its shard through the real multi-rank code over the
:mod:`benchmarks.gpu.staged_gloo` group:

* ``attention``: ring-flash-attn's ``llama3_flash_attn_varlen_func`` (packed documents, one
  shorter than a shard; causal and bidirectional) and ``zigzag_ring_flash_attn_func`` (causal),
  bf16, on the kernels cptune gives it (PyTorch's FlashAttention-2 on CUDA); relative errors of
  the gathered output and gradients against float64 attention, next to the single-rank kernels'; and
  cptune's own zigzag ring (``batch_zigzag``'s windowed and gpt-oss layers) with a sliding window across
  chunks and ranks and gpt-oss's attention sinks, the sinks' gradient included.
* ``model``: a model (the tiny test Llama, or a Llama-3.1-8B-shaped one with fewer layers and
  random weights) with LoRA in bf16, through cptune's :class:`RingFlashAttnBackend`
  (``varlen_llama3`` on packed rows, ``batch_zigzag`` on one causal document) with the
  token-weighted loss, gradients averaged over the ranks as DDP does, 3 AdamW steps; against the
  same model at cp=1 (:class:`LocalBackend`, transformers' SDPA): step losses and the largest
  relative gradient difference at step 0.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu import reference
from cptune.labels import shift_labels_within_documents
from cptune.parallel.backends.base import step_context
from cptune.parallel.backends.local.sharding import LocalBackend
from cptune.parallel.backends.ring_flash_attn.sharding import RingFlashAttnBackend
from cptune.parallel.loss import count_targets, scaled_step_loss, token_loss_sum
from cptune.parallel.shard import TokenBatch


def gather(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    world = dist.get_world_size(group)
    full = torch.empty((world * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(full, tensor.contiguous(), group=group)
    return full


def attention_cases(ring: Any, group: Any, device: str, tokens: int, heads: tuple[int, int], head_dim: int,
                    zigzag_ring: Any = None):  # fmt: skip
    """Relative errors of ring-flash-attn's llama3 and zigzag functions, and of cptune's zigzag ring with a sliding
    window and gpt-oss's sinks (``zigzag_ring``: ``RingKernels.zigzag_ring``); see the module docstring."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator(device=device).manual_seed(1234)
    h, hk = heads

    def randn(*shape):
        return torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)

    q, dout, k, v = (
        randn(tokens, h, head_dim),
        randn(tokens, h, head_dim),
        randn(tokens, hk, head_dim),
        randn(tokens, hk, head_dim),
    )
    # Packed documents: a short one (shorter than a shard at cp=4), a long one across ranks, the rest.
    short, long = max(1, tokens // 16), tokens // 2
    bounds = [0, short, short + long, tokens]
    results = {}
    for causal in (True, False):
        expected = _reference(q, k, v, dout, lambda a, b, c, causal=causal: reference.varlen_attention(
            a, b, c, bounds, bounds, causal=causal))  # fmt: skip
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        cu_q, cu_k, max_q, max_k, k_slice = ring.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
        shard = slice(rank * tokens // world, (rank + 1) * tokens // world)
        leaves = [t[shard].clone().requires_grad_() for t in (q, k, v)]
        out = ring.llama3_flash_attn_varlen_func(
            *leaves, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=causal, group=group
        )
        out.backward(dout[shard])
        got = {"out": out.detach(), **{f"d{n}": leaf.grad for n, leaf in zip("qkv", leaves, strict=True)}}
        got = {name: gather(t, group) for name, t in got.items()}
        results[f"llama3 {'causal' if causal else 'bidirectional'}"] = _errors(got, expected)
    # zigzag: one causal document, chunks r and 2W-1-r on rank r.
    order = [c for r in range(world) for c in (r, 2 * world - 1 - r)]
    inverse = [order.index(c) for c in range(2 * world)]

    def local(t):
        return torch.cat([t.chunk(2 * world)[order[2 * rank + i]] for i in range(2)])[None]

    expected = _reference(
        q,
        k,
        v,
        dout,
        lambda a, b, c: reference.varlen_attention(a, b, c, [0, tokens], [0, tokens], causal=True),
    )
    leaves = [local(t).clone().requires_grad_() for t in (q, k, v)]
    out = ring.zigzag_ring_flash_attn_func(*leaves, causal=True, group=group)
    out.backward(local(dout))
    got = _zigzag_whole(out, leaves, group, inverse)
    results["zigzag causal"] = _errors(got, expected)
    if zigzag_ring is not None:
        results["zigzag ring, sliding window and sinks"] = _zigzag_sinks_case(
            zigzag_ring, group, generator, q, k, v, dout, local, inverse
        )
    return results


def _zigzag_whole(out, leaves, group, inverse) -> dict[str, torch.Tensor]:
    """The zigzag ring's out and q/k/v gradients as whole rows: every rank's chunks gathered, back in row order."""
    world = dist.get_world_size(group)
    whole = {}
    for name, tensor in {
        "out": out.detach(),
        **{f"d{n}": x.grad for n, x in zip("qkv", leaves, strict=True)},
    }.items():
        chunks = gather(tensor[0], group).chunk(2 * world)
        whole[name] = torch.cat([chunks[inverse[c]] for c in range(2 * world)])
    return whole


def _zigzag_sinks_case(zigzag_ring, group, generator, q, k, v, dout, local, inverse) -> dict[str, float]:
    """gpt-oss's layers on cptune's zigzag ring (``batch_zigzag``): a sliding window of a quarter of the row, so it
    crosses chunk and rank boundaries, and a sink per head applied once to the ring's merged ``(out, lse)``;
    out, dq, dk, dv and the sinks' gradient (each rank's summed over the group) against float64."""
    from cptune.parallel.kernels.sinks import attention_with_sinks

    tokens, heads, head_dim = q.shape
    window = max(2, tokens // 4)
    sinks = 2 * torch.randn(heads, generator=generator, device=q.device)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    kx, vx = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in leaves64[1:3])
    scores = torch.einsum("qhd,khd->hqk", leaves64[0], kx) * head_dim**-0.5
    seen = reference.visible_keys(tokens, tokens, window - 1, 0, q.device)
    logits = torch.cat(
        [scores.masked_fill(~seen, float("-inf")), leaves64[3][:, None, None].expand(-1, tokens, 1)], -1
    )
    out64 = torch.einsum("hqk,khd->qhd", logits.softmax(-1)[..., :-1], vx)
    out64.backward(dout.double())
    expected = {"out": out64.detach(), **{f"d{n}": x.grad for n, x in zip("qkv", leaves64[:3], strict=True)}}
    expected["dsinks"] = leaves64[3].grad
    leaves = [local(t).clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    out = attention_with_sinks(zigzag_ring(head_dim**-0.5, window, group), *leaves)
    out.backward(local(dout))
    got = _zigzag_whole(out, leaves[:3], group, inverse)
    dsinks = leaves[3].grad.clone()
    dist.all_reduce(dsinks, group=group)  # each rank's queries' share, as the gradient reduction adds them
    got["dsinks"] = dsinks
    return _errors(got, expected)


def _reference(q, k, v, dout, forward) -> dict[str, torch.Tensor]:
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, _ = forward(*leaves)
    out.backward(dout.double())
    return {"out": out.detach(), **{f"d{n}": leaf.grad for n, leaf in zip("qkv", leaves, strict=True)}}


def _errors(got: dict, expected: dict) -> dict[str, float]:
    return {name: reference.relative_error(got[name], expected[name]) for name in expected}


# ---- model parity ---------------------------------------------------------------------------


def make_batch(seed: int, seq_len: int, vocab: int, packed: bool, device: str) -> TokenBatch:
    """One row: three documents (packed) or one causal document; the first 2 tokens of each untrained."""
    generator = torch.Generator().manual_seed(seed)
    docs = [seq_len // 8, seq_len // 2, seq_len - seq_len // 8 - seq_len // 2] if packed else [seq_len]
    ids = torch.randint(3, vocab, (1, seq_len), generator=generator)
    positions = torch.cat([torch.arange(n) for n in docs])[None]
    labels = ids.clone()
    for start in itertools.accumulate([0, *docs[:-1]]):
        labels[0, start : start + 2] = -100
    batch = TokenBatch(ids, positions, shift_labels_within_documents(labels, positions))
    return TokenBatch(*(t.to(device) for t in (batch.input_ids, batch.position_ids, batch.shift_labels)))


def model_case(build_model, kernels: Any, group: Any, *, func: str, seq_len: int, vocab: int, device: str,
               steps: int = 3) -> dict[str, Any]:  # fmt: skip
    """cp=world through RingFlashAttnBackend against cp=1; see the module docstring."""
    from peft import LoraConfig, get_peft_model

    from cptune.parallel.backends.attention import register_attention

    register_attention()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(1234)
    base = construct(build_model, device)
    torch.manual_seed(7)
    reference_model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                      init_lora_weights=False))  # fmt: skip
    reference_model.set_attn_implementation("sdpa")
    model = copy.deepcopy(reference_model)
    model.set_attn_implementation("cptune")
    backend = RingFlashAttnBackend(func=func, causal=True, heads_k_stride=1, cp_size=world, cp_rank=rank,
                                   group=group, pad_token_id=0, kernels=kernels)  # fmt: skip
    local = LocalBackend(causal=True)
    params = [[p for p in m.parameters() if p.requires_grad] for m in (reference_model, model)]
    optimizers = [torch.optim.AdamW(p, lr=1e-3) for p in params]
    ref_losses, cp_losses, grad_rel = [], [], None
    for step in range(steps):
        batch = make_batch(step, seq_len, vocab, packed=func == "varlen_llama3", device=device)
        targets = count_targets(batch.shift_labels)
        ref_losses.append(_step(reference_model, local, batch, targets, 1))
        loss = torch.tensor(_step(model, backend, batch, targets, world), device=device)
        dist.all_reduce(loss, group=group)
        cp_losses.append(loss.item() / world)
        for p in params[1]:
            dist.all_reduce(p.grad, group=group)
            p.grad /= world
        if step == 0:
            grad_rel = max(
                float((mine.grad.float() - ref.grad.float()).abs().max() / ref.grad.float().abs().max().clamp_min(1e-30))
                for ref, mine in zip(params[0], params[1], strict=True)
            )  # fmt: skip
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return {"ref_losses": ref_losses, "cp_losses": cp_losses, "grad_rel": grad_rel,
            "loss_rel": max(abs(a - b) / abs(a) for a, b in zip(ref_losses, cp_losses, strict=True))}  # fmt: skip


def _step(model, backend, batch, targets, world) -> float:
    with step_context(backend):
        sharded = backend.shard(batch)
        logits = model(**sharded.model_kwargs, use_cache=False).logits
        loss = scaled_step_loss(token_loss_sum(logits, sharded.shift_labels), targets, world)
        loss.backward()
    return loss.item()


def construct(build_model, device: str) -> torch.nn.Module:
    """The model built straight on ``device`` in bf16 (an 8B-shaped one in fp32 on the host is slow)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return build_model().to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default)


def llama_31_8b_shaped(layers: int, vocab: int | None = None):
    """A builder of Llama-3.1-8B's shape with ``layers`` layers (random weights; memory, not quality)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.gpu.flops import LLAMA_31_8B as s

    config = LlamaConfig(vocab_size=vocab or s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, attention_dropout=0.0)  # fmt: skip
    return lambda: LlamaForCausalLM(config)


def tiny_llama(vocab: int):
    from devtools.tiny import build_tiny_model, tiny_llama_config

    return lambda: build_tiny_model(tiny_llama_config(vocab, num_key_value_heads=2), seed=1234)
