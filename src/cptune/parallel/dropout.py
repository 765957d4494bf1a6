"""Dropout whose masks do not depend on how sequences are split: exact under context parallelism.

torch's dropout draws each mask from the process's random generator, element by
element in the order the tensor holds them. Under CP every rank seeds the same
generator, so rank ``r`` draws for its shard the bits rank 0 draws for shard 0, and
every data-parallel replica draws the same masks: no CP run equals its cp=1 run.

Here the keep/drop bit of an element is a hash of where the element is, not of
what was drawn before it::

    bit(seed, layer, row, column, feature)

``row`` is the row's number in the order the data loader gives the training rows
(the same in every layout of a run: cp=1 and cp=N, and dp × micro batch as long as
their product is the same), ``column`` the token's index in its row, ``feature``
the index in the layer's input. Any rank computes exactly the bits of its own
tokens (contiguous, zigzag, head-tail and Ulysses slices alike, from their
:class:`~cptune.parallel.shard.TokenCoords`), data-parallel replicas hold other
rows and so draw other masks, and a resumed run draws what the uninterrupted run
drew, without restoring a generator.

The hash is integer arithmetic in int64 on values below 2**32 with multipliers
below 2**31 (no overflow, identical on every device), two rounds of a
multiply-xorshift mixer: first per token and per feature, then per element.
Elements are hashed in chunks of :data:`CHUNK_ELEMENTS`, so the int64 scratch stays
at 32 MiB whatever the activation's size. The backward recomputes nothing: it
keeps the boolean mask, as ``nn.Dropout`` does.

:func:`use_exact_lora_dropout` puts :class:`TokenKeyedDropout` in place of the
``nn.Dropout`` modules peft builds for ``lora_dropout``; the trainer tells the
shared :class:`DropoutKeys` where the tokens of each micro batch sit.
"""

from __future__ import annotations

import torch
from torch import nn

from cptune.parallel.shard import TokenCoords

MASK32 = 0xFFFFFFFF
# A two-round multiply-xorshift mixer on 32-bit values (shifts 15, 12, 15) whose multipliers are
# below 2**31, so value × multiplier stays below 2**63 in int64.
_MULTIPLIERS = (0x2C1B3C6D, 0x297A2D39)
_SHIFTS = (15, 12, 15)
# Distinct salts keep the per-token, per-layer and per-feature hashes apart.
_ROW_SALT, _COLUMN_SALT, _LAYER_SALT, _FEATURE_SALT = 0x1B873593, 0x5BD1E995, 0x68E31DA4, 0x3C6EF372

CHUNK_ELEMENTS = 1 << 22
"""Elements hashed at once (32 MiB of int64 scratch)."""


def mix32(values: torch.Tensor) -> torch.Tensor:
    """Hash int64 values in ``[0, 2**32)`` to int64 values in ``[0, 2**32)``, in place."""
    values ^= values >> _SHIFTS[0]
    values.mul_(_MULTIPLIERS[0]).bitwise_and_(MASK32)
    values ^= values >> _SHIFTS[1]
    values.mul_(_MULTIPLIERS[1]).bitwise_and_(MASK32)
    values ^= values >> _SHIFTS[2]
    return values


def mix32_int(value: int) -> int:
    """:func:`mix32` of one Python integer (taken modulo 2**32)."""
    return int(mix32(torch.tensor([value & MASK32], dtype=torch.int64))[0])


