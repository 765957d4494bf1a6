"""The patch of torch 2.13 that ``cp_backend: torch`` needs: context-parallel attention for the CPU SDPA op.

torch's context parallelism turns ``F.scaled_dot_product_attention`` on query,
key and value DTensors sharded on the sequence dim (``Shard(2)``) into ring
attention through DTensor *custom op handlers*: the module-level dict
``custom_ops`` in ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``
(:939), which ``_enable_cp_dtensor_dispatcher`` (:1001) installs while CP is on.
torch 2.13 lists only the CUDA SDPA ops there (flash, memory-efficient, cuDNN).
On CPU, SDPA runs ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward, which have neither a handler nor a sharding strategy, so CP fails with
"... does not have a sharding strategy registered" (notes/cpu-measurements.md, B).

The handlers here do for the CPU op what torch's ``_sdpa_handler`` (:897) does
for the CUDA ones: unwrap the local shards, run torch's own ring templates
(``_templated_ring_attention`` / ``_templated_ring_attention_backward``, which
read the load-balance and rotate options from ``_cp_options``), and wrap the
results as sequence-sharded DTensors. Only the dispatch is new; the ring
algorithm, the K/V rotation and the lse merge are torch's.

Nothing is imported from torch until a handler runs or the patch is applied.
"""

from __future__ import annotations

from typing import Any

from cptune import versions
from cptune.errors import PatchError
from cptune.patches.core import Patch, Predicate

SEQ_DIM = 2
"""SDPA's sequence dim in (batch, heads, tokens, head_dim); torch's CP hard-codes it too (:673)."""


def torch_cp_context_owned_by_backend(*args: Any, **kwargs: Any) -> Any:
    """Put in ``Accelerator._cp_context`` for cp_backend: torch, whose backend drives torch CP itself
    (the registry's guard patch, with this backend's runtime's ``cp_context_guard``)."""
    raise PatchError(
        "accelerator.maybe_context_parallel() was called, but cptune's torch backend already shards every "
        "batch and switches torch's context-parallel attention on around each micro batch; accelerate's "
        "context would shard the batch a second time. Remove the call (cptune's Trainer does this for you)."
    )


def _bind(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by schema name, defaults filled in."""
    bound: dict[str, Any] = {}
    for index, argument in enumerate(op_call._schema.arguments):
        if index < len(args):
            bound[argument.name] = args[index]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _sequence_sharded_locals(bound: dict[str, Any], names: tuple[str, ...]) -> tuple[Any, dict[str, Any]]:
    """The CP mesh and the local shards of ``names``; all must be DTensors sharded on the sequence dim."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = None
    local: dict[str, Any] = {}
    for name in names:
        tensor = bound[name]
        if not isinstance(tensor, DTensor) or tensor.placements != (Shard(SEQ_DIM),):
            raise NotImplementedError(
                f"context-parallel SDPA on CPU needs {name} as a DTensor sharded on dim {SEQ_DIM} "
                f"of a 1-D mesh, got {type(tensor).__name__} {getattr(tensor, 'placements', '')}"
            )
        if mesh is None:
            mesh = tensor.device_mesh
        elif tensor.device_mesh != mesh:
            raise NotImplementedError("context-parallel SDPA needs query, key and value on one mesh")
        local[name] = tensor.to_local()
    return mesh, local


def _sequence_sharded_spec(local: Any, mesh: Any) -> Any:
    """The DTensorSpec of a contiguous tensor whose local part ``local`` is sharded on the sequence dim."""
    import torch
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = list(local.shape)
    shape[SEQ_DIM] *= mesh.size()
    size = torch.Size(shape)
    stride = torch.empty(size, device="meta").stride()
    return DTensorSpec(mesh, (Shard(SEQ_DIM),), tensor_meta=TensorMeta(size, stride, local.dtype))


def _check_no_mask(bound: dict[str, Any]) -> None:
    # torch's ring templates have no way to rotate a mask with its K/V block (the CUDA
    # handlers refuse attn_bias the same way); a mask here would be silently misapplied.
    if bound.get("attn_mask") is not None:
        raise NotImplementedError("context-parallel SDPA takes no attn_mask; use is_causal")


def ring_cpu_flash_attention(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DTensor handler of ``aten._scaled_dot_product_flash_attention_for_cpu`` under CP."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention

    bound = _bind(op_call, args, kwargs)
    _check_no_mask(bound)
    mesh, local = _sequence_sharded_locals(bound, ("query", "key", "value"))
    out, logsumexp = _attention._templated_ring_attention(
        mesh.get_group(),
        SEQ_DIM,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        local["query"],
        local["key"],
        local["value"],
        is_causal=bound["is_causal"],
        dropout_p=bound["dropout_p"],
        scale=bound["scale"],
    )
    specs = (_sequence_sharded_spec(out, mesh), _sequence_sharded_spec(logsumexp, mesh))
    return DTensor._op_dispatcher.wrap((out, logsumexp), specs)


def ring_cpu_flash_attention_backward(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """DTensor handler of ``aten._scaled_dot_product_flash_attention_for_cpu_backward`` under CP."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention

    bound = _bind(op_call, args, kwargs)
    _check_no_mask(bound)
    sharded = ("grad_out", "query", "key", "value", "out", "logsumexp")
    mesh, local = _sequence_sharded_locals(bound, sharded)
    grads = _attention._templated_ring_attention_backward(
        mesh.get_group(),
        SEQ_DIM,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=local["grad_out"],
        grad_out_name="grad_out",
        query=local["query"],
        key=local["key"],
        value=local["value"],
        out=local["out"],
        logsumexp=local["logsumexp"],
        is_causal=bound["is_causal"],
        dropout_p=bound["dropout_p"],
        scale=bound["scale"],
    )
    # Each gradient is laid out like its input, so it takes the input's spec.
    specs = tuple(bound[name]._spec for name in ("query", "key", "value"))
    return DTensor._op_dispatcher.wrap(tuple(grads[:3]), specs)


def _with_cpu_handlers(original: dict[Any, Any]) -> dict[Any, Any]:
    import torch

    aten = torch.ops.aten
    return {
        **original,
        aten._scaled_dot_product_flash_attention_for_cpu.default: ring_cpu_flash_attention,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ring_cpu_flash_attention_backward,
    }


def torch_cp_cpu_sdpa_patch(applies_to: Predicate) -> Patch:
    """torch CP's ``custom_ops`` → the same dict plus handlers for the CPU SDPA op and its backward.

    A new dict is installed (the original is left untouched and put back on
    revert); ``_enable_cp_dtensor_dispatcher`` reads the module attribute each
    time CP is switched on, so the handlers are live exactly while CP is on and
    the patch is applied. On CUDA the CPU op never runs, so the entries are inert.
    """
    return Patch(
        name="torch-cp-cpu-sdpa-handlers",
        target="torch.distributed.tensor.experimental._context_parallel._attention:custom_ops",
        replacement=_with_cpu_handlers,
        reason=(
            "Lets torch's context-parallel ring attention run on CPU (gloo).\n"
            "torch/distributed/tensor/experimental/_context_parallel/_attention.py:939 registers DTensor "
            "handlers for the CUDA SDPA ops only; aten._scaled_dot_product_flash_attention_for_cpu and its "
            "backward have none. The added handlers call torch's private _templated_ring_attention(_backward), "
            "hence the exact torch pin."
        ),
        remove_when=(
            "torch's context parallelism handles aten._scaled_dot_product_flash_attention_for_cpu "
            "(and its backward) itself."
        ),
        requires=versions.written_for("torch"),
        applies_to=applies_to,
    )
