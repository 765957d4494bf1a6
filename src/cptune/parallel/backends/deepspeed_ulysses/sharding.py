"""The deepspeed backend: DeepSpeed's Ulysses attention, with cptune's sharding and DeepSpeed's engine.

cptune gives DeepSpeed's engine its config (ZeRO 0-3, :func:`deepspeed_config`) and accelerate the
same mesh as next to DDP (``dp_shard × cp``), and shards every batch itself, as for ring-flash-attn
and torch CP; from DeepSpeed 0.19 it takes the all-to-all attention:

* :func:`install_ulysses_attention` puts DeepSpeed's ``UlyssesSPAttentionHF`` around the model's core
  attention, over the mesh's ``cp`` group: each layer turns (this rank's tokens, all heads) into
  (all tokens, ``H/C`` heads), runs the core attention over the whole rows, and turns the result back
  (deepspeed/runtime/sequence_parallel/ulysses_sp.py:231-394).
* The ranks of a CP group load the same batches (accelerate's loader, with
  :func:`cptune.patches.zero_ring_patches.loader_shares_cp_batches_patch` under DeepSpeed), and
  :class:`DeepSpeedUlyssesBackend` gives each rank its contiguous ``1/C`` of every row. So a run
  trains the batches of the cp=1 run in the same steps and epochs, and DeepSpeed, given no
  sequence-parallel groups, averages the gradients over all ranks as DDP does.

Earlier cptune let accelerate wire Ulysses (``ParallelismConfig(sp_backend="deepspeed")``): DeepSpeed's
``UlyssesSPDataLoaderAdapter`` then trained the batches of a group's C ranks one after another, so with
several data-parallel groups a step held other rows than the cp=1 run's, an epoch whose batches did not
divide by the world size trained repeated rows, the epoch counter ran over a different number of
micro batches, and DeepSpeed kept process-wide sequence-parallel state after the run.

Evaluation runs the same way (sharded rows, Ulysses attention), as for the other backends.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cptune import versions
from cptune.errors import BackendUnavailableError, CptuneError
from cptune.labels import IGNORE_INDEX
from cptune.parallel.backends.attention import (
    ATTENTION_KWARG,
    AttentionCall,
    check_window_support,
    refuse_sinks,
    refuse_windowed_layers,
)
from cptune.parallel.backends.base import SameBatchForEveryCpRank, ShardedInputs
from cptune.parallel.backends.document_attention import (
    DOCUMENT_ATTENTION_NAME,
    DocumentAttention,
)
from cptune.parallel.shard import TokenBatch, TokenCoords, shard_contiguous

if TYPE_CHECKING:
    from cptune.config.recipe import Recipe

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


def check_heads(text_config: Any, cp_size: int, core: str, *, causal: bool = True) -> None:
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
    if core != "cptune":
        refuse_sinks(
            text_config,
            f"cp_backend: deepspeed with ulysses_attn_implementation: {core}",
            "DeepSpeed's Ulysses wrapper hands the core attention the sink logits of all heads while each rank "
            "attends 1/C of them (and sdpa has no place for a sink at all)",
            "Use ulysses_attn_implementation: cptune (the default), which applies each rank's heads' sinks.",
        )
    if core == "sdpa":
        refuse_windowed_layers(
            text_config,
            f"cp_backend: deepspeed with ulysses_attn_implementation: {core}",
            "DeepSpeed's Ulysses wrapper drops the attention mask, which is where sdpa gets its window",
            "Use ulysses_attn_implementation: cptune (the default; exact on CPU and GPU) or flash_attention_2.",
        )
    elif core == "cptune":
        check_window_support(
            text_config, "cp_backend: deepspeed with ulysses_attn_implementation: cptune", causal=causal
        )


# --- the DeepSpeed config -------------------------------------------------------------

# Keys the Trainer fills from the recipe (transformers/integrations/deepspeed.py:
# trainer_config_process); a DeepSpeed JSON may leave them out or set them to "auto".
_RECIPE_OWNED = {
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
}


def deepspeed_config(recipe: Recipe) -> dict[str, Any]:
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


# --- the attention and the batches -----------------------------------------------------------


def install_ulysses_attention(text_config: Any, core_name: str, group: Any, micro_batch_size: int) -> Any:
    """Route the model's core attention ``core_name`` through DeepSpeed's Ulysses all-to-all over ``group``.

    The wrapper goes into transformers' attention registry under the core attention's own name, as
    DeepSpeed's ``register_with_transformers`` puts its own (ulysses_sp.py:559-566: transformers keeps
    its special cases for that name); the run's ``attention-registry-run-scope`` patch takes it out
    again. cptune builds ``UlyssesSPAttentionHF`` itself instead of calling ``register_with_transformers``,
    which would create DeepSpeed's process-wide sequence-parallel groups: the mesh's ``cp`` group is the
    one the batches are sharded over. The wrapper drops the attention mask, which was built for this
    rank's slice (the core attention sees whole rows: documents come from ``position_ids``, which
    DeepSpeed gathers, and the causal mask from the core attention's own ``is_causal``).

    Args:
        text_config: The model's text config (heads, head size, key/value heads, layers).
        core_name: The ``attn_implementation`` the model was loaded with.
        group: The process group of this rank's CP group.
        micro_batch_size: Rows per batch (DeepSpeed's module reshapes with it).

    Returns:
        DeepSpeed's ``UlyssesSPAttentionHF`` module now in place.
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    heads = text_config.num_attention_heads
    module = UlyssesSPAttentionHF(
        attn=ALL_ATTENTION_FUNCTIONS[core_name],
        batch_size=micro_batch_size,
        attn_head_count=heads,
        attn_head_size=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
        kv_head_count=getattr(text_config, "num_key_value_heads", None) or heads,
        num_hidden_layers=text_config.num_hidden_layers,
        process_group=group,
        seq_length_is_variable=True,
    )
    module.core_attn_implementation = core_name

    def ulysses_attention(
        attn_module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any
    ):
        return module(attn_module, query, key, value, None, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[core_name] = ulysses_attention
    return module


def pad_rows(batch: TokenBatch, rows: int, pad_token_id: int) -> TokenBatch:
    """``batch`` with rows of padding added up to ``rows`` (each one document with no targets)."""
    missing = rows - batch.shape[0]
    if missing <= 0:
        return batch
    tokens = batch.shape[-1]
    like = batch.input_ids
    return TokenBatch(
        input_ids=torch.cat([like, like.new_full((missing, tokens), pad_token_id)]),
        position_ids=torch.cat(
            [
                batch.position_ids,
                torch.arange(tokens, device=like.device).expand(missing, tokens).to(batch.position_ids),
            ]
        ),
        shift_labels=torch.cat(
            [batch.shift_labels, batch.shift_labels.new_full((missing, tokens), IGNORE_INDEX)]
        ),
    )


class DeepSpeedUlyssesBackend(SameBatchForEveryCpRank):
    """Gives each rank of a CP group its contiguous slice of every row; DeepSpeed's Ulysses attends across them."""

    def __init__(
        self,
        *,
        core_attention: str,
        causal: bool,
        cp_size: int,
        cp_rank: int,
        micro_batch_size: int,
        pad_token_id: int,
        kv_heads_per_call: int | None = None,
    ):
        self.core_attention = core_attention
        self.kv_heads_per_call = kv_heads_per_call
        self.attn_implementation = CORE_ATTENTION_NAMES[core_attention]
        self.causal = causal
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.micro_batch_size = micro_batch_size
        self.pad_token_id = pad_token_id

    def shard(self, batch: TokenBatch) -> ShardedInputs:
        rows = batch.shape[0]
        # DeepSpeed's module reshapes with a fixed number of rows: the last evaluation batch gets rows
        # of padding (training batches are full: accelerate's even_batches).
        shard = shard_contiguous(
            pad_rows(batch, self.micro_batch_size, self.pad_token_id),
            self.cp_size,
            self.cp_rank,
            self.pad_token_id,
        )
        coords = TokenCoords(
            rows=torch.where(shard.coords.rows < rows, shard.coords.rows, -1), columns=shard.coords.columns
        )
        tokens = shard.tokens
        kwargs: dict[str, Any] = {"input_ids": tokens.input_ids, "position_ids": tokens.position_ids}
        call = None
        if self.core_attention == "cptune":
            call = AttentionCall(
                attend=DocumentAttention(self.causal, self.kv_heads_per_call, head_block=self.cp_rank),
                takes_window=self.causal,
                takes_sinks=True,
            )
            kwargs[ATTENTION_KWARG] = call
        return ShardedInputs(model_kwargs=kwargs, shift_labels=tokens.shift_labels, call=call, coords=coords)
