"""Tensor parallelism: the model's own tensor-parallel plan, applied on the ``tp`` axis of accelerate's mesh.

transformers models carry a plan (``config.base_model_tp_plan`` and the class's ``_tp_plan``):
query/key/value and MLP up/gate projections split by columns (each tp rank computes its own
attention heads), output and down projections by rows (an all-reduce sums the ranks' parts).
cptune applies that plan with transformers' DTensor styles to the loaded model, on the ``tp``
axis of the one mesh accelerate builds, so that FSDP2 (``fully_shard`` over ``dp_shard_cp``)
finds the tensor-parallel weights on a mesh of the same root and shards their pieces. The
attention then sees plain tensors holding the rank's own heads, and cptune's ring attention
runs over the ``cp`` axis as without tensor parallelism.

Why not transformers' ``from_pretrained(tp_plan=...)``: it builds its own mesh without a ``cp``
axis (transformers/distributed/utils.py:294), and FSDP2 refuses weights whose mesh has another
root than its own. Why not accelerate's ``_prepare_tp``: under FSDP2 it imports
``transformers.integrations.tensor_parallel.ReplicateParallel``, which transformers 5.23 no
longer has (see :func:`cptune.patches.accelerate_patches.prepare_tp_passthrough_patch`).
"""

from __future__ import annotations

from typing import Any

from cptune.errors import CptuneError


def tensor_parallel_plan(config: Any, model_class: type | None) -> dict[str, str]:
    """The model's tensor-parallel plan with the base model's prefix, before the layers' ``*`` are expanded."""
    base = getattr(config.get_text_config(), "base_model_tp_plan", None) or {}
    prefix = getattr(model_class, "base_model_prefix", "model") if model_class is not None else "model"
    plan = {f"{prefix}.{name}": style for name, style in base.items()}
    plan.update(getattr(model_class, "_tp_plan", None) or {})
    return plan


def check_tensor_parallel_model(config: Any, model_class: type | None, tp_size: int) -> None:
    """Refuse a model that cannot be split over ``tp_size`` ranks (before its weights are loaded).

    Raises:
        CptuneError: The model has no tensor-parallel plan, or its heads do not divide by ``tp_size``.
    """
    if tp_size == 1:
        return
    text = config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        raise CptuneError(
            f"tensor_parallel_size: {getattr(text, 'model_type', 'this model')} has no tensor-parallel plan "
            "in transformers (config.base_model_tp_plan), so its weights cannot be split; remove "
            "tensor_parallel_size (shard the model states with FSDP2 and context_parallel_size alone)."
        )
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count % tp_size:
            raise CptuneError(
                f"tensor_parallel_size: {tp_size} does not divide the model's {name} ({count}), so a "
                "tensor-parallel rank would hold part of a head; use a tensor_parallel_size that divides "
                f"{heads} attention heads and {kv_heads} key/value heads."
            )


def apply_tensor_parallel(model: Any, tp_mesh: Any) -> Any:
    """Split ``model``'s weights over ``tp_mesh`` as its plan says, in place; returns the model.

    Every rank must hold the same weights (all load one checkpoint with one seed): each keeps
    its own slice, with no communication (``src_data_rank=None`` in transformers' styles).
    """
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    check_tensor_parallel_model(model.config, type(model), tp_mesh.size())
    plan = expand_plan(tensor_parallel_plan(model.config, type(model)), model)
    return apply_tensor_parallelism(model, tp_mesh, plan)


def expand_plan(plan: dict[str, str], model: Any) -> dict[str, str]:
    """One entry per module and per parameter of ``model`` that ``plan`` names (``*`` stands for a layer number).

    A module's parameters come before the module (they are sharded, then the module is hooked), as
    ``apply_tensor_parallelism`` expects; a parameter takes its own rule, else its module's.
    """
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    expanded: dict[str, str] = {}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            style = plan.get(replace_layer_number_by_wildcard(name)) or plan.get(
                replace_layer_number_by_wildcard(module_name)
            )
            if style is not None:
                expanded[name] = style
        if (style := plan.get(replace_layer_number_by_wildcard(module_name))) is not None:
            expanded[module_name] = style
    return expanded