def token_keys(seed: int, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per token from (seed, row number, column); int64, flattened."""
    key = (rows.reshape(-1).to(torch.int64) ^ mix32_int(seed ^ _ROW_SALT)) & MASK32
    key = mix32(key)
    key ^= (columns.reshape(-1).to(torch.int64) + _COLUMN_SALT) & MASK32
    return mix32(key)


def drop_mask(tokens: torch.Tensor, layer: int, features: int, p: float) -> torch.Tensor:
    """Boolean (tokens, features) mask, True where an element is dropped (probability ``p``).

    Args:
        tokens: :func:`token_keys` of the tokens, int64.
        layer: The dropout module's id (each module draws its own masks).
        features: Size of the last dimension of the dropped tensor.
        p: Drop probability.
    """
    threshold = round(p * (1 << 32))
    per_layer = mix32((tokens ^ mix32_int(layer ^ _LAYER_SALT)) & MASK32)
    feature_keys = mix32(torch.arange(features, device=tokens.device, dtype=torch.int64) + _FEATURE_SALT)
    drop = torch.empty((tokens.numel(), features), dtype=torch.bool, device=tokens.device)
    rows = max(1, CHUNK_ELEMENTS // max(features, 1))
    for start in range(0, tokens.numel(), rows):
        chunk = per_layer[start : start + rows, None] ^ feature_keys[None, :]
        torch.lt(mix32(chunk), threshold, out=drop[start : start + rows])
    return drop


class DropoutKeys:
    """The token keys of the micro batch being trained, shared by every :class:`TokenKeyedDropout` of a model.

    The trainer calls :meth:`set` before each training forward; the keys stay until the
    next call, so a backward that recomputes the forward (gradient checkpointing) draws
    the same masks.
    """

    def __init__(self, seed: int):
        self.seed = seed
        self._keys: torch.Tensor | None = None

    def set(self, row_numbers: torch.Tensor, columns: torch.Tensor) -> None:
        """Key the next forward's tokens: their rows' numbers in the data order and their columns."""
        self._keys = token_keys(self.seed, row_numbers, columns)

    def set_coords(self, coords: TokenCoords, first_row: int) -> None:
        """:meth:`set` from a shard's coordinates; row ``b`` of its batch is row ``first_row + b``.

        Padding (row -1) gets row number -1 in every batch; its outputs reach no real token.
        """
        rows = torch.where(coords.rows >= 0, coords.rows + first_row, -1)
        self.set(rows, coords.columns)

    def keys_for(self, x: torch.Tensor) -> torch.Tensor:
        """The keys of ``x``'s tokens: ``x`` is (..., tokens, features) in the model input's token order."""
        if self._keys is None:
            raise RuntimeError(
                "this model's LoRA dropout is cptune's exact dropout, whose masks follow the tokens' places in "
                "the batch, which cptune's Trainer sets before each training forward. Train it through cptune, "
                "or call model.eval() for inference."
            )
        if x.shape[:-1].numel() != self._keys.numel():
            raise RuntimeError(
                f"exact dropout got an input of shape {tuple(x.shape)}, which does not hold the "
                f"{self._keys.numel()} tokens of the batch: the model reshapes tokens before a LoRA layer, "
                "which cptune's dropout does not support. Set lora_dropout: 0."
            )
        return self._keys.to(x.device)


class TokenKeyedDropout(nn.Module):
    """``nn.Dropout`` whose mask is :func:`drop_mask` of the tokens' keys (see module docstring)."""

    def __init__(self, p: float, layer: int, keys: DropoutKeys):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.layer = layer
        self.keys = keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        drop = drop_mask(self.keys.keys_for(x), self.layer, x.shape[-1], self.p).view(x.shape)
        return x.masked_fill(drop, 0) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}"


def use_exact_lora_dropout(model: nn.Module, seed: int) -> DropoutKeys | None:
    """Put :class:`TokenKeyedDropout` in place of every LoRA dropout of ``model``; None if it has none.

    peft keeps one ``nn.Dropout`` per adapter in each LoRA layer's ``lora_dropout``
    ``ModuleDict`` (``nn.Identity`` when ``lora_dropout`` is 0) and applies it to the
    layer's input; each gets its own id, in module order, so the masks of two layers
    differ. Call before the model is wrapped (DDP, FSDP2, DeepSpeed).
    """
    keys = DropoutKeys(seed)
    layer = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, nn.ModuleDict):
            continue
        for adapter, dropout in dropouts.items():
            if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                dropouts[adapter] = TokenKeyedDropout(dropout.p, layer, keys)
                layer += 1
    return keys if layer else None
