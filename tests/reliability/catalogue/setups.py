"""What the cases build in their workspace: bad data, models, tokenizers, output folders."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.catalogue.framework import Workspace


def _dataset(ws: Workspace, path: str, **extra: Any) -> dict[str, Any]:
    return {"datasets": [{"path": path, "type": "alpaca", **extra}]}


def _alpaca_rows(count: int = 4) -> list[dict[str, str]]:
    return [
        {"instruction": f"Add {i} and {i}.", "input": "", "output": f"The sum is {2 * i}."}
        for i in range(count)
    ]


def _row_missing_output(ws: Workspace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = _alpaca_rows()
    rows[1] = {"instruction": "Say hello.", "input": ""}
    return _dataset(ws, ws.write_rows("missing.jsonl", rows))


def _row_wrong_type(ws: Workspace) -> dict[str, Any]:
    rows = [{"instruction": "Add 2 and 3.", "input": "", "output": 5}]
    return _dataset(ws, ws.write_rows("numbers.jsonl", rows))


def _row_empty_output(ws: Workspace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = _alpaca_rows()
    rows[2]["output"] = "   "
    return _dataset(ws, ws.write_rows("empty_output.jsonl", rows))


def _empty_file(ws: Workspace) -> dict[str, Any]:
    (ws.data / "empty.jsonl").write_text("")
    return _dataset(ws, str(ws.data / "empty.jsonl"))


def _bad_json(ws: Workspace) -> dict[str, Any]:
    (ws.data / "broken.jsonl").write_text('{"instruction": "a", "output": "b"}\n{not json\n')
    return _dataset(ws, str(ws.data / "broken.jsonl"))


def _text_file(ws: Workspace) -> dict[str, Any]:
    (ws.data / "notes.txt").write_text("some text\n")
    return _dataset(ws, str(ws.data / "notes.txt"))


def _chat(ws: Workspace, rows: list[Any], **keys: Any) -> dict[str, Any]:
    path = ws.write_rows("chat.jsonl", rows)
    return {"datasets": [{"path": path, "type": "chat_template"}], **keys}


def _chat_without_assistant(ws: Workspace) -> dict[str, Any]:
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    bad = {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Anyone?"}]}
    return _chat(ws, [good, good, bad])


def _tokenizer_without_template(ws: Workspace) -> dict[str, Any]:
    folder = ws.root / "plain-tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (ws.model_dir / name).is_file():
            shutil.copy(ws.model_dir / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    return _chat(ws, [good], tokenizer_config=str(folder))


def _chat_messages_not_a_list(ws: Workspace) -> dict[str, Any]:
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    return _chat(ws, [good, {"messages": "Hi! Hello!"}])


def _chat_system_message_only(ws: Workspace) -> dict[str, Any]:
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    bad = {"messages": [{"role": "system", "content": "Be brief."}]}
    path = ws.write_rows("chat.jsonl", [good, bad])
    return {"datasets": [{"path": path, "type": "chat_template", "drop_system_message": True}]}


def _chat_unknown_role(ws: Workspace) -> dict[str, Any]:
    bad = {"messages": [{"role": "narrator", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    return _chat(ws, [bad])


def _folder_without_data(ws: Workspace) -> dict[str, Any]:
    folder = ws.data / "notes"
    folder.mkdir()
    (folder / "README.txt").write_text("the data is somewhere else\n")
    return _dataset(ws, str(folder))


def _latin1_rows(ws: Workspace) -> dict[str, Any]:
    good = json.dumps({"instruction": "Say hi.", "input": "", "output": "Hi."})
    bad = '{"instruction": "Say caf\u00e9.", "input": "", "output": "Caf\u00e9."}'
    (ws.data / "latin1.jsonl").write_bytes((good + "\n" + bad + "\n").encode("latin-1"))
    return _dataset(ws, str(ws.data / "latin1.jsonl"))


def _model_without_weights(ws: Workspace) -> dict[str, Any]:
    folder = ws.root / "config-only-model"
    folder.mkdir()
    shutil.copy(ws.model_dir / "config.json", folder / "config.json")
    return {"base_model": str(folder)}


def _model_with_truncated_weights(ws: Workspace) -> dict[str, Any]:
    folder = ws.root / "half-copied-model"
    shutil.copytree(ws.model_dir, folder)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # an interrupted copy
    return {"base_model": str(folder)}


def _model_not_causal_lm(ws: Workspace) -> dict[str, Any]:
    from transformers import T5Config

    folder = ws.root / "t5-model"
    folder.mkdir()
    T5Config(vocab_size=768, d_model=32, num_layers=1, num_heads=2, d_kv=16, d_ff=64).save_pretrained(folder)
    return {"base_model": str(folder)}


def _model_with_a_smaller_vocabulary(ws: Workspace) -> dict[str, Any]:
    """A model that embeds 256 tokens next to the tiny tokenizer's 768; its data already prepared."""
    from transformers import AutoConfig, LlamaForCausalLM

    from cptune.config.recipe import Recipe
    from cptune.data.prepare import prepare_datasets
    from cptune.models.loading import load_tokenizer

    folder = ws.root / "small-vocabulary-model"
    config = AutoConfig.from_pretrained(ws.model_dir)
    config.vocab_size = 256
    LlamaForCausalLM(config).save_pretrained(folder)
    for tokenizer_file in ws.model_dir.glob("tokenizer*"):
        shutil.copy(tokenizer_file, folder / tokenizer_file.name)
    keys = {**ws.keys, "base_model": str(folder)}
    # As after `cptune preprocess`: the check reads the prepared rows, and no cache is written here.
    recipe = Recipe.model_validate(keys)
    prepare_datasets(recipe, load_tokenizer(recipe), log=lambda line: None)
    return {"base_model": str(folder)}


