"""Tiled MLP: each decoder layer's MLP runs over tiles of the sequence, forward and backward.

An MLP is token-wise, so it can run on a few tokens at a time. At long context its
intermediates are the largest tensors of a recomputed layer: Llama-3.1-8B's MLP makes
four 14,336-wide tensors per token (gate, up, activation, product), 3.5x the hidden
width each, and its backward as many gradients. :class:`TiledMlp` computes the MLP tile
by tile without keeping anything (the forward under ``no_grad``), and in the backward
recomputes one tile at a time and backpropagates through it, so the intermediates of
one tile exist at any moment. It keeps only the MLP's input.

It is installed with two module hooks on the MLP, not a change to the model's source:
a forward pre-hook hands the MLP's own ``forward`` an empty slice of the tokens (so the
untiled computation does no work) and keeps the input; the forward hook replaces the
(empty) result by the tiled one. The MLP's submodules are called as usual, so peft's
LoRA layers on ``gate_proj``/``up_proj``/``down_proj`` and the hooks of FSDP2 or
DeepSpeed on them work unchanged (under ZeRO-3 each submodule call in the backward's
recomputation gathers its weights). The trained parameters' gradients are summed over
the tiles and handed to autograd once per backward (as an untiled MLP does), so DDP
and the other engines see one gradient per parameter. A ZeRO-3 partitioned parameter
gets its sum inside the backward while it is gathered (:func:`_accumulate_gathered`):
ZeRO-3 frees it again before autograd would accumulate what the Function returns.

Exactness: the output and the input's gradient are the same per token whatever the
tiling; a weight's gradient is a sum over tokens, which the tiles add in a different
order (tests/models/test_memory_features.py, and in bf16 tests/models/test_memory_features_bf16.py).
Dropout inside the MLP (LoRA dropout) draws per tile and replays the same draws in the backward,
and the backward recomputes each tile under the autocast state of its forward: the Trainer runs
the backward outside autocast, where a bf16 run's LoRA branch would otherwise be recomputed in
fp32, and the gradients would not be those of the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cptune.models.autocast_state import AutocastState
from cptune.parallel.backends.zero3_params import gathered, is_partitioned, partitioned
from cptune.parallel.memory import mlp_tiles


class _TiledMlpFunction(torch.autograd.Function):
    """``apply(run, x, tiles, zero3, *params)``: ``run`` over ``tiles`` tiles of ``x``'s sequence dimension.

    The parameters are inputs so that their gradients reach autograd (and DDP's hooks) once,
    summed over the tiles; ``zero3`` lists the trained parameters DeepSpeed ZeRO-3 partitions,
    which get their sums in the backward instead (:func:`_accumulate_gathered`).
    """

    @staticmethod
    def forward(
        ctx: Any,
        run: Callable[[torch.Tensor], torch.Tensor],
        x: torch.Tensor,
        tiles: int,
        zero3: list,
        *params,
    ):
        ctx.run, ctx.tiles, ctx.zero3 = run, tiles, zero3
        ctx.autocast = AutocastState.capture(x.device)
        ctx.save_for_backward(x, *params)
        ctx.rng_states = []
        outputs = []
        for tile in x.tensor_split(tiles, dim=-2):
            ctx.rng_states.append(_rng_state(x.device))
            outputs.append(run(tile))
        # The list beside its concatenation is one output more, also where gradient checkpointing recomputes
        # this in the layer backward. An output allocated after the first tile and written tile by tile (the
        # same bytes) holds it whole while the later tiles run instead: tried for issue 30, it lowered no
        # traced peak (another moment is 0.17 MB below, benchmarks/memory_coefficients.py FITTED_ROWS) and
        # raised the forward's peak at 2,048 tokens by up to one tile's output, which moved fitted rows.
        return torch.cat(outputs, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        x, *params = ctx.saved_tensors
        needed = ctx.needs_input_grad[4:]
        trained = [p for p, need in zip(params, needed, strict=True) if need] + ctx.zero3
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[1] else None
        sums: list[torch.Tensor | None] = [None] * len(trained)
        start = 0
        for tile, grad_tile, state in zip(
            x.tensor_split(ctx.tiles, dim=-2),
            grad_output.tensor_split(ctx.tiles, dim=-2),
            ctx.rng_states,
            strict=True,
        ):
            tile = tile.detach().requires_grad_(grad_x is not None)
            with torch.enable_grad(), _replayed_rng(x.device, state), ctx.autocast.entered():
                out = ctx.run(tile)
            inputs = ([tile] if grad_x is not None else []) + trained
            grads = list(torch.autograd.grad(out, inputs, grad_tile, allow_unused=True))
            if grad_x is not None:
                grad_x.narrow(-2, start, tile.shape[-2]).copy_(grads.pop(0))
                start += tile.shape[-2]
            for i, grad in enumerate(grads):
                if grad is not None:
                    sums[i] = grad if sums[i] is None else sums[i].add_(grad)
        if ctx.zero3:
            _accumulate_gathered(ctx.zero3, sums[len(sums) - len(ctx.zero3) :])
        summed = iter(sums)
        return (None, grad_x, None, None, *(next(summed) if need else None for need in needed))


def _accumulate_gathered(params: list, grads: list) -> None:
    """Hand ZeRO-3 partitioned parameters their gradients summed over the tiles, while they are gathered.

    They are no inputs of the Function: autograd would accumulate what it returned once the backward
    returned, when ZeRO-3 has freed them again (an empty ``data`` that the whole gradient does not
    fit), and would run their gradient accumulators (and ZeRO-3's reduce hooks) even for a None.
    Here each one's accumulator runs once, with the sum over all tiles, and fires the hook once.
    """
    owed = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
    if owed:
        with gathered([p for p, _ in owed]), torch.enable_grad():
            torch.autograd.backward([p.view_as(p) for p, _ in owed], [g for _, g in owed])


def tiled_mlp(
    run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: int, params: list
) -> torch.Tensor:
    """``run(x)`` computed over ``tiles`` tiles of the sequence (dimension -2), recomputed per tile in the backward.

    Args:
        run: The MLP's computation on a (..., tokens, hidden) tensor.
        x: The MLP's input.
        tiles: Number of tiles (capped at the number of tokens).
        params: The parameters ``run`` uses that require grad.
    """
    tiles = max(1, min(tiles, x.shape[-2]))
    if not torch.is_grad_enabled():
        return torch.cat([run(tile) for tile in x.tensor_split(tiles, dim=-2)], dim=-2)
    # ZeRO-3 partitioned parameters get their gradients from the backward itself (_accumulate_gathered).
    zero3 = partitioned(params)
    plain = [p for p in params if not is_partitioned(p)] if zero3 else params
    return _TiledMlpFunction.apply(run, x, tiles, zero3, *plain)


@dataclass(frozen=True)
class TilePlan:
    """How many tiles an MLP call gets: a fixed number, or ALST's default of ``ceil(tokens / hidden)``."""

    num_shards: int | None
    hidden: int

    def tiles(self, tokens: int) -> int:
        return mlp_tiles(tokens, self.hidden, self.num_shards)


class TiledMlp:
    """Hooks that make one MLP module run tiled; :meth:`remove` takes them off again."""

    def __init__(self, mlp: torch.nn.Module, plan: TilePlan):
        self.mlp, self.plan = mlp, plan
        self._input: torch.Tensor | None = None
        self._handles = [
            mlp.register_forward_pre_hook(self._before),
            mlp.register_forward_hook(self._after),
        ]

    def _before(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise TypeError(
                f"tiled_mlp: {type(module).__name__} was called with {len(args)} inputs; it takes one"
            )
        (x,) = args
        self._input = x
        # The MLP's own forward sees no tokens; the forward hook computes the real result.
        return (x.narrow(-2, 0, 0),)

    def _after(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x, self._input = self._input, None
        params = [p for p in module.parameters() if p.requires_grad]
        return tiled_mlp(module.forward, x, self.plan.tiles(x.shape[-2]), params)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def decoder_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``mlp`` of every decoder layer (the model's ``_no_split_modules`` classes).

    Raises:
        ValueError: the model's layers have no ``mlp``, or it is a mixture of experts. Its routing is
            per token, but transformers records the router's logits (for the load-balancing loss) from
            the block's calls, and the tiling hands the block's own call an empty slice and runs the
            tiles under ``no_grad``: the loss would read logits without gradient and train no router.
    """
    layer_classes = set(_find_attr(model, "_no_split_modules") or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    if not layers or any(m is None for m in mlps):
        raise ValueError("its decoder layers have no `mlp` module")
    for mlp in mlps:
        if (
            hasattr(mlp, "experts")
            or hasattr(mlp, "router")
            or (hasattr(mlp, "gate") and not hasattr(mlp, "gate_proj"))
        ):
            raise ValueError(
                f"its MLP ({type(mlp).__name__}) is a mixture of experts: the tiles run under no_grad, so the "
                "router logits its load-balancing loss reads would carry no gradient"
            )
    return mlps


def enable_tiled_mlp(model: torch.nn.Module, num_shards: int | None) -> list[TiledMlp]:
    """Tile every decoder layer's MLP of ``model`` (``num_shards`` tiles per call; None: ceil(tokens / hidden))."""
    config = _find_attr(model, "config")
    hidden = config.get_text_config().hidden_size
    plan = TilePlan(num_shards, hidden)
    return [TiledMlp(mlp, plan) for mlp in decoder_mlps(model)]


def _find_attr(model: torch.nn.Module, name: str) -> Any:
    # A peft model answers attribute lookups from the model it wraps.
    return getattr(model, name, None)


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return (torch.get_rng_state(), cuda)


class _replayed_rng:
    """Run with the RNG state of a tile's forward, leaving the caller's RNG state as it was."""

    def __init__(self, device: torch.device, state: tuple):
        self.device, self.state = device, state

    def __enter__(self) -> None:
        self._fork = torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])
        self._fork.__enter__()
        cpu, cuda = self.state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)

    def __exit__(self, *exc: Any) -> None:
        self._fork.__exit__(*exc)
