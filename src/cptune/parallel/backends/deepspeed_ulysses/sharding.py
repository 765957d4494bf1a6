"""The deepspeed backend: DeepSpeed's Ulysses sequence parallelism, driven by accelerate and the Trainer.

cptune hands the Trainer a ``ParallelismConfig(sp_backend="deepspeed", sp_size=C)``
and a DeepSpeed config; everything else is upstream code (DeepSpeed 0.19,
accelerate 1.15, transformers 5.23):

* accelerate's ``_prepare_deepspeed`` (accelerator.py:2395-2431) calls
  ``UlyssesSPAttentionHF.register_with_transformers``, which puts an all-to-all
  wrapper in place of the model's core attention: each layer turns (this rank's
  tokens, all heads) into (all tokens, ``H/C`` heads), runs the core attention over
  the whole sequence, and turns the result back (ulysses_sp.py:231-394).
* The Trainer wraps its training loader in ``UlyssesSPDataLoaderAdapter``
  (trainer.py:1797): every rank loads its own batch, the adapter gathers the C
  batches of a sequence-parallel group and hands each rank, one batch per micro
  step, its contiguous ``1/C`` slice (ulysses_sp.py:651-726). Batches therefore
  reach cptune's Trainer *already sharded* (:attr:`DeepSpeedUlyssesBackend.batch_is_sharded`).
* DeepSpeed sums every rank's gradient and divides by the data-parallel size
  ``D = W/C`` under ZeRO 0-2, but by the world size ``W`` under ZeRO-3 with
  reduce-scatter (see :func:`gradient_divisor`); cptune scales each rank's loss to
  match, so the step's gradient is that of the global token mean (invariant 5).

Evaluation runs without sequence parallelism: accelerate registers Ulysses with
``disable_in_eval=True``, so in eval mode the core attention sees a whole row on
one rank, and cptune's evaluation loop gives every rank of a group whole rows.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cptune import versions
from cptune.errors import BackendUnavailableError, CptuneError
from cptune.labels import IGNORE_INDEX
from cptune.parallel.backends.attention import (
    ATTENTION_KWARG,
    AttentionCall,
    windowed_layer_types,
)
from cptune.parallel.backends.base import ShardedInputs
from cptune.parallel.backends.document_attention import (
    DOCUMENT_ATTENTION_NAME,
    DocumentAttention,
)
from cptune.parallel.shard import TokenBatch, TokenCoords, pad_tokens

INSTALL_HINT = f"DS_BUILD_OPS=0 pip install 'deepspeed{versions.DEEPSPEED}' (or the cptune[deepspeed] extra)"


CORE_ATTENTION_NAMES: Mapping[str, str] = {
    "cptune": DOCUMENT_ATTENTION_NAME,
    "sdpa": "sdpa",
    "flash_attention_2": "flash_attention_2",
    "flash_attention_3": "flash_attention_3",
}
"""recipe ``ulysses_attn_implementation`` → the model's ``attn_implementation``, which DeepSpeed wraps."""


def load_deepspeed() -> None:
    """Import DeepSpeed's Ulysses module, or say how to install it.

    Raises:
        BackendUnavailableError: DeepSpeed cannot be imported.
    """
    try:
        importlib.import_module("deepspeed.runtime.sequence_parallel.ulysses_sp")
    except ImportError as err:
        raise BackendUnavailableError(
            f"cp_backend: deepspeed needs DeepSpeed, which cannot be imported here ({err}). "
            f"Install it with: {INSTALL_HINT}."
        ) from None


def check_core_attention_available(core: str) -> None:
    """flash_attention_2/3 need the flash-attn package (CUDA); cptune's and sdpa run anywhere."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    available = {
        "flash_attention_2": is_flash_attn_2_available,
        "flash_attention_3": is_flash_attn_3_available,
    }
    if core in available and not available[core]():
        raise BackendUnavailableError(
            f"ulysses_attn_implementation: {core} needs flash-attn on a CUDA GPU, which is not available "
            "here. Use ulysses_attn_implementation: cptune (exact everywhere), or install flash-attn."
        )


def check_resume_supported(recipe: Any) -> None:
    """Resuming needs the Trainer to skip batches, which DeepSpeed's Ulysses loader cannot do yet."""
    if getattr(recipe, "resume_from_checkpoint", None):
        raise CptuneError(
            "resume_from_checkpoint: resuming a cp_backend: deepspeed run is not supported yet: the Trainer "
            "skips the batches already trained with accelerate's skip_first_batches, which fails on "
            "DeepSpeed's UlyssesSPDataLoaderAdapter (it has no dataset). Start the run afresh; the other "
            "cp_backends resume their own runs."
        )


