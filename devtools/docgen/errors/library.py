"""Troubleshooting entries of the section "Using cptune from Python"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "Using cptune from Python"
NOTE: str | None = "These concern Python code that uses cptune's modules directly, not `cptune` commands."
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = ()

DOCUMENTED: tuple[Documented, ...] = (
    Documented(
        "library-call-without-metadata",
        SECTION,
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
        SECTION,
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
        SECTION,
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
        SECTION,
        "accelerator.maybe_context_parallel() in your own code (cp_backend: torch)",
        "accelerator.maybe_context_parallel() was called, but cptune's torch backend already shards every "
        "batch",
        "Remove the call: cptune's trainer switches torch's context-parallel attention on around each micro "
        "batch.",
        raised_in="src/cptune/parallel/backends/torch_cp/patches.py",
        why_not_in_catalogue="only reachable from Python code running inside a cptune run",
        tested_by="tests/patches/test_real_patches.py::test_prepare_cp_for_torch_checks_instead_of_dropping_masks",
    ),
    Documented(
        "library-torch-cp-without-patch",
        SECTION,
        "cp_backend: torch on CPU in your own training loop without cptune's patch",
        "cp_backend: torch on CPU needs cptune's patch 'torch-cp-cpu-sdpa-handlers'",
        "`cptune train` applies the patch; in your own loop, apply "
        "`PatchSet(cptune.parallel.backends.torch_cp.runtime.RUNTIME.training_patches())` around it.",
        raised_in="src/cptune/parallel/backends/torch_cp/sharding.py",
        why_not_in_catalogue="only reachable from Python code that drives the backend itself",
        tested_by="tests/parallel/backends/test_torch_cp.py::test_step_context_needs_the_cpu_patch_and_restores_torchs_globals",
    ),
    Documented(
        "library-patch-revert-conflict",
        SECTION,
        "Reverting cptune's patches after other code patched the same function",
        "cannot revert cptune's patches:",
        "Other code replaced a function cptune had patched, so undoing cptune's patch would drop it; nothing "
        "was reverted. Undo the other patch first (or do not apply it inside a cptune run), then revert.",
        raised_in="src/cptune/patches/core.py",
        why_not_in_catalogue="only reachable from Python code that patches the same functions as cptune",
        tested_by="tests/patches/test_core.py::test_revert_over_foreign_patch_raises_and_touches_nothing",
    ),
)
