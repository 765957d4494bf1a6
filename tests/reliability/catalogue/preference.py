"""Catalogue cases of the section "Preference training (rl)" (their text: devtools/docgen/errors/preference.py)."""

from __future__ import annotations

from tests.reliability.catalogue.framework import DELETE, Case, Workspace
from tests.reliability.catalogue.setups import _full_model_folder, _tokenizer_folder

# A ChatML-like template that starts with the number of messages: rendering fewer messages
# is then never a prefix of rendering more (a pair's response cannot be located after its prompt).
COUNTING_TEMPLATE = (
    "{{ messages | length }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PAIR_ROWS = [{"prompt": "Say hi.", "chosen": "Hi.", "rejected": "Go away."}] * 4


def _pairs(ws: Workspace) -> dict:
    """Preference data (the recipe is refused before any row is read) and rl: dpo."""
    return {
        "rl": "dpo",
        "datasets": [{"path": str(ws.data / "train.jsonl"), "type": "chat_template.default"}],
    }


def _full_model(ws: Workspace) -> dict:
    """A full fine-tune's keys and a saved full model in ``full-model``."""
    _full_model_folder(ws)
    return {"adapter": DELETE, "precompute_ref_log_probs": True}


def _pair_data(ws: Workspace, type_: str, **tokenizer: object) -> dict:
    """Real pair rows (the error comes from preparing them) with a tokenizer built for the case."""
    path = ws.write_rows("pairs.jsonl", PAIR_ROWS)
    dataset = {"path": path, "type": type_, "field_messages": "prompt"}
    return {"rl": "dpo", "datasets": [dataset], "tokenizer_config": _tokenizer_folder(ws, **tokenizer)}


def _eval_pairs_all_in_training(ws: Workspace) -> dict:
    """Deduplicated pairs whose evaluation file is the training file: every evaluation pair is dropped."""
    path = ws.write_rows("pairs.jsonl", PAIR_ROWS)
    dataset = {"path": path, "type": "chat_template.default", "field_messages": "prompt"}
    return {
        "rl": "dpo",
        "datasets": [dataset],
        "test_datasets": [dataset],
        "dataset_exact_deduplication": True,
    }


CASES: tuple[Case, ...] = (
    Case("rl-not-built", setup=lambda ws: {**_pairs(ws), "rl": "kto"}),
    Case("rl-unknown", setup=lambda ws: {**_pairs(ws), "rl": "ppo"}),
    Case("preference-type-without-rl", setup=lambda ws: {**_pairs(ws), "rl": DELETE}),
    Case("beta-without-rl", keys={"rl_beta": 0.2}),
    Case("precompute-without-rl", keys={"precompute_ref_log_probs": True}),
    Case("label-smoothing-without-rl", keys={"dpo_label_smoothing": 0.1}),
    Case("rl-supervised-type", keys={"rl": "dpo"}),
    Case("rl-full-fine-tune", setup=lambda ws: {**_pairs(ws), "adapter": DELETE}),
    Case("rl-lora-model-dir", setup=lambda ws: {**_pairs(ws), "lora_model_dir": str(ws.root / "adapter")}),
    Case("rl-train-on-inputs", setup=lambda ws: {**_pairs(ws), "train_on_inputs": True}),
    Case("rl-evaluate-base-model", setup=lambda ws: {**_pairs(ws), "val_set_size": 0.1}, command="evaluate"),
    Case(
        "rl-evaluate-full-model",
        # A LoRA recipe (no precompute_ref_log_probs) and a saved full model, e.g. the adapter merged.
        setup=lambda ws: {
            **_pairs(ws),
            **_full_model(ws),
            "adapter": "lora",
            "precompute_ref_log_probs": DELETE,
            "val_set_size": 0.1,
        },
        command="evaluate",
        args=("--checkpoint", "{ws}/full-model"),
    ),
    Case(
        "rl-torch-bidirectional",
        setup=lambda ws: {
            **_pairs(ws),
            "context_parallel_size": 2,
            "cp_backend": "torch",
            "sample_packing": False,
            "causal": False,
            "cp_load_balance": False,
        },
    ),
    Case(
        "rl-zigzag",
        setup=lambda ws: {
            **_pairs(ws),
            "context_parallel_size": 2,
            "ring_attn_func": "batch_zigzag",
            "bf16": True,
            "sample_packing": False,
        },
    ),
    Case("beta-disagree", setup=lambda ws: {**_pairs(ws), "rl_beta": 0.2, "dpo_beta": 0.3}),
    Case(
        "pairs-tokenizer-without-eos",
        setup=lambda ws: _pair_data(ws, "passthrough.default", name="no-eos-tokenizer", drop=("eos_token",)),
    ),
    Case(
        "pairs-chat-template-not-prefix-stable",
        setup=lambda ws: _pair_data(
            ws, "chat_template.default", name="counting-tokenizer", template=COUNTING_TEMPLATE
        ),
    ),
    Case("label-smoothing-ipo", setup=lambda ws: {**_pairs(ws), "rl": "ipo", "dpo_label_smoothing": 0.1}),
    Case("variant-key-without-its-rl", setup=lambda ws: {**_pairs(ws), "orpo_alpha": 0.2}),
    Case("orpo-beta", setup=lambda ws: {**_pairs(ws), "rl": "orpo", "rl_beta": 0.2}),
    Case(
        "reference-free-precompute",
        setup=lambda ws: {**_pairs(ws), "rl": "simpo", "adapter": DELETE, "precompute_ref_log_probs": True},
    ),
    Case("dedup-eval-pairs-all-in-training", setup=_eval_pairs_all_in_training),
)