def _prepared_with(ws: Workspace, changes: dict[str, Any]) -> dict[str, Any]:
    """Recipe key changes whose data is already prepared (as after `cptune preprocess`): the run writes no cache."""
    from cptune.config.recipe import Recipe
    from cptune.data.prepare import prepare_datasets
    from cptune.models.loading import load_tokenizer

    recipe = Recipe.model_validate({**ws.keys, **changes})
    prepare_datasets(recipe, load_tokenizer(recipe), log=lambda line: None)
    return changes


TORCH_BIDIRECTIONAL = {
    "context_parallel_size": 2,
    "cp_backend": "torch",
    "causal": False,
    "sample_packing": False,
}


def _torch_bidirectional_odd_rows(ws: Workspace) -> dict[str, Any]:
    # Samples of 5 and 6 tokens: the first row does not split over 2 ranks.
    rows = [{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))} for n in (5, 6)]
    return _prepared_with(ws, {**_pretokenized(ws, rows), **TORCH_BIDIRECTIONAL, "micro_batch_size": 1})


def _torch_bidirectional_mixed_rows(ws: Workspace) -> dict[str, Any]:
    # Rows of 6 and 8 tokens split evenly, but a batch of both pads the first.
    rows = [{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))} for n in (6, 8)]
    return _prepared_with(ws, {**_pretokenized(ws, rows), **TORCH_BIDIRECTIONAL, "micro_batch_size": 2})


def _output_dir_is_file(ws: Workspace) -> dict[str, Any]:
    (ws.root / "taken").write_text("keep me")
    return {"output_dir": str(ws.root / "taken")}


def _output_dir_below_file(ws: Workspace) -> dict[str, Any]:
    (ws.root / "taken").write_text("keep me")
    return {"output_dir": str(ws.root / "taken" / "run")}


def _output_dir_read_only(ws: Workspace) -> dict[str, Any]:
    locked = ws.root / "locked"
    locked.mkdir()
    locked.chmod(0o555)  # the test fixture restores the permission afterwards
    if os.access(locked, os.W_OK):
        # root writes through permission bits; a read-only mount refuses root too (e.g. a
        # container's /proc/sys). Nothing can be created there, so the workspace check still holds.
        locked = next(
            (Path(p) for p in READ_ONLY_MOUNTS if Path(p).is_dir() and not os.access(p, os.W_OK)), None
        )
        if locked is None:
            pytest.skip("this user can write everywhere: no read-only folder to point output_dir at")
    return {"output_dir": str(locked / "run")}


READ_ONLY_MOUNTS = ("/proc/sys", "/sys/fs/cgroup")


def _finished_run(ws: Workspace) -> None:
    (ws.out / "adapter_model.safetensors").write_bytes(b"weights of the earlier run")
    (ws.out / "train_log.json").write_text('[{"loss": 1.0, "step": 1}]')


def _complete_checkpoint(ws: Workspace, step: int) -> None:
    from cptune.run.training.checkpoints import write_marker

    folder = ws.out / f"checkpoint-{step}"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    write_marker(folder, step)


def _interrupted_run_with_checkpoint(ws: Workspace) -> None:
    _complete_checkpoint(ws, 2)


def _incomplete_checkpoint(ws: Workspace) -> dict[str, Any]:
    (ws.out / "checkpoint-4").mkdir()
    (ws.out / "checkpoint-4" / "trainer_state.json").write_text("{}")
    return {}


def _run_with_other_settings(ws: Workspace) -> dict[str, Any]:
    """An earlier run with a checkpoint whose recipe file has since been edited (other steps and learning rate)."""
    from cptune.config.loader import validate_recipe
    from cptune.run.training.run_recipe import save_run_recipe

    _complete_checkpoint(ws, 2)
    save_run_recipe(validate_recipe({**ws.keys, "max_steps": 6, "learning_rate": 0.01}))
    return {}


