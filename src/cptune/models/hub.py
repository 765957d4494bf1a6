"""A hub id of the recipe that cannot be fetched from here, refused at once.

Given a hub id that is not in the Hugging Face cache, transformers asks the hub for it; with no
network, huggingface_hub retries for half a minute or more (printing each retry) before it fails, and
with ``HF_HUB_OFFLINE=1`` cptune would report the same id once for the tokenizer and once for the
config. :func:`check_hub_ids` answers first, in one line: a hub id that is neither a local folder
nor cached, when the hub may not (``HF_HUB_OFFLINE``) or cannot (no connection within
:data:`PROBE_SECONDS`) be reached. Where the hub answers, or through a proxy (which a direct
connection cannot judge), transformers fetches as usual.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError

__all__ = ["PROBE_SECONDS", "check_hub_ids", "hub_unreachable"]

PROBE_SECONDS = 2.0
"""How long a connection to the hub may take before cptune calls the hub unreachable."""

_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def check_hub_ids(recipe: Recipe) -> None:
    """Refuse a hub id of ``base_model`` or ``tokenizer_config`` that cannot be fetched from here.

    Raises:
        CptuneError: one of them is neither a local folder nor in the Hugging Face cache, and
            ``HF_HUB_OFFLINE`` is set or the hub does not answer.
    """
    from huggingface_hub import constants

    wanted = {"base_model": (recipe.base_model, "config.json")}
    if recipe.tokenizer_config:
        wanted["tokenizer_config"] = (recipe.tokenizer_config, "tokenizer_config.json")
    missing: dict[str, list[str]] = {}
    for key, (repo, filename) in wanted.items():
        if not _is_local(repo) and not _is_cached(repo, filename, recipe.model_revision):
            missing.setdefault(repo, []).append(key)
    if not missing:
        return
    offline = constants.HF_HUB_OFFLINE or _is_true(
        os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    )
    reason = (
        "HF_HUB_OFFLINE is set, so nothing is downloaded"
        if offline
        else _unreachable_reason(constants.ENDPOINT)
    )
    if reason is None:
        return
    repo, keys = next(iter(missing.items()))
    hint = (
        "Give the path of a local model folder, or download it once where the hub is reachable "
        f"(`hf download {repo}`) into this cache."
    )
    if not offline:
        hint += " Set HF_HUB_OFFLINE=1 to load cached models without trying the network."
    raise CptuneError(
        f"{' and '.join(keys)}: '{repo}' is neither a local folder nor in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}), and {reason}. {hint}"
    )


def _is_local(path: str) -> bool:
    return Path(os.path.expanduser(path)).exists()


def _is_cached(repo: str, filename: str, revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo, filename, revision=revision), str)
    except ValueError:  # not a valid repo id: transformers says what is wrong with it
        return True


def _is_true(value: str | None) -> bool:
    # As huggingface_hub reads its switches (constants._is_true).
    return value is not None and value.upper() in {"1", "ON", "YES", "TRUE"}


def _unreachable_reason(endpoint: str) -> str | None:
    error = hub_unreachable(endpoint)
    return None if error is None else f"{endpoint} cannot be reached from here ({error})"


def hub_unreachable(endpoint: str, timeout: float = PROBE_SECONDS) -> str | None:
    """Why a connection to ``endpoint`` fails within ``timeout`` seconds, or None when it opens.

    None too when a proxy is configured: the hub may be reachable through it.
    """
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None
    url = urlsplit(endpoint)
    address = (url.hostname or "", url.port or (443 if url.scheme == "https" else 80))
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection(address, timeout=timeout).close()
        except OSError as err:
            outcome.append(str(err) or type(err).__name__)
        else:
            outcome.append(None)

    # The name lookup has no timeout of its own: wait for the whole attempt in a thread.
    thread = threading.Thread(target=connect, name="cptune-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"
