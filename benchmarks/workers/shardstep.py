"""One context-parallel training step assembled from cptune's own pieces, for the rank workers.

The step is what :class:`cptune.run.training.trainer.CptuneTrainer` does per micro batch,
without the Trainer around it: the backend chosen by
:meth:`cptune.run.plan.RunPlan.attention` shards the batch (built by
cptune's :class:`~cptune.data.collator.PackedCollator`), the tiny Llama of
:mod:`devtools.tiny` with cptune's LoRA runs forward inside the backend's step
context, the token-weighted loss of :mod:`cptune.parallel.loss` runs backward,
gradients are averaged over the CP group as DDP would, and AdamW steps.

One launch measures several CP sizes: for ``cp_size`` C in a world of W ranks
the ranks form W/C groups of C (a ``(dp_shard, cp)`` device mesh, as cptune
builds it), and only the first group computes; the others wait. Per-rank memory
and CPU time are then those of a C-rank run, while process start-up is paid once.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import EXAMPLE_DATA, EXAMPLE_MODEL
from benchmarks.memtrace import tensors_bytes

VOCAB = 768  # the tiny tokenizer's vocabulary (examples/tiny-llama)


def init_world() -> tuple[int, int]:
    """(rank, world size); joins the gloo process group when launched with several ranks.

    First, as a rank of ``cptune train`` does for its recipe, leaves bitsandbytes out
    (:mod:`cptune.run.training.unused_imports`): the recipes of :func:`make_recipe` quantize nothing.
    """
    from cptune.run.training.unused_imports import leave_out_bitsandbytes

    leave_out_bitsandbytes([make_recipe(1)])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
        return dist.get_rank(), world
    return 0, 1


def agree_max(values: Sequence[float]) -> list[float]:
    """Element-wise maximum over all ranks (every rank must call this in the same order)."""
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def make_recipe(cp_size: int, **keys: Any) -> Any:
    """A validated LoRA recipe for the tiny model (its data and model paths are never read here)."""
    from cptune.config.loader import validate_recipe

    data = {
        "base_model": str(EXAMPLE_MODEL),
        "datasets": [{"path": str(EXAMPLE_DATA), "type": "alpaca_instruct.load_no_prompt"}],
        "adapter": "lora",
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_target_linear": True,
        "context_parallel_size": cp_size,
        **keys,
    }
    return validate_recipe(data)


def make_batch(length: int, documents: Sequence[int] | None = None, seed: int = 0) -> Any:
    """One row of ``length`` tokens, all trained: one document, or packed documents of these lengths."""
    from cptune.data.collator import PackedCollator
    from cptune.parallel.shard import TokenBatch
    from devtools.tiny import PAD_TOKEN_ID

    documents = list(documents or [length])
    if sum(documents) != length:
        raise ValueError(f"documents {documents} do not add up to {length} tokens")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (length,), generator=generator).tolist()
    positions = [p for n in documents for p in range(n)]
    batch = PackedCollator(pad_token_id=PAD_TOKEN_ID)(
        [{"input_ids": ids, "labels": ids, "position_ids": positions}]
    )
    return TokenBatch(batch["input_ids"], batch["position_ids"], batch["shift_labels"])


@dataclass
class CpSetup:
    """The backend of one CP size in this process, and whether this rank computes with it."""

    cp_size: int
    plan: Any
    backend: Any
    group: Any
    active: bool


def setup_backend(recipe: Any, rank: int, world: int) -> CpSetup:
    """cptune's backend for ``recipe.context_parallel_size`` ranks; the first group of them is active."""
    from torch.distributed.device_mesh import init_device_mesh

    from cptune.run.plan import RunPlan
    from devtools.tiny import PAD_TOKEN_ID

    cp = recipe.context_parallel_size
    plan = RunPlan.build(recipe, world).attention(PAD_TOKEN_ID)
    if cp == 1:
        return CpSetup(1, plan, plan.build(None, None), None, rank == 0)
    # The names cptune gives its mesh axes (cptune.run.training.train: dp_shard × cp).
    mesh = init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp_shard", "cp"))
    backend = plan.build(SimpleNamespace(torch_device_mesh=mesh), None)
    return CpSetup(cp, plan, backend, mesh["cp"].get_group(), rank < cp)


