"""Four of Axolotl's example recipes train at cp=2 on the tiny models, in one launch of two processes.

- ``llama-3/qlora-1b.yml`` (QLoRA: 4-bit NF4 base, adamw_bnb_8bit): its adapter loads in plain peft
  on the quantized base, and ``cptune merge-lora`` merges it into the dequantized base so the merged
  model computes what the trained one does. (cp=2 equals cp=1 for QLoRA, gradients included:
  tests/parallel/test_parity.py and test_ulysses_parity.py.)
- ``llama-3/lora-1b.yml`` (LoRA, adamw_8bit) with W&B in offline mode: the run folder W&B writes
  holds the losses the run logged, with no network, and the adapter loads in plain peft.
- ``qwen2/qlora-fsdp.yaml`` (QLoRA with Axolotl's FSDP1 keys, run as FSDP2 on a tiny Qwen2), and the same
  recipe without its fsdp keys: the sharded run equals the unsharded one (losses, grad norms, adapter).
- ``alst/llama3-8b-deepspeed-alst`` (ALST: ring-flash-attn CP under DeepSpeed ZeRO-3 with parameters and
  optimizer offloaded to the CPU, tiled MLP, the chunked loss of the CutCrossEntropyPlugin, activation
  offloading): it trains, with ZeRO-3 partitioning every weight matrix and both memory features hooked in.
  (The same combination equals the cp=1 run without ZeRO: tests/parallel/test_ulysses_parity.py.)

All run through ``cptune.run.training.train.train`` one after the other in the same two gloo processes
(``train_worker.py``): process start-up dominates such short runs. Overrides keep them short
(steps, sequence length; for ALST also ``min_sample_len``, and ``optimizer: adamw_torch`` for its
``adamw_torch_8bit``, which needs torchao); everything else is Axolotl's recipe."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.axolotl.recipes import RECIPES_DIR, localised
from tests.conftest import logged, logged_losses, max_rel_diff
from tests.dist_utils import run_ranks
from tests.numerics import assert_float64_twins_rule, assert_within, logged_tolerance
from tests.parallel.float64_reference import float64_twin
from tests.parallel.reorder_twins import sdpa_twin_runs

pytest.importorskip("bitsandbytes", reason="the quantization extra is not installed")
pytest.importorskip("wandb", reason="the wandb extra is not installed")

WORKER = Path(__file__).with_name("train_worker.py")
QLORA, LORA, QWEN2_FSDP = "llama-3--qlora-1b.yml", "llama-3--lora-1b.yml", "qwen2--qlora-fsdp.yaml"
# The qwen2 recipe once more without its fsdp keys: the reference its FSDP2 run must equal; and resumed
# from the FSDP2 run's sharded checkpoint of step 2 (4-bit base weights sharded in it).
QWEN2_NO_FSDP, QWEN2_RESUMED = "qwen2--qlora-no-fsdp.yaml", "qwen2--qlora-fsdp-resumed.yaml"
ALST = "alst--llama3-8b-deepspeed-alst.yaml"
SHORT = {"max_steps": 3, "sequence_len": 256, "context_parallel_size": 2}
# FSDP2 against the same run whole on every rank (fp32, gloo, AdamW). Losses and gradient norms: bound
# (tests/numerics.py), rows of 256 tokens, 4 a step (the qwen2 recipe's micro batch 1 x accumulation 4).
LOGGED_TOL = logged_tolerance(SHORT["sequence_len"], 4)
# Adapter weights: bound. AdamW moves an element by lr x |m / sqrt(v)| a step, and with betas (0.9, 0.999)
# over 3 steps Cauchy-Schwarz gives |m / sqrt(v)| <= 1.004 (bias-corrected), whatever the gradients: two
# runs whose gradients differ by rounding (a near-zero gradient's sign can flip) end at most 2 x 1.004 x
# lr x steps apart (the recipe's learning_rate 2e-4, warm-up only lowers it; weight_decay 0).
ADAPTER_TOL = 2 * 1.004 * 2e-4 * SHORT["max_steps"]
WANDB = {"wandb_project": "cptune-axolotl", "wandb_name": "lora-1b-cp2", "wandb_mode": "offline"}
# ALST's recipe keeps samples of 200,000 tokens and more; its optimizer (adamw_torch_8bit) needs torchao.
ALST_SHORT = {"min_sample_len": 16, "optimizer": "adamw_torch"}


@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory) -> dict[str, Any]:
    """Output folders of the recipes, trained at cp=2 in one launch (the DeepSpeed one last), and under
    ``NAME:setup`` what each trained with (``train_worker.Setup``)."""
    root = tmp_path_factory.mktemp("axolotl-cp2")
    paths, outputs = [], {}
    resumed = {"resume_from_checkpoint": str(root / "qlora-fsdp" / "checkpoint-2")}
    runs = (
        (QLORA, {}),
        (LORA, WANDB),
        (QWEN2_FSDP, {}),
        (QWEN2_NO_FSDP, {}),
        (QWEN2_RESUMED, resumed),
        (ALST, ALST_SHORT),
    )
    for name, extra in runs:
        data = localised(RECIPES_DIR / (QWEN2_FSDP if name.startswith("qwen2--") else name), tiny_models)
        if name == QWEN2_NO_FSDP:
            del data["fsdp"], data["fsdp_config"]
        outputs[name] = root / name.split("--")[1].split(".")[0]
        data.update(
            SHORT, **extra, output_dir=str(outputs[name]), dataset_prepared_path=str(root / "prepared")
        )
        paths.append(root / name)
        paths[-1].write_text(yaml.safe_dump(data))
    home = root / "wandb-home"
    # No network: W&B offline, and any request would go to a closed port.
    env = {
        "WANDB_CONFIG_DIR": str(home),
        "WANDB_CACHE_DIR": str(home),
        "WANDB_DATA_DIR": str(home),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "OMP_NUM_THREADS": "1",
    }
    with mock.patch.dict(os.environ, env):
        ranks = run_ranks(WORKER, 2, root / "ranks", *map(str, paths))
    assert ranks[0] == ranks[1]  # every rank logs the same (global) losses
    for name in list(outputs):
        (run,) = [v for k, v in ranks[0].items() if k.endswith(name)]
        losses = run["losses"]
        assert losses == logged_losses(outputs[name]) and len(losses) == 3 and len(set(losses)) == 3
        outputs[name + ":setup"] = run
    return outputs


def load_in_peft(adapter: Path, base_dir: Path, **quantization) -> torch.nn.Module:
    """The adapter on its base model with plain transformers + peft, as a user would load it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, **quantization)
    base.resize_token_embeddings(len(AutoTokenizer.from_pretrained(adapter)))  # the recipe's new pad token
    return PeftModel.from_pretrained(base, adapter)


