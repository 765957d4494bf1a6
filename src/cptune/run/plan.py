"""One process's plan of a run, worked out once from the recipe and the launch: :class:`RunPlan`.

Every command that runs a backend builds it once, with :meth:`RunPlan.build`, and passes it down:
the launcher (preflight, ``cptune validate``), each rank of ``cptune train`` and ``cptune evaluate``,
and the benchmarks' workers. Nothing below it asks the recipe again which backend runs, how the
processes are laid out or which patches apply. (``cptune inference`` and ``merge-lora`` run no
backend: one process, the model's own attention; they share the weights loading of
:mod:`cptune.run.commands.weights` with ``evaluate``. ``cptune preprocess`` starts no processes: it
asks the table once for the backend whose rows it checks and reports.) Building it loads nothing and
imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cptune.config.recipe import Recipe
from cptune.parallel.backends.spec import BackendPlan, BackendPolicy, TrainerParallelism
from cptune.parallel.backends.table import BACKENDS, LOCAL, named_backend
from cptune.parallel.backends.zero import trains_on_deepspeed
from cptune.parallel.layout import ParallelDims
from cptune.patches.registry import build_patch_set

if TYPE_CHECKING:
    from cptune.patches.core import PatchSet


@dataclass(frozen=True)
class RunPlan:
    """The layout, the backend, the patch set and the memory features of one process's run.

    Attributes:
        recipe: The validated recipe.
        dims: How the launch's processes split into data-, context- and tensor-parallel axes.
        backend: The backend that computes the attention in this layout (the local one at
            context_parallel_size 1, whatever ``cp_backend`` says).
        cp_backend: The backend ``cp_backend`` names, which runs the recipe at every
            context_parallel_size above 1 (the memory estimates try other sizes with it).
        patches: The patches of a training or evaluation run with this recipe.
    """

    recipe: Recipe
    dims: ParallelDims
    backend: BackendPolicy
    cp_backend: BackendPolicy
    patches: PatchSet

    @classmethod
    def build(cls, recipe: Recipe, world_size: int) -> RunPlan:
        """The plan of ``recipe`` on ``world_size`` processes.

        Raises:
            LaunchError: the processes do not split into the recipe's axes.
        """
        dims = ParallelDims.from_recipe(recipe, world_size)
        cp_backend = named_backend(recipe)
        return cls(
            recipe=recipe,
            dims=dims,
            backend=LOCAL if dims.cp_size <= 1 else cp_backend,
            cp_backend=cp_backend,
            patches=build_patch_set(cp_backend, BACKENDS.values(), LOCAL),
        )

    def backend_at(self, cp_size: int) -> BackendPolicy:
        """The backend that would run the recipe at ``cp_size`` (for estimates of other layouts)."""
        return LOCAL if cp_size <= 1 else self.cp_backend

    @property
    def memory_features(self) -> tuple[str, ...]:
        """The recipe keys of the memory features that are on (offloading, tiled MLP, chunked loss)."""
        return self.recipe.memory_features

    @property
    def on_deepspeed(self) -> bool:
        """DeepSpeed's engine trains the model (Ulysses, or ring / torch CP under ZeRO), not DDP or FSDP2."""
        return trains_on_deepspeed(self.backend, self.recipe)

    def zero_stage(self) -> int | None:
        """The ZeRO stage that shards the model states under DeepSpeed's engine (reads its JSON); else None."""
        return self.backend.zero_stage(self.recipe)

    def trainer_parallelism(self) -> TrainerParallelism:
        """accelerate's ``ParallelismConfig`` and the DeepSpeed config of the Trainer's arguments."""
        return self.backend.runtime().trainer_parallelism(self.recipe, self.dims)

    def attention(self, pad_token_id: int) -> BackendPlan:
        """The model's attention and the factory of the process's sharder; imports the backend's packages."""
        from cptune.models.loading import model_config
        from cptune.parallel.backends.select import plan_backend

        return plan_backend(self.backend, self.recipe, self.dims, pad_token_id, model_config(self.recipe))

    def check_model(self, config: Any, model_class: type | None) -> None:
        """Refuse a model whose attention the backend cannot split (from its config, before any weight)."""
        from cptune.parallel.backends.select import check_model_config

        check_model_config(self.backend, self.recipe, self.dims, config, model_class)

    def check_model_before_loading(self) -> Any:
        """:meth:`check_model` on the recipe's model config and class, before any weight loads; returns the config.

        The launcher's preflight runs it; a rank started without cptune's launcher (torchrun) runs it too.
        """
        from transformers import AutoModelForCausalLM

        from cptune.models.loading import model_config

        config = model_config(self.recipe)
        self.check_model(config, AutoModelForCausalLM._model_mapping.get(type(config), None))
        return config

    def check_prepared_rows(self, prepared: Any) -> None:
        """Refuse prepared data the backend would stop on at its first batch."""
        self.backend.runtime().check_prepared_rows(self.recipe, prepared)

    def check_ready(self, *, training: bool) -> None:
        """Before launching: the backend's packages, precision and configuration files (imports them)."""
        self.backend.runtime().check_ready(self.recipe, training=training)
