"""Packed rows through Qwen3.5's and Qwen3-Next's linear-attention layers, one sample at a time.

transformers runs a linear-attention layer (the gated delta rule of Qwen3.5, Qwen3.5-MoE and Qwen3-Next)
over the whole row it is given: its short causal convolution and its recurrent state run on from one
packed sample into the next, whatever the ``position_ids`` say (its torch path drops the
``cu_seq_lens_q`` its optional kernels take). :func:`enable_document_recurrence` makes every such layer
run each sample of a packed row on its own, from a zero state, as the sample would run alone.

It is installed with module hooks, not a change to the model's source (as :mod:`cptune.models.tiled_mlp`):

* a forward pre-hook on each decoder layer that has a linear-attention mixer reads the layer's
  ``position_ids`` (a packed row's samples restart their positions; :func:`cptune.labels.document_starts`)
  and adds the samples' bounds to the keyword arguments the layer hands its mixer;
* a forward pre-hook on the mixer takes them out and hands the mixer's own ``forward`` the first token of
  each row only (so the whole-row computation does next to no work), keeping the input;
* the mixer's forward hook replaces that result by the mixer's ``forward`` run on each sample of each
  row, concatenated back in place.

A row that holds one sample, a call without ``position_ids``, or one with a cache (generation) passes
through unchanged. The mixer's submodules are called as usual, so peft's LoRA layers on its projections work
unchanged. Exactness: each sample's output is the mixer's output on that sample alone, computed by the
same code (tests/models/test_packed_models.py).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from cptune.labels import document_starts

MIXER = "linear_attn"
"""The attribute of a Qwen3.5 / Qwen3-Next decoder layer that holds its linear-attention mixer (the model types
are :data:`cptune.parallel.backends.attention.PER_SAMPLE_RECURRENCE`)."""


BOUNDS_KWARG = "cptune_sample_bounds"
"""The keyword that carries a packed batch's sample bounds from a decoder layer's call to its mixer's."""


class _BoundsOf:
    """The sample bounds of the last ``position_ids`` tensor asked about: every layer of a forward gets the same
    tensor, so its bounds are read (one device-to-host copy) once per forward, not once per layer."""

    def __init__(self) -> None:
        self._tensor: weakref.ref[torch.Tensor] | None = None
        self._bounds: list[list[tuple[int, int]]] = []

    def __call__(self, position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
        if self._tensor is None or self._tensor() is not position_ids:
            self._tensor, self._bounds = weakref.ref(position_ids), sample_bounds(position_ids)
        return self._bounds


class DocumentRecurrence:
    """The hooks that run one decoder layer's linear-attention mixer sample by sample.

    The decoder layer's pre-hook adds the bounds to the layer's keyword arguments, which the layer hands on to
    its mixer, so they travel with the call; gradient checkpointing keeps them with the arguments it
    recomputes the layer's ``forward`` from (transformers 5.23 checkpoints ``forward``, not ``__call__``, so
    the layer's hooks do not run again, its mixer's do). The mixer's pre-hook takes them out of the call.
    """

    def __init__(self, layer: torch.nn.Module, bounds_of: _BoundsOf):
        self.mixer: torch.nn.Module = getattr(layer, MIXER)
        self._bounds_of = bounds_of
        # Between the mixer's pre-hook and its forward hook (one call): its input and the samples' bounds.
        self._call: tuple[torch.Tensor, list[list[tuple[int, int]]]] | None = None
        self.handles = [
            layer.register_forward_pre_hook(self._add_bounds, with_kwargs=True),
            self.mixer.register_forward_pre_hook(self._keep_input, with_kwargs=True),
            self.mixer.register_forward_hook(self._run_samples),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _add_bounds(self, layer: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        position_ids = kwargs.get("position_ids")
        if position_ids is None or kwargs.get("past_key_values") is not None:
            return None
        bounds = self._bounds_of(position_ids)
        if not any(len(row) > 1 for row in bounds):
            return None  # one sample per row: the mixer's own computation is the sample's
        return args, {**kwargs, BOUNDS_KWARG: bounds}

    def _keep_input(self, mixer: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        self._call = None
        if BOUNDS_KWARG not in kwargs:
            return None
        kwargs = dict(kwargs)
        bounds = kwargs.pop(BOUNDS_KWARG)
        if kwargs.get("cache_params") is not None:
            return args, kwargs
        if args:  # transformers' decoder layers pass every argument by keyword
            raise RuntimeError(
                "cptune runs a linear-attention layer's samples apart only when it is called by keyword"
            )
        hidden = kwargs["hidden_states"]
        if len(bounds) != hidden.shape[0]:
            raise RuntimeError(
                f"{len(bounds)} rows of position_ids for {hidden.shape[0]} rows of hidden states in a "
                "linear-attention layer; cptune runs its samples apart from the decoder layer's position_ids"
            )
        self._call = (hidden, bounds)
        return args, {**kwargs, "hidden_states": hidden[:, :1], "attention_mask": None}

    def _run_samples(self, mixer: torch.nn.Module, args: tuple, output: Any) -> Any:
        call, self._call = self._call, None
        if call is None:
            return None
        hidden, bounds = call
        forward = type(mixer).forward
        # Each sample alone, as its own batch of one row: no cache, no padding mask, no whole-row arguments.
        rows = [
            torch.cat(
                [forward(mixer, hidden_states=hidden[row : row + 1, start:end]) for start, end in spans], 1
            )
            for row, spans in enumerate(bounds)
        ]
        return torch.cat(rows, dim=0)


def sample_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """(start, end) of each packed sample of each row, from ``position_ids`` of shape (rows, tokens)."""
    starts = document_starts(position_ids)
    tokens = position_ids.shape[-1]
    bounds = []
    for row in starts.reshape(-1, tokens):
        begin = row.nonzero().flatten().tolist()
        bounds.append(list(zip(begin, [*begin[1:], tokens], strict=True)))
    return bounds


def enable_document_recurrence(model: torch.nn.Module) -> list[DocumentRecurrence]:
    """Run every linear-attention mixer of ``model`` sample by sample on packed rows; returns the hooks."""
    bounds_of = _BoundsOf()
    return [
        DocumentRecurrence(module, bounds_of)
        for module in model.modules()
        if isinstance(getattr(module, MIXER, None), torch.nn.Module)
    ]
