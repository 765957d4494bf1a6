"""Packed rows through Qwen3.5's and Qwen3-Next's linear-attention layers, one sample at a time.

transformers runs a linear-attention layer (the gated delta rule of Qwen3.5, Qwen3.5-MoE and Qwen3-Next)
over the whole row it is given: its short causal convolution and its recurrent state run on from one
packed sample into the next, whatever the ``position_ids`` say (its torch path drops the
``cu_seq_lens_q`` its optional kernels take). :func:`enable_document_recurrence` makes every such layer
run each sample of a packed row on its own, from a zero state, as the sample would run alone.

It is installed with module hooks, not a change to the model's source (as :mod:`cptune.models.tiled_mlp`):

* a forward pre-hook on each decoder layer that has a linear-attention mixer reads the layer's
  ``position_ids`` and keeps the samples' bounds for the call that follows (a packed row's samples
  restart their positions; :func:`cptune.labels.document_starts`);
* a forward pre-hook on the mixer hands its own ``forward`` the first token of each row only (so the
  whole-row computation does next to no work) and keeps the input;
* the mixer's forward hook replaces that result by the mixer's ``forward`` run on each sample of each
  row, concatenated back in place.

The bounds stay on the hook from one call of the decoder layer to the next: gradient checkpointing
recomputes the layer's ``forward`` in the backward without the layer's own hooks (transformers 5.23
checkpoints ``forward``, not ``__call__``) but with its mixer's, which then find the bounds of the forward
they recompute. A row
that holds one sample, a call without ``position_ids``, or one with a cache (generation) passes through
unchanged. The mixer's submodules are called as usual, so peft's LoRA layers on its projections work
unchanged. Exactness: each sample's output is the mixer's output on that sample alone, computed by the
same code (tests/models/test_packed_models.py).
"""

from __future__ import annotations

from typing import Any

import torch

from cptune.labels import document_starts

MIXER = "linear_attn"
"""The attribute of a Qwen3.5 / Qwen3-Next decoder layer that holds its linear-attention mixer (the model types
are :data:`cptune.parallel.backends.attention.PER_SAMPLE_RECURRENCE`)."""


class DocumentRecurrence:
    """The hooks that run one decoder layer's linear-attention mixer sample by sample."""

    def __init__(self, layer: torch.nn.Module):
        self.mixer: torch.nn.Module = getattr(layer, MIXER)
        self._bounds: list[list[tuple[int, int]]] | None = (
            None  # from the decoder layer, for its mixer's call
        )
        self._hidden: torch.Tensor | None = None  # the mixer's input, kept for its forward hook
        self._row_bounds: list[list[tuple[int, int]]] = []
        self._kwargs: dict[str, Any] = {}
        self.handles = [
            layer.register_forward_pre_hook(self._read_bounds, with_kwargs=True),
            self.mixer.register_forward_pre_hook(self._keep_input, with_kwargs=True),
            self.mixer.register_forward_hook(self._run_samples, with_kwargs=True),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _read_bounds(self, layer: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        position_ids = kwargs.get("position_ids")
        self._bounds = None
        if position_ids is None or kwargs.get("past_key_values") is not None:
            return
        bounds = sample_bounds(position_ids)
        if any(len(row) > 1 for row in bounds):
            self._bounds = bounds

    def _keep_input(self, mixer: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        bounds = self._bounds
        if bounds is None or kwargs.get("cache_params") is not None:
            self._hidden = None
            return None
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
        self._hidden, self._row_bounds = hidden, bounds
        self._kwargs = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "attention_mask")}
        return args, {**kwargs, "hidden_states": hidden[:, :1], "attention_mask": None}

    def _run_samples(self, mixer: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            return None
        forward = type(mixer).forward
        rows = []
        for row, bounds in enumerate(self._row_bounds):
            pieces = [
                forward(
                    mixer, hidden_states=hidden[row : row + 1, start:end], attention_mask=None, **self._kwargs
                )
                for start, end in bounds
            ]
            rows.append(torch.cat(pieces, dim=1))
        self._kwargs, self._row_bounds = {}, []
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
    return [
        DocumentRecurrence(module)
        for module in model.modules()
        if isinstance(getattr(module, MIXER, None), torch.nn.Module)
    ]
