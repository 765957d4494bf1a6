"""``cptune inference``: the quickstart's adapter answers like its data, deterministically; scores are exact.

The quickstart's own run (``quickstart_run``, shared with tests/test_examples.py) provides the
trained adapter, so trying it adds no training to the suite.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from cptune.config.loader import load_recipe
from cptune.data.formats import build_formatter
from cptune.models.loading import load_tokenizer
from cptune.run.commands.inference import (
    Generated,
    GenerationOptions,
    InferenceSession,
    Score,
    load_inference_model,
    prompter_for,
    run_inference,
)
from cptune.run.commands.weights import ModelSource
from tests.conftest import QUICKSTART_DATA, REPO, succeeded
from tests.numerics import float64_loss_sum, float64_scalar_twins_excess, loss_sum_floor
from tests.parallel.reorder_twins import SDPA_TWIN_DRAWS, sdpa_twin_runs

ROWS = [json.loads(line) for line in QUICKSTART_DATA.read_text().splitlines() if line.strip()]
PROMPTS = ROWS[::20]  # 30 training prompts, every task of the data among them


def _quiet(*_: object) -> None:
    pass


def _prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"instruction": r["instruction"], "input": r["input"]}) + "\n" for r in PROMPTS)
    )
    return path


@pytest.fixture
def quickstart(quickstart_run, monkeypatch):
    """The quickstart recipe pointing at the session's trained adapter (run from the repository root)."""
    done, out = quickstart_run
    succeeded(done)
    monkeypatch.chdir(REPO)
    return load_recipe("examples/quickstart.yaml", [f"--output_dir={out}"])