def nf4():
    """The 4-bit NF4 quantization a QLoRA recipe trains its base in (Axolotl's defaults, fp32 on CPU)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=torch.float32,
    )


def prompt_ids(adapter: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(adapter)(
        "### Instruction:\nName a colour.\n\n### Response:\n", return_tensors="pt"
    ).input_ids


@pytest.mark.distributed
def test_qlora_recipe_adapter_loads_in_peft_and_merges_into_the_dequantized_base(
    trained, tiny_model_dir, tmp_path, cptune_in_process
):
    from transformers import AutoModelForCausalLM

    adapter = trained[QLORA]
    history = json.loads((adapter / "train_log.json").read_text())
    assert (
        len([e for e in history if "eval_loss" in e]) == 3
    )  # evals_per_epoch: 4 of a 3-step run: every step
    recipe = adapter.parent / QLORA
    merged = tmp_path / "merged"
    done = cptune_in_process("merge-lora", str(recipe), "--checkpoint", str(adapter), "--out", str(merged))
    assert done.returncode == 0, done.stderr
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    standalone = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)

    model = load_in_peft(adapter, tiny_model_dir, quantization_config=nf4())
    model.train()  # bitsandbytes' exact path (its CPU inference kernel computes in bf16) ...
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.eval()  # ... without the recipe's LoRA dropout
    ids = prompt_ids(adapter)
    with torch.no_grad():
        expected, got = model(input_ids=ids).logits, standalone(input_ids=ids).logits
        expected64 = float64_twin(model)(input_ids=ids).logits  # the 4-bit base dequantized, in float64
    # Twins rule (tests/numerics.py): the merged model's fp32 logits within 32x the farthest distance from
    # float64 of the adapter-on-4-bit model's and of its 2 twins' (sdpa's math backend, sdpa over the tokens in a strided order:
    # tests/parallel/reorder_twins.py). Merged into the original, unquantized weights it was 0.05 off.
    with torch.no_grad():
        twins = sdpa_twin_runs(model, lambda: {"logits": model(input_ids=ids).logits})
    assert_float64_twins_rule({"logits": got}, [{"logits": expected}, *twins], {"logits": expected64})
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().max() > 0 for p in lora_b)


@pytest.mark.distributed
def test_lora_recipe_logs_to_wandb_offline_and_its_adapter_loads_in_peft(trained, tiny_model_dir):
    from wandb.proto import wandb_internal_pb2

    out = trained[LORA]
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file, wandb_internal_pb2.Record))
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in records
        if record.WhichOneof("record_type") == "history"
    ]
    assert [h["train/loss"] for h in history if "train/loss" in h] == logged_losses(out)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("cptune-axolotl", "lora-1b-cp2")

    model = load_in_peft(out, tiny_model_dir)
    with torch.no_grad():
        logits = model(input_ids=prompt_ids(out)).logits
    assert torch.isfinite(logits).all()
    # The trained adapter is not the zero initialisation.
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().max() > 0 for p in lora_b)


@pytest.mark.distributed
def test_qwen2_qlora_fsdp_recipe_trains_as_without_fsdp_and_its_adapter_loads_in_peft(trained, tiny_models):
    """Axolotl's FSDP1 recipe (``fsdp: [full_shard, auto_wrap]``, QLoRA) runs as FSDP2 over the two ranks of
    its cp=2 ring: the adapter, the norms, the embeddings and the 4-bit base (stored in fp32, so FSDP2
    shards it too) are split over both ranks. It equals the same recipe without its fsdp keys (whole on
    every rank), step by step; resumed from its sharded checkpoint it continues exactly; and its adapter,
    gathered at the end (FULL_STATE_DICT), loads in plain peft.
    """
    sharded, whole = trained[QWEN2_FSDP], trained[QWEN2_NO_FSDP]
    for key in ("loss", "grad_norm"):
        assert len(logged(whole, key)) == 3
        assert max_rel_diff(logged(sharded, key), logged(whole, key)) <= LOGGED_TOL, key
    adapters = [load_file(out / "adapter_model.safetensors") for out in (sharded, whole)]
    # peft's own save adds the pad-resized embeddings and head (frozen) of the unsharded run; the sharded
    # run's gathered adapter holds the trained LoRA weights only (the same on both sides).
    lora = {name for name in adapters[1] if ".lora_" in name}
    assert set(adapters[0]) == lora and lora
    for name in lora:
        assert_within(adapters[0][name], adapters[1][name], ADAPTER_TOL, name)

    # Resumed from the sharded checkpoint of step 2, step 3 is the uninterrupted run's: exact, the same
    # operations in the same layout from a state restored bit for bit.
    resumed = trained[QWEN2_RESUMED]
    for key in ("loss", "grad_norm"):
        assert logged(resumed, key)[3] == logged(sharded, key)[3]

    model = load_in_peft(sharded, tiny_models["qwen2"], quantization_config=nf4())
    assert type(model.get_base_model()).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        logits = model(input_ids=prompt_ids(sharded)).logits
    assert torch.isfinite(logits).all()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().max() > 0 for p in lora_b)


def wandb_records(path: Path, record_type):
    """The protobuf records of a W&B run file (wandb's log format: 32 KiB blocks of framed chunks)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = record_type()
            record.ParseFromString(parts)
            parts = b""
            yield record


@pytest.mark.distributed
def test_alst_deepspeed_recipe_trains_ring_attention_under_zero3_with_tiled_mlp_and_chunked_loss(trained):
    run, out = trained[ALST + ":setup"], trained[ALST]
    # ZeRO-3 split every weight matrix over the ranks. Axolotl's config keeps parameters below
    # stage3_param_persistence_threshold "auto" (10 x hidden size: 640 elements here, 40,960 on Llama-3-8B)
    # whole on every rank: the RMSNorm weights, here as on the 8B model.
    assert run["zero3_whole"] is not None
    assert run["zero3_whole"] and all(name.endswith("norm.weight") for name in run["zero3_whole"])
    # The tiny model's 2 MLPs are tiled, and the chunked loss hooks the decoder, its final norm (which it runs
    # per chunk) and the output layer.
    assert run["tiled_mlp_modules"] == 2 and run["head_loss_modules"] == 3
    history = json.loads((out / "train_log.json").read_text())
    norms = [e["grad_norm"] for e in history if "grad_norm" in e]
    assert len(norms) == 3 and all(0 < n < 100 for n in norms)
    # A full fine-tune saved whole (gather_16bit_weights_on_model_save), loadable without DeepSpeed.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=prompt_ids(out)).logits).all()
