"""A hub id that cannot be fetched from here fails at once, in one line, before transformers is asked."""

from __future__ import annotations

import socket
import time

import pytest
from huggingface_hub import constants

from cptune.config.loader import load_recipe
from cptune.errors import CptuneError
from cptune.models import hub
from cptune.models.hub import check_hub_ids, hub_unreachable

MADE_UP = "madeup-owner/no-such-model"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, online by default, where transformers must not be asked for anything."""
    import transformers

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", *hub._PROXY_VARIABLES):
        monkeypatch.delenv(name, raising=False)

    def asked(*args, **kwargs):
        raise AssertionError("transformers was asked for the hub id")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", asked)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", asked)
    return cache


def cache_file(cache, repo: str, filename: str) -> None:
    """Put ``filename`` of ``repo`` (revision main) into the cache as huggingface_hub lays it out."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text("abc123")
    (folder / "snapshots" / "abc123").mkdir(parents=True, exist_ok=True)
    (folder / "snapshots" / "abc123" / filename).write_text("{}")


@pytest.mark.parametrize("command", ["validate", "train"])
def test_an_uncached_hub_id_with_hf_hub_offline_fails_in_one_line(
    command, hub_cache, write_recipe, cptune_in_process, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(
        hub, "hub_unreachable", lambda *a, **k: pytest.fail("offline: no connection is tried")
    )
    started = time.perf_counter()
    done = cptune_in_process(command, str(write_recipe()), f"--base_model={MADE_UP}")
    seconds = time.perf_counter() - started
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == [
        f"error: base_model: '{MADE_UP}' is neither a local folder nor in the Hugging Face cache ({hub_cache}), "
        "and HF_HUB_OFFLINE is set, so nothing is downloaded. Give the path of a local model folder, or "
        f"download it once where the hub is reachable (`hf download {MADE_UP}`) into this cache."
    ], done.stderr
    print(f"cptune {command} with an uncached hub id offline: {seconds:.2f} s in-process")


def test_an_uncached_hub_id_without_network_fails_in_one_line_with_the_offline_hint(
    hub_cache, write_recipe, cptune_in_process, monkeypatch
):
    monkeypatch.setattr(hub, "hub_unreachable", lambda endpoint, **k: "[Errno -2] Name or service not known")
    done = cptune_in_process("validate", str(write_recipe()), f"--tokenizer_config={MADE_UP}")
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == [
        f"error: tokenizer_config: '{MADE_UP}' is neither a local folder nor in the Hugging Face cache "
        f"({hub_cache}), and {constants.ENDPOINT} cannot be reached from here ([Errno -2] Name or service not "
        f"known). Give the path of a local model folder, or download it once where the hub is reachable "
        f"(`hf download {MADE_UP}`) into this cache. Set HF_HUB_OFFLINE=1 to load cached models without "
        "trying the network."
    ], done.stderr


def test_local_cached_or_reachable_ids_are_left_to_transformers(hub_cache, write_recipe, monkeypatch):
    probed = []
    monkeypatch.setattr(hub, "hub_unreachable", lambda endpoint, **k: probed.append(endpoint))
    path = write_recipe()
    check_hub_ids(load_recipe(path))  # a local folder: no connection tried
    cache_file(hub_cache, MADE_UP, "config.json")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_hub_ids(load_recipe(path, [f"--base_model={MADE_UP}"]))  # cached: loads offline
    assert probed == []
    # The same id for the tokenizer needs the tokenizer's files cached too.
    with pytest.raises(CptuneError, match=f"^tokenizer_config: '{MADE_UP}' is neither"):
        check_hub_ids(load_recipe(path, [f"--base_model={MADE_UP}", f"--tokenizer_config={MADE_UP}"]))
    cache_file(hub_cache, MADE_UP, "tokenizer_config.json")
    check_hub_ids(load_recipe(path, [f"--base_model={MADE_UP}", f"--tokenizer_config={MADE_UP}"]))
    # Online and not cached: the hub answers (the probe says so), so transformers fetches it.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    check_hub_ids(load_recipe(path, ["--base_model=other-owner/model"]))
    assert probed == [constants.ENDPOINT]


def test_the_probe_says_why_the_hub_cannot_be_reached(monkeypatch):
    for name in hub._PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert hub_unreachable(f"http://127.0.0.1:{port}") is None
    # The port is closed now: refused at once.
    assert "refused" in hub_unreachable(f"http://127.0.0.1:{port}").lower()

    def hangs(address, timeout):  # a name lookup that waits for a DNS server that does not answer
        time.sleep(2)
        raise OSError("timed out")

    monkeypatch.setattr(socket, "create_connection", hangs)
    started = time.perf_counter()
    assert hub_unreachable("https://huggingface.co", timeout=0.2) == "no answer within 0.2 s"
    assert time.perf_counter() - started < 2
    # Through a proxy a direct connection says nothing: left to the libraries.
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert hub_unreachable("https://huggingface.co", timeout=0.2) is None
