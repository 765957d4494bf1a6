"""Troubleshooting entries of the section "During a run"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "During a run"
NOTE: str | None = (
    "These stop a run that has already started: each process prints the message (with a "
    '`[rank R]` prefix when there are several), and the run exits non-zero (see "When a process fails '
    'during training" below). Checkpoints already written are kept.'
)
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = ()

DOCUMENTED: tuple[Documented, ...] = (
    Documented(
        "torch-cp-padded-bidirectional-batch",
        SECTION,
        "cp_backend: torch meets a padded or packed batch with causal: false",
        "cp_backend: torch cannot mask padding or packed documents with causal: false",
        "torch's context-parallel attention takes no mask, so with bidirectional attention every token would "
        "see the padding. Rows of different lengths in one micro batch are padded: use "
        "`micro_batch_size: 1` (with more `gradient_accumulation_steps`), or `cp_backend: ring-flash-attn`, "
        "which masks padding and packed documents. Raised at the first such batch, in every rank.",
        raised_in="src/cptune/parallel/backends/torch_cp/sharding.py",
        why_not_in_catalogue="it depends on the batches, so it is raised after the processes started",
        tested_by="tests/run/test_train_torch_cp.py::test_packed_and_padded_batches_stop_training_at_the_first_batch",
    ),
    Documented(
        "torch-cp-uneven-bidirectional-batch",
        SECTION,
        "cp_backend: torch meets a row that does not split evenly with causal: false",
        "cp_backend: torch cannot mask padding with causal: false, and this batch's",
        "Without a mask, torch cannot pad a row to split it over the ranks. Use rows whose length is a "
        "multiple of context_parallel_size, or `cp_backend: ring-flash-attn`. Raised at the first such "
        "batch, in every rank.",
        raised_in="src/cptune/parallel/backends/torch_cp/sharding.py",
        why_not_in_catalogue="it depends on the batches, so it is raised after the processes started",
        tested_by="tests/parallel/backends/test_torch_cp.py::test_bidirectional_needs_a_length_that_splits_without_padding",
    ),
    Documented(
        "torch-cp-packed-batch",
        SECTION,
        "cp_backend: torch meets a packed batch",
        "cp_backend: torch cannot mask packed documents: its context-parallel attention is plain causal "
        "attention over each row",
        "`sample_packing: true` with `cp_backend: torch` is refused before the run (see above); this is the "
        "same check on the batch itself, for recipes built without the recipe checks. Use "
        "`cp_backend: ring-flash-attn`, or `sample_packing: false`.",
        raised_in="src/cptune/parallel/backends/torch_cp/sharding.py",
        why_not_in_catalogue="it depends on the batches, so it is raised after the processes started",
        tested_by="tests/run/test_train_torch_cp.py::test_packed_and_padded_batches_stop_training_at_the_first_batch",
    ),
    Documented(
        "model-weights-unreadable",
        SECTION,
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
        SECTION,
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
        SECTION,
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
        "model-windowed-layers-without-window",
        SECTION,
        "Sliding-window layers that do not pass their window",
        "sliding-window layers; the others would attend over the whole sequence",
        "The model's config has sliding-window layers, but some of them called the attention without their "
        "`sliding_window` (custom attention code), so cptune's context-parallel attention would attend the "
        "whole sequence there. Use `context_parallel_size: 1` with `causal: true`, where transformers' own "
        "attention applies the window. Raised at the first step.",
        raised_in="src/cptune/parallel/backends/attention.py",
        why_not_in_catalogue="it is found by counting the windows of a real forward pass",
        tested_by="tests/parallel/backends/test_sliding_window.py::"
        "test_windowed_layers_that_do_not_pass_their_window_are_caught",
    ),
    Documented(
        "model-without-layer-count",
        SECTION,
        "A model config without num_hidden_layers",
        "cannot tell how many attention layers this model has (no num_hidden_layers).",
        "cptune counts the attention layers each step to prove that all of them went through its attention. "
        "Use a model whose config has `num_hidden_layers` (every decoder model in transformers has it). "
        "Raised at the first step.",
        raised_in="src/cptune/parallel/backends/attention.py",
        why_not_in_catalogue="it is found at the first step of a model cptune cannot inspect",
    ),
    Documented(
        "cut-cross-entropy-logits-changed",
        SECTION,
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
        SECTION,
        "cut_cross_entropy with a model that ignores logits_to_keep",
        "cut_cross_entropy: the model ignored logits_to_keep and computed",
        "Remove `cut_cross_entropy`: the model computes every logit anyway, so the chunked loss saves nothing.",
        raised_in="src/cptune/models/head_loss.py",
        why_not_in_catalogue="only at the first training step, with remote code that accepts but ignores the "
        "argument",
        tested_by="tests/models/test_memory_features.py::test_head_loss_refuses_a_model_that_ignores_logits_to_keep",
    ),
    Documented(
        "cut-cross-entropy-after-final-norm",
        SECTION,
        "cut_cross_entropy with a model that changes the hidden states after its final norm",
        "cut_cross_entropy: the decoder's output is not its final norm's output",
        "Remove `cut_cross_entropy`. The chunked loss runs the decoder's final `norm` itself, chunk by "
        "chunk, so the decoder must return that norm's output as it is; every step checks it.",
        raised_in="src/cptune/models/head_loss.py",
        why_not_in_catalogue="only at the first training step, with a model whose decoder ends otherwise than "
        "the transformers models cptune knows",
        tested_by="tests/models/test_memory_features.py::test_head_loss_refuses_a_decoder_that_changes_its_norms_output",
    ),
    Documented(
        "cut-cross-entropy-final-norm-reused",
        SECTION,
        "cut_cross_entropy with a model that calls its final norm more than once",
        "cut_cross_entropy: the decoder called its final norm",
        "Remove `cut_cross_entropy`. The chunked loss makes the decoder's final `norm` compute the last "
        "token only, in place of the decoder's one call at its end; a decoder that also uses it elsewhere "
        "is stopped at the first step.",
        raised_in="src/cptune/models/head_loss.py",
        why_not_in_catalogue="only at the first training step, with a model whose decoder ends otherwise than "
        "the transformers models cptune knows",
        tested_by="tests/models/test_memory_features.py::test_head_loss_refuses_a_decoder_that_changes_its_norms_output",
    ),
)
