"""The tiny tokenizer and model, and the shipped example folder and quickstart data."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from devtools import tiny

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = REPO_ROOT / "examples" / "tiny-llama"
CHAT_DATA = REPO_ROOT / "examples" / "data" / "quickstart_chat.jsonl"

# Chats whose contents would break a token-level prefix if a merge could span the
# "\n" that ends "<|im_start|>assistant\n": leading spaces, newlines, tabs.
EDGE_CHATS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "  hi"},
        {"role": "user", "content": "\nAgain?"},
        {"role": "assistant", "content": "\n\nhi again\n"},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "\tthe end"},
    ],
    [
        {"role": "user", "content": "Empty answer next."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": " ok"},
    ],
]


@pytest.fixture(scope="module")
def scripts() -> dict[str, ModuleType]:
    """The two example-building scripts, imported as modules."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        return {name: importlib.import_module(name) for name in ("make_quickstart_data", "make_tiny_model")}
    finally:
        sys.path.remove(str(REPO_ROOT / "scripts"))


@pytest.fixture(scope="module")
def example_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer of the shipped example, loaded the way users load it."""
    return AutoTokenizer.from_pretrained(EXAMPLE_DIR)


@pytest.fixture(scope="module")
def small_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer trained on nothing but the generic corpus, with many newline pairs to tempt merges."""
    return tiny.build_tiny_tokenizer([*tiny.GENERIC_CORPUS, "a\n\nb\n c\n\n\n  d\t\n"] * 3, vocab_size=400)


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(exclude_categories=("Cs",)), max_size=64))
def test_any_text_round_trips_without_unknown_tokens(
    example_tokenizer: PreTrainedTokenizerFast, text: str
) -> None:
    ids = example_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert all(0 <= i < len(example_tokenizer) for i in ids)
    assert example_tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\x00\x01\x7f\x80\xff",
        "Ünïcödé · 東京 · Москва · 😀👍🏽 · \u200b\ufeff",
        "line\r\nwindows\rmac\n\n\ttab",
        "looks special: <s> </s> <pad> <|im_start|>",
        bytes(range(256)).decode("latin-1"),
    ],
)
def test_edge_texts_round_trip(example_tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = example_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert example_tokenizer.decode(ids) == text


def test_tokenizer_adds_bos_but_not_eos(example_tokenizer: PreTrainedTokenizerFast) -> None:
    tok = example_tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        tiny.BOS_TOKEN_ID,
        tiny.EOS_TOKEN_ID,
        tiny.PAD_TOKEN_ID,
    )
    assert tok.unk_token is None
    assert tok.convert_tokens_to_ids([tiny.IM_START_TOKEN, tiny.IM_END_TOKEN]) == [
        tiny.IM_START_TOKEN_ID,
        tiny.IM_END_TOKEN_ID,
    ]
    ids = tok("hello")["input_ids"]
    assert ids[0] == tiny.BOS_TOKEN_ID
    assert ids[1:] == tok("hello", add_special_tokens=False)["input_ids"]
    assert tiny.EOS_TOKEN_ID not in ids


def test_tokenizer_training_is_deterministic() -> None:
    texts = [*tiny.GENERIC_CORPUS, "repeat repeat repeat the words the words"]
    first = tiny.build_tiny_tokenizer(texts, vocab_size=320)
    second = tiny.build_tiny_tokenizer(texts, vocab_size=320)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) <= 320


def test_tokenizer_rejects_a_vocab_without_room_for_bytes() -> None:
    with pytest.raises(ValueError, match="vocab_size=100"):
        tiny.build_tiny_tokenizer(tiny.GENERIC_CORPUS, vocab_size=100)


def _render(tok: PreTrainedTokenizerFast, messages: list[dict[str, str]], **kwargs: bool) -> list[int]:
    return tok.apply_chat_template(messages, return_dict=True, **kwargs)["input_ids"]


def _chats() -> list[list[dict[str, str]]]:
    lines = CHAT_DATA.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["messages"] for line in lines] + EDGE_CHATS


@pytest.mark.parametrize("tokenizer_name", ["example_tokenizer", "small_tokenizer"])
def test_chat_template_renders_token_prefixes(tokenizer_name: str, request: pytest.FixtureRequest) -> None:
    # The data pipeline masks non-assistant turns by rendering growing prefixes of
    # a conversation; that is only sound if each rendering is a token prefix of the next.
    tok: PreTrainedTokenizerFast = request.getfixturevalue(tokenizer_name)
    for messages in _chats():
        for i, message in enumerate(messages):
            full = _render(tok, messages[: i + 1])
            before = _render(tok, messages[:i]) if i else [tiny.BOS_TOKEN_ID]
            assert full[: len(before)] == before
            if message["role"] == "assistant":
                prompt = _render(tok, messages[:i], add_generation_prompt=True)
                answer = tok(message["content"] + tiny.IM_END_TOKEN + "\n", add_special_tokens=False)
                assert full == prompt + answer["input_ids"]