def check_heads(text_config: Any, cp_size: int, core: str) -> None:
    """Ulysses gives every rank whole heads: refuse head counts and attention it cannot split.

    Raises:
        CptuneError: query heads do not divide by ``cp_size``, key/value heads neither divide by
            nor divide ``cp_size``, or the model has sliding-window layers the core attention would drop.
    """
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    fits = [c for c in range(2, heads + 1) if heads % c == 0 and (kv_heads % c == 0 or c % kv_heads == 0)]
    if heads % cp_size:
        raise CptuneError(
            f"context_parallel_size: {cp_size} does not divide the model's {heads} query heads; "
            f"cp_backend: deepspeed (Ulysses) gives every rank whole heads. Choose context_parallel_size "
            f"in {fits}, or cp_backend: ring-flash-attn, which splits the sequence instead of the heads."
        )
    if kv_heads % cp_size and cp_size % kv_heads:
        # DeepSpeed replicates key/value heads when cp_size is a multiple of them (ulysses_sp.py:132-138).
        raise CptuneError(
            f"context_parallel_size: {cp_size} neither divides nor is a multiple of the model's {kv_heads} "
            f"key/value heads, which DeepSpeed's Ulysses attention needs. Choose context_parallel_size in "
            f"{fits}, or cp_backend: ring-flash-attn."
        )
    if windowed_layer_types(text_config) and core in ("cptune", "sdpa"):
        raise CptuneError(
            f"base_model: has sliding-window attention layers, which ulysses_attn_implementation: {core} "
            "would compute as full attention (DeepSpeed's Ulysses wrapper drops the mask). Use "
            "ulysses_attn_implementation: flash_attention_2 on GPUs, or a model with full attention only."
        )


# --- the DeepSpeed config -------------------------------------------------------------

# Keys the Trainer fills from the recipe (transformers/integrations/deepspeed.py:
# trainer_config_process); a DeepSpeed JSON may leave them out or set them to "auto".
_RECIPE_OWNED = {
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
}


def deepspeed_config(recipe: Any) -> dict[str, Any]:
    """The DeepSpeed config for this recipe: the ``deepspeed`` JSON (if any) with the ZeRO stage set.

    Values the recipe already decides (batch sizes, accumulation, clipping, precision)
    are ``"auto"``, which the Trainer fills in.

    Raises:
        CptuneError: the JSON cannot be read, or contradicts the recipe.
    """
    config = _read_json(recipe.deepspeed) if recipe.deepspeed else {}
    where = f"deepspeed: {recipe.deepspeed}"
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise CptuneError(
                f"{where} has an '{section}' section; cptune takes the optimizer and learning-rate "
                "schedule from the recipe (optimizer, learning_rate, lr_scheduler, warmup_*). Remove it."
            )
    for key, recipe_key in _RECIPE_OWNED.items():
        value = config.get(key, "auto")
        wanted = getattr(recipe, recipe_key)
        if key == "gradient_clipping":
            wanted = wanted or 0.0  # the Trainer's max_grad_norm: null and 0 both mean no clipping
        if value != "auto" and value != wanted:
            raise CptuneError(
                f"{where} sets {key}: {value}, but the recipe's {recipe_key} is {wanted}. "
                f'Set it to "auto" (or remove it): cptune fills it from the recipe.'
            )
    if config.get("train_batch_size", "auto") != "auto":
        raise CptuneError(
            f'{where} sets train_batch_size; set it to "auto" (or remove it): it follows from '
            "micro_batch_size, gradient_accumulation_steps and the number of processes."
        )
    zero = dict(config.get("zero_optimization", {}))
    stage = zero.get("stage", 0)
    if recipe.zero_stage is not None and "stage" in zero and stage != recipe.zero_stage:
        raise CptuneError(
            f"zero_stage: {recipe.zero_stage} contradicts zero_optimization.stage: {stage} in {where}; "
            "set one of them."
        )
    stage = recipe.zero_stage if recipe.zero_stage is not None else stage
    if stage == 3 and zero.get("reduce_scatter", True) is False:
        raise CptuneError(
            f"{where}: ZeRO-3 with reduce_scatter: false averages some gradient buckets over the "
            "data-parallel ranks and others over all ranks (deepspeed/runtime/zero/stage3.py:1673-1679), "
            "so no loss scale makes the gradient exact. Remove reduce_scatter (it defaults to true)."
        )
    zero["stage"] = stage
    config.update(
        zero_optimization=zero,
        train_micro_batch_size_per_gpu="auto",
        gradient_accumulation_steps="auto",
        train_batch_size="auto",
        gradient_clipping="auto",
    )
    for precision in ("bf16", "fp16"):
        config[precision] = {**config.get(precision, {}), "enabled": "auto"}
    return config


