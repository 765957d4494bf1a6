"""The catalogue of bad inputs: what a user can get wrong, and what cptune must say.

Each :class:`Case` builds one bad input in a fresh workspace (a recipe, data
files, an output folder), names the command line that meets it, and the exact
fragment of the message the user must see. ``test_catalogue.py`` runs every case
through the real CLI; ``scripts/gen_troubleshooting.py`` renders the same cases
as ``docs/troubleshooting.md``, so the page cannot drift from what the code says.

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
        recipe = ws.root / self.recipe_at if self.recipe_at is not None else ws.recipe
        return [self.command, str(recipe), *self.args]


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
    bad = {"messages": [{"role": "human", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
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


def _resume_path_incomplete(ws: Workspace) -> dict[str, Any]:
    _incomplete_checkpoint(ws)
    return {"resume_from_checkpoint": str(ws.out / "checkpoint-4")}


# --- the cases ------------------------------------------------------------------------------

RECIPE_FILE = "The recipe file"
RECIPE_KEYS = "Recipe keys and values"
CONTRADICTIONS = "Keys that contradict each other"
MODEL = "Model, tokenizer and processes"
DATA = "Data"
OUTPUT = "The output folder and resuming"

SECTIONS = (RECIPE_FILE, RECIPE_KEYS, CONTRADICTIONS, MODEL, DATA, OUTPUT)

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
        "load_in_4bit: is an Axolotl key that cptune does not support",
        "The message says what cptune offers instead; remove the key.",
        keys={"load_in_4bit": True},
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
        "the folder holds no data files (.json, .jsonl, .ndjson, .csv, .tsv, .parquet, .arrow)",
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
        "Convert the data to one of the listed formats (JSON lines, JSON, CSV, TSV, Parquet, Arrow).",
        setup=_text_file,
    ),
    Case(
        "data-column-missing",
        DATA,
        "A field name that no row has",
        "no column 'answer'",
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
        "row 0: the chat template rejected the messages (Unknown role human",
        "The tokenizer's chat template refused the row; its own message follows. Map the roles to the "
        "template's (e.g. `human` to `user`), or skip such rows with `skip_invalid_rows: true`.",
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
        "val_set_size: 1000.0 asks for 1000 of the 600 training samples",
        "Lower `val_set_size` (a share below 1, or a row count) or add data.",
        keys={"val_set_size": 1000},
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
        "is not writable (its nearest existing parent",
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
)
