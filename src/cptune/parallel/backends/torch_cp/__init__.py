"""``cp_backend: torch``: torch's native context-parallel ring attention (DTensor SDPA dispatch).

This module is the backend as the rest of cptune sees it (:class:`TorchCp`, see
:mod:`cptune.parallel.backends.spec`); :mod:`.sharding` shards batches and drives torch's
dispatch around each step. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends import zero
from cptune.parallel.backends.spec import BackendPlan, CpBackendName, TrainerParallelism

if TYPE_CHECKING:
    from cptune.patches.core import Patch


class TorchCp:
    """torch's context-parallel SDPA, all-gather or all-to-all ring, optionally load-balanced."""

    name = CpBackendName.TORCH
    label = "cp_backend: torch"
    shards_inputs_itself = True
    drives_torch_cp = True
    runs_own_engine = False
    runs_under_zero = True
    attends_whole_layers = True
    splits_heads = False

    def recipe_rules(self, recipe: Any) -> Iterator[tuple[str, str]]:
        """torch context parallelism.

        - `cp_comm_strategy` and `cp_load_balance` apply only to `cp_backend: torch`.
        - With `cp_backend: torch` and `context_parallel_size > 1` (torch's attention takes no mask):
          `sample_packing: true` is refused (packed samples would attend to each other); with
          `causal: false`, `cp_load_balance: true` is refused (torch balances causal attention only) and
          `pad_to_sequence_len: true` is refused (every token would attend to the padding).
        """
        r = recipe
        if r.cp_backend != self.name:
            for key in ("cp_comm_strategy", "cp_load_balance"):
                if getattr(r, key) is not None:
                    yield key, "applies only to cp_backend: torch; remove it."
            return
        if r.context_parallel_size == 1:
            return
        if r.sample_packing:
            yield (
                "sample_packing",
                "cp_backend: torch cannot keep packed samples apart (torch's context-parallel attention takes "
                "no document mask), so they would attend to each other. Use cp_backend: ring-flash-attn, or "
                "sample_packing: false.",
            )
        if not r.causal and r.cp_load_balance:
            yield (
                "cp_load_balance",
                "torch's load balancing reorders tokens for causal attention only (it refuses it otherwise); "
                "with causal: false set cp_load_balance: false, or remove it.",
            )
        if not r.causal and r.pad_to_sequence_len:
            yield (
                "pad_to_sequence_len",
                "with cp_backend: torch and causal: false every token would attend to the padding (torch's "
                "context-parallel attention takes no padding mask). Use cp_backend: ring-flash-attn, or "
                "pad_to_sequence_len: false.",
            )

    def chunks_per_rank(self, recipe: Any) -> int:
        return 2 if recipe.resolved_cp_load_balance else 1

    def check_ready(self, recipe: Any, *, training: bool) -> None:
        # torch's context parallelism ships with torch; the recipe rules cover the rest.
        zero.check_ready_under_zero(recipe)

    def check_model(self, recipe: Any, cp_size: int, text_config: Any) -> None:
        return None  # the common checks (select.check_model_config) are all it needs

    def uses_cptune_attention(self, recipe: Any) -> bool:
        return True

    def sequence_split(self, recipe: Any) -> str:
        return "zigzag" if recipe.resolved_cp_load_balance else "contiguous"

    def check_prepared_rows(self, recipe: Any, prepared: Any) -> None:
        """With ``causal: false``: rows of one document whose length splits evenly over the CP ranks and,
        with more than one row per batch, rows of one length (:func:`.sharding.check_bidirectional_rows`)."""
        if recipe.context_parallel_size == 1 or recipe.causal:
            return
        if recipe.pad_to_sequence_len:
            return  # batches are not the rows as prepared; the recipe rules refuse this with causal: false
        import pyarrow.compute as pc

        from cptune.parallel.backends.torch_cp.sharding import check_bidirectional_rows

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

    def plan_lines(self, recipe: Any) -> list[str]:
        balance = "load-balanced" if recipe.resolved_cp_load_balance else "contiguous"
        attention = "causal" if recipe.causal else "bidirectional"
        return [f"attention:  {self.name} / {recipe.resolved_cp_comm_strategy} ring, {balance}, {attention}"]

    def trainer_parallelism(self, recipe: Any, dims: Any) -> TrainerParallelism:
        return zero.parallelism_under_zero(recipe, dims)

    def plan(self, recipe: Any, dims: Any, pad_token_id: int) -> BackendPlan:
        from cptune.parallel.backends.attention import ATTENTION_NAME
        from cptune.parallel.backends.torch_cp.sharding import TorchCpBackend

        def build(accelerator: Any, model: Any) -> TorchCpBackend:
            return TorchCpBackend(
                causal=recipe.causal,
                load_balance=recipe.resolved_cp_load_balance,
                comm_strategy=recipe.resolved_cp_comm_strategy,
                cp_mesh=accelerator.torch_device_mesh["cp"],
                pad_token_id=pad_token_id,
            )

        return BackendPlan(ATTENTION_NAME, build)

    def training_patches(self) -> Sequence[Patch]:
        from cptune.patches.core import ContextParallelWith, WithoutCuda
        from cptune.patches.torch_patches import torch_cp_cpu_sdpa_patch

        # On CUDA torch's context parallelism has handlers for the GPU attention ops itself.
        return (torch_cp_cpu_sdpa_patch(WithoutCuda(ContextParallelWith((self.name,)))),)

    def import_patches(self) -> Sequence[Patch]:
        return ()

    def attention_buffer_bytes(self, shape: Any, setup: Any) -> float:
        # The all-gather strategy gathers all K/V of the sequence, all-to-all rotates two blocks.
        blocks = 2 * setup.cp_size if setup.comm_strategy == "allgather" else 4
        return blocks * shape.kv_width * setup.dtype_bytes

    def zero_stage(self, recipe: Any) -> int | None:
        return zero.stage_under_zero(recipe)


TORCH_CP = TorchCp()
