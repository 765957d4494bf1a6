"""Where this process sits in a launch, as the launcher (torchrun or cptune's own) describes it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """Rank and world size of this process (1 process when not launched)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def launched(self) -> bool:
        return self.world_size > 1


def under_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """True when torchrun, ``accelerate launch`` or cptune's launcher started this process."""
    environ = os.environ if environ is None else environ
    return "WORLD_SIZE" in environ and "RANK" in environ


def read_dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    environ = os.environ if environ is None else environ
    if not under_launcher(environ):
        return DistEnv()
    world = int(environ["WORLD_SIZE"])
    return DistEnv(
        rank=int(environ["RANK"]),
        world_size=world,
        local_rank=int(environ.get("LOCAL_RANK", environ["RANK"])),
        local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world)),
    )