def describe_backend(recipe: Any) -> str:
    """``ring-flash-attn / varlen_llama3``, ``torch``, ...: the backend a recipe runs at cp > 1."""
    from cptune.parallel.backends.table import backend_for

    return backend_for(recipe).run_name(recipe)


class ShardedStep:
    """A tiny Llama with LoRA and its optimizer, stepping on batches through a CP backend."""

    def __init__(
        self,
        recipe: Any,
        setup: CpSetup,
        model_overrides: dict[str, Any] | None = None,
        loss_chunk_elements: int | None = None,
    ):
        from cptune.models.loading import apply_lora, torch_dtype
        from cptune.models.memory_features import install_memory_features
        from cptune.parallel.backends.attention import count_attention_layers
        from cptune.parallel.loss import LOSS_CHUNK_ELEMENTS
        from devtools.tiny import build_tiny_model, tiny_llama_config

        self.setup = setup
        model = build_tiny_model(tiny_llama_config(VOCAB, **(model_overrides or {})), seed=0)
        model.to(torch_dtype(recipe))
        model.set_attn_implementation(setup.plan.attn_implementation)
        model.config.use_cache = False
        if recipe.resolved_gradient_checkpointing:  # as cptune.models.loading.load_model
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(recipe.seed)
        self.model = apply_lora(model, recipe)
        # The recipe's memory features, and the loss in chunks of this many logits (a benchmark may
        # scale cptune's LOSS_CHUNK_ELEMENTS to the tiny vocabulary).
        self.features = install_memory_features(self.model, recipe)
        self.loss_chunk_elements = loss_chunk_elements or LOSS_CHUNK_ELEMENTS
        if hasattr(self.features.loss, "chunk_elements"):
            self.features.loss.chunk_elements = self.loss_chunk_elements
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=1e-4)
        self.attention_layers = count_attention_layers(self.model)

    def __call__(self, batch: Any) -> float:
        """One optimizer step on ``batch``; returns the loss."""
        from cptune.models.head_loss import logits_loss
        from cptune.parallel.backends.attention import check_layers_served
        from cptune.parallel.backends.base import step_context
        from cptune.parallel.loss import count_targets, scaled_step_loss, token_loss_sum

        cp = self.setup.cp_size
        targets = count_targets(batch.shift_labels)
        with step_context(self.setup.backend):
            sharded = self.setup.backend.shard(batch)
            if self.features.loss is logits_loss:
                logits = self.model(**sharded.model_kwargs, use_cache=False).logits
                loss_sum = token_loss_sum(logits, sharded.shift_labels, self.loss_chunk_elements)
                del logits
            else:
                loss_sum = self.features.loss(self.model, sharded.model_kwargs, sharded.shift_labels)[0]
            if sharded.call is not None:
                check_layers_served(sharded.call, self.attention_layers)
            loss = scaled_step_loss(loss_sum, targets, cp)
            loss.backward()
        if cp > 1:
            for p in self.trainable:  # DDP's average over the ranks that share the batch
                dist.all_reduce(p.grad, group=self.setup.group)
                p.grad /= cp
        self.optimizer.step()
        # Gradients stay allocated between steps, so they count as model state, not as activations.
        self.optimizer.zero_grad(set_to_none=False)
        return float(loss.detach()) / cp

    def model_state_bytes(self) -> dict[str, int]:
        """Parameters, gradients and optimizer state held between steps."""
        optimizer_tensors = [
            t
            for state in self.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        ]
        return {
            "parameters": tensors_bytes(self.model.parameters()),
            "gradients": tensors_bytes(p.grad for p in self.trainable if p.grad is not None),
            "optimizer": tensors_bytes(optimizer_tensors),
        }

    def close(self) -> None:
        del self.model, self.optimizer, self.trainable
        gc.collect()