def _read_json(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise CptuneError(
            f"deepspeed: cannot read the DeepSpeed config '{path}' ({err.strerror or err}). Fix the path "
            "(relative paths are read from the folder cptune runs in)."
        ) from None
    except json.JSONDecodeError as err:
        raise CptuneError(f"deepspeed: '{path}' is not valid JSON ({err}).") from None
    if not isinstance(data, dict):
        raise CptuneError(f"deepspeed: '{path}' must hold a JSON object (a DeepSpeed config).")
    return data


def gradient_divisor(zero_stage: int, world_size: int, cp_size: int) -> int:
    """What DeepSpeed 0.19 divides the sum of all ranks' gradients by, under Ulysses.

    ZeRO 0 (engine.py:3884, ``dp_world_size = seq_dp_world / sp_size``) and ZeRO 1/2
    (stage_1_and_2.py:1508 and :1688) divide by the data-parallel size ``W/C``;
    ZeRO-3 with reduce-scatter pre-divides by the whole sequence-data-parallel
    group (coalesced_collectives.py:124 via stage3.py:1678), i.e. by ``W``.
    """
    return world_size if zero_stage == 3 else world_size // cp_size


# --- batches ----------------------------------------------------------------------------


def labels_for_plain_shift(shift_labels: torch.Tensor) -> torch.Tensor:
    """``labels`` whose plain shift (DeepSpeed's adapter, ulysses_sp.py:712-714) gives ``shift_labels``.

    The adapter drops ``labels`` and builds ``shift_labels = labels[..., 1:] + [-100]``,
    which would train the last token of each packed document on the first token of
    the next. Handing it cptune's per-document targets moved one place right makes
    its shift reproduce them exactly: the last target of a row is always -100.
    """
    labels = torch.full_like(shift_labels, IGNORE_INDEX)
    labels[..., 1:] = shift_labels[..., :-1]
    return labels


@dataclass(frozen=True)
class UlyssesCollator:
    """Wraps cptune's collator so its batches fit DeepSpeed's data-loader adapter.

    The adapter needs every tensor as (rows, tokens) with the token count a multiple
    of ``cp_size`` (ulysses_sp.py:684-707), so rows are padded (padding is a
    document of its own with no targets), ``labels`` carries the targets as
    :func:`labels_for_plain_shift` describes, and the token count for throughput is
    a plain ``int``, which the adapter passes through unsharded. With
    ``fixed_length`` (a multiple of ``cp_size``) every batch is padded to that many
    tokens: the adapter all-gathers the batches of a group (ulysses_sp.py:686-692),
    and gloo's all-gather takes equal shapes only.
    """

    collate: Callable[[Any], dict[str, Any]]
    cp_size: int
    pad_token_id: int
    fixed_length: int | None = None

    def __call__(self, rows: Any) -> dict[str, Any]:
        batch = self.collate(rows)
        tokens = TokenBatch(batch["input_ids"], batch["position_ids"], batch["shift_labels"])
        multiple = self.cp_size
        if self.fixed_length is not None:
            if tokens.shape[-1] > self.fixed_length:
                raise ValueError(f"a batch of {tokens.shape[-1]} tokens is longer than {self.fixed_length}")
            multiple = self.fixed_length  # a multiple of cp_size: pads up to exactly that length
        tokens = pad_tokens(tokens, multiple, self.pad_token_id)
        out = {
            "input_ids": tokens.input_ids,
            "position_ids": tokens.position_ids,
            "shift_labels": tokens.shift_labels,
            "labels": labels_for_plain_shift(tokens.shift_labels),
        }
        if "num_tokens" in batch:
            out["num_tokens"] = int(batch["num_tokens"])
        return out


class DeepSpeedUlyssesBackend:
    """Model inputs for one rank under Ulysses; the shard itself comes from DeepSpeed's adapter."""

    #: the loader hands each rank its shard (counted once across the world, not once per CP rank)
    batch_is_sharded = True
    #: what DeepSpeed divides the sum of all ranks' gradients by (set per run from the ZeRO stage)
    gradient_divisor: int | None = None

    def __init__(
        self,
        *,
        core_attention: str,
        causal: bool,
        cp_size: int,
        cp_rank: int,
        gradient_divisor: int,
        pad_token_id: int,
        fixed_length: int | None = None,
    ):
        self.core_attention = core_attention
        self.attn_implementation = CORE_ATTENTION_NAMES[core_attention]
        self.causal = causal
        self.cp_size = cp_size
        #: this rank's place in its sequence-parallel group (DeepSpeed's groups are consecutive ranks)
        self.cp_rank = cp_rank
        #: what DeepSpeed divides the sum of all ranks' gradients by
        self.gradient_divisor = gradient_divisor
        self.pad_token_id = pad_token_id
        self.fixed_length = fixed_length

    def shard(self, batch: TokenBatch) -> ShardedInputs:
        kwargs: dict[str, Any] = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
        call = None
        if self.core_attention == "cptune":
            call = AttentionCall(attend=DocumentAttention(self.causal))
            kwargs[ATTENTION_KWARG] = call
        # The adapter gave this rank the contiguous slice cp_rank of each padded row
        # (ulysses_sp.py:724). Evaluation runs whole rows on each rank, but there dropout, the
        # only reader of the coordinates, is off.
        rows, tokens = batch.shape
        columns = torch.arange(tokens, device=batch.input_ids.device) + self.cp_rank * tokens
        coords = TokenCoords(
            rows=torch.arange(rows, device=columns.device).unsqueeze(1).expand(rows, tokens),
            columns=columns.expand(rows, tokens),
        )
        return ShardedInputs(model_kwargs=kwargs, shift_labels=batch.shift_labels, call=call, coords=coords)

    def batch_number(self, micro_index: int, dp_rank: int, dp_size: int) -> int:
        """Which batch of the data loader's order this rank's micro batch ``micro_index`` is.

        Every rank loads its own batches (rank ``r`` gets batches ``k·W + r``), and the
        adapter has a sequence-parallel group train the batches of its ``C`` ranks one
        after another, one per micro step (ulysses_sp.py:651-726).
        """
        world = dp_size * self.cp_size
        return (micro_index // self.cp_size) * world + dp_rank * self.cp_size + micro_index % self.cp_size

    def wrap_collator(self, collate: Callable[[Any], dict[str, Any]]) -> UlyssesCollator:
        return UlyssesCollator(collate, self.cp_size, self.pad_token_id, self.fixed_length)

    def step_context(self) -> AbstractContextManager:
        return nullcontext()  # DeepSpeed's adapter needs nothing around the forward and backward


def gloo_fixed_length(sequence_len: int, cp_size: int) -> int | None:
    """On gloo, the length every batch is padded to (see :class:`UlyssesCollator`); else None."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return None
    return -(-sequence_len // cp_size) * cp_size


def ulysses_parallelism_config(recipe: Any, dp_size: int, cp_size: int) -> Any:
    """accelerate's ParallelismConfig for Ulysses (build it while cptune's patches are applied)."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    core = CORE_ATTENTION_NAMES[recipe.resolved_ulysses_attn_implementation]
    return ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=cp_size,
        # ZeRO's data-parallel axis; accelerate sizes DeepSpeed's train_batch_size with it
        # (accelerator.py:2360-2366) and builds no mesh for Ulysses.
        dp_shard_size=dp_size,
        sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True, sp_attn_implementation=core
        ),
    )
