"""Troubleshooting entries of the section "Preference training (rl)"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "Preference training (rl)"
NOTE: str | None = (
    "What cptune trains with `rl` and how: [preference training](preference-training.md). What it does not "
    "train yet is refused when the recipe is validated, before anything is loaded."
)

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "rl-not-built",
        SECTION,
        "rl: kto or grpo",
        "rl: kto is not built in cptune",
        "cptune trains `rl: dpo`, `ipo`, `orpo` and `simpo`; the message says what the other would need.",
    ),
    Entry(
        "rl-unknown",
        SECTION,
        "An rl value cptune does not know",
        "is not a preference loss cptune knows; use rl: dpo, rl: ipo, rl: orpo or rl: simpo.",
        "Set `rl` to one of them.",
    ),
    Entry(
        "preference-type-without-rl",
        SECTION,
        "Preference data without rl",
        "holds preference pairs (prompt, chosen, rejected), which rl (dpo, ipo, orpo, simpo) trains",
        "Set `rl: dpo` (or `ipo`, `orpo`, `simpo`) to train the pairs, or use a supervised data type.",
    ),
    Entry(
        "beta-without-rl",
        SECTION,
        "rl_beta or dpo_beta without rl",
        "rl_beta: applies only with rl (dpo, ipo or simpo); remove it.",
        "Remove it, or set `rl`.",
    ),
    Entry(
        "precompute-without-rl",
        SECTION,
        "precompute_ref_log_probs without rl",
        "precompute_ref_log_probs: applies only with rl: dpo or rl: ipo; remove it.",
        "Remove it, or set `rl`.",
    ),
    Entry(
        "label-smoothing-without-rl",
        SECTION,
        "dpo_label_smoothing without rl",
        "dpo_label_smoothing: applies only with rl: dpo; remove it.",
        "Remove it, or set `rl: dpo`.",
    ),
    Entry(
        "rl-supervised-type",
        SECTION,
        "rl with a supervised data type",
        "rows are not preference pairs, which rl: dpo trains",
        "Use `type: chat_template.default` (the prompt's messages in `field_messages`, the responses in "
        "`field_chosen` and `field_rejected`) or `type: passthrough.default` (prompt, chosen and rejected text).",
    ),
    Entry(
        "rl-full-fine-tune",
        SECTION,
        "rl with a full fine-tune",
        "adapter: rl: dpo needs a reference model",
        "Set `precompute_ref_log_probs: true`: a first pass computes the reference's log-prob sums of every "
        "training pair from the model as loaded, and training reads them (no reference copy). Or train a LoRA "
        "(or QLoRA) adapter: `adapter: lora`.",
    ),
    Entry(
        "rl-lora-model-dir",
        SECTION,
        "rl starting from a trained adapter (lora_model_dir)",
        "would compare with the base model (the adapter disabled), not with the adapter you start from",
        "Merge the adapter into the base model (`cptune merge-lora`) and train a fresh adapter on the merged model.",
    ),
    Entry(
        "rl-train-on-inputs",
        SECTION,
        "rl with train_on_inputs",
        "trains the responses only (the prompt's log-probs are the same in the chosen and rejected sequences)",
        "Remove `train_on_inputs`.",
    ),
    Entry(
        "rl-evaluate-base-model",
        SECTION,
        "cptune evaluate of an rl recipe without --checkpoint",
        "and --checkpoint is not given, so the base model would be compared with itself (every pair's loss ln 2)",
        "Give `--checkpoint` with the LoRA adapter a run saved (its output_dir or a `checkpoint-N` folder): "
        "the evaluation compares it with the base model (the adapter disabled).",
    ),
    Entry(
        "rl-evaluate-full-model",
        SECTION,
        "cptune evaluate of an rl recipe's saved full model",
        "a full model: the base model's log-prob sums of the evaluation pairs are read from those a training run "
        "stored",
        "Set `precompute_ref_log_probs: true` in the recipe (a full fine-tune's recipe has it). The evaluation "
        "reads the evaluation pairs' reference sums that the run's first pass stored with the prepared data "
        "(`dataset_prepared_path/<fingerprint>/reference_log_probs/`); if none match the recipe's data and base "
        "model, `cptune evaluate` says so and names the file: run `cptune train` of the recipe with "
        "`val_set_size` (or `test_datasets`), whose first pass stores them before training.",
    ),
    Entry(
        "rl-torch-bidirectional",
        SECTION,
        "rl with cp_backend: torch and causal: false",
        "with cp_backend: torch and causal: false: each side of a pair is a row of its own, padded to the longer "
        "side",
        "torch's bidirectional context-parallel attention takes no padding mask. Use `cp_backend: ring-flash-attn` "
        "(or `deepspeed`), which mask documents and padding, or `causal: true`.",
    ),
    Entry(
        "rl-zigzag",
        SECTION,
        "rl with ring_attn_func: batch_zigzag",
        "batch_zigzag cannot keep a preference pair's chosen and rejected sequences apart",
        "Use `ring_attn_func: varlen_llama3` (the default).",
    ),
    Entry(
        "beta-disagree",
        SECTION,
        "rl_beta and dpo_beta disagree",
        "disagrees with rl_beta: 0.2 (two names of β); set one.",
        "They are two names of β; keep one.",
    ),
    Entry(
        "pairs-tokenizer-without-eos",
        SECTION,
        "passthrough.default pairs with a tokenizer that has no eos token",
        "The tokenizer has no eos token, which passthrough.default responses end with.",
        "Each response ends with the eos token (as TRL tokenizes such pairs). Use a tokenizer that defines "
        "`eos_token` (`tokenizer_config`).",
    ),
    Entry(
        "pairs-chat-template-not-prefix-stable",
        SECTION,
        "chat_template.default pairs with a template that renders the prompt differently before a response",
        "the chat template is not prefix-stable: the prompt with the generation prompt does not render to a "
        "token prefix of the prompt followed by the response",
        "cptune finds each response's tokens after the prompt's; a template that changes the prompt's text "
        "when a response follows (here: it starts with the message count) hides them. Set "
        "`chat_template: chatml`, or use a template that renders earlier turns the same.",
    ),
    Entry(
        "label-smoothing-ipo",
        SECTION,
        "dpo_label_smoothing with rl: ipo",
        "dpo_label_smoothing: applies only with rl: dpo (not rl: ipo); remove it.",
        "Remove it: IPO's loss has no label smoothing.",
    ),
    Entry(
        "variant-key-without-its-rl",
        SECTION,
        "orpo_alpha, simpo_gamma or cpo_alpha without the rl they belong to",
        "orpo_alpha: applies only with rl: orpo (not rl: dpo); remove it, or set rl: orpo.",
        "`orpo_alpha` is ORPO's λ; `simpo_gamma` and `cpo_alpha` are SimPO's margin and NLL weight. Remove the "
        "key, or set the `rl` it belongs to.",
    ),
    Entry(
        "orpo-beta",
        SECTION,
        "rl_beta or dpo_beta with rl: orpo",
        "rl_beta: rl: orpo weighs its odds-ratio term with orpo_alpha (ORPO's λ); set orpo_alpha instead.",
        "Set `orpo_alpha` (Axolotl's name of ORPO's λ, TRL's ORPOConfig `beta`) and remove `rl_beta`.",
    ),
    Entry(
        "reference-free-precompute",
        SECTION,
        "precompute_ref_log_probs with rl: orpo or simpo",
        "rl: simpo reads no reference model (its loss compares the policy's own per-token log-probs of the two "
        "sides), so there is nothing to precompute",
        "Remove `precompute_ref_log_probs`: ORPO and SimPO train a full fine-tune or an adapter without one.",
    ),
    Entry(
        "dedup-eval-pairs-all-in-training",
        SECTION,
        "dataset_exact_deduplication with test_datasets whose every pair is also a training pair",
        "dataset_exact_deduplication: every evaluation pair of test_datasets equals a training pair of datasets, "
        "so no evaluation data is left",
        "With `rl`, deduplication also drops the evaluation pairs that repeat a training pair (as Axolotl does). "
        "Evaluate on pairs the training data does not hold, or set `dataset_exact_deduplication: false`.",
    ),
)

DOCUMENTED: tuple[Documented, ...] = (
    Documented(
        "rl-cp-backend",
        SECTION,
        "rl with a cp_backend that cannot sum a pair over its shards",
        "needs a backend that sums each pair's log-probs over its shards, which",
        "Use a backend the message names (`ring-flash-attn`, `torch`, `deepspeed` all train pairs).",
        raised_in="src/cptune/config/rules.py",
        why_not_in_catalogue="every backend of cptune's table trains preference pairs; only a backend added to the "
        "table without trains_preference_pairs (a new backend being written) meets it",
    ),
    Documented(
        "rl-evaluate-full-model-without-stored-reference",
        SECTION,
        "cptune evaluate of a saved full model without stored reference sums",
        "none matches this recipe's data and base model",
        "Run `cptune train` of this recipe with `val_set_size` (or `test_datasets`): its first pass stores the "
        "base model's sums of the evaluation pairs with the prepared data before training (`max_steps: 1` is "
        "enough), then evaluate again. Data prepared again differently (another `sequence_len`, dataset or "
        "tokenizer) or another base model, dtype or transformers version needs its own stored sums.",
        raised_in="src/cptune/run/training/preference_trainer.py",
        why_not_in_catalogue="it needs a full fine-tune saved by a training run before the evaluation, which the "
        "catalogue's quick cases do not train",
        tested_by="tests/run/test_reference_cache.py::"
        "test_evaluate_reads_a_full_fine_tunes_stored_reference_and_a_lora_evaluation_passes_over_eval_rows_only",
    ),
)
