"""The upstream versions cptune's patches and backends were written for, in one place.

pyproject.toml states the same ranges for installing (``tests/test_versions.py`` checks they
agree); torch is the exception: it installs from ``>=2.13,<2.15`` while the patch that calls
torch's private ring attention is pinned to the minor version it was read against.
"""

from __future__ import annotations

TRANSFORMERS = ">=5.23,<5.24"
ACCELERATE = ">=1.15,<1.16"
DEEPSPEED = ">=0.19,<0.20"
PEFT = ">=0.21,<0.22"
RING_FLASH_ATTN = "==0.1.8"
FLASH_ATTN = ">=2.8,<2.9"
TORCH_PRIVATE_API = ">=2.13,<2.14"
"""torch's private ``_templated_ring_attention`` (parallel/backends/torch_cp/patches.py) changes between minor versions."""

SPECIFIERS: dict[str, str] = {
    "transformers": TRANSFORMERS,
    "accelerate": ACCELERATE,
    "deepspeed": DEEPSPEED,
    "peft": PEFT,
    "ring-flash-attn": RING_FLASH_ATTN,
    "flash-attn": FLASH_ATTN,
}
"""Distribution name → the range pyproject.toml installs."""


def written_for(*distributions: str) -> dict[str, str]:
    """A patch's ``requires``: each distribution with the range its patch was read against.

    ``torch`` means :data:`TORCH_PRIVATE_API` (its patches call private functions); the others come
    from :data:`SPECIFIERS`.
    """
    known = {**SPECIFIERS, "torch": TORCH_PRIVATE_API}
    return {name: known[name] for name in distributions}
