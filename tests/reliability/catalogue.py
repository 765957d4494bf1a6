"""The catalogue of bad inputs: what a user can get wrong, and what cptune must say.

Each :class:`Case` builds one bad input in a fresh workspace (a recipe, data
files, an output folder), names the command line that meets it, and the exact
fragment of the message the user must see. ``test_catalogue.py`` runs every case
through the real CLI; ``scripts/gen_troubleshooting.py`` renders the same cases
as ``docs/troubleshooting.md``, so the page cannot drift from what the code says.

A few user-facing errors cannot be met cheaply through the CLI before a run starts (they
happen at the first batch, only on a GPU, or only when a package is missing). They are
:class:`Documented` entries: the page shows them too, with the file that raises them and the
test that proves them, and ``test_error_coverage.py`` checks that their fragment is still
literal text of that file and that every user-facing error in ``src/`` has an entry.

Workspace layout (see :class:`Workspace`): ``recipe.yaml``, ``data/train.jsonl``
(the quickstart rows), a ``prepared/`` cache holding an earlier build, and an
``out/`` output folder holding a file that is not a run. A case changes only
what its bad input needs.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
QUICKSTART_DATA = REPO / "examples" / "data" / "quickstart.jsonl"

DELETE = object()
"""A key value that removes the key from the recipe."""


@dataclass
class Workspace:
    """The folder a case runs in, and the recipe keys it starts from."""

    root: Path
    model_dir: Path
    keys: dict[str, Any] = field(default_factory=dict)

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def out(self) -> Path:
        return self.root / "out"

    def write_rows(self, name: str, rows: list[Any]) -> str:
        path = self.data / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)


def base_keys(ws: Workspace) -> dict[str, Any]:
    """A small valid LoRA recipe for the tiny model; every case breaks one thing of it."""
    return {
        "base_model": str(ws.model_dir),
        "datasets": [{"path": str(ws.data / "train.jsonl"), "type": "alpaca"}],
        "dataset_prepared_path": str(ws.root / "prepared"),
        "sequence_len": 128,
        "sample_packing": True,
        "adapter": "lora",
        "micro_batch_size": 2,
        "max_steps": 2,
        "output_dir": str(ws.out),
    }


def make_workspace(root: Path, model_dir: Path) -> Workspace:
    """The starting state every case is built on (and which no failure may change)."""
    ws = Workspace(root=root, model_dir=model_dir)
    ws.data.mkdir(parents=True)
    shutil.copy(QUICKSTART_DATA, ws.data / "train.jsonl")
    earlier_cache = root / "prepared" / "0123456789abcdef"
    earlier_cache.mkdir(parents=True)
    (earlier_cache / "stats.json").write_text('{"earlier": "build"}')
    ws.out.mkdir()
    (ws.out / "notes.txt").write_text("not a run: cptune must leave this alone")
    ws.keys = base_keys(ws)
    return ws


# What a case's ``setup`` may return: recipe key changes (DELETE removes a key).
Setup = Callable[[Workspace], dict[str, Any] | None]


@dataclass(frozen=True)
class Case:
    """One bad input, the command that meets it, and what the user must read."""

    id: str
    section: str
    title: str
    fragment: str
    fix: str
    keys: dict[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    setup: Setup | None = None
    # Raw recipe file content instead of the YAML dump of the keys.
    recipe_text: str | bytes | None = None
    # YAML lines appended to the dump of the keys (e.g. a key written a second time).
    extra_yaml: str = ""
    command: str = "train"
    # Also run through a real subprocess, to check stderr of the console entry point.
    subprocess: bool = False
    # Point the command at this path (relative to the workspace) instead of recipe.yaml.
    recipe_at: str | None = None
    # Skip the case (with this reason) when it returns a reason; for inputs that are only bad on
    # some machines (a package that is absent here may be installed there).
    skip_if: Callable[[], str | None] | None = None

    def write_recipe(self, ws: Workspace) -> Path:
        keys = dict(ws.keys)
        changes = dict(self.keys)
        if self.setup is not None:
            changes.update(self.setup(ws) or {})
        for key, value in changes.items():
            if value is DELETE:
                keys.pop(key, None)
            else:
                keys[key] = value
        if isinstance(self.recipe_text, bytes):
            ws.recipe.write_bytes(self.recipe_text)
        elif self.recipe_text is not None:
            ws.recipe.write_text(self.recipe_text)
        else:
            ws.recipe.write_text(yaml.safe_dump(keys) + self.extra_yaml)
        return ws.recipe

    def argv(self, ws: Workspace) -> list[str]:
        """The command line; ``{ws}`` in an argument stands for the workspace folder."""
        recipe = ws.root / self.recipe_at if self.recipe_at is not None else ws.recipe
        return [self.command, str(recipe), *(arg.replace("{ws}", str(ws.root)) for arg in self.args)]


@dataclass(frozen=True)
class Documented:
    """A user-facing error shown on the troubleshooting page but not reproduced by the catalogue.

    For errors that only happen after the processes started (at the first batch), only on a
    GPU, or only without an optional package. ``fragment`` must be literal text of a message
    raised in ``raised_in`` (checked by test_error_coverage.py), and ``tested_by`` names the
    test that proves the error, as ``path::function``, when there is one.
    """

    id: str
    section: str
    title: str
    fragment: str
    fix: str
    raised_in: str
    why_not_in_catalogue: str
    tested_by: str | None = None


# --- setups -------------------------------------------------------------------------------


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
    from cptune.run.checkpoints import write_marker

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


def _sharded_checkpoint(ws: Workspace) -> dict[str, Any]:
    """A complete checkpoint of an FSDP2 run: each rank's shards, no loadable model files."""
    from cptune.run.checkpoints import write_marker

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