def test_chat_template_marks_assistant_content_and_end(example_tokenizer: PreTrainedTokenizerFast) -> None:
    messages = EDGE_CHATS[1]
    out = example_tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    trained = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert example_tokenizer.decode(trained) == "<|im_end|> ok<|im_end|>"
    assert out["input_ids"][0] == tiny.BOS_TOKEN_ID
    assert out["input_ids"].count(tiny.BOS_TOKEN_ID) == 1


def test_chat_template_rejects_unknown_roles(example_tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(Exception, match="Unknown role tool"):
        example_tokenizer.apply_chat_template([{"role": "tool", "content": "{}"}], tokenize=False)


def test_config_defaults_match_the_tokenizer() -> None:
    config = tiny.tiny_llama_config(300, num_hidden_layers=3)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        64,
        4,
        2,
        16,
    )
    assert config.num_hidden_layers == 3
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert not config.tie_word_embeddings


def test_model_init_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    config = tiny.tiny_llama_config(300)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = tiny.build_tiny_model(config, seed=5).state_dict()
    assert torch.equal(torch.rand(3), expected_next)
    second = tiny.build_tiny_model(config, seed=5).state_dict()
    other = tiny.build_tiny_model(config, seed=6).state_dict()
    assert all(v.dtype == torch.float32 for v in first.values())
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_pretraining_lowers_the_loss_deterministically(small_tokenizer: PreTrainedTokenizerFast) -> None:
    config = tiny.tiny_llama_config(len(small_tokenizer))
    runs = []
    for _ in range(2):
        model = tiny.build_tiny_model(config, seed=0)
        losses = tiny.pretrain_tiny_model(model, small_tokenizer, tiny.GENERIC_CORPUS, steps=12, seed=0)
        runs.append((losses, model.state_dict()))
    (losses, weights), (losses_again, weights_again) = runs
    assert losses == losses_again
    assert all(torch.equal(weights[k], weights_again[k]) for k in weights)
    assert losses[-1] < losses[0]


def test_saved_folder_loads_offline(tmp_path: Path) -> None:
    out = tiny.save_tiny_model_dir(tmp_path / "m", tiny.GENERIC_CORPUS, seed=3, vocab_size=300)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    fresh = tiny.build_tiny_model(tiny.tiny_llama_config(len(tok)), seed=3)
    assert tok.chat_template == tiny.CHAT_TEMPLATE
    assert model.config.vocab_size == len(tok) <= 300
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())
    assert model.generation_config.eos_token_id == [tiny.EOS_TOKEN_ID, tiny.IM_END_TOKEN_ID]


def test_example_folder_is_small_and_matches_its_script(scripts: dict[str, ModuleType]) -> None:
    assert sum(p.stat().st_size for p in EXAMPLE_DIR.iterdir()) < 2_000_000
    assert scripts["make_tiny_model"].check(EXAMPLE_DIR) == []


def test_folder_comparison_reports_changed_files(scripts: dict[str, ModuleType], tmp_path: Path) -> None:
    compare = scripts["make_tiny_model"].compare_model_dirs
    copy = Path(shutil.copytree(EXAMPLE_DIR, tmp_path / "copy"))
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.0"  # volatile: ignored
    (copy / "config.json").write_text(json.dumps(config))
    assert compare(EXAMPLE_DIR, copy) == []

    weights = load_file(copy / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 0.1
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    (copy / "chat_template.jinja").write_text("{{ messages }}")
    problems = compare(EXAMPLE_DIR, copy)
    assert any(p.startswith("model.safetensors: model.norm.weight") for p in problems)
    assert "chat_template.jinja: bytes differ" in problems


def test_quickstart_data_matches_its_script(scripts: dict[str, ModuleType]) -> None:
    data = scripts["make_quickstart_data"]
    for path, text in data.expected_files().items():
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale: run {data.__file__}"
    rows = [json.loads(line) for line in data.ALPACA_PATH.read_text(encoding="utf-8").splitlines()]
    assert 300 <= len(rows) <= 800
    assert all(set(row) == {"instruction", "input", "output"} and row["output"] for row in rows)
    assert any(row["input"] == "" for row in rows)
