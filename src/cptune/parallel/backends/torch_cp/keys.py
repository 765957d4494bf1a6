"""The recipe keys of ``cp_backend: torch`` (top-level keys of the recipe)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

CpCommStrategy = Literal["allgather", "alltoall"]


class TorchCpKeys(BaseModel):
    """Mixin of :class:`~cptune.config.recipe.Recipe`: how torch's ring exchanges K/V and orders the tokens."""

    # --- context parallelism: torch ------------------------------------------------------
    cp_comm_strategy: CpCommStrategy | None = Field(
        None, description="cp_backend: torch: how K/V reach the other ranks; default allgather."
    )
    cp_load_balance: bool | None = Field(
        None, description="cp_backend: torch: head-tail token order; default on when causal (off otherwise)."
    )

    if TYPE_CHECKING:  # the recipe's own key, which resolved_cp_load_balance reads
        causal: bool

    @property
    def resolved_cp_comm_strategy(self) -> CpCommStrategy:
        return self.cp_comm_strategy or "allgather"

    @property
    def resolved_cp_load_balance(self) -> bool:
        # torch balances causal work only (it refuses load balancing for non-causal attention).
        return self.causal if self.cp_load_balance is None else self.cp_load_balance


KEYS = TorchCpKeys
"""The backend's key group (what :mod:`cptune.parallel.backends.rows` reads)."""
