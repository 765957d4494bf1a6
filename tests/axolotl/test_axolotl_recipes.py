"""Axolotl's own example recipes through `cptune validate`, with only base_model and dataset paths changed.

The recipes are byte-for-byte copies (``recipes/ORIGIN.md``). Every one validates and gets a plan, with
a note for each key that means something different in cptune (``docs/migrating-from-axolotl.md`` shows
every key's status). Four of them train at cp=2 in ``test_axolotl_training.py``.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import yaml

from tests.axolotl.recipes import RECIPES, RECIPES_DIR, localised


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_copies_are_axolotls_files_unchanged():
    listed = dict(
        re.findall(
            r"\| `([^`]+)` \| `examples/[^`]+` \| `([0-9a-f]{40})` \|",
            (RECIPES_DIR / "ORIGIN.md").read_text(),
        )
    )
    assert set(listed) == {r.name for r in RECIPES}
    for recipe in RECIPES:
        assert git_blob_id(recipe.read_bytes()) == listed[recipe.name], recipe.name
    # The DeepSpeed config the ALST recipe names (deepspeed_configs/ at the root of Axolotl's repository).
    config = "deepspeed_configs/zero3_bf16_cpuoffload_all.json"
    (blob,) = re.findall(
        rf"\| `{config}` \| `{config}` \| `([0-9a-f]{{40}})` \|", (RECIPES_DIR / "ORIGIN.md").read_text()
    )
    assert git_blob_id((RECIPES_DIR / config).read_bytes()) == blob


def test_the_set_covers_what_the_issue_names():
    """Dense Llama / Mistral / Qwen recipes: LoRA, QLoRA, full fine-tune, instruct, ALST and CP."""
    data = {r.name: yaml.safe_load(r.read_text()) for r in RECIPES}
    assert {d.get("adapter") for d in data.values()} == {"lora", "qlora", None}
    assert any(d.get("chat_template") == "llama3" for d in data.values())
    assert sum(bool(d.get("context_parallel_size")) for d in data.values()) >= 3
    families = {name.split("--")[0].split("-")[0] for name in data}
    assert {"llama", "mistral", "qwen2", "qwen3", "alst"} <= families
    assert len(RECIPES) == 16


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates_with_only_its_paths_changed(path, tiny_models, tmp_path, cptune_in_process):
    data = localised(path, tiny_models)
    data["output_dir"] = str(tmp_path / "out")  # Axolotl's ./outputs/... would land in the working folder
    recipe = tmp_path / path.name
    recipe.write_text(yaml.safe_dump(data))
    done = cptune_in_process("validate", str(recipe))
    assert done.returncode == 0, done.stderr
    assert "Plan:" in done.stdout and "Notes:" in done.stdout
    if "attn_implementation" in data or "flash_attention" in data:
        assert "is not what picks the attention in cptune" in done.stdout
    if data.get("deepspeed"):  # ALST's ring attention under ZeRO-3 (the JSON's stage)
        assert "model states: DeepSpeed ZeRO-3 over all 8 ranks" in done.stdout
        # Its tiled MLP and Cut Cross Entropy run under ZeRO-3 (test_axolotl_training.py trains it).
        assert "refuses" not in done.stdout
    if data.get("fsdp"):  # Axolotl's FSDP1 form (qwen2/qlora-fsdp): each key's meaning under FSDP2
        assert (
            "fsdp: [full_shard, auto_wrap] is Axolotl's FSDP1 form; cptune runs it with FSDP2" in done.stdout
        )
        for key in (
            "limit_all_gathers",
            "use_orig_params",
            "sync_module_states",
            "cpu_ram_efficient_loading",
        ):
            assert f"fsdp_config.{key} is not used:" in done.stdout
        assert (
            "fsdp_config.sharding_strategy: FULL_SHARD is FSDP1's; with FSDP2 it is reshard_after_forward"
            in (done.stdout)
        )
    if data.get("tensor_parallel_size"):  # distributed-parallel/qwen3-8b-fsdp-tp-cp
        assert (
            "processes:  8 = 2 dp_shard × 2 cp × 2 tp; model states sharded (FSDP2) over 4 ranks (dp_shard × cp), "
            "each weight first split over 2 tp ranks" in done.stdout
        )
        assert "apply accelerate-prepare-tp-passthrough" in done.stdout
        assert (
            "  FSDP2 over 4 ranks × 2 tp  " in done.stdout
        )  # the memory estimate splits weights over tp too
    if data.get("adapter") == "qlora":
        assert "on a 4-bit NF4 base (bitsandbytes)" in done.stdout
        assert "base weights in 4 bits" in done.stdout  # the memory estimate counts them so


def test_instruct_recipe_trains_the_assistant_turns_with_llama3s_format(
    tiny_model_dir, tmp_path, cptune_in_process
):
    """llama-3/instruct-lora-8b: chat_template: llama3 on role/content messages, tokenized for training."""
    data = localised(RECIPES_DIR / "llama-3--instruct-lora-8b.yml", tiny_model_dir)
    data.update(dataset_prepared_path=str(tmp_path / "prepared"), output_dir=str(tmp_path / "out"))
    recipe = tmp_path / "instruct.yml"
    recipe.write_text(yaml.safe_dump(data))
    done = cptune_in_process("preprocess", str(recipe))
    assert done.returncode == 0, done.stderr
    import datasets
    from transformers import AutoTokenizer

    (folder,) = [p for p in (tmp_path / "prepared").iterdir() if p.is_dir()]
    rows = datasets.load_from_disk(str(folder / "train"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"pad_token": "<|end_of_text|>"})  # the recipe's special_tokens
    text = tokenizer.decode(rows[0]["input_ids"])
    assert text.startswith("<s><|start_header_id|>user<|end_header_id|>\n\n")
    trained = tokenizer.decode(
        [t for t, label in zip(rows[0]["input_ids"], rows[0]["labels"], strict=True) if label != -100]
    )
    # The assistant's text only: the tiny tokenizer has no <|eot_id|> token (the template writes it as text)
    # and no eos in the template, so, as in Axolotl (parity/chat-llama3), no end of turn is trained.
    assert "<|eot_id|>" not in trained and "<|start_header_id|>" not in trained and trained.strip()
    stats = json.loads((folder / "stats.json").read_text())
    assert stats["train"]["trained_tokens"] > 0 and stats["eval"] is not None  # val_set_size: 0.05