@pytest.fixture
def one_thread():
    """One torch thread, as the CLI runs in tests (OMP_NUM_THREADS=1): tiny matrices on two busy cores
    otherwise spend their time handing work between threads (measured: 37 s against 2 s for 30 answers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _generate(session: InferenceSession, tmp_path: Path) -> list[Generated]:
    results = session.run(
        prompts=_prompts_file(tmp_path),
        options=GenerationOptions(max_new_tokens=24),
        stream=False,
        echo=_quiet,
    )
    return [r for r in results if isinstance(r, Generated)]


@pytest.mark.distributed
def test_quickstart_adapter_answers_in_the_datas_style_greedily_and_unlike_the_base_model(
    quickstart, tmp_path, one_thread
):
    tokenizer = load_tokenizer(quickstart)
    tuned = InferenceSession(quickstart)
    first = _generate(tuned, tmp_path)
    again = _generate(tuned, tmp_path)
    base = _generate(InferenceSession(quickstart, base=True), tmp_path)
    assert len(first) == len(PROMPTS)
    assert [g.output_ids for g in again] == [g.output_ids for g in first], "greedy decoding is deterministic"
    assert [g.output_ids for g in base] != [g.output_ids for g in first]

    # The data's answer style: a short answer on one line that ends with eos by itself (the data's
    # answers are 2-11 tokens), not a continuation of the prompt format; made of the data's answer tokens.
    answer_tokens = {
        token
        for row in ROWS
        for token in tokenizer(row["output"], add_special_tokens=False)["input_ids"]
        + [tokenizer.eos_token_id]
    }
    for g in first:
        assert g.output_ids[-1] == tokenizer.eos_token_id and len(g.output_ids) <= 16, g.text
        assert g.text.strip() and "\n" not in g.text and "###" not in g.text, g.text
    generated = [t for g in first for t in g.output_ids]
    share = sum(t in answer_tokens for t in generated) / len(generated)
    # Measured: 0.83 of the tokens (the rest are words of the base model's pre-training prose).
    assert share >= 0.75, [g.text for g in first]
    assert len({g.text for g in first}) >= 8, "different prompts get different answers"
    # The base model has not learnt the format: it answers nothing and stops at once.
    assert not any(g.text.strip() for g in base)


@pytest.mark.distributed
def test_a_training_answer_scores_higher_with_the_adapter_than_without(quickstart, tmp_path, one_thread):
    sessions = InferenceSession(quickstart), InferenceSession(quickstart, base=True)
    for number, row in enumerate(PROMPTS[:8]):
        prompts = tmp_path / f"row{number}.jsonl"
        prompts.write_text(json.dumps({"instruction": row["instruction"], "input": row["input"]}) + "\n")
        tuned, base = (
            session.run(prompts=prompts, completion=row["output"], echo=_quiet)[0] for session in sessions
        )
        assert isinstance(tuned, Score) and isinstance(base, Score)
        assert tuned.tokens == base.tokens > 1
        assert tuned.log_likelihood > base.log_likelihood, (row, tuned, base)


@pytest.mark.distributed
def test_inference_command_streams_the_answer_and_prints_the_score(
    quickstart, quickstart_run, cptune_in_process, one_thread
):
    _, out = quickstart_run
    prompt = "What is the opposite of this word?"
    expected = run_inference(quickstart, prompt=prompt, stream=False, echo=_quiet)[0]
    done = cptune_in_process(
        "inference", "examples/quickstart.yaml", f"--output_dir={out}", "--prompt", prompt
    )
    succeeded(done)
    assert done.stdout == expected.text + "\n"
    done = cptune_in_process(
        "inference", "examples/quickstart.yaml", f"--output_dir={out}", "--prompt", prompt, "--score", "loud"
    )
    succeeded(done)
    assert re.fullmatch(
        r"log-likelihood -\d+\.\d{4} over 2 completion tokens \(mean -\d+\.\d{4} per token\)\n", done.stdout
    )


def test_score_is_the_training_loss_of_the_answer_and_sampling_follows_the_seed(
    write_recipe, one_thread, caplog
):
    recipe = load_recipe(write_recipe())
    tokenizer = load_tokenizer(recipe)
    row = {"instruction": "Say hello.", "input": "", "output": "Hello there, friend."}
    with caplog.at_level(logging.INFO, logger="cptune"):
        (result,) = run_inference(
            recipe, base=True, prompt=row["instruction"], completion=row["output"], echo=_quiet
        )
    # Scoring generates nothing, and the line that names the weights says so.
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if m.startswith(("scoring with", "generating with"))] == [
        f"scoring with {ModelSource('base').describe(recipe)}"
    ], said
    # Independently: the model's own loss on the training sample is the mean negative log-likelihood
    # of exactly the trained tokens.
    sample = build_formatter(
        recipe.datasets[0], tokenizer, train_on_inputs=False, chat_template=None, label="t"
    )(row)
    model = load_inference_model(recipe, ModelSource("base"), tokenizer)
    ids, labels = torch.tensor([sample.input_ids]), torch.tensor([sample.labels])
    with torch.no_grad():
        losses = [model(input_ids=ids, labels=labels).loss]
        losses += sdpa_twin_runs(model, lambda: model(input_ids=ids, labels=labels).loss)  # the loss's twins
        loss64 = float64_loss_sum(copy.deepcopy(model).double()(input_ids=ids).logits[:, :-1], labels[:, 1:])
    trained = sum(label != -100 for label in sample.labels[1:])
    assert result.tokens == trained
    # Twins rule (tests/numerics.py): the score may land 32x as far from the float64 sum as the farthest of the
    # model's own fp32 loss and its 2 twins (sdpa's math backend, sdpa over the tokens in a strided order: tests/parallel/reorder_twins.py)
    # do (SDPA_TWIN_DRAWS), each known to within its last rounding, plus the reorder bound of the sum of its token
    # losses.
    error, *reference_errors = (
        abs(-x - float(loss64)) / float(loss64)
        for x in (result.log_likelihood, *(-float(loss) * trained for loss in losses))
    )
    excess = float64_scalar_twins_excess(error, reference_errors, loss_sum_floor(trained), SDPA_TWIN_DRAWS)
    assert excess <= 1, (result.log_likelihood, error, reference_errors)

    sampled = [
        run_inference(
            recipe,
            base=True,
            prompt="Say hello.",
            options=GenerationOptions(max_new_tokens=12, do_sample=True, temperature=1.5),
            stream=False,
            echo=_quiet,
            seed=seed,
        )[0].output_ids
        for seed in (1, 1, 2)
    ]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


@pytest.mark.distributed
def test_a_merged_full_model_answers_like_the_adapter_on_its_base(quickstart, tmp_path, one_thread):
    from cptune.run.commands.merge import merge_lora

    merged = merge_lora(quickstart, out=tmp_path / "merged")
    tuned = _generate(InferenceSession(quickstart), tmp_path)
    full = _generate(InferenceSession(quickstart, checkpoint=merged), tmp_path)
    assert [g.output_ids for g in full] == [g.output_ids for g in tuned]


def test_an_adapter_trained_with_new_tokens_loads_with_its_grown_embeddings(
    write_recipe, tmp_path, one_thread
):
    """Training grows the embeddings for the recipe's new tokens and the adapter saves them whole
    (lora_modules_to_save): inference grows the base model's the same way before loading the adapter,
    as evaluate and merge-lora do (it once loaded the base as it was, and peft refused the shapes)."""
    from cptune.models.added_tokens import fit_embeddings
    from cptune.models.loading import apply_lora, load_model

    recipe = load_recipe(
        write_recipe(
            tokens=["<fact>"], lora_modules_to_save=["embed_tokens", "lm_head"], sample_packing=False
        )
    )
    tokenizer = load_tokenizer(recipe)
    model = load_model(recipe, "sdpa")
    rows = model.get_input_embeddings().num_embeddings
    fit_embeddings(model, tokenizer, recipe)  # what training does before the adapter goes on
    adapter = tmp_path / "adapter"
    apply_lora(model, recipe).save_pretrained(adapter)

    session = InferenceSession(recipe, checkpoint=adapter)
    assert session.model.get_input_embeddings().num_embeddings == len(tokenizer) == rows + 1
    (answer,) = session.run(
        prompt="What is a <fact>?", echo=_quiet, options=GenerationOptions(max_new_tokens=2)
    )
    assert len(answer.output_ids) <= 2


def test_a_run_with_embeddings_padded_to_32x_saves_merges_and_loads_them(
    write_recipe, tmp_path, cptune_in_process, one_thread
):
    """resize_token_embeddings_to_32x with LoRA and no lora_modules_to_save: peft saves both embeddings whole
    with the adapter (their rows are no longer the base model's), and inference and merge-lora pad the base
    model the same way before the adapter goes on (peft refuses a base of other shapes)."""
    from safetensors import safe_open

    path = write_recipe(resize_token_embeddings_to_32x=True, max_steps=1)
    done = cptune_in_process("train", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    recipe = load_recipe(path)
    tokens = len(load_tokenizer(recipe))
    rows = -(-tokens // 32) * 32
    assert rows > tokens
    with safe_open(tmp_path / "out" / "adapter_model.safetensors", "pt") as saved:
        head = saved.get_tensor("base_model.model.lm_head.weight")
        embed = saved.get_tensor("base_model.model.model.embed_tokens.weight")
    assert head.shape[0] == embed.shape[0] == rows

    adapter = InferenceSession(recipe)
    assert torch.equal(adapter.model.get_output_embeddings().weight, head)
    assert torch.equal(adapter.model.get_input_embeddings().weight, embed)
    (answer,) = adapter.run(prompt="Say hello.", echo=_quiet, options=GenerationOptions(max_new_tokens=2))
    assert 1 <= len(answer.output_ids) <= 2

    merged = tmp_path / "merged"
    done = cptune_in_process("merge-lora", str(path), "--out", str(merged))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((merged / "config.json").read_text())["vocab_size"] == rows
    full = InferenceSession(recipe, checkpoint=merged)
    assert torch.equal(full.model.get_output_embeddings().weight, head)
    (answer,) = full.run(prompt="Say hello.", echo=_quiet, options=GenerationOptions(max_new_tokens=2))
    assert 1 <= len(answer.output_ids) <= 2


def test_prompts_use_the_recipes_chat_template_jinja_and_eot_tokens():
    """prompter_for passes chat_template_jinja and eot_tokens on: prompts render as training renders rows."""
    from transformers import AutoTokenizer

    from cptune.config.loader import validate_recipe
    from cptune.data.chat_templates import TEMPLATES

    keys = {
        "base_model": "m",
        "datasets": [{"path": "c.jsonl", "type": "chat_template"}],
        "chat_template_jinja": TEMPLATES["phi_3"],
    }
    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny-llama")
    prompter = prompter_for(validate_recipe(keys), tokenizer)
    assert (
        tokenizer.decode(prompter.prompt_ids(prompter.row("Hi"))) == "<s><|user|>\nHi<|end|>\n<|assistant|>\n"
    )
    assert prompter_for(validate_recipe({**keys, "eot_tokens": ["<|end|>"]}), tokenizer).eot_tokens == (
        "<|end|>",
    )
