"""The recipe: one frozen, validated object that every layer of cptune reads.

Key names follow Axolotl where Axolotl has the concept, so users can bring their
recipes. Keys Axolotl lacks (``cp_backend``, ``causal``, ...) are cptune's own. The
keys come in groups, one per domain (:mod:`~cptune.config.model`, :mod:`~cptune.config.data`,
:mod:`~cptune.config.adapter`, :mod:`~cptune.config.training`, :mod:`~cptune.config.preference`,
:mod:`~cptune.config.parallelism`), one per context-parallel backend (its package's ``keys``) and
the Axolotl keys cptune maps (:mod:`~cptune.config.axolotl`); :class:`Recipe` composes them flat,
so every key is top-level in the YAML. Problems that involve several keys are :mod:`cptune.config.rules`.
"""

from __future__ import annotations

from pydantic import BaseModel

from cptune.config.adapter import AdapterExtraKeys, AdapterKeys, QuantizationKeys
from cptune.config.axolotl.fsdp1 import Fsdp1Keys
from cptune.config.axolotl.mapped import AxolotlKeys, share_of_run
from cptune.config.base import Frozen
from cptune.config.data import DataKeys, TokenKeys
from cptune.config.model import ModelKeys
from cptune.config.parallelism import ContextParallelKeys, FsdpConfig, ShardingKeys, resolved_fsdp_config
from cptune.config.preference import PreferenceKeys
from cptune.config.training import MemoryKeys, OptimizerKeys, TrackingKeys, TrainingKeys
from cptune.parallel.backends.rows import KEY_GROUPS

KEY_GROUPS_IN_ORDER: tuple[type[BaseModel], ...] = (
    ModelKeys,
    DataKeys,
    AdapterKeys,
    TrainingKeys,
    PreferenceKeys,
    MemoryKeys,
    ShardingKeys,
    ContextParallelKeys,
    *KEY_GROUPS,  # each backend's keys (its package's KEYS), in the backend table's order
    Fsdp1Keys,
    AxolotlKeys,
    TrackingKeys,
    OptimizerKeys,
    TokenKeys,
    AdapterExtraKeys,
    QuantizationKeys,
)
"""The recipe's key groups in the order of its keys (``cptune validate`` prints them so, the reference page
lists them so): cptune's own domains, the backends', then the groups Axolotl's recipes brought."""


class Recipe(*reversed(KEY_GROUPS_IN_ORDER), Frozen):  # type: ignore[misc]  # pydantic lists the last base's keys first
    """A validated training recipe (reference: ``docs/reference/recipe.md``, generated from its key groups).

    Properties that combine keys of several groups are defined here; each group's own are on the group.
    """

    @property
    def resolved_fsdp_config(self) -> FsdpConfig:
        """``fsdp_config`` with what Axolotl's FSDP1 keys ask for (:mod:`cptune.config.axolotl.fsdp1`)."""
        return resolved_fsdp_config(self.fsdp, self.fsdp_config)

    @property
    def resolved_gradient_checkpointing(self) -> bool:
        return self.gradient_checkpointing or (
            self.is_fsdp and self.resolved_fsdp_config.activation_checkpointing
        )

    @property
    def resolved_lr_scheduler(self) -> tuple[str, dict[str, float]]:
        """The Trainer's lr_scheduler_type and lr_scheduler_kwargs: lr_scheduler, or with Axolotl's
        cosine_min_lr_ratio the cosine that ends at that share of the peak (``cosine_with_min_lr``, whose
        factor ``cos_part * (1 - ratio) + ratio`` is Axolotl's ``(1 - ratio) * cos_part + ratio``)."""
        if self.cosine_min_lr_ratio is not None and self.lr_scheduler == "cosine":
            return "cosine_with_min_lr", {"min_lr_rate": self.cosine_min_lr_ratio}
        return self.lr_scheduler, {}

    @property
    def resolved_dataset_processes(self) -> int | None:
        """Tokenization workers: dataset_processes, or Axolotl's dataset_num_proc (None: this process)."""
        return self.dataset_processes if self.dataset_processes is not None else self.dataset_num_proc

    @property
    def default_process_count(self) -> int:
        """Processes to start on one node when the command line does not say (``--nproc-per-node``)."""
        group = self.resolved_dp_replicate_size * self.context_parallel_size * self.tensor_parallel_size
        if self.dp_shard_size is not None:
            return group * self.dp_shard_size
        return group

    @property
    def resolved_report_to(self) -> tuple[str, ...]:
        """The Trainer's loggers: report_to plus what the Axolotl switches (use_tensorboard, W&B) turn on."""
        loggers = [r for r in self.report_to if r != "none"]
        for name, on in (("tensorboard", self.use_tensorboard), ("wandb", self.wandb_enabled)):
            if on and name not in loggers:
                loggers.append(name)
        return tuple(loggers)

    @property
    def has_eval_data(self) -> bool:
        return bool(self.val_set_size or self.test_datasets)

    @property
    def resolved_eval_steps(self) -> float | None:
        """eval_steps, or Axolotl's evals_per_epoch as a share of the run's steps (the Trainer's float steps)."""
        if self.eval_steps is not None:
            return self.eval_steps
        if self.evals_per_epoch and self.has_eval_data:
            return share_of_run(self.evals_per_epoch, self.num_epochs)
        return None

    @property
    def resolved_eval_strategy(self) -> str:
        """The Trainer's eval_strategy: eval_strategy (Axolotl's key), else ``steps`` when evaluation has a period."""
        if self.eval_strategy is not None and (self.eval_strategy == "no" or self.has_eval_data):
            return self.eval_strategy
        return "steps" if self.resolved_eval_steps else "no"

    @property
    def resolved_save_strategy(self) -> str:
        """The Trainer's save_strategy: save_strategy (Axolotl's key), else ``steps`` when checkpoints have a period."""
        if self.save_strategy is not None:
            return self.save_strategy
        return "steps" if self.resolved_save_steps else "no"

    @property
    def resolved_save_steps(self) -> float | None:
        """save_steps, or Axolotl's saves_per_epoch as a share of the run's steps."""
        if self.save_steps is not None:
            return self.save_steps
        if self.saves_per_epoch:
            return share_of_run(self.saves_per_epoch, self.num_epochs)
        return None

    @property
    def pair_sides_in_own_rows(self) -> bool:
        """Preference pairs without ``sample_packing`` go into a batch as one row per side (chosen, rejected).

        Every backend then sees rows of one document followed by padding, which causal attention keeps
        exact without a document mask (torch's CP attention, DeepSpeed's Ulysses with sdpa); packed pairs
        (two documents per pair in one row) need an attention that reads document boundaries.
        """
        return self.is_preference and not self.sample_packing

    @property
    def resolved_eval_batch_size(self) -> int:
        """Rows (pairs, with ``rl``) per process per evaluation forward: ``eval_batch_size``, else ``micro_batch_size``."""
        return self.eval_batch_size or self.micro_batch_size

    @property
    def rows_per_micro_batch(self) -> int:
        """Rows of a collated micro batch: ``micro_batch_size``, twice that when each pair side has its own row."""
        return self.micro_batch_size * (2 if self.pair_sides_in_own_rows else 1)

    @property
    def rows_per_eval_batch(self) -> int:
        """Rows of a collated evaluation batch: ``resolved_eval_batch_size``, twice that for pairs side by side."""
        return self.resolved_eval_batch_size * (2 if self.pair_sides_in_own_rows else 1)