def _sharded_checkpoint(ws: Workspace) -> dict[str, Any]:
    """A complete checkpoint of an FSDP2 run: each rank's shards, no loadable model files."""
    from cptune.run.training.checkpoints import write_marker

    shards = ws.out / "checkpoint-2" / "pytorch_model_fsdp_0"
    shards.mkdir(parents=True)
    for rank in range(2):
        (shards / f"__{rank}_0.distcp").write_bytes(b"shard")
    write_marker(ws.out / "checkpoint-2", 2)
    return {}


def _resume_path_incomplete(ws: Workspace) -> dict[str, Any]:
    _incomplete_checkpoint(ws)
    return {"resume_from_checkpoint": str(ws.out / "checkpoint-4")}


def _pretokenized(ws: Workspace, rows: list[Any]) -> dict[str, Any]:
    path = ws.write_rows("tokens.jsonl", rows)
    return {"datasets": [{"path": path, "type": "pretokenized"}]}


def _tokenizer_folder(
    ws: Workspace, name: str, *, drop: tuple[str, ...] = (), template: str | None = None
) -> str:
    """A copy of the workspace model's tokenizer without some special tokens, or with another chat template."""
    folder = ws.root / name
    folder.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ws.model_dir / file, folder / file)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key in drop:
        config.pop(key, None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return str(folder)


def _tokenizer_without_eos(ws: Workspace) -> dict[str, Any]:
    return {"tokenizer_config": _tokenizer_folder(ws, "no-eos-tokenizer", drop=("eos_token",))}


def _tokenizer_without_pad_or_eos(ws: Workspace) -> dict[str, Any]:
    return {"tokenizer_config": _tokenizer_folder(ws, "bare-tokenizer", drop=("eos_token", "pad_token"))}


HELLO = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


def _chat_eot_eos_conflict(ws: Workspace) -> dict[str, Any]:
    # eos is <|im_end|>, listed in eot_tokens, and the dataset trains eos and end-of-turn tokens differently.
    rows = [{"messages": HELLO}]
    keys = _chat(
        ws, rows, eot_tokens=["<|im_start|>", "<|im_end|>"], special_tokens={"eos_token": "<|im_end|>"}
    )
    keys["datasets"][0]["train_on_eot"] = "none"
    return keys


def _saved_model(ws: Workspace, name: str, config: Any) -> dict[str, Any]:
    """A real (random, tiny) model of ``config`` with the workspace model's tokenizer, as base_model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ws.root / name
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(ws.model_dir).save_pretrained(folder)
    return {"base_model": str(folder)}


def _vocab(ws: Workspace) -> int:
    return json.loads((ws.model_dir / "config.json").read_text())["vocab_size"]


def _llama_like(ws: Workspace, config_class: str, **fields: Any) -> Any:
    import transformers

    small = {
        "vocab_size": _vocab(ws),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return getattr(transformers, config_class)(**{**small, **fields})


def _bloom_model(ws: Workspace) -> dict[str, Any]:
    from transformers import BloomConfig

    return _saved_model(ws, "bloom", BloomConfig(vocab_size=_vocab(ws), hidden_size=32, n_layer=1, n_head=2))


def _sliding_window_model(ws: Workspace) -> dict[str, Any]:
    return _saved_model(ws, "mistral-windowed", _llama_like(ws, "MistralConfig", sliding_window=16))


def _short_convolution_model(ws: Workspace) -> dict[str, Any]:
    return _saved_model(ws, "lfm2", _llama_like(ws, "Lfm2Config", layer_types=["conv", "full_attention"]))


def _llama4_temperature_model(ws: Workspace) -> dict[str, Any]:
    config = _llama_like(
        ws,
        "Llama4TextConfig",
        head_dim=16,
        intermediate_size_mlp=128,
        num_local_experts=1,
        no_rope_layers=[1, 0],
        floor_scale=16,
    )
    return _saved_model(ws, "llama4", config)


def _afmoe_model(ws: Workspace) -> dict[str, Any]:
    config = _llama_like(
        ws,
        "AfmoeConfig",
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        moe_intermediate_size=32,
        num_experts=2,
        num_experts_per_tok=1,
    )
    return _saved_model(ws, "afmoe", config)


def _softcapping_model(ws: Workspace) -> dict[str, Any]:
    return _saved_model(ws, "gemma2", _llama_like(ws, "Gemma2Config", head_dim=16))


def _sinks_model(ws: Workspace) -> dict[str, Any]:
    return _saved_model(ws, "gpt-oss", _llama_like(ws, "GptOssConfig", head_dim=16, num_local_experts=2))


def _dropout_model(ws: Workspace) -> dict[str, Any]:
    return _saved_model(ws, "llama-dropout", _llama_like(ws, "LlamaConfig", attention_dropout=0.1))


def _hidden_dropout_model(ws: Workspace) -> dict[str, Any]:
    return _saved_model(ws, "llama-hidden-dropout", _llama_like(ws, "LlamaConfig", hidden_dropout=0.1))


def _twelve_heads_model(ws: Workspace) -> dict[str, Any]:
    config = _llama_like(ws, "LlamaConfig", hidden_size=96, num_attention_heads=12, num_key_value_heads=4)
    return _saved_model(ws, "llama-12-heads", config)


def _mixed_formats(ws: Workspace) -> dict[str, Any]:
    folder = ws.data / "mixed"
    folder.mkdir()
    shutil.copy(ws.data / "train.jsonl", folder / "part-1.jsonl")
    (folder / "part-2.csv").write_text("instruction,input,output\nSay hi.,,Hi.\n")
    return _dataset(ws, str(folder))


def _csv_header_only(ws: Workspace) -> dict[str, Any]:
    (ws.data / "header.csv").write_text("instruction,input,output\n")
    return _dataset(ws, str(ws.data / "header.csv"))


def _saved_dataset_without_split(ws: Workspace) -> dict[str, Any]:
    import datasets

    folder = ws.data / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_alpaca_rows())}).save_to_disk(str(folder))
    return _dataset(ws, str(folder), split="validation")


def _deepspeed_json(ws: Workspace, content: str, **keys: Any) -> dict[str, Any]:
    path = ws.root / "ds_config.json"
    path.write_text(content)
    return {**DEEPSPEED_CP, "deepspeed": str(path), **keys}


DEEPSPEED_CP = {"cp_backend": "deepspeed", "context_parallel_size": 2}


def _without_deepspeed() -> str | None:
    import importlib.util

    return (
        None
        if importlib.util.find_spec("deepspeed")
        else "DeepSpeed is not installed (its own entry covers that)"
    )


def _with_flash_attn() -> str | None:
    reason = _without_deepspeed()
    if reason is not None:
        return reason
    from transformers.utils import is_flash_attn_2_available

    return (
        "flash-attn is installed here: the core attention is available"
        if is_flash_attn_2_available()
        else None
    )


def _adapter_folder(ws: Workspace) -> None:
    folder = ws.root / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (folder / "adapter_model.safetensors").write_bytes(b"")  # only its presence is checked before --out
    (ws.root / "merged.txt").write_text("a file where the merged model would go")


def _full_model_folder(ws: Workspace) -> None:
    folder = ws.root / "full-model"
    folder.mkdir()
    shutil.copy(ws.model_dir / "config.json", folder / "config.json")
    shutil.copy(ws.model_dir / "model.safetensors", folder / "model.safetensors")


def _adapter_without_weights(ws: Workspace) -> None:
    folder = ws.root / "adapter-no-weights"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA"}')


def _model_folder_without_weights(ws: Workspace) -> None:
    folder = ws.root / "model-no-weights"
    folder.mkdir()
    shutil.copy(ws.model_dir / "config.json", folder / "config.json")


def _prompt_files(ws: Workspace) -> None:
    (ws.data / "prompts.txt").write_text("Say hello.\n")
    (ws.data / "empty.txt").write_text("\n\n")
    (ws.data / "prompts.jsonl").write_text('{"instruction": "Say hello."}\n["Say hello."]\n')
    # The tiny model's context is 8192 tokens (max_position_embeddings).
    (ws.data / "long.txt").write_text(" ".join(["hello"] * 9000) + "\n")


def _completion_data(ws: Workspace) -> dict[str, Any]:
    return {"datasets": [{"path": str(ws.data / "train.jsonl"), "type": "completion"}]}


def _chat_mapping_extra_key(ws: Workspace) -> dict[str, Any]:
    keys = _chat(ws, [{"messages": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}])
    keys["datasets"][0]["message_property_mappings"] = {"role": "from", "content": "value", "name": "speaker"}
    return keys


def _chat_jinja_file_missing(ws: Workspace) -> dict[str, Any]:
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    return _chat(ws, [good], chat_template_jinja=str(ws.root / "templates" / "chat.jinja"))


def _lora_model_dir_missing(ws: Workspace) -> dict[str, Any]:
    return {"lora_model_dir": str(ws.root / "no-adapter")}


def _with_package(module: str) -> Callable[[], str | None]:
    def skip() -> str | None:
        import importlib.util

        return f"{module} is installed here" if importlib.util.find_spec(module) is not None else None

    return skip