# A ChatML-like template that starts with the number of messages: rendering fewer messages
# is then never a prefix of rendering more.
COUNTING_TEMPLATE = (
    "{{ messages | length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A ChatML-like template that marks conversations of more than two messages at the start.
LONG_MARK_TEMPLATE = (
    "{% if messages | length > 2 %}[long]{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HELLO = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]


def _chat_template_counting(ws: Workspace) -> dict[str, Any]:
    folder = _tokenizer_folder(ws, "counting-tokenizer", template=COUNTING_TEMPLATE)
    return _chat(ws, [{"messages": HELLO}], tokenizer_config=folder)


def _chat_template_marking_long(ws: Workspace) -> dict[str, Any]:
    folder = _tokenizer_folder(ws, "marking-tokenizer", template=LONG_MARK_TEMPLATE)
    rows = [{"messages": [*HELLO, {"role": "user", "content": "Thanks"}]}]
    return _chat(ws, rows, tokenizer_config=folder)


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


# --- the cases ------------------------------------------------------------------------------

RECIPE_FILE = "The recipe file"
RECIPE_KEYS = "Recipe keys and values"
CONTRADICTIONS = "Keys that contradict each other"
MODEL = "Model, tokenizer and processes"
DATA = "Data"
DEEPSPEED = "DeepSpeed (cp_backend: deepspeed)"
OUTPUT = "The output folder and resuming"
EVALUATE = "cptune evaluate and merge-lora"
INFERENCE = "cptune inference"
PACKAGES = "Installed packages and devices"
DURING_RUN = "During a run"
LIBRARY = "Using cptune from Python"

# A paragraph under a section's heading on the page, where the entries need one.
SECTION_NOTES: dict[str, str] = {
    DURING_RUN: "These stop a run that has already started: each process prints the message (with a "
    '`[rank R]` prefix when there are several), and the run exits non-zero (see "When a process fails '
    'during training" below). Checkpoints already written are kept.',
    LIBRARY: "These concern Python code that uses cptune's modules directly, not `cptune` commands.",
}

SECTIONS = (
    RECIPE_FILE,
    RECIPE_KEYS,
    CONTRADICTIONS,
    MODEL,
    DEEPSPEED,
    DATA,
    OUTPUT,
    EVALUATE,
    INFERENCE,
    PACKAGES,
    DURING_RUN,
    LIBRARY,
)

CASES: tuple[Case, ...] = (
    # --- the recipe file ---
    Case(
        "yaml-malformed",
        RECIPE_FILE,
        "The recipe is not valid YAML",
        "not valid YAML at line 2, column 18: mapping values are not allowed here",
        "A bracket, quote or indentation is off at the line and column shown. Fix the YAML there; "
        "`python -c 'import yaml,sys; yaml.safe_load(open(sys.argv[1]))' recipe.yaml` shows the same.",
        recipe_text="base_model: tiny\nsequence_len: 128: 64\n",
        subprocess=True,
    ),
    Case(
        "yaml-python-tag",
        RECIPE_FILE,
        "The recipe uses a Python tag (`!!python/object...`)",
        "the YAML tag '!!python/object/apply:os.system' at line 1, column 13 is not allowed",
        "cptune reads recipes with YAML's safe loader, which never builds Python objects (a recipe cannot "
        "run code). Write the value as plain text, a number, a list or a mapping.",
        recipe_text='base_model: !!python/object/apply:os.system ["echo pwned"]\n',
    ),
    Case(
        "yaml-not-a-mapping",
        RECIPE_FILE,
        "The recipe is a list or a single value",
        "the recipe must be a mapping of keys to values, got list",
        "A recipe is a mapping (`key: value` lines at the top level). Remove the leading `- `.",
        recipe_text="- base_model: tiny\n",
    ),
    Case(
        "recipe-not-utf8",
        RECIPE_FILE,
        "The recipe is not UTF-8 text",
        "the file is not UTF-8 text",
        "Save the recipe as UTF-8 (most editors have an encoding setting).",
        recipe_text=b"base_model: \xff\xfe\n",
    ),
    Case(
        "recipe-missing",
        RECIPE_FILE,
        "The recipe file does not exist",
        "recipe file not found:",
        "Check the path given to `cptune train`; relative paths are read from the current folder.",
        recipe_at="no-such-recipe.yaml",
    ),
    Case(
        "recipe-is-folder",
        RECIPE_FILE,
        "The recipe path is a folder",
        "is a folder, not a recipe file; give the path of the YAML file",
        "Give the path of the recipe's YAML file itself, not the folder it is in.",
        recipe_at="data",
    ),
    Case(
        "recipe-empty",
        RECIPE_FILE,
        "The recipe file is empty",
        "has 2 problems:\n  - base_model: is required but missing.\n  - datasets: is required but missing.",
        "An empty file (or one with only comments) is an empty recipe. Check that the file was saved; "
        "a recipe needs at least `base_model` and `datasets`.",
        recipe_text="# a recipe that was never filled in\n",
    ),
    Case(
        "yaml-duplicate-key",
        RECIPE_FILE,
        "A key written twice",
        "the key 'sequence_len' appears twice in one mapping (first at line",
        "YAML parsers keep the last of two equal keys without a word, so the first value would be "
        "silently ignored. cptune refuses instead: keep one of them.",
        extra_yaml="sequence_len: 64\n",
    ),
    # --- keys and values ---
    Case(
        "key-misspelt",
        RECIPE_KEYS,
        "A misspelt key",
        "sequnce_len: is not a known key. Did you mean 'sequence_len'?",
        "cptune never ignores a key it does not know (a misspelt key would otherwise silently keep its "
        "default). Use the suggested spelling.",
        keys={"sequnce_len": 64},
    ),
    Case(
        "key-unknown",
        RECIPE_KEYS,
        "A key cptune does not know",
        "turbo_mode: is not a known key.",
        "Remove the key, or look up the key you meant in the recipe reference.",
        keys={"turbo_mode": True},
    ),
    Case(
        "key-axolotl-unsupported",
        RECIPE_KEYS,
        "An Axolotl key cptune does not support",
        "torch_compile: is an Axolotl key that cptune does not support",
        "The message says what cptune offers instead; remove the key. An empty value (`torch_compile:`) or "
        "`false` is accepted as not set, as in Axolotl's example recipes.",
        keys={"torch_compile": True},
    ),
    Case(
        "key-axolotl-no-counterpart",
        RECIPE_KEYS,
        "An Axolotl key with no counterpart in cptune",
        "sage_attention: is an Axolotl key that cptune does not support: it has no counterpart in cptune",
        "Remove the key: cptune knows every key of Axolotl's schema and refuses those it has no counterpart "
        "for, so a refusal here is not a typo.",
        keys={"sage_attention": True},
    ),
    Case(
        "dataset-key-misspelt",
        RECIPE_KEYS,
        "A misspelt key inside a dataset entry",
        "datasets[0].feild_output: is not a known key. Did you mean 'field_output'?",
        "Dataset entries are checked like the recipe itself; the key path says which entry.",
        setup=lambda ws: _dataset(ws, str(ws.data / "train.jsonl"), feild_output="answer"),
    ),
    Case(
        "key-required-missing",
        RECIPE_KEYS,
        "A required key is missing",
        "base_model: is required but missing.",
        "Add the key: `base_model` (a model folder or hub id) and `datasets` have no default.",
        keys={"base_model": DELETE},
    ),
    Case(
        "type-not-an-integer",
        RECIPE_KEYS,
        "A number key holds text",
        "micro_batch_size: Input should be a valid integer, unable to parse string as an integer; got 'two'.",
        "Write the number as a number (`micro_batch_size: 2`).",
        keys={"micro_batch_size": "two"},
    ),
    Case(
        "type-not-a-boolean",
        RECIPE_KEYS,
        "A true/false key holds something else",
        "sample_packing: Input should be a valid boolean",
        "Use `true` or `false`.",
        keys={"sample_packing": "maybe"},
    ),
    Case(
        "range-lora-r",
        RECIPE_KEYS,
        "A value below its minimum",
        "lora_r: Input should be greater than or equal to 1; got 0.",
        "Each key's range is in the recipe reference; `lora_r` is at least 1.",
        keys={"lora_r": 0},
    ),
    Case(
        "range-lora-dropout",
        RECIPE_KEYS,
        "A value above its maximum",
        "lora_dropout: Input should be less than 1; got 1.5.",
        "`lora_dropout` is a probability below 1.",
        keys={"lora_dropout": 1.5},
    ),
    Case(
        "range-learning-rate",
        RECIPE_KEYS,
        "A negative learning rate",
        "learning_rate: Input should be greater than 0; got -0.0002.",
        "`learning_rate` is a positive number (e.g. `2e-4` for LoRA).",
        keys={"learning_rate": -2e-4},
    ),
    Case(
        "choice-misspelt",
        RECIPE_KEYS,
        "A misspelt choice",
        "cp_backend: Input should be 'ring-flash-attn', 'torch' or 'deepspeed'; got 'ring-flash'. "
        "Did you mean 'ring-flash-attn'?",
        "Keys with a fixed set of values list them; use one of them.",
        keys={"cp_backend": "ring-flash"},
    ),
    Case(
        "datasets-empty",
        RECIPE_KEYS,
        "No datasets",
        "datasets: List should have at least 1 item after validation, not 0; got [].",
        "List at least one dataset under `datasets`.",
        keys={"datasets": []},
    ),
    Case(
        "datasets-not-a-list",
        RECIPE_KEYS,
        "datasets written as a single entry instead of a list",
        "datasets: Input should be a valid list; got {",
        "`datasets` is a list even with one dataset: start the entry with `- ` (`- path: ...`).",
        setup=lambda ws: {"datasets": {"path": str(ws.data / "train.jsonl"), "type": "alpaca"}},
    ),
    Case(
        "override-unknown-key",
        RECIPE_KEYS,
        "A command-line override of a key that does not exist",
        "sequnce_len: is not a known key. Did you mean 'sequence_len'?",
        "Overrides are checked like recipe keys; use the suggested spelling.",
        args=("--sequnce_len=64",),
    ),
    Case(
        "option-with-underscores",
        RECIPE_KEYS,
        "A command-line option spelt with underscores (`--nproc_per_node`)",
        "--nproc_per_node: cptune spells this option --nproc-per-node (with dashes)",
        "cptune's options are spelt with dashes; any other `--key=value` is a recipe override. Use the "
        "spelling the message gives (`cptune train --help` lists the options).",
        args=("--nproc_per_node=2",),
    ),
    Case(
        "override-malformed",
        RECIPE_KEYS,
        "A command-line override without a value",
        "override '--lora_r' is not of the form --key=value",
        "Overrides are `--key=value` (nested keys with dots: `--datasets.0.path=x.jsonl`).",
        args=("--lora_r",),
    ),
    Case(
        "override-index-out-of-range",
        RECIPE_KEYS,
        "A command-line override of a list entry that does not exist",
        "datasets.3.path: override index '3' is out of range (list of 1)",
        "Count list entries from 0; the recipe has as many as the message says.",
        args=("--datasets.3.path=x.jsonl",),
    ),
    Case(
        "override-inside-a-value",
        RECIPE_KEYS,
        "A command-line override of a key inside a plain value",
        "sequence_len.x: sequence_len holds a value of type int, which has no keys",
        "Only mappings and lists have keys: override the value itself (`--sequence_len=256`), or fix the "
        "key path (`--datasets.0.path=...`).",
        args=("--sequence_len.x=1",),
    ),
    Case(
        "fsdp-key-twice",
        RECIPE_KEYS,
        "An fsdp_config key written with and without the fsdp_ prefix",
        "'fsdp_offload_params' and 'offload_params' are the same key (with and without the fsdp_ prefix)",
        "`fsdp_config` accepts Axolotl's older `fsdp_`-prefixed spellings; keep one spelling of each key.",
        keys={"fsdp_version": 2, "fsdp_config": {"fsdp_offload_params": True, "offload_params": False}},
    ),
    # --- contradictions ---
    Case(
        "bf16-and-fp16",
        CONTRADICTIONS,
        "bf16 and fp16 both on",
        "fp16: bf16 and fp16 are both true; choose one (or neither for fp32).",
        "Set one of them (bf16 on GPUs that have it).",
        keys={"bf16": True, "fp16": True},
    ),
    Case(
        "warmup-twice",
        CONTRADICTIONS,
        "Both warmup_steps and warmup_ratio",
        "warmup_ratio: set either warmup_steps or warmup_ratio, not both.",
        "Keep one of them.",
        keys={"warmup_steps": 10, "warmup_ratio": 0.1},
    ),
    Case(
        "eval-without-data",
        CONTRADICTIONS,
        "eval_steps without evaluation data",
        "eval_steps: evaluation needs data: set val_set_size or test_datasets.",
        "Set `val_set_size` (a share or a count of the training rows) or `test_datasets`, or remove "
        "`eval_steps`.",
        keys={"eval_steps": 5},
    ),
    Case(
        "torch-cp-packing",
        CONTRADICTIONS,
        "cp_backend: torch with sample_packing",
        "sample_packing: cp_backend: torch cannot keep packed samples apart",
        "torch's context-parallel attention takes no document mask, so packed samples would attend to "
        "each other. Use `cp_backend: ring-flash-attn`, or `sample_packing: false`.",
        keys={"context_parallel_size": 2, "cp_backend": "torch"},
    ),
    Case(
        "torch-cp-bidirectional-row-length",
        DATA,
        "cp_backend: torch with causal: false, and a row whose length does not split over the ranks",
        "cp_backend: torch with causal: false cannot split row 0 of the prepared training data: its 5 tokens "
        "are not a multiple of context_parallel_size=2",
        "torch's context-parallel attention takes no padding mask, so every row must split evenly as it is. "
        "Use `cp_backend: ring-flash-attn` (it masks padding), or samples whose lengths are multiples of "
        "`context_parallel_size`. Checked on the prepared data before launching (and by `cptune preprocess`).",
        setup=_torch_bidirectional_odd_rows,
    ),
    Case(
        "torch-cp-bidirectional-mixed-lengths",
        DATA,
        "cp_backend: torch with causal: false, micro_batch_size > 1 and rows of different lengths",
        "cp_backend: torch with causal: false and micro_batch_size: 2 would pad rows of different lengths in "
        "one batch",
        "Rows of one batch are padded to the longest, which torch's attention cannot mask. Use "
        "`micro_batch_size: 1` (with more `gradient_accumulation_steps`), or `cp_backend: ring-flash-attn`. "
        "Checked on the prepared data before launching (and by `cptune preprocess`).",
        setup=_torch_bidirectional_mixed_rows,
    ),
    Case(
        "option-of-another-backend",
        CONTRADICTIONS,
        "An option of another backend",
        "cp_comm_strategy: applies only to cp_backend: torch; remove it.",
        "Backend options apply to their backend only; remove it or change `cp_backend`.",
        keys={"cp_comm_strategy": "alltoall"},
    ),
    Case(
        "resume-and-overwrite",
        CONTRADICTIONS,
        "--resume together with --overwrite",
        "overwrite_output_dir: resume_from_checkpoint continues the earlier run in output_dir, "
        "overwrite_output_dir starts afresh and removes it; set only one of them.",
        "Decide: continue the earlier run (`--resume`) or replace it (`--overwrite`).",
        args=("--resume", "--overwrite"),
    ),
    Case(
        "val-set-and-test-datasets",
        CONTRADICTIONS,
        "Both val_set_size and test_datasets",
        "val_set_size: set either val_set_size or test_datasets, not both.",
        "Evaluate on a held-out share of the training data (`val_set_size`) or on your own evaluation data "
        "(`test_datasets`), not both.",
        setup=lambda ws: {"val_set_size": 0.1, "test_datasets": [{"path": str(ws.data / "train.jsonl")}]},
    ),
    Case(
        "val-set-not-whole",
        CONTRADICTIONS,
        "val_set_size of 1 or more that is not a whole number",
        "val_set_size: 2.5 is 1 or more, so it counts rows and must be a whole number",
        "A `val_set_size` below 1 is a share of the training samples, 1 or more is a count of them: write "
        "`0.05` or `25`, not `2.5`.",
        keys={"val_set_size": 2.5},
    ),
    Case(
        "ring-attn-func-other-backend",
        CONTRADICTIONS,
        "ring_attn_func with another cp_backend",
        "ring_attn_func: applies only to cp_backend: ring-flash-attn; remove it.",
        "`ring_attn_func` chooses ring-flash-attn's algorithm; remove it, or use `cp_backend: ring-flash-attn`.",
        keys={"cp_backend": "torch", "ring_attn_func": "varlen_llama3", "sample_packing": False},
    ),
    Case(
        "zigzag-packing",
        CONTRADICTIONS,
        "ring_attn_func: batch_zigzag with sample_packing",
        "ring_attn_func: batch_zigzag cannot keep packed samples apart (it has no document boundaries)",
        "Use `ring_attn_func: varlen_llama3` (the default), which keeps packed samples apart, or "
        "`sample_packing: false`.",
        keys={"context_parallel_size": 2, "ring_attn_func": "batch_zigzag", "bf16": True},
    ),
    Case(
        "zigzag-bidirectional",
        CONTRADICTIONS,
        "ring_attn_func: batch_zigzag with causal: false",
        "ring_attn_func: batch_zigzag is causal only; use varlen_llama3 with causal: false.",
        "Use `ring_attn_func: varlen_llama3` (the default) for bidirectional attention.",
        keys={
            "context_parallel_size": 2,
            "ring_attn_func": "batch_zigzag",
            "bf16": True,
            "sample_packing": False,
            "causal": False,
        },
    ),
    Case(
        "zigzag-without-bf16",
        CONTRADICTIONS,
        "ring_attn_func: batch_zigzag without bf16",
        "ring_attn_func: batch_zigzag needs bf16: true. ring-flash-attn 0.1.8 computes wrong gradients",
        "Set `bf16: true`, or use `ring_attn_func: varlen_llama3` (the default), which is exact in fp32.",
        keys={"context_parallel_size": 2, "ring_attn_func": "batch_zigzag", "sample_packing": False},
    ),
    Case(
        "torch-load-balance-bidirectional",
        CONTRADICTIONS,
        "cp_backend: torch with cp_load_balance and causal: false",
        "cp_load_balance: torch's load balancing reorders tokens for causal attention only",
        "Remove `cp_load_balance` (it is off by default with `causal: false`), or set it to false.",
        keys={
            "context_parallel_size": 2,
            "cp_backend": "torch",
            "sample_packing": False,
            "causal": False,
            "cp_load_balance": True,
        },
    ),
    Case(
        "torch-padding-bidirectional",
        CONTRADICTIONS,
        "cp_backend: torch with pad_to_sequence_len and causal: false",
        "pad_to_sequence_len: with cp_backend: torch and causal: false every token would attend to the padding",
        "torch's context-parallel attention takes no padding mask. Use `cp_backend: ring-flash-attn`, or "
        "`pad_to_sequence_len: false`.",
        keys={
            "context_parallel_size": 2,
            "cp_backend": "torch",
            "sample_packing": False,
            "causal": False,
            "pad_to_sequence_len": True,
        },
    ),
    Case(
        "deepspeed-option-other-backend",
        CONTRADICTIONS,
        "A DeepSpeed option with another cp_backend",
        "ulysses_attn_implementation: applies only to cp_backend: deepspeed; remove it.",
        "`ulysses_attn_implementation` configures `cp_backend: deepspeed`; remove it or change `cp_backend`. "
        "(`zero_stage` and `deepspeed` with another backend: see the next entries.)",
        keys={"context_parallel_size": 2, "ulysses_attn_implementation": "sdpa"},
    ),
    Case(
        "deepspeed-without-cp",
        CONTRADICTIONS,
        "zero_stage or deepspeed with context_parallel_size: 1",
        "zero_stage: DeepSpeed runs only with context_parallel_size > 1 (a cp=1 run trains with plain DDP)",
        "cptune uses DeepSpeed for Ulysses context parallelism only. Set `context_parallel_size`, or remove "
        "the DeepSpeed keys.",
        keys={"cp_backend": "deepspeed", "zero_stage": 2},
    ),
    Case(
        "deepspeed-zero-without-cp",
        CONTRADICTIONS,
        "deepspeed (a ZeRO config) in a recipe without context parallelism",
        "deepspeed: DeepSpeed runs only as cp_backend: deepspeed with context_parallel_size > 1",
        "Axolotl uses DeepSpeed's ZeRO for any run; cptune uses DeepSpeed for Ulysses context parallelism only. "
        "To shard model states without CP use `fsdp_version: 2`; otherwise remove `deepspeed`.",
        keys={"deepspeed": "zero2.json"},
    ),
    Case(
        "ulysses-core-bidirectional",
        CONTRADICTIONS,
        "Ulysses with sdpa or flash-attn core attention and causal: false",
        "ulysses_attn_implementation: sdpa attends causally only here (DeepSpeed's Ulysses wrapper drops "
        "attention masks)",
        "Use `ulysses_attn_implementation: cptune` (the default) for bidirectional attention.",
        keys={
            **DEEPSPEED_CP,
            "ulysses_attn_implementation": "sdpa",
            "sample_packing": False,
            "causal": False,
        },
    ),
    Case(
        "ulysses-sdpa-packing",
        CONTRADICTIONS,
        "Ulysses with sdpa core attention and sample_packing",
        "sample_packing: ulysses_attn_implementation: sdpa cannot keep packed samples apart",
        "Use `ulysses_attn_implementation: cptune` (the default), which keeps packed samples apart, or "
        "`sample_packing: false`.",
        keys={**DEEPSPEED_CP, "ulysses_attn_implementation": "sdpa"},
    ),
    Case(
        "ulysses-flash-packing-batch",
        CONTRADICTIONS,
        "Ulysses with flash-attn core attention, sample_packing and micro_batch_size > 1",
        "micro_batch_size: flash_attention_2 finds packed samples from position_ids only in batches of one row",
        "Use `micro_batch_size: 1` with more `gradient_accumulation_steps`, or "
        "`ulysses_attn_implementation: cptune`.",
        keys={**DEEPSPEED_CP, "ulysses_attn_implementation": "flash_attention_2"},
    ),
    Case(
        "lora-targets-empty",
        CONTRADICTIONS,
        "An empty lora_target_modules",
        "lora_target_modules: is empty; list module names or set lora_target_linear: true.",
        "List the module names to adapt (e.g. `[q_proj, v_proj]`), or remove the key to adapt every linear "
        "layer.",
        keys={"lora_target_modules": []},
    ),
    Case(
        "fsdp-version-1",
        CONTRADICTIONS,
        "fsdp_version: 1",
        "fsdp_version: FSDP1 is not supported (transformers deprecates it); use fsdp_version: 2",
        "Set `fsdp_version: 2`; it shards the same model states, and `fsdp_config` takes the same keys.",
        keys={"fsdp_version": 1},
    ),
    Case(
        "fsdp-keys-without-version",
        CONTRADICTIONS,
        "FSDP keys without fsdp_version",
        "dp_shard_size: applies only with fsdp_version: 2 (without FSDP every rank holds the whole model",
        "`fsdp_config`, `dp_shard_size` and `dp_replicate_size` shape FSDP2 sharding. Set `fsdp_version: 2`, "
        "or remove them.",
        keys={"dp_shard_size": 2},
    ),
    Case(
        "fsdp-with-deepspeed",
        CONTRADICTIONS,
        "fsdp_version with cp_backend: deepspeed",
        "fsdp_version: cp_backend: deepspeed shards model states with DeepSpeed's ZeRO stages, not FSDP",
        "Use `zero_stage: 3` to shard weights, gradients and optimizer state with DeepSpeed, or another "
        "`cp_backend` with `fsdp_version: 2`.",
        keys={**DEEPSPEED_CP, "fsdp_version": 2},
    ),
    # --- model, tokenizer, processes ---
    Case(
        "model-path-unknown",
        MODEL,
        "base_model does not exist",
        "base_model: cannot load a model config from",
        "Give a local folder with config.json and weights, or a hub id reachable from here. Nothing is "
        "loaded or started before this check.",
        setup=lambda ws: {"base_model": str(ws.root / "no-such-model")},
    ),
    Case(
        "model-without-weights",
        MODEL,
        "base_model is a folder without weights",
        "holds no weight files (*.safetensors or *.bin), only config.json",
        "The folder has the model's configuration but not its weights (a partial copy or download). "
        "Copy the weight files into it, or point `base_model` at a complete folder or a hub id.",
        setup=_model_without_weights,
    ),
    Case(
        "model-weights-truncated",
        MODEL,
        "base_model has a truncated weight file",
        "model.safetensors' is damaged or incomplete (Error while deserializing header: incomplete metadata, "
        "file not fully covered).",
        "An interrupted copy or download leaves a weight file shorter than its header says. Copy or "
        "download it again. cptune reads only the file's header here, not the weights.",
        setup=_model_with_truncated_weights,
    ),
    Case(
        "model-not-causal-lm",
        MODEL,
        "base_model is not a causal language model (e.g. T5, BERT-style encoders)",
        "which transformers cannot load as a causal language model (AutoModelForCausalLM)",
        "cptune fine-tunes decoder language models (Llama, Qwen, Mistral, ...), also for bidirectional "
        "fine-tunes (`causal: false`). Checked from config.json before the data is prepared.",
        setup=_model_not_causal_lm,
    ),
    Case(
        "tokenizer-of-another-model",
        MODEL,
        "The data holds token ids the model has no embedding for",
        "but the model embeds only 256 tokens (vocab_size), so the tokenizer from",
        "The tokenizer (base_model's own files, or `tokenizer_config`) belongs to another model. Use the "
        "model's own tokenizer. Checked on the prepared data before launching (and in every rank, "
        "against the loaded embedding, under torchrun).",
        setup=_model_with_a_smaller_vocabulary,
    ),
    Case(
        "tokenizer-path-unknown",
        MODEL,
        "tokenizer_config does not exist",
        "tokenizer_config: cannot load a tokenizer from",
        "Point `tokenizer_config` at a folder with the tokenizer files, or remove it to use base_model's.",
        setup=lambda ws: {"tokenizer_config": str(ws.root / "no-such-tokenizer")},
    ),
    Case(
        "cp-not-dividing-world",
        MODEL,
        "context_parallel_size does not divide the number of processes",
        "context_parallel_size=2 does not divide the number of processes (3)",
        "Launch a multiple of context_parallel_size processes (the rest form data-parallel groups).",
        keys={"context_parallel_size": 2},
        args=("--nproc-per-node", "3"),
        subprocess=True,
    ),
    Case(
        "nproc-zero",
        MODEL,
        "--nproc-per-node 0",
        "--nproc-per-node: got 0, but a run needs at least 1 process per node",
        "Give the number of processes to start on this node (by default, context_parallel_size).",
        args=("--nproc-per-node", "0"),
    ),
    Case(
        "cp-exceeds-sequence",
        MODEL,
        "context_parallel_size larger than the sequence",
        "sequence_len: 2 tokens cannot be split into the 4 chunks that context_parallel_size=4 needs",
        "Each rank needs at least one token of every row: use a longer sequence_len or a smaller "
        "context_parallel_size.",
        keys={"context_parallel_size": 4, "sequence_len": 2},
    ),
    Case(
        "heads-k-stride",
        MODEL,
        "heads_k_stride does not divide the model's key/value heads",
        "heads_k_stride: 3 does not divide the model's 2 key/value heads",
        "ring-flash-attn gathers key/value heads heads_k_stride at a time; use a divisor (the message "
        "lists them).",
        keys={"context_parallel_size": 2, "heads_k_stride": 3},
    ),
    Case(
        "ulysses-heads",
        MODEL,
        "Attention heads not divisible for DeepSpeed Ulysses",
        "context_parallel_size: 3 does not divide the model's 4 query heads",
        "Ulysses splits attention heads across the ranks: context_parallel_size must divide the number "
        "of heads (the message lists the sizes that do), or use cp_backend: ring-flash-attn.",
        keys={"context_parallel_size": 3, "cp_backend": "deepspeed"},
        args=("--nproc-per-node", "3"),
    ),
    Case(
        "dp-replicate-not-dividing",
        MODEL,
        "dp_replicate_size × context_parallel_size does not divide the number of processes",
        "dp_replicate_size=2 × context_parallel_size=2 = 4 does not divide the number of processes (6)",
        "Launch a multiple of dp_replicate_size × context_parallel_size processes, or change "
        "`dp_replicate_size`.",
        keys={"fsdp_version": 2, "dp_replicate_size": 2, "context_parallel_size": 2},
        args=("--nproc-per-node", "6"),
    ),
    Case(
        "dp-replicate-without-shard",
        MODEL,
        "dp_replicate_size with context parallelism and nothing left to shard",
        "dp_replicate_size=2 with context_parallel_size=2 leaves dp_shard_size at 1, which accelerate does "
        "not support with context parallelism",
        "Launch more processes (the message says how many), or remove `dp_replicate_size` to shard the model "
        "states over every rank.",
        keys={"fsdp_version": 2, "dp_replicate_size": 2, "context_parallel_size": 2},
    ),
    Case(
        "dp-shard-not-matching",
        MODEL,
        "dp_shard_size does not match the number of processes",
        "dp_shard_size=2 needs dp_replicate_size × dp_shard_size × context_parallel_size = 4 processes, but 2 "
        "were asked for.",
        "Launch the number of processes the message gives, or remove `dp_shard_size` (it then follows from "
        "the number of processes).",
        keys={"fsdp_version": 2, "dp_shard_size": 2, "context_parallel_size": 2},
        args=("--nproc-per-node", "2"),
    ),
    Case(
        "model-not-attention-interface",
        MODEL,
        "A model whose attention cannot be split",
        "base_model: BloomForCausalLM does not route its attention through transformers' AttentionInterface, "
        "so its attention cannot be split across context-parallel ranks.",
        "Context parallelism replaces the model's attention function; models whose attention code does not "
        "go through transformers' AttentionInterface (older architectures such as Bloom, GPT-J, MPT) cannot "
        "use it. Use a model that does (Llama, Qwen2/3, Mistral, ...), or `context_parallel_size: 1`.",
        keys={"context_parallel_size": 2},
        setup=_bloom_model,
    ),
    Case(
        "model-not-attention-interface-bidirectional",
        MODEL,
        "causal: false with a model whose attention cannot be replaced",
        "base_model: BloomForCausalLM does not route its attention through transformers' AttentionInterface, "
        "so cptune cannot give it bidirectional attention (causal: false).",
        "Bidirectional attention comes from cptune's own attention function, also at "
        "`context_parallel_size: 1`. Use a model that routes its attention through transformers' "
        "AttentionInterface, or `causal: true`.",
        keys={"causal": False},
        setup=_bloom_model,
    ),
    Case(
        "model-sliding-window",
        MODEL,
        "A sliding-window model with context parallelism or causal: false",
        "base_model: has attention layers of type ['sliding_attention'], but cp_backend: ring-flash-attn "
        "computes full (causal or bidirectional) attention over the whole row",
        "cptune's attention never sees the window, so those layers would silently attend to too much. Use a "
        "model with full attention only (for Mistral-style configs, `sliding_window: null` if the model was "
        "trained so), or `context_parallel_size: 1` with `causal: true`. `causal: false` is refused for the "
        "same reason at any context_parallel_size.",
        keys={"context_parallel_size": 2},
        setup=_sliding_window_model,
    ),
    Case(
        "model-attention-dropout",
        MODEL,
        "A model config with attention dropout",
        "base_model: its config sets attention_dropout: 0.1, but cp_backend: ring-flash-attn computes "
        "attention without dropout (cptune's attention does not support attention dropout).",
        "Set `attention_dropout` to 0 in the model folder's config.json (most fine-tunes use none), or use "
        "`context_parallel_size: 1` with `causal: true`, where transformers' own attention applies it.",
        keys={"context_parallel_size": 2},
        setup=_dropout_model,
    ),
    Case(
        "model-hidden-dropout",
        MODEL,
        "A model config with hidden-state dropout, with context parallelism",
        "base_model: its config sets hidden_dropout: 0.1, a dropout inside the model whose masks cptune "
        "cannot split exactly across context-parallel ranks",
        "Each rank would draw its own masks instead of its slice of the masks one process draws, so the run "
        "would not equal its `context_parallel_size: 1` run. Set the key to 0 in the model folder's "
        "config.json, or use `context_parallel_size: 1`. `lora_dropout` is exact under context parallelism.",
        keys={"context_parallel_size": 2},
        setup=_hidden_dropout_model,
    ),
    Case(
        "lora-target-missing",
        MODEL,
        "lora_target_modules names a module the model does not have",
        "lora_target_modules: Target modules {'q_projj'} not found in the base model.",
        "Use the model's module names (Llama-style models: q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj), or remove the key to adapt every linear layer. Checked on a weightless copy of "
        "the model before anything is loaded.",
        keys={"lora_target_modules": ["q_projj"]},
    ),
    Case(
        "tokenizer-without-pad-or-eos",
        MODEL,
        "A tokenizer with neither a pad nor an eos token",
        "has neither a pad nor an eos token; cptune needs one of them to pad batches.",
        "Use a tokenizer that defines `pad_token` or `eos_token` (add it to its tokenizer_config.json), or "
        "point `tokenizer_config` at one.",
        setup=_tokenizer_without_pad_or_eos,
    ),
    # --- DeepSpeed ---
    Case(
        "ulysses-kv-heads",
        DEEPSPEED,
        "Key/value heads not divisible for DeepSpeed Ulysses",
        "context_parallel_size: 3 neither divides nor is a multiple of the model's 4 key/value heads",
        "Ulysses splits key/value heads across the ranks (or copies them when there are fewer): choose a "
        "context_parallel_size the message lists, or `cp_backend: ring-flash-attn`.",
        keys={"cp_backend": "deepspeed", "context_parallel_size": 3},
        args=("--nproc-per-node", "3"),
        setup=_twelve_heads_model,
    ),
    Case(
        "ulysses-sliding-window",
        DEEPSPEED,
        "A sliding-window model with DeepSpeed Ulysses",
        "base_model: has sliding-window attention layers, which ulysses_attn_implementation: cptune would "
        "compute as full attention",
        "DeepSpeed's Ulysses wrapper drops the mask. Use `ulysses_attn_implementation: flash_attention_2` on "
        "GPUs (it applies the window), or a model with full attention only.",
        keys=DEEPSPEED_CP,
        setup=_sliding_window_model,
    ),
    Case(
        "deepspeed-json-optimizer",
        DEEPSPEED,
        "A DeepSpeed JSON with an optimizer or scheduler section",
        "has an 'optimizer' section; cptune takes the optimizer and learning-rate schedule from the recipe",
        "Remove the section; set `optimizer`, `learning_rate`, `lr_scheduler` and `warmup_*` in the recipe.",
        setup=lambda ws: _deepspeed_json(ws, '{"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}'),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-batch-size",
        DEEPSPEED,
        "A DeepSpeed JSON whose batch size contradicts the recipe",
        'sets train_micro_batch_size_per_gpu: 4, but the recipe\'s micro_batch_size is 2. Set it to "auto" '
        "(or remove it): cptune fills it from the recipe.",
        'cptune fills the batch sizes, accumulation and clipping from the recipe: set them to `"auto"` in '
        "the JSON or remove them.",
        setup=lambda ws: _deepspeed_json(ws, '{"train_micro_batch_size_per_gpu": 4}'),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-train-batch-size",
        DEEPSPEED,
        "A DeepSpeed JSON that sets train_batch_size",
        'sets train_batch_size; set it to "auto" (or remove it)',
        "The global batch follows from `micro_batch_size`, `gradient_accumulation_steps` and the number of "
        "processes; remove it from the JSON.",
        setup=lambda ws: _deepspeed_json(ws, '{"train_batch_size": 16}'),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-zero-stage",
        DEEPSPEED,
        "zero_stage contradicts the DeepSpeed JSON",
        "zero_stage: 2 contradicts zero_optimization.stage: 3 in deepspeed:",
        "Set the ZeRO stage in one place: `zero_stage` in the recipe or `zero_optimization.stage` in the JSON.",
        setup=lambda ws: _deepspeed_json(ws, '{"zero_optimization": {"stage": 3}}', zero_stage=2),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-reduce-scatter",
        DEEPSPEED,
        "ZeRO-3 with reduce_scatter: false",
        "ZeRO-3 with reduce_scatter: false averages some gradient buckets over the data-parallel ranks and "
        "others over all ranks",
        "No loss scale makes that gradient exact; remove `reduce_scatter` (it defaults to true).",
        setup=lambda ws: _deepspeed_json(ws, '{"zero_optimization": {"stage": 3, "reduce_scatter": false}}'),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-invalid",
        DEEPSPEED,
        "A DeepSpeed JSON that is not valid JSON",
        "' is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
        "Fix the JSON at the line and column shown (JSON needs double quotes and no trailing commas).",
        setup=lambda ws: _deepspeed_json(ws, "{'zero_optimization': {'stage': 2}}"),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-not-an-object",
        DEEPSPEED,
        "A DeepSpeed JSON that is not an object",
        "must hold a JSON object (a DeepSpeed config).",
        "A DeepSpeed config is one JSON object (`{...}`) at the top level.",
        setup=lambda ws: _deepspeed_json(ws, '[{"zero_optimization": {"stage": 2}}]'),
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-json-missing",
        DEEPSPEED,
        "The DeepSpeed JSON does not exist",
        "deepspeed: cannot read the DeepSpeed config",
        "Fix the path of `deepspeed` (relative paths are read from the folder you run cptune in).",
        setup=lambda ws: {**DEEPSPEED_CP, "deepspeed": str(ws.root / "no-such-ds-config.json")},
        skip_if=_without_deepspeed,
    ),
    Case(
        "deepspeed-resume",
        DEEPSPEED,
        "Resuming a cp_backend: deepspeed run",
        "resume_from_checkpoint: resuming a cp_backend: deepspeed run is not supported yet",
        "Start the run afresh (`--overwrite`, or another output_dir); the other cp_backends resume their own "
        "runs.",
        keys=DEEPSPEED_CP,
        args=("--resume",),
        setup=_interrupted_run_with_checkpoint,
        skip_if=_without_deepspeed,
    ),
    Case(
        "ulysses-flash-attn-missing",
        DEEPSPEED,
        "Ulysses with flash_attention_2 where flash-attn is not installed",
        "ulysses_attn_implementation: flash_attention_2 needs flash-attn on a CUDA GPU, which is not "
        "available here.",
        "Use `ulysses_attn_implementation: cptune` (the default, exact everywhere), or install flash-attn on "
        "a CUDA machine (`pip install 'cptune[flash-attn]'`).",
        keys={**DEEPSPEED_CP, "ulysses_attn_implementation": "flash_attention_2", "sample_packing": False},
        skip_if=_with_flash_attn,
    ),
    # --- data ---
    Case(
        "data-path-missing",
        DATA,
        "A dataset path that does not exist",
        "missing.jsonl' does not exist (relative paths are read from",
        "Fix the path (relative paths are read from the folder you run cptune in), or give a hub "
        "dataset id such as `owner/name`.",
        setup=lambda ws: _dataset(ws, str(ws.data / "missing.jsonl")),
    ),
    Case(
        "data-folder-without-files",
        DATA,
        "A dataset folder without data files",
        "the folder holds no data files (.json, .jsonl, .ndjson, .csv, .tsv, .parquet, .arrow, and",
        "Point the dataset at a data file, or at a folder holding files of the listed types.",
        setup=_folder_without_data,
    ),
    Case(
        "data-file-empty",
        DATA,
        "An empty data file",
        "the data files are empty. Point datasets[0].path at data with rows.",
        "Point the dataset at a file with rows.",
        setup=_empty_file,
    ),
    Case(
        "data-not-json",
        DATA,
        "A JSONL file with a broken line",
        "could not load it as local data",
        "The message quotes the reader's error; fix the line it names (every line of a .jsonl file is "
        "one JSON object).",
        setup=_bad_json,
    ),
    Case(
        "data-not-utf8",
        DATA,
        "A data file that is not UTF-8",
        "latin1.jsonl' is not UTF-8 text (line 2).",
        "JSON, JSON lines, CSV and TSV files must be UTF-8. Convert the file (e.g. "
        "`iconv -f latin1 -t utf-8 in.jsonl > out.jsonl`) or fix the bytes on the line shown.",
        setup=_latin1_rows,
    ),
    Case(
        "data-unsupported-file",
        DATA,
        "A data file of a type cptune cannot read",
        "cannot read files of type .txt",
        "Convert the data to one of the listed formats (JSON lines, JSON, CSV, TSV, Parquet, Arrow; the text "
        "formats may be compressed: .gz, .zst, .bz2, .xz).",
        setup=_text_file,
    ),
    Case(
        "data-column-missing",
        DATA,
        "A field name that no row has",
        "no column 'answer' (it has 'instruction', 'input', 'output'). Set the field name keys of "
        "datasets[0]",
        "Set the dataset's field keys (`field_output`, `field_messages`, `field`, ...) to the columns "
        "your data uses; the message lists them.",
        setup=lambda ws: _dataset(ws, str(ws.data / "train.jsonl"), field_output="answer"),
    ),
    Case(
        "data-row-field-missing",
        DATA,
        "A row without a required field",
        "missing.jsonl), row 1: field 'output' is missing.",
        "The message names the dataset, the row (counted from 0) and the field. Fix the row, or set "
        "`skip_invalid_rows: true` to skip such rows (they are counted and reported).",
        setup=_row_missing_output,
    ),
    Case(
        "data-row-wrong-type",
        DATA,
        "A row whose field has the wrong type",
        "row 0: field 'output' is a int, not text.",
        "Make the field text (quote numbers in JSON), or skip such rows with `skip_invalid_rows: true`.",
        setup=_row_wrong_type,
    ),
    Case(
        "data-row-empty-field",
        DATA,
        "A row whose answer is empty",
        "row 2: field 'output' is empty.",
        "A row with nothing to train on is a mistake in the data; fix it or skip such rows.",
        setup=_row_empty_output,
    ),
    Case(
        "chat-no-assistant-turn",
        DATA,
        "A chat row without an assistant turn",
        "row 2: no message with a role in roles_to_train ['assistant']",
        "Every chat row needs a turn to train on. Fix the row, set `roles_to_train` for the dataset, or "
        "skip such rows with `skip_invalid_rows: true`.",
        setup=_chat_without_assistant,
    ),
    Case(
        "chat-messages-not-a-list",
        DATA,
        "A chat row whose messages are not a list",
        "row 1: field 'messages' is not a non-empty list of messages.",
        "`messages` holds a list of `{role, content}` turns. Fix the row, or skip such rows with "
        "`skip_invalid_rows: true`.",
        setup=_chat_messages_not_a_list,
    ),
    Case(
        "chat-unknown-role",
        DATA,
        "A chat row with a role the chat template does not know",
        "row 0: the chat template rejected the messages (Unknown role narrator",
        "The tokenizer's chat template refused the row; its own message follows. Map the data's roles to the "
        "template's with the dataset's `roles` (e.g. `{user: [narrator]}`; `human` and `gpt` are mapped to "
        "`user` and `assistant` by default, as in Axolotl), or skip such rows with `skip_invalid_rows: true`.",
        setup=_chat_unknown_role,
    ),
    Case(
        "chat-no-template",
        DATA,
        "A chat dataset with a tokenizer that has no chat template",
        "has type chat_template, but the tokenizer has no chat template",
        "Set `chat_template: chatml` to use cptune's ChatML template, or use a tokenizer that ships one.",
        setup=_tokenizer_without_template,
    ),
    Case(
        "data-all-too-long",
        DATA,
        "Every sample is longer than sequence_len",
        "no sample is left of its 600 rows (600 longer than sequence_len",
        "Samples longer than `sequence_len` are dropped (and counted in the data statistics); when none "
        "is left, raise `sequence_len` or set `excess_length_strategy: truncate`.",
        keys={"sequence_len": 8},
    ),
    Case(
        "val-set-too-large",
        DATA,
        "val_set_size takes every training sample",
        "val_set_size: 1000.0 asks for 1000 of the 600 training samples left after preprocessing",
        "Lower `val_set_size` (a share below 1, or a row count) or add data.",
        keys={"val_set_size": 1000},
    ),
    Case(
        "data-mixed-formats",
        DATA,
        "A dataset folder that mixes file formats",
        "the files mix formats (.csv, .jsonl). Put one format per dataset entry",
        "One dataset entry reads one format. Split the folder into one entry per format, or pick the files "
        "of one format with the entry's `data_files`.",
        setup=_mixed_formats,
    ),
    Case(
        "data-files-match-nothing",
        DATA,
        "data_files that match no file",
        "datasets[0].data_files entry '*.parquet' matches no file in",
        "`data_files` patterns are matched inside the dataset's folder (`path`); fix the pattern or the "
        "folder.",
        setup=lambda ws: _dataset(ws, str(ws.data), data_files="*.parquet"),
    ),
    Case(
        "data-files-with-a-file",
        DATA,
        "data_files with a path that is a file",
        "datasets[0].data_files selects files inside a folder; datasets[0].path is a file. Remove data_files.",
        "Point `path` at the folder and `data_files` at files in it, or remove `data_files`.",
        setup=lambda ws: _dataset(ws, str(ws.data / "train.jsonl"), data_files="train.jsonl"),
    ),
    Case(
        "data-split-missing",
        DATA,
        "A saved dataset without the split asked for",
        "the saved dataset has no split 'validation' (it has train). Set datasets[0].split to one of them.",
        "The dataset was written with `save_to_disk`; set `split` to one of the splits the message lists.",
        setup=_saved_dataset_without_split,
    ),
    Case(
        "data-split-empty",
        DATA,
        "A data file with a header but no rows",
        "split 'train' has no rows (the data holds none, or the split's slice selects none).",
        "The file (here a CSV file with only its header line) holds no rows; point the dataset at data with "
        "rows.",
        setup=_csv_header_only,
    ),
    Case(
        "tokenizer-without-eos",
        DATA,
        "alpaca or completion data with a tokenizer that has no eos token",
        "The tokenizer has no eos token, which alpaca and completion rows end with.",
        "Each sample ends with the eos token so the model learns to stop. Use a tokenizer that defines "
        "`eos_token` (`tokenizer_config`), or add it to its tokenizer_config.json.",
        setup=_tokenizer_without_eos,
    ),
    Case(
        "pretokenized-not-a-list",
        DATA,
        "A pretokenized row whose token ids are not a list",
        "row 0: field 'input_ids' is a str, not a list of token ids.",
        "pretokenized rows hold lists of ints; fix the row, or skip such rows with `skip_invalid_rows: true`.",
        setup=lambda ws: _pretokenized(ws, [{"input_ids": "5 6 7"}]),
    ),
    Case(
        "pretokenized-not-an-int",
        DATA,
        "A pretokenized row with a token id that is not an int",
        "row 0: field 'input_ids' holds a float at position 0, not an int.",
        "Write token ids as integers (a JSON number with a fraction becomes a float for the whole column).",
        setup=lambda ws: _pretokenized(ws, [{"input_ids": [5, 6.5, 7]}]),
    ),
    Case(
        "pretokenized-out-of-vocabulary",
        DATA,
        "A pretokenized row with a token id outside the vocabulary",
        "row 0: field 'input_ids' holds 99999 at position 2; token ids must be in 0..",
        "The rows were tokenized with another tokenizer than the recipe's (`tokenizer_config`, by default "
        "base_model's); tokenize them with the model's tokenizer.",
        setup=lambda ws: _pretokenized(ws, [{"input_ids": [5, 6, 99999]}]),
    ),
    Case(
        "pretokenized-labels-length",
        DATA,
        "A pretokenized row whose labels and token ids differ in length",
        "row 0: field 'labels' has 2 entries but input_ids has 3",
        "`labels` holds one entry per token (-100 for tokens not trained); fix the row or remove `labels`.",
        setup=lambda ws: _pretokenized(ws, [{"input_ids": [5, 6, 7], "labels": [6, 7]}]),
    ),
    Case(
        "chat-message-not-an-object",
        DATA,
        "A chat row whose messages are not objects",
        "row 0: field 'messages' message 0 is a str, not an object",
        'Each message is an object with a role and a content (`{"role": "user", "content": "Hi"}`).',
        setup=lambda ws: _chat(ws, [{"messages": ["Hi", "Hello!"]}]),
    ),
    Case(
        "chat-message-without-role",
        DATA,
        "A chat message without a role or content",
        "row 0: field 'messages' message 0 has no text 'role'",
        "Give every message a role and a text content, or set `message_field_role` / "
        "`message_field_content` to the keys your data uses.",
        setup=lambda ws: _chat(ws, [{"messages": [{"content": "Hi"}, HELLO[1]]}]),
    ),
    Case(
        "chat-reasoning-not-text",
        DATA,
        "A chat message whose reasoning is not text",
        "row 0: field 'messages' message 1 has a 'reasoning_content' that is not text",
        "Give the reasoning as text (or leave it out), or set `field_thinking` to the key your data keeps it in.",
        setup=lambda ws: _chat(
            ws, [{"messages": [HELLO[0], {**HELLO[1], "reasoning_content": ["step"]}]}], chat_template="qwen3"
        ),
    ),
    Case(
        "chat-template-not-prefix-stable",
        DATA,
        "A chat template that renders earlier turns differently as a conversation grows",
        "the chat template is not prefix-stable: messages[:1] does not render to a token prefix of messages[:2]",
        "cptune finds the tokens of each trained turn by rendering the conversation up to it; a template "
        "that changes earlier text when more messages follow (here: it starts with the message count) "
        "hides them. Set `chat_template: chatml`, or use a template whose earlier turns render the same.",
        setup=_chat_template_counting,
    ),
    Case(
        "chat-template-not-prefix-stable-whole",
        DATA,
        "A chat template that renders long conversations differently",
        "the chat template is not prefix-stable: messages[:2] does not render to a token prefix of the whole "
        "conversation",
        "The same problem, found against the whole conversation (here the template marks conversations of "
        "more than two messages at the start). Set `chat_template: chatml`, or fix the template.",
        setup=_chat_template_marking_long,
    ),
    # --- output folder and resume ---
    Case(
        "output-dir-is-file",
        OUTPUT,
        "output_dir is a file",
        "is a file; give a folder path.",
        "Give a folder path; the file is left as it is.",
        setup=_output_dir_is_file,
    ),
    Case(
        "output-dir-below-file",
        OUTPUT,
        "output_dir lies below a file",
        "cannot be created because",
        "A parent of output_dir is a file; choose another output_dir.",
        setup=_output_dir_below_file,
    ),
    Case(
        "output-dir-not-writable",
        OUTPUT,
        "output_dir cannot be written",
        "does not allow this user to write). Choose an output_dir you can write to",
        "Choose an output_dir you can write to, or change the folder's permissions. This is checked "
        "before any process starts, not when the first checkpoint is saved.",
        setup=_output_dir_read_only,
    ),
    Case(
        "output-dir-finished-run",
        OUTPUT,
        "output_dir holds a finished run",
        "already holds an earlier run (adapter_model.safetensors, train_log.json); cptune does not "
        "replace it without being told.",
        "Choose another output_dir to keep it, or pass `--overwrite` (or set `overwrite_output_dir: true`) "
        "to start afresh: the earlier checkpoints and train log are removed, the model is replaced when "
        "the new run saves.",
        setup=_finished_run,
        subprocess=True,
    ),
    Case(
        "output-dir-earlier-checkpoints",
        OUTPUT,
        "output_dir holds checkpoints of an earlier run",
        "already holds an earlier run (checkpoint-2); cptune does not replace it without being told. "
        "To keep it, choose another output_dir; pass --resume to continue it",
        "Pass `--resume` to continue that run from its newest checkpoint, `--overwrite` to start afresh, "
        "or choose another output_dir.",
        setup=_interrupted_run_with_checkpoint,
    ),
    Case(
        "resume-without-checkpoint",
        OUTPUT,
        "--resume with no complete checkpoint",
        "there is no complete checkpoint in output_dir",
        "A checkpoint whose save was interrupted has no completion marker and is never resumed from. "
        "Train without `--resume` to start from scratch, or point output_dir at the run to continue.",
        setup=_incomplete_checkpoint,
        args=("--resume",),
    ),
    Case(
        "resume-incomplete-path",
        OUTPUT,
        "resume_from_checkpoint names an incomplete checkpoint",
        "is not a complete cptune checkpoint",
        "Give a `checkpoint-N` folder that cptune finished writing, or `true` for the newest complete one.",
        setup=_resume_path_incomplete,
    ),
    # --- evaluate and merge-lora ---
    Case(
        "evaluate-without-eval-data",
        EVALUATE,
        "cptune evaluate with a recipe without evaluation data",
        "evaluate: the recipe has no evaluation data; set val_set_size",
        "Set `val_set_size` (a held-out share of the training data) or `test_datasets` in the recipe, or "
        "with an override: `cptune evaluate recipe.yaml --val_set_size=0.05`.",
        command="evaluate",
    ),
    Case(
        "evaluate-checkpoint-not-a-folder",
        EVALUATE,
        "--checkpoint that is not a folder",
        "is not a folder; give output_dir or a checkpoint-N folder of a run.",
        "`--checkpoint` takes the folder a run saved its adapter or model in: output_dir, or one of its "
        "`checkpoint-N` folders.",
        keys={"val_set_size": 0.1},
        command="evaluate",
        args=("--checkpoint", "{ws}/no-such-checkpoint"),
    ),
    Case(
        "evaluate-checkpoint-incomplete",
        EVALUATE,
        "--checkpoint that is an incomplete checkpoint",
        "is an incomplete checkpoint (no cptune_checkpoint_complete.json matching its files: its save was "
        "interrupted).",
        "Evaluate another checkpoint (or output_dir after the run finished).",
        keys={"val_set_size": 0.1},
        command="evaluate",
        args=("--checkpoint", "{ws}/out/checkpoint-4"),
        setup=_incomplete_checkpoint,
    ),
    Case(
        "evaluate-checkpoint-without-model",
        EVALUATE,
        "--checkpoint that holds neither an adapter nor a model",
        "holds neither a LoRA adapter (adapter_config.json) nor a model (config.json).",
        "Point `--checkpoint` at the folder a run saved its adapter or model in (output_dir after training, "
        "or a `checkpoint-N` folder; the message names one when the folder holds checkpoints).",
        keys={"val_set_size": 0.1},
        command="evaluate",
        args=("--checkpoint", "{ws}/out"),
    ),
    Case(
        "evaluate-sharded-checkpoint",
        EVALUATE,
        "--checkpoint that is a sharded checkpoint of an FSDP2 run",
        "is a sharded checkpoint of an FSDP2 run (each process wrote its own part of the weights), for "
        "resuming that run with `cptune train --resume`. Give the run's output_dir instead",
        "Evaluate (or merge) the run's output_dir: when an FSDP2 run ends, its model or adapter is gathered "
        "there into a standard Hugging Face folder. Its `checkpoint-N` folders hold each process's shards "
        "and the optimizer state, for `cptune train --resume` with the same number of processes.",
        keys={"val_set_size": 0.1},
        command="evaluate",
        args=("--checkpoint", "{ws}/out/checkpoint-2"),
        setup=_sharded_checkpoint,
    ),
    Case(
        "merge-full-fine-tune",
        EVALUATE,
        "cptune merge-lora for a full fine-tune",
        "merge-lora: the recipe fine-tunes the whole model (no adapter: lora)",
        "A full fine-tune saves a standalone model in output_dir already; load it directly.",
        keys={"adapter": DELETE},
        command="merge-lora",
    ),
    Case(
        "merge-without-adapter",
        EVALUATE,
        "cptune merge-lora before training",
        "holds no trained LoRA adapter (adapter_config.json) yet. Train first, or pass --checkpoint",
        "Train first, or pass `--checkpoint` with the folder that holds the adapter.",
        command="merge-lora",
    ),
    Case(
        "merge-full-model",
        EVALUATE,
        "cptune merge-lora --checkpoint with a full model",
        "holds a full model, not a LoRA adapter; there is nothing to merge.",
        "That folder is already a standalone model; use it directly.",
        command="merge-lora",
        args=("--checkpoint", "{ws}/full-model"),
        setup=_full_model_folder,
    ),
    Case(
        "merge-out-is-file",
        EVALUATE,
        "cptune merge-lora --out that is a file",
        "is a file; give the path of a folder for the merged model.",
        "Give a folder path for `--out` (it is created, or replaced if it holds an earlier merge).",
        command="merge-lora",
        args=("--checkpoint", "{ws}/adapter", "--out", "{ws}/merged.txt"),
        setup=_adapter_folder,
    ),
    # --- keys of Axolotl recipes (issue 20) ---
    Case(
        "qlora-without-4bit",
        CONTRADICTIONS,
        "adapter: qlora without load_in_4bit",
        "adapter: qlora trains a LoRA adapter on a 4-bit base: set load_in_4bit: true",
        "Add `load_in_4bit: true` (QLoRA), or use `adapter: lora` on the full-precision base.",
        keys={"adapter": "qlora"},
    ),
    Case(
        "4bit-without-qlora",
        CONTRADICTIONS,
        "load_in_4bit without adapter: qlora",
        "load_in_4bit: a 4-bit base model is trained through a LoRA adapter: set adapter: qlora",
        "Set `adapter: qlora`, or remove `load_in_4bit` to train on the full-precision base.",
        keys={"load_in_4bit": True},
    ),
    Case(
        "8bit-without-lora",
        CONTRADICTIONS,
        "load_in_8bit with a full fine-tune",
        "load_in_8bit: an 8-bit base model is trained through adapter: lora",
        "8-bit weights are frozen: set `adapter: lora`, or remove `load_in_8bit`.",
        keys={"load_in_8bit": True, "adapter": DELETE},
    ),
    Case(
        "bnb-kwargs-without-quantization",
        CONTRADICTIONS,
        "bnb_config_kwargs without a quantized base",
        "bnb_config_kwargs: applies only with load_in_4bit or load_in_8bit; remove it.",
        "Set `load_in_4bit: true` with `adapter: qlora` (or `load_in_8bit`), or remove `bnb_config_kwargs`.",
        keys={"bnb_config_kwargs": {"bnb_4bit_quant_type": "fp4"}},
    ),
    Case(
        "quantized-with-fsdp2",
        CONTRADICTIONS,
        "A quantized base with fsdp_version: 2",
        "fsdp_version: cptune does not shard bitsandbytes-quantized weights with FSDP2",
        "Remove `fsdp_version`: a QLoRA run keeps the 4-bit base whole on every rank (a quarter of bf16's "
        "memory) and trains with plain data parallelism and any `cp_backend`.",
        keys={"adapter": "qlora", "load_in_4bit": True, "fsdp_version": 2},
    ),
    Case(
        "jinja-without-template",
        CONTRADICTIONS,
        "chat_template: jinja without chat_template_jinja",
        "chat_template: jinja needs the template in chat_template_jinja",
        "Give the template's text (or the path of a .jinja file) in `chat_template_jinja`.",
        keys={"chat_template": "jinja"},
    ),
    Case(
        "jinja-with-named-template",
        CONTRADICTIONS,
        "chat_template_jinja next to a named chat_template",
        "chat_template_jinja: chat_template: llama3 names another template",
        "Keep one: `chat_template: jinja` with `chat_template_jinja`, or the named template alone.",
        keys={"chat_template": "llama3", "chat_template_jinja": "{{ messages }}"},
    ),
    Case(
        "lora-extras-without-lora",
        CONTRADICTIONS,
        "lora_modules_to_save or lora_model_dir in a full fine-tune",
        "lora_modules_to_save: applies only with adapter: lora or qlora; remove it.",
        "A full fine-tune trains every module already; remove the key, or set `adapter: lora`.",
        keys={"adapter": DELETE, "lora_modules_to_save": ["lm_head"]},
    ),
    Case(
        "per-epoch-and-steps",
        CONTRADICTIONS,
        "evals_per_epoch next to eval_steps (or saves_per_epoch next to save_steps)",
        "evals_per_epoch: and eval_steps both set how often (Axolotl's count per epoch, cptune's steps); set one",
        "Keep one of them: Axolotl's per-epoch count, or cptune's steps.",
        keys={"evals_per_epoch": 4, "eval_steps": 10, "val_set_size": 0.1},
    ),
    Case(
        "bfloat16-disagrees-with-bf16",
        CONTRADICTIONS,
        "bfloat16 (or float16) that disagrees with bf16 (fp16)",
        "bfloat16: is True but bf16 is False; they are the same setting, set bf16 only.",
        "`bfloat16` and `float16` are Axolotl's other spellings of `bf16` and `fp16`: set `bf16` (or `fp16`) "
        "alone.",
        keys={"bfloat16": True},
    ),
    Case(
        "deepspeed-with-ring-cp",
        CONTRADICTIONS,
        "deepspeed (ZeRO) with ring-flash-attn or torch context parallelism",
        "deepspeed: DeepSpeed's engine cannot run cp_backend: ring-flash-attn: under DeepSpeed, accelerate gives "
        "every rank a batch of its own",
        "Axolotl runs ring attention under ZeRO; cptune cannot (the ranks of a CP group must see the same "
        "batch). Set `cp_backend: deepspeed` (Ulysses, with ZeRO from `deepspeed` or `zero_stage`), or keep "
        "ring-flash-attn and shard model states with `fsdp_version: 2`.",
        keys={"context_parallel_size": 2, "deepspeed": "zero3.json"},
    ),
    Case(
        "attn-implementation-unsupported",
        RECIPE_KEYS,
        "attn_implementation cptune does not run (eager, flex_attention, ...)",
        "attn_implementation: cptune does not run 'eager' attention; it picks the attention from cp_backend",
        "cptune picks the attention from `cp_backend`; `flash_attention_2`, `flash_attention_3` and `sdpa` are "
        "accepted (validate notes what runs), other values are refused. Remove the key.",
        keys={"attn_implementation": "eager"},
    ),
    Case(
        "reentrant-checkpointing",
        RECIPE_KEYS,
        "gradient_checkpointing_kwargs other than use_reentrant: false",
        "cptune checkpoints with use_reentrant: false only",
        "Write `use_reentrant: false` (what cptune does anyway) or remove `gradient_checkpointing_kwargs`.",
        keys={"gradient_checkpointing_kwargs": {"use_reentrant": True}},
    ),
    Case(
        "model-type-not-causal",
        RECIPE_KEYS,
        "model_type that is not a causal LM class",
        "model_type: 'AutoModel' is not a causal language model class",
        "Use `model_type: AutoModelForCausalLM` (or the model's `...ForCausalLM` class), or remove it.",
        keys={"model_type": "AutoModel"},
    ),
    Case(
        "lora-kernel-with-dropout",
        RECIPE_KEYS,
        "Axolotl's fused LoRA kernel with lora_dropout",
        "Axolotl's kernel shares one dropout mask between q_proj, k_proj and v_proj, whereas peft's LoRA layers "
        "(which cptune runs) draw a mask for each projection",
        "Set `lora_dropout: 0` (what Axolotl's kernels are meant for), or `lora_qkv_kernel: false` to keep "
        "peft's dropout, a mask per projection.",
        keys={"adapter": "lora", "lora_dropout": 0.05, "lora_qkv_kernel": True},
    ),
    Case(
        "chat-template-not-built-in",
        RECIPE_KEYS,
        "A chat_template name cptune does not render itself",
        "chat_template: 'deepseek_v3' is not a chat template cptune renders itself",
        "Use `chat_template: tokenizer_default` when the model's tokenizer ships its template (DeepSeek-V3's "
        "does), one of the built-in names, or your own template in `chat_template_jinja`.",
        keys={"chat_template": "deepseek_v3"},
    ),
    Case(
        "message-mappings-extra-key",
        RECIPE_KEYS,
        "message_property_mappings beyond role and content",
        "maps name; cptune's chat messages have a role, a content and a reasoning_content only",
        "Map `role`, `content` and (for reasoning) `reasoning_content` only (e.g. `{role: from, content: value}`).",
        setup=_chat_mapping_extra_key,
    ),
    Case(
        "model-type-mismatch",
        MODEL,
        "model_type names another model's class",
        "model_type: MistralForCausalLM is not the class of",
        "Set `model_type: AutoModelForCausalLM` or remove it: cptune loads the class the model's config names.",
        keys={"model_type": "MistralForCausalLM"},
    ),
    Case(
        "lora-model-dir-missing",
        MODEL,
        "lora_model_dir without an adapter",
        "does not exist. Point it at the folder of a trained LoRA adapter",
        "Point `lora_model_dir` at a folder with `adapter_config.json` (a run's output_dir or checkpoint), or "
        "remove it (Axolotl's recipes often leave it empty, which means no adapter).",
        setup=_lora_model_dir_missing,
    ),
    Case(
        "modules-to-save-unknown",
        MODEL,
        "lora_modules_to_save naming no module",
        "lora_modules_to_save: the model has no module named 'embed'",
        "Use the modules' last names, e.g. `[embed_tokens, lm_head]` for Llama-style models.",
        keys={"lora_modules_to_save": ["embed"]},
    ),
    Case(
        "new-tokens-untrained",
        MODEL,
        "New tokens in a LoRA run without training their embeddings",
        "tokens: adds 1 token(s) the tokenizer did not have (<tool>); their embeddings start untrained",
        "Add `lora_modules_to_save: [embed_tokens, lm_head]` (the message names the model's modules) so the "
        "new rows are trained and saved with the adapter. A new pad token alone needs nothing.",
        keys={"tokens": ["<tool>"]},
    ),
    Case(
        "chat-template-jinja-file-missing",
        DATA,
        "chat_template_jinja naming a file that cannot be read",
        "chat_template_jinja: cannot read the template file",
        "Give the path of a readable `.jinja` file, or the template's text itself.",
        setup=_chat_jinja_file_missing,
    ),
    Case(
        "optimizer-needs-other-hardware",
        PACKAGES,
        "An optimizer for other hardware (adamw_torch_xla, adamw_torch_npu_fused)",
        "optimizer: adamw_torch_xla runs on TPUs (torch_xla) only; use adamw_torch (or adamw_torch_fused) here.",
        "Use `adamw_torch` or `adamw_torch_fused` (or an 8-bit one from bitsandbytes).",
        keys={"optimizer": "adamw_torch_xla"},
    ),
    Case(
        "optimizer-package-missing",
        PACKAGES,
        "An optimizer whose package is not installed",
        "optimizer: schedule_free_adamw needs the schedulefree package, which is not installed",
        "Install the package the message names, or use another optimizer (`adamw_torch`, `adamw_bnb_8bit`, ...). "
        "Checked before any process starts.",
        keys={"optimizer": "schedule_free_adamw"},
        skip_if=_with_package("schedulefree"),
    ),
    Case(
        "checkpoint-adapter-without-weights",
        EVALUATE,
        "--checkpoint that holds an adapter's config but no weights",
        "holds adapter_config.json but no weights (adapter_model.safetensors or adapter_model.bin); the save did "
        "not finish",
        "The folder has the adapter's config without its weights: a save that did not finish, or a copy that "
        "left the weight file behind. Use the run's output_dir after training, or a complete `checkpoint-N`. "
        "`cptune evaluate`, `merge-lora` and `inference` all check this before loading anything.",
        command="inference",
        args=("--checkpoint", "{ws}/adapter-no-weights", "--prompt", "Say hello."),
        setup=_adapter_without_weights,
    ),
    Case(
        "checkpoint-model-without-weights",
        EVALUATE,
        "--checkpoint that holds a model's config but no weights",
        "holds config.json but no weights (*.safetensors or *.bin); the save did not finish or the weight files "
        "were not copied",
        "Copy the model's weight files into the folder too, or point `--checkpoint` at a complete folder.",
        keys={"val_set_size": 0.1},
        command="evaluate",
        args=("--checkpoint", "{ws}/model-no-weights"),
        setup=_model_folder_without_weights,
    ),
    # --- cptune inference ---
    Case(
        "inference-before-training",
        INFERENCE,
        "cptune inference before training",
        "holds no trained adapter or model yet. Train first (cptune train), pass --checkpoint",
        "Train first, point `--checkpoint` at a folder with an adapter or model, or add `--base` to try "
        "the base model alone (to compare with the fine-tuned one later).",
        command="inference",
        args=("--prompt", "Say hello."),
    ),
    Case(
        "inference-base-and-checkpoint",
        INFERENCE,
        "--base together with --checkpoint",
        "--base and --checkpoint: give one of them",
        "`--base` tries the base model alone; `--checkpoint` a trained adapter or model. Give one.",
        command="inference",
        args=("--base", "--checkpoint", "{ws}/out", "--prompt", "Say hello."),
    ),
    Case(
        "inference-prompt-and-prompts",
        INFERENCE,
        "--prompt together with --prompts",
        "--prompt and --prompts: give one of them",
        "Give one prompt with `--prompt`, or a file of prompts with `--prompts` (without either, each line "
        "typed on standard input is a prompt).",
        command="inference",
        args=("--base", "--prompt", "Say hello.", "--prompts", "{ws}/data/prompts.txt"),
        setup=_prompt_files,
    ),
    Case(
        "inference-sampling-without-do-sample",
        INFERENCE,
        "--temperature, --top-p or --top-k without --do-sample",
        "--temperature: sampling options apply only with --do-sample",
        "Generation is greedy by default, which would ignore the sampling options (as transformers' "
        "`generate` does). Add `--do-sample` to sample, or leave them out.",
        command="inference",
        args=("--base", "--prompt", "Say hello.", "--temperature", "0.7"),
    ),
    Case(
        "inference-prompts-missing",
        INFERENCE,
        "--prompts names a file that does not exist",
        "is not a file; give a text file of prompts, one per line",
        "Check the path (relative paths are read from the current folder). A `.jsonl` file holds rows in the "
        "format of the recipe's first dataset, without the answer.",
        command="inference",
        args=("--base", "--prompts", "{ws}/data/no-such-prompts.txt"),
    ),
    Case(
        "inference-prompts-empty",
        INFERENCE,
        "--prompts names a file without a prompt",
        "' holds no prompt.",
        "Write one prompt per line (empty lines are skipped).",
        command="inference",
        args=("--base", "--prompts", "{ws}/data/empty.txt"),
        setup=_prompt_files,
    ),
    Case(
        "inference-prompts-jsonl-line",
        INFERENCE,
        "A line of a .jsonl prompts file is not a row",
        "line 2: each line of a .jsonl file of prompts must be a JSON object",
        "Write each prompt as a row of the data without its answer, e.g. "
        '`{"instruction": "...", "input": "..."}` for alpaca data or `{"messages": [...]}` ending with the '
        "user's message for chat data; or use a plain text file with one prompt per line.",
        command="inference",
        args=("--base", "--prompts", "{ws}/data/prompts.jsonl"),
        setup=_prompt_files,
    ),
    Case(
        "inference-prompt-too-long",
        INFERENCE,
        "A prompt longer than the model's context",
        "line 1: the prompt is 27029 tokens, but the model's context is 8192 tokens",
        "The prompt (in the training format) must leave room for at least one new token within the model's "
        "`max_position_embeddings`; with `--score`, the prompt and the completion must fit. Shorten it.",
        command="inference",
        args=("--base", "--prompts", "{ws}/data/long.txt"),
        setup=_prompt_files,
    ),
    Case(
        "inference-score-empty",
        INFERENCE,
        "--score with an empty completion",
        "--score: the completion has no token to score",
        'Give the completion whose log-likelihood you want, e.g. `--score "loud"`. (For alpaca and chat '
        "data an empty answer is refused like an empty answer in the data.)",
        command="inference",
        args=("--base", "--prompt", "Say hello.", "--score", ""),
        setup=_completion_data,
    ),
    # --- memory for long sequences (activation offloading, tiled MLP, chunked loss) ---
    Case(
        "activation-offloading-without-checkpointing",
        CONTRADICTIONS,
        "activation_offloading without gradient checkpointing",
        "activation_offloading: offloads the layer inputs that gradient checkpointing keeps for the backward "
        "pass; set gradient_checkpointing: true as well.",
        "Add `gradient_checkpointing: true`: offloading moves exactly the inputs that checkpointing keeps.",
        keys={"activation_offloading": True},
    ),
    Case(
        "activation-offloading-disk",
        RECIPE_KEYS,
        "activation_offloading: disk (Axolotl's offloading to files)",
        "activation_offloading: 'disk' (Axolotl's offloading to files) is not supported; cptune offloads to host "
        "memory with activation_offloading: true.",
        "Use `activation_offloading: true` (pinned host memory, copied on a side stream).",
        keys={"activation_offloading": "disk", "gradient_checkpointing": True},
    ),
    Case(
        "tiled-mlp-shards-without-tiled-mlp",
        CONTRADICTIONS,
        "tiled_mlp_num_shards without tiled_mlp",
        "tiled_mlp_num_shards: applies only with tiled_mlp: true",
        "Add `tiled_mlp: true`, or remove `tiled_mlp_num_shards`.",
        keys={"tiled_mlp_num_shards": 4},
    ),
    Case(
        "tiled-mlp-generic-mlp",
        RECIPE_KEYS,
        "tiled_mlp_use_original_mlp: false",
        "tiled_mlp_use_original_mlp: cptune always tiles the model's own MLP module",
        "Remove the key: cptune tiles the model's own MLP, with its LoRA layers.",
        keys={"tiled_mlp": True, "tiled_mlp_use_original_mlp": False},
    ),
    Case(
        "plugins-unknown",
        RECIPE_KEYS,
        "An Axolotl plugin cptune has no equivalent for",
        "plugins[0]: 'axolotl.integrations.spectrum.SpectrumPlugin': cptune runs no Axolotl plugins; remove it.",
        "Remove it; each plugin gets its own line. `CutCrossEntropyPlugin` and `LigerPlugin` (with "
        "`liger_fused_linear_cross_entropy`) map onto cptune's chunked loss, `cut_cross_entropy`.",
        keys={"plugins": ["axolotl.integrations.spectrum.SpectrumPlugin"]},
    ),
    Case(
        "tiled-mlp-with-zero3",
        DEEPSPEED,
        "tiled_mlp or cut_cross_entropy with zero_stage: 3",
        "tiled_mlp: is not supported with DeepSpeed ZeRO-3 yet: it calls modules again in the backward pass",
        "Use `zero_stage` 0-2 (or FSDP2 with another `cp_backend`), or remove the feature; "
        "`activation_offloading` works with ZeRO-3.",
        keys={**DEEPSPEED_CP, "zero_stage": 3, "tiled_mlp": True},
    ),
    Case(
        "cut-cross-entropy-with-zero3-json",
        DEEPSPEED,
        "cut_cross_entropy or tiled_mlp with stage 3 in the DeepSpeed JSON",
        "sets ZeRO stage 3, which frees each module's gathered weights after its forward pass, but "
        "cut_cross_entropy calls modules again",
        "Use a ZeRO stage below 3 in the JSON, or remove the feature.",
        setup=lambda ws: _deepspeed_json(ws, '{"zero_optimization": {"stage": 3}}', cut_cross_entropy=True),
        skip_if=_without_deepspeed,
    ),
    Case(
        "cut-cross-entropy-softcapped-logits",
        MODEL,
        "cut_cross_entropy with a model that soft-caps or scales its logits",
        "cut_cross_entropy: LlamaConfig transforms the logits after its output layer (final_logit_softcapping: "
        "30.0), which the chunked loss does not reproduce; the chunked loss needs a model whose logits are its "
        "output layer's output.",
        "Remove `cut_cross_entropy` (and the plugin or Liger key that turns it on) for Gemma 2/3-, Cohere- and "
        "Granite-style models. Checked from the config before anything is loaded.",
        keys={"cut_cross_entropy": True},
        setup=lambda ws: _saved_model(
            ws, "llama-softcap", _llama_like(ws, "LlamaConfig", final_logit_softcapping=30.0)
        ),
    ),
    Case(
        "activation-offloading-host-ram",
        MODEL,
        "activation_offloading needs more host RAM than the machine has",
        "activation_offloading: the offloaded layer inputs need",
        "The message gives the arithmetic (layers x tokens per process x hidden size x bytes, times the processes "
        "on the node). Split each sequence over more processes (`context_parallel_size`), train shorter rows, "
        "or remove `activation_offloading`. `cptune validate` prints the host RAM a recipe needs. Checked "
        "before anything is loaded.",
        keys={"activation_offloading": True, "gradient_checkpointing": True, "sequence_len": 1 << 40},
        command="validate",
    ),
)


# --- documented entries: errors the catalogue cannot meet before a run starts -----------------

DOCUMENTED: tuple[Documented, ...] = (
    # --- installed packages and devices ---
    Documented(
        "deepspeed-not-installed",
        PACKAGES,
        "cp_backend: deepspeed without DeepSpeed installed",
        "cp_backend: deepspeed needs DeepSpeed, which cannot be imported here",
        "Install it as the message says (`DS_BUILD_OPS=0 pip install 'deepspeed>=0.19,<0.20'`, or the "
        "`cptune[deepspeed]` extra), or use another `cp_backend`. Checked before any process starts.",
        raised_in="src/cptune/parallel/backends/deepspeed_ulysses.py",
        why_not_in_catalogue="the catalogue runs where DeepSpeed is installed; the test shadows it with a "
        "package that fails to import",
        tested_by="tests/run/test_cli_errors.py::test_deepspeed_not_installed",
    ),
    Documented(
        "zstandard-not-installed",
        PACKAGES,
        "A .zst data file without the zstandard package",
        "is zstd-compressed and the zstandard package is not installed",
        "cptune depends on zstandard, so this means a broken install: `pip install zstandard`, or decompress "
        "the file (`zstd -d rows.jsonl.zst`) and point the dataset at the plain file.",
        raised_in="src/cptune/data/compression.py",
        why_not_in_catalogue="zstandard is installed wherever cptune is; the test hides it from the import",
        tested_by="tests/data/test_sources.py::test_zstd_without_zstandard_says_how_to_decompress",
    ),
    Documented(
        "ring-flash-attn-not-installed",
        PACKAGES,
        "cp_backend: ring-flash-attn without ring-flash-attn installed",
        "cp_backend: ring-flash-attn needs the ring-flash-attn package, which cannot be imported here",
        "Install it as the message says (`pip install ring-flash-attn==0.1.8`; flash-attn itself is optional "
        "on CPU), or use another `cp_backend`. Checked before any process starts.",
        raised_in="src/cptune/parallel/backends/ring_flash_attn.py",
        why_not_in_catalogue="the catalogue runs where ring-flash-attn is installed; the test shadows it with "
        "a package that fails to import",
        tested_by="tests/run/test_cli_errors.py::test_ring_flash_attn_not_importable",
    ),
    Documented(
        "ring-flash-attn-fp32-on-gpu",
        PACKAGES,
        "cp_backend: ring-flash-attn in fp32 on a GPU with flash-attn",
        "cp_backend: ring-flash-attn runs flash-attn's CUDA kernels, which support bf16 and fp16 only",
        "Set `bf16: true` (or `fp16: true`). cptune's CPU kernels take fp32, so the same recipe dry-runs "
        "on a laptop. Checked before any process starts.",
        raised_in="src/cptune/parallel/backends/select.py",
        why_not_in_catalogue="only on a machine with a CUDA GPU and flash-attn",
        tested_by="tests/run/test_preflight.py::test_fp32_ring_flash_attn_on_a_gpu_is_refused_before_launching",
    ),
    Documented(
        "patch-version-mismatch",
        PACKAGES,
        "Library versions that cptune's patches were not written for",
        "cptune cannot patch the installed libraries (",
        "Each problem line names the library, the versions the patch was written for and the installed one. "
        "Install the versions cptune pins (`pip install -e .` in a fresh environment), or use a cptune "
        "release made for your versions; `cptune validate` lists the problems without training. Raised when "
        "training starts, in every process, before any step.",
        raised_in="src/cptune/patches/core.py",
        why_not_in_catalogue="it needs installed libraries of other versions",
        tested_by="tests/patches/test_core.py::test_all_problems_reported_at_once_before_touching_anything",
    ),
    # --- during a run ---
    Documented(
        "torch-cp-padded-bidirectional-batch",
        DURING_RUN,
        "cp_backend: torch meets a padded or packed batch with causal: false",
        "cp_backend: torch cannot mask padding or packed documents with causal: false",
        "torch's context-parallel attention takes no mask, so with bidirectional attention every token would "
        "see the padding. Rows of different lengths in one micro batch are padded: use "
        "`micro_batch_size: 1` (with more `gradient_accumulation_steps`), or `cp_backend: ring-flash-attn`, "
        "which masks padding and packed documents. Raised at the first such batch, in every rank.",
        raised_in="src/cptune/parallel/backends/torch_cp.py",
        why_not_in_catalogue="it depends on the batches, so it is raised after the processes started",
        tested_by="tests/run/test_train_torch_cp.py::test_packed_and_padded_batches_stop_training_at_the_first_batch",
    ),
    Documented(
        "torch-cp-uneven-bidirectional-batch",
        DURING_RUN,
        "cp_backend: torch meets a row that does not split evenly with causal: false",
        "cp_backend: torch cannot mask padding with causal: false, and this batch's",
        "Without a mask, torch cannot pad a row to split it over the ranks. Use rows whose length is a "
        "multiple of context_parallel_size, or `cp_backend: ring-flash-attn`. Raised at the first such "
        "batch, in every rank.",
        raised_in="src/cptune/parallel/backends/torch_cp.py",
        why_not_in_catalogue="it depends on the batches, so it is raised after the processes started",
        tested_by="tests/parallel/backends/test_torch_cp.py::test_bidirectional_needs_a_length_that_splits_without_padding",
    ),
    Documented(
        "torch-cp-packed-batch",
        DURING_RUN,
        "cp_backend: torch meets a packed batch",
        "cp_backend: torch cannot mask packed documents: its context-parallel attention is plain causal "
        "attention over each row",
        "`sample_packing: true` with `cp_backend: torch` is refused before the run (see above); this is the "
        "same check on the batch itself, for recipes built without the recipe checks. Use "
        "`cp_backend: ring-flash-attn`, or `sample_packing: false`.",
        raised_in="src/cptune/parallel/backends/torch_cp.py",
        why_not_in_catalogue="it depends on the batches, so it is raised after the processes started",
        tested_by="tests/run/test_train_torch_cp.py::test_packed_and_padded_batches_stop_training_at_the_first_batch",
    ),
    Documented(
        "model-weights-unreadable",
        DURING_RUN,
        "The model's weights cannot be loaded",
        "base_model: cannot load '",
        "The checks before the run passed (safetensors files are checked there), but loading the weights "
        "failed: a damaged `.bin` file, weights of another architecture or size, or a download that failed. "
        "The message quotes the loader's reason. Copy or download the model again. Raised when each process "
        "loads the model.",
        raised_in="src/cptune/models/loading.py",
        why_not_in_catalogue="weights are loaded only after the checks, in every process",
        tested_by="tests/models/test_loading.py::test_a_damaged_weight_file_is_a_clear_error_when_loading",
    ),
    Documented(
        "model-attention-implementation",
        DURING_RUN,
        "The model cannot use the attention implementation the recipe needs",
        "cannot use the attention implementation",
        "transformers refused to load the model with the attention function the recipe needs (sdpa for "
        "causal training at context_parallel_size: 1, cptune's own otherwise). Use a model whose attention "
        "goes through transformers' AttentionInterface (Llama, Qwen2/3, Mistral, ...). Raised when each "
        "process loads the model.",
        raised_in="src/cptune/models/loading.py",
        why_not_in_catalogue="weights are loaded only after the checks, in every process",
    ),
    Documented(
        "model-layers-bypass-attention",
        DURING_RUN,
        "Some attention layers bypass cptune's attention",
        "attention layers through cptune's context-parallel attention; the others would attend only within "
        "this rank's shard",
        "The model's class says it routes attention through transformers' AttentionInterface, but some "
        "layers did not (custom attention code). Use a model whose every layer does, or "
        "`context_parallel_size: 1` with `causal: true`. Raised at the first step.",
        raised_in="src/cptune/parallel/backends/attention.py",
        why_not_in_catalogue="it is found by counting the layers of a real forward pass",
        tested_by="tests/parallel/backends/test_attention.py::test_a_layer_that_bypasses_the_backend_is_an_error",
    ),
    Documented(
        "model-without-layer-count",
        DURING_RUN,
        "A model config without num_hidden_layers",
        "cannot tell how many attention layers this model has (no num_hidden_layers).",
        "cptune counts the attention layers each step to prove that all of them went through its attention. "
        "Use a model whose config has `num_hidden_layers` (every decoder model in transformers has it). "
        "Raised at the first step.",
        raised_in="src/cptune/parallel/backends/attention.py",
        why_not_in_catalogue="it is found at the first step of a model cptune cannot inspect",
    ),
    # --- using cptune from Python ---
    Documented(
        "library-call-without-metadata",
        LIBRARY,
        "Calling a model set up for cptune's attention outside cptune's trainer",
        "this model is set up for cptune's context-parallel attention, which needs per-batch metadata",
        "A model loaded by cptune for context parallelism or `causal: false` takes its attention metadata "
        "from cptune's trainer with every forward call; it cannot generate or run a plain forward pass. "
        "Save the model (or merge the adapter with `cptune merge-lora`) and load it again with "
        "`AutoModelForCausalLM.from_pretrained`.",
        raised_in="src/cptune/parallel/backends/attention.py",
        why_not_in_catalogue="only reachable from Python code that calls the model itself",
        tested_by="tests/parallel/backends/test_attention.py::test_model_called_without_metadata_is_refused",
    ),
    Documented(
        "library-ulysses-call-without-metadata",
        LIBRARY,
        "Calling a model set up for cptune's Ulysses attention outside cptune's trainer",
        "this model is set up for cptune's Ulysses attention, which needs the batch's position_ids and "
        "per-batch metadata",
        "The same as above for `cp_backend: deepspeed`: save or merge the model and load it again.",
        raised_in="src/cptune/parallel/backends/document_attention.py",
        why_not_in_catalogue="only reachable from Python code that calls the model itself",
        tested_by="tests/parallel/backends/test_deepspeed_ulysses.py::"
        "test_document_attention_refuses_calls_without_metadata_or_with_a_mask",
    ),
    Documented(
        "library-maybe-context-parallel",
        LIBRARY,
        "accelerator.maybe_context_parallel() in your own code",
        "accelerator.maybe_context_parallel() was called, but cptune's",
        "cptune's trainer shards every batch itself; accelerate's context-parallel context would shard it a "
        "second time (or does not exist for ring-flash-attn). Remove the call.",
        raised_in="src/cptune/patches/accelerate_patches.py",
        why_not_in_catalogue="only reachable from Python code running inside a cptune run",
        tested_by="tests/patches/test_real_patches.py::test_prepare_cp_for_ring_returns_args_and_adds_no_hooks",
    ),
    Documented(
        "library-maybe-context-parallel-torch",
        LIBRARY,
        "accelerator.maybe_context_parallel() in your own code (cp_backend: torch)",
        "accelerator.maybe_context_parallel() was called, but cptune's torch backend already shards every "
        "batch",
        "Remove the call: cptune's trainer switches torch's context-parallel attention on around each micro "
        "batch.",
        raised_in="src/cptune/patches/accelerate_patches.py",
        why_not_in_catalogue="only reachable from Python code running inside a cptune run",
        tested_by="tests/patches/test_real_patches.py::test_prepare_cp_for_torch_checks_instead_of_dropping_masks",
    ),
    Documented(
        "library-torch-cp-without-patch",
        LIBRARY,
        "cp_backend: torch on CPU in your own training loop without cptune's patch",
        "cp_backend: torch on CPU needs cptune's patch 'torch-cp-cpu-sdpa-handlers'",
        "`cptune train` applies the patch; in your own loop, apply "
        "`cptune.patches.torch_patches.torch_cp_cpu_sdpa_patch()` with a `PatchSet` around it.",
        raised_in="src/cptune/parallel/backends/torch_cp.py",
        why_not_in_catalogue="only reachable from Python code that drives the backend itself",
        tested_by="tests/parallel/backends/test_torch_cp.py::test_step_context_needs_the_cpu_patch_and_restores_torchs_globals",
    ),
    Documented(
        "tiled-mlp-mixture-of-experts",
        MODEL,
        "tiled_mlp with a mixture-of-experts model",
        "the MLP of each decoder layer must be a dense, token-wise module. Remove tiled_mlp.",
        "Remove `tiled_mlp`: an expert router balances its experts over all the tokens of a call, which tiles "
        "would change. Checked from a weightless copy of the model before anything is loaded.",
        raised_in="src/cptune/models/memory_features.py",
        why_not_in_catalogue="a saved mixture-of-experts model is large for the catalogue's workspace",
        tested_by="tests/models/test_memory_features.py::test_check_memory_features_refuses_a_mixture_of_experts_before_loading",
    ),
    Documented(
        "cut-cross-entropy-logits-changed",
        DURING_RUN,
        "cut_cross_entropy with a model whose logits are not its output layer's",
        "cut_cross_entropy: the model's logits are not its output layer applied to its decoder's output",
        "Remove `cut_cross_entropy`. Every step checks the one token of logits the model returns against "
        "the output layer; a model that changes them (a scale, a soft cap, a norm after the decoder) that "
        "its config does not reveal is stopped at the first step.",
        raised_in="src/cptune/models/head_loss.py",
        why_not_in_catalogue="only at the first training step, with a model that hides the change from its config",
        tested_by="tests/models/test_memory_features.py::test_head_loss_refuses_a_model_that_transforms_its_logits",
    ),
    Documented(
        "cut-cross-entropy-logits-to-keep-ignored",
        DURING_RUN,
        "cut_cross_entropy with a model that ignores logits_to_keep",
        "cut_cross_entropy: the model ignored logits_to_keep and computed",
        "Remove `cut_cross_entropy`: the model computes every logit anyway, so the chunked loss saves nothing.",
        raised_in="src/cptune/models/head_loss.py",
        why_not_in_catalogue="only at the first training step, with remote code that accepts but ignores the "
        "argument",
        tested_by="tests/models/test_memory_features.py::test_head_loss_refuses_a_model_that_ignores_logits_to_keep",
    ),
    Documented(
        "library-patch-revert-conflict",
        LIBRARY,
        "Reverting cptune's patches after other code patched the same function",
        "cannot revert cptune's patches:",
        "Other code replaced a function cptune had patched, so undoing cptune's patch would drop it; nothing "
        "was reverted. Undo the other patch first (or do not apply it inside a cptune run), then revert.",
        raised_in="src/cptune/patches/core.py",
        why_not_in_catalogue="only reachable from Python code that patches the same functions as cptune",
        tested_by="tests/patches/test_core.py::test_revert_over_foreign_patch_raises_and_touches_nothing",
    ),
    Documented(
        "bitsandbytes-not-installed",
        PACKAGES,
        "load_in_4bit or load_in_8bit without bitsandbytes",
        "quantizing the base model needs bitsandbytes, which is not installed",
        "Install it: `pip install 'cptune[quantization]'` (bitsandbytes 0.50 has CPU kernels too, so a QLoRA "
        "recipe dry-runs on a laptop). Checked before any process starts.",
        raised_in="src/cptune/models/quantization.py",
        why_not_in_catalogue="the catalogue runs where bitsandbytes is installed; the test hides it",
        tested_by="tests/models/test_quantization.py::test_missing_bitsandbytes_is_refused_before_launching",
    ),
    Documented(
        "wandb-not-installed",
        PACKAGES,
        "W&B keys without the wandb package",
        "logging to Weights & Biases needs the wandb package, which is not installed",
        "Install it (`pip install 'cptune[wandb]'`), or remove `wandb_project` / `use_wandb`. Checked before "
        "any process starts.",
        raised_in="src/cptune/run/tracking.py",
        why_not_in_catalogue="the catalogue runs where wandb is installed; the test hides it",
        tested_by="tests/run/test_tracking.py::test_wandb_missing_is_refused",
    ),
    Documented(
        "gpus-not-divisible-by-cp",
        MODEL,
        "A GPU count that is not a multiple of the CP group",
        "cannot be split into groups of context_parallel_size × dp_replicate_size",
        "Without `--nproc-per-node`, `cptune train` starts one process per visible GPU. Pass "
        "`--nproc-per-node` (a multiple of the group), or choose GPUs with `CUDA_VISIBLE_DEVICES`.",
        raised_in="src/cptune/run/launch.py",
        why_not_in_catalogue="only on a machine with GPUs; the test fakes the GPU count",
        tested_by="tests/run/test_launch.py::test_default_processes_one_per_gpu",
    ),
)
