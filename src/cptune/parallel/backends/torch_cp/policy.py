"""What validation and planning ask of ``cp_backend: torch`` (:class:`TorchCp`). Imports no torch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from cptune.parallel.backends import zero
from cptune.parallel.backends.torch_cp import NAME

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe
    from cptune.parallel.backends.spec import BackendRuntime, SequenceSplit
    from cptune.parallel.memory import ModelShape


class TorchCp:
    """torch's context-parallel SDPA, all-gather or all-to-all ring, optionally load-balanced."""

    name = NAME
    label = f"cp_backend: {NAME}"
    variant_key = None
    shards_inputs_itself = True
    runs_own_engine = False
    runs_under_zero = True
    # check_model refuses sliding windows with torch's own reason
    attends_whole_layers = False
    splits_heads = False
    takes_tensor_parallel = False
    # Unpacked only: each side of a pair is a row of its own (Recipe.pair_sides_in_own_rows), one document
    # followed by padding, which causal attention keeps exact without a mask.
    trains_preference_pairs = True

    def run_name(self, recipe: Recipe) -> str:
        return self.label if self.name is None else self.name

    def recipe_rules(self, recipe: Recipe) -> Iterator[tuple[str, str]]:
        """torch context parallelism.

        - `cp_comm_strategy` and `cp_load_balance` apply only to `cp_backend: torch`.
        - With `cp_backend: torch` and `context_parallel_size > 1` (torch's attention takes no mask):
          `sample_packing: true` is refused (packed samples would attend to each other); with
          `causal: false`, `cp_load_balance: true` is refused (torch balances causal attention only) and
          `pad_to_sequence_len: true` is refused (every token would attend to the padding); `rl` with
          `causal: false` is refused (a pair's two sides are padded to one length in a batch).
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
        if not r.causal and r.is_preference:
            yield (
                "causal",
                f"rl: {r.rl} with cp_backend: torch and causal: false: each side of a pair is a row of its own, "
                "padded to the longer side, and torch's bidirectional context-parallel attention takes no padding "
                "mask. Use cp_backend: ring-flash-attn (it masks documents and padding), or causal: true.",
            )
        if not r.causal and r.pad_to_sequence_len:
            yield (
                "pad_to_sequence_len",
                "with cp_backend: torch and causal: false every token would attend to the padding (torch's "
                "context-parallel attention takes no padding mask). Use cp_backend: ring-flash-attn, or "
                "pad_to_sequence_len: false.",
            )

    def chunks_per_rank(self, recipe: Recipe) -> int:
        return 2 if recipe.resolved_cp_load_balance else 1

    def check_model(self, recipe: Recipe, cp_size: int, text_config: Any) -> None:
        from cptune.errors import CptuneError

        # gpt-oss has both (sinks on every layer, sliding windows on half): one message names every feature
        # torch cannot attend, so a user does not fix one to meet the next.
        refusals = []
        for refuse in (_refuse_sinks, _refuse_windows):
            try:
                refuse(text_config, self.label)
            except CptuneError as refused:
                refusals.append(str(refused))
        if refusals:
            raise CptuneError(" Also: ".join(refusals))
        # Beside the common checks (select.check_model_config): padding seen by a router loss.
        from cptune.parallel.router_padding import check_router_loss_padding

        if cp_size > 1:
            check_router_loss_padding(recipe, text_config, "cp_backend: torch")

    def uses_cptune_attention(self, recipe: Recipe) -> bool:
        return True

    def sequence_split(self, recipe: Recipe) -> SequenceSplit:
        return "zigzag" if recipe.resolved_cp_load_balance else "contiguous"

    def plan_lines(self, recipe: Recipe) -> list[str]:
        balance = "load-balanced" if recipe.resolved_cp_load_balance else "contiguous"
        attention = "causal" if recipe.causal else "bidirectional"
        return [f"attention:  {self.name} / {recipe.resolved_cp_comm_strategy} ring, {balance}, {attention}"]

    def attention_buffer_bytes(
        self, recipe: Recipe, shape: ModelShape, cp_size: int, dtype_bytes: int
    ) -> float:
        # The all-gather strategy gathers all K/V of the sequence, all-to-all rotates two blocks.
        blocks = 2 * cp_size if recipe.resolved_cp_comm_strategy == "allgather" else 4
        return blocks * shape.kv_width * dtype_bytes

    def zero_stage(self, recipe: Recipe) -> int | None:
        return zero.stage_under_zero(recipe)

    def runtime(self) -> BackendRuntime:
        from cptune.parallel.backends.torch_cp.runtime import RUNTIME

        return RUNTIME


POLICY = TorchCp()


def _refuse_sinks(text_config: Any, label: str) -> None:
    from cptune.parallel.backends.attention import refuse_sinks

    refuse_sinks(
        text_config,
        label,
        "PyTorch's context-parallel SDPA (torch 2.13) merges the ring's blocks inside scaled_dot_product_"
        "attention, which takes no sink and returns no log-sum-exp to put one into",
        "Use cp_backend: ring-flash-attn or cp_backend: deepspeed, or context_parallel_size: 1.",
    )


def _refuse_windows(text_config: Any, label: str) -> None:
    from cptune.parallel.backends.attention import refuse_windowed_layers

    refuse_windowed_layers(
        text_config,
        label,
        "PyTorch's context-parallel SDPA (torch 2.13, distributed/tensor/experimental/_context_parallel) "
        "rings the attention with is_causal only and takes no mask or window, so those layers would "
        "silently see the whole sequence",
        "Use cp_backend: ring-flash-attn or cp_backend: deepspeed, which attend sliding windows exactly, "
        "or context_parallel_size: 1.",
    )
