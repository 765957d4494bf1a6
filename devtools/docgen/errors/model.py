"""Troubleshooting entries of the section "Model, tokenizer and processes"."""

from __future__ import annotations

from devtools.docgen.errors.base import Documented, Entry

SECTION = "Model, tokenizer and processes"
NOTE: str | None = None
"""A paragraph under the section's heading, where the entries need one."""

ENTRIES: tuple[Entry, ...] = (
    Entry(
        "model-path-unknown",
        SECTION,
        "base_model does not exist",
        "base_model: cannot load a model config from",
        "Give a local folder with config.json and weights, or a hub id reachable from here. Nothing is "
        "loaded or started before this check.",
    ),
    Entry(
        "model-without-weights",
        SECTION,
        "base_model is a folder without weights",
        "holds no weight files (*.safetensors or *.bin), only config.json",
        "The folder has the model's configuration but not its weights (a partial copy or download). "
        "Copy the weight files into it, or point `base_model` at a complete folder or a hub id.",
    ),
    Entry(
        "model-weights-truncated",
        SECTION,
        "base_model has a truncated weight file",
        "model.safetensors' is damaged or incomplete (Error while deserializing header: incomplete metadata, "
        "file not fully covered).",
        "An interrupted copy or download leaves a weight file shorter than its header says. Copy or "
        "download it again. cptune reads only the file's header here, not the weights.",
    ),
    Entry(
        "model-not-causal-lm",
        SECTION,
        "base_model is not a causal language model (e.g. T5, BERT-style encoders)",
        "which transformers cannot load as a causal language model (AutoModelForCausalLM)",
        "cptune fine-tunes decoder language models (Llama, Qwen, Mistral, ...), also for bidirectional "
        "fine-tunes (`causal: false`). Checked from config.json before the data is prepared.",
    ),
    Entry(
        "tokenizer-of-another-model",
        SECTION,
        "The data holds token ids the model has no embedding for",
        "but the model embeds only 256 tokens (vocab_size), so the tokenizer from",
        "The tokenizer (base_model's own files, or `tokenizer_config`) belongs to another model. Use the "
        "model's own tokenizer. Checked on the prepared data before launching (and in every rank, "
        "against the loaded embedding, under torchrun).",
    ),
    Entry(
        "tokenizer-path-unknown",
        SECTION,
        "tokenizer_config does not exist",
        "tokenizer_config: cannot load a tokenizer from",
        "Point `tokenizer_config` at a folder with the tokenizer files, or remove it to use base_model's.",
    ),
    Entry(
        "cp-not-dividing-world",
        SECTION,
        "context_parallel_size does not divide the number of processes",
        "context_parallel_size=2 does not divide the number of processes (3)",
        "Launch a multiple of context_parallel_size processes (the rest form data-parallel groups).",
    ),
    Entry(
        "nproc-zero",
        SECTION,
        "--nproc-per-node 0",
        "--nproc-per-node: got 0, but a run needs at least 1 process per node",
        "Give the number of processes to start on this node (by default, context_parallel_size).",
    ),
    Entry(
        "cp-exceeds-sequence",
        SECTION,
        "context_parallel_size larger than the sequence",
        "sequence_len: 2 tokens cannot be split into the 4 chunks that context_parallel_size=4 needs",
        "Each rank needs at least one token of every row: use a longer sequence_len or a smaller "
        "context_parallel_size.",
    ),
    Entry(
        "heads-k-stride",
        SECTION,
        "heads_k_stride does not divide the model's key/value heads",
        "heads_k_stride: 3 does not divide the model's 2 key/value heads",
        "ring-flash-attn gathers key/value heads heads_k_stride at a time; use a divisor (the message "
        "lists them).",
    ),
    Entry(
        "ulysses-heads",
        SECTION,
        "Attention heads not divisible for DeepSpeed Ulysses",
        "context_parallel_size: 3 does not divide the model's 4 query heads",
        "Ulysses splits attention heads across the ranks: context_parallel_size must divide the number "
        "of heads (the message lists the sizes that do), or use cp_backend: ring-flash-attn.",
    ),
    Entry(
        "dp-replicate-not-dividing",
        SECTION,
        "dp_replicate_size × context_parallel_size does not divide the number of processes",
        "dp_replicate_size=2 × context_parallel_size=2 = 4 does not divide the number of processes (6)",
        "Launch a multiple of dp_replicate_size × context_parallel_size processes, or change "
        "`dp_replicate_size`.",
    ),
    Entry(
        "dp-replicate-without-shard",
        SECTION,
        "dp_replicate_size with context parallelism and nothing left to shard",
        "dp_replicate_size=2 with context_parallel_size=2 leaves dp_shard_size at 1, which accelerate does "
        "not support with context parallelism",
        "Launch more processes (the message says how many), or remove `dp_replicate_size` to shard the model "
        "states over every rank.",
    ),
    Entry(
        "dp-shard-not-matching",
        SECTION,
        "dp_shard_size does not match the number of processes",
        "dp_shard_size=2 needs dp_replicate_size × dp_shard_size × context_parallel_size = 4 processes, but 2 "
        "were asked for.",
        "Launch the number of processes the message gives, or remove `dp_shard_size` (it then follows from "
        "the number of processes).",
    ),
    Entry(
        "model-not-attention-interface",
        SECTION,
        "A model whose attention cannot be split",
        "base_model: BloomForCausalLM does not route its attention through transformers' AttentionInterface, "
        "so its attention cannot be split across context-parallel ranks.",
        "Context parallelism replaces the model's attention function; models whose attention code does not "
        "go through transformers' AttentionInterface (older architectures such as Bloom, GPT-J, MPT) cannot "
        "use it. Use a model that does (Llama, Qwen2/3, Mistral, ...), or `context_parallel_size: 1`.",
    ),
    Entry(
        "model-not-attention-interface-bidirectional",
        SECTION,
        "causal: false with a model whose attention cannot be replaced",
        "base_model: BloomForCausalLM does not route its attention through transformers' AttentionInterface, "
        "so cptune cannot give it bidirectional attention (causal: false).",
        "Bidirectional attention comes from cptune's own attention function, also at "
        "`context_parallel_size: 1`. Use a model that routes its attention through transformers' "
        "AttentionInterface, or `causal: true`.",
    ),
    Entry(
        "model-sliding-window",
        SECTION,
        "A sliding-window model with a backend that cannot attend its windows",
        "base_model: mistral has attention layers of type ['sliding_attention'] (sliding_window: 16), which "
        "cp_backend: torch cannot compute exactly",
        "Sliding-window layers are exact with `cp_backend: ring-flash-attn` (`ring_attn_func: varlen_llama3` "
        "or `batch_zigzag`) and `cp_backend: deepspeed` (`ulysses_attn_implementation: cptune` or "
        "`flash_attention_2`), causal only. PyTorch's context-parallel attention takes no window, and "
        "`causal: false` has no single window in transformers to be exact to: the message names the reason. "
        "See the model table in choosing-a-backend.md.",
    ),
    Entry(
        "model-packed-without-attention-interface",
        SECTION,
        "Sample packing with an older model that does not route attention through the AttentionInterface",
        "sample_packing: base_model BloomForCausalLM does not route its attention through transformers' "
        "AttentionInterface, so neither cptune's attention nor transformers' masks from position_ids keep its "
        "packed samples apart",
        "Packed samples are kept apart by `position_ids` restarting at each sample: cptune's attention attends "
        "each sample within itself, and transformers' masks (`masking_utils`) split the row by sample, for "
        "models that route attention through transformers' `AttentionInterface`. Older models (Bloom, Falcon, "
        "MPT, GPT-J ...) build one causal mask over the whole row, so each packed sample would attend to the "
        "ones before it. Set `sample_packing: false` (one sample per row), or use a model that routes its "
        "attention (Llama, Qwen2/3, Mistral, Gemma 3 ...). With `context_parallel_size` above 1 such models are "
        "refused anyway.",
    ),
    Entry(
        "model-packed-masks-unchecked",
        SECTION,
        "Sample packing at context_parallel_size 1 with a windowed model cptune has not checked",
        "sample_packing: base_model afmoe has attention layers of type ['sliding_attention'], which at "
        "context_parallel_size: 1 transformers computes with masks of its own",
        "At `context_parallel_size: 1` cptune leaves sliding-window and chunked attention layers to "
        "transformers' `sdpa`, whose masks keep packed samples apart only where the model's code builds them "
        "from `position_ids`. cptune lets the model types it has checked pack (Gemma 3, Gemma 3n, Gemma 4, "
        "Mistral, Ministral, Mixtral, Qwen2, Phi-3, Starcoder2, Cohere 2, Olmo 3, EXAONE 4, Llama 4 text and a "
        "few more; `PACKED_MASKS_FROM_POSITION_IDS` in `cptune/parallel/backends/attention.py`); AfMoE builds "
        "its masks without them, so its packed samples attend to each other. Set `sample_packing: false`; for "
        "sliding windows, `context_parallel_size: 2` or more with `cp_backend: ring-flash-attn` "
        "(`ring_attn_func: varlen_llama3`) keeps the samples apart in cptune's own attention.",
    ),
    Entry(
        "model-stateful-layers-packed",
        SECTION,
        "Sample packing with a model that has Mamba or convolution layers",
        "sample_packing: base_model lfm2 has layers of type ['conv'], which carry a state from each token to "
        "the next across a whole row",
        "Packed samples are kept apart by `position_ids` restarting at each sample, which attention layers turn "
        "into a mask. transformers runs a recurrent layer (Mamba beside attention in Falcon-H1, Jamba or "
        "Nemotron-H, LFM2's short convolutions) over the whole row, so each sample would be trained on the ones "
        "packed before it, silently. Set `sample_packing: false` (one sample per row, padded at its end, which a "
        "recurrent layer never reads back) or use a model with attention layers only. Qwen3.5's and "
        "Qwen3-Next's linear-attention layers are not refused: cptune runs them sample by sample. Refused at "
        "any `context_parallel_size`; with context parallelism such models are refused anyway (their recurrent "
        "layers would see only a slice of each row).",
    ),
    Entry(
        "model-stateful-layers-cp",
        SECTION,
        "Context parallelism with a model that has Mamba, linear-attention or convolution layers",
        "context_parallel_size: base_model lfm2 has layers of type ['conv'], which carry a state from each token "
        "to the next",
        "Such a layer reads each token with the state the tokens before it left. Context parallelism gives each "
        "rank a part of every row, and cptune passes no such state between the ranks (attention needs none: the "
        "ranks exchange keys and values), so every part but the first would start from nothing. Train at "
        "`context_parallel_size: 1`, or use a model with attention layers only. Refused for every backend, "
        "before anything is loaded.",
    ),
    Entry(
        "model-temperature-packed",
        SECTION,
        "Sample packing with Llama 4 rows of floor_scale tokens or more",
        "sample_packing: base_model llama4_text scales the queries of its layers without rotary embeddings by "
        "each token's place in the row",
        "Llama 4's layers without rotary embeddings multiply their queries by a temperature that grows every "
        "`floor_scale` tokens (8192 by default, `attn_temperature_tuning`), counted from the start of the row "
        "in transformers, not from the start of the sample. A sample packed after others would be scaled as it "
        "is not alone. Set `sample_packing: false`, a `sequence_len` below `floor_scale`, or "
        "`attn_temperature_tuning: false` in `overrides_of_model_config` (which changes the model).",
    ),
    Entry(
        "model-attention-softcapping",
        SECTION,
        "A model that soft-caps its attention logits (Gemma 2) with context parallelism",
        "base_model: gemma2 soft-caps its attention logits (attn_logit_softcapping: 50.0), which cp_backend: "
        "ring-flash-attn does not",
        "cptune's attention kernels have no soft-capping. Use `context_parallel_size: 1` with `causal: true` "
        "(transformers' own attention applies it), or `cp_backend: deepspeed` with "
        "`ulysses_attn_implementation: flash_attention_2` on GPUs.",
    ),
    Entry(
        "model-attention-sinks",
        SECTION,
        "A model with attention sinks (gpt-oss) with a backend that cannot apply them",
        "base_model: gpt_oss adds a learned sink logit per head to the softmax of its attention layers (of type "
        "['full_attention', 'sliding_attention']), which cp_backend: torch cannot apply exactly",
        "gpt-oss's sink logits are exact with `cp_backend: ring-flash-attn` (`ring_attn_func: varlen_llama3` or "
        "`batch_zigzag`) and `cp_backend: deepspeed` (`ulysses_attn_implementation: cptune`), which put each "
        "head's sink once into every query's softmax over all of its keys. PyTorch's context-parallel attention "
        "(whose message names gpt-oss's sliding windows too), the other Ulysses core attentions and cptune's "
        "bidirectional attention at `context_parallel_size: 1` do not: the message names the reason. See the "
        "model table in choosing-a-backend.md.",
    ),
    Entry(
        "model-attention-dropout",
        SECTION,
        "A model config with attention dropout",
        "base_model: its config sets attention_dropout: 0.1, but cp_backend: ring-flash-attn computes "
        "attention without dropout (cptune's attention does not support attention dropout).",
        "Set `attention_dropout` to 0 in the model folder's config.json (most fine-tunes use none), or use "
        "`context_parallel_size: 1` with `causal: true`, where transformers' own attention applies it.",
    ),
    Entry(
        "model-hidden-dropout",
        SECTION,
        "A model config with hidden-state dropout, with context parallelism",
        "base_model: its config sets hidden_dropout: 0.1, a dropout inside the model whose masks cptune "
        "cannot split exactly across context-parallel ranks",
        "Each rank would draw its own masks instead of its slice of the masks one process draws, so the run "
        "would not equal its `context_parallel_size: 1` run. Set the key to 0 in the model folder's "
        "config.json, or use `context_parallel_size: 1`. `lora_dropout` is exact under context parallelism.",
    ),
    Entry(
        "lora-target-missing",
        SECTION,
        "lora_target_modules names a module the model does not have",
        "lora_target_modules: Target modules {'q_projj'} not found in the base model.",
        "Use the model's module names (Llama-style models: q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj), or remove the key to adapt every linear layer. Checked on a weightless copy of "
        "the model before anything is loaded.",
    ),
    Entry(
        "tokenizer-without-pad-or-eos",
        SECTION,
        "A tokenizer with neither a pad nor an eos token",
        "has neither a pad nor an eos token; cptune needs one of them to pad batches.",
        "Use a tokenizer that defines `pad_token` or `eos_token` (add it to its tokenizer_config.json), or "
        "point `tokenizer_config` at one.",
    ),
    Entry(
        "model-type-mismatch",
        SECTION,
        "model_type names another model's class",
        "model_type: MistralForCausalLM is not the class of",
        "Set `model_type: AutoModelForCausalLM` or remove it: cptune loads the class the model's config names.",
    ),
    Entry(
        "lora-model-dir-missing",
        SECTION,
        "lora_model_dir without an adapter",
        "does not exist. Point it at the folder of a trained LoRA adapter",
        "Point `lora_model_dir` at a folder with `adapter_config.json` (a run's output_dir or checkpoint), or "
        "remove it (Axolotl's recipes often leave it empty, which means no adapter).",
    ),
    Entry(
        "modules-to-save-unknown",
        SECTION,
        "lora_modules_to_save naming no module",
        "lora_modules_to_save: the model has no module named 'embed'",
        "Use the modules' last names, e.g. `[embed_tokens, lm_head]` for Llama-style models.",
    ),
    Entry(
        "unfrozen-selects-nothing",
        SECTION,
        "unfrozen_parameters pattern that selects no parameter",
        "unfrozen_parameters: 'model.language_model.*' selects no parameter of the model, whose parameters are "
        "named model.embed_tokens.weight",
        "A pattern must match the start of a parameter's name, its dots literal except in `.+` (Axolotl's "
        "reading): `mlp` selects nothing, `model.layers.+.mlp` every layer's MLP. The message lists the "
        "model's first names; the check runs on the model's shapes before any weight loads. Axolotl "
        "silently trains less; cptune refuses.",
    ),
    Entry(
        "new-tokens-untrained",
        SECTION,
        "New tokens in a LoRA run without training their embeddings",
        "tokens: adds 1 token(s) the tokenizer did not have (<tool>); their embeddings start untrained",
        "Add `lora_modules_to_save: [embed_tokens, lm_head]` (the message names the model's modules) so the "
        "new rows are trained and saved with the adapter. A new pad token alone needs nothing.",
    ),
    Entry(
        "new-tokens-frozen",
        SECTION,
        "New tokens in a run whose unfrozen_parameters freeze the embeddings",
        "their embeddings start untrained, and unfrozen_parameters freezes model.embed_tokens.weight, "
        "lm_head.weight. Add [^model.embed_tokens.weight$, ^lm_head.weight$] to unfrozen_parameters",
        "Add the patterns the message gives, so the new rows of the input and output embeddings are trained. A "
        "new pad token alone needs nothing.",
    ),
    Entry(
        "cut-cross-entropy-softcapped-logits",
        SECTION,
        "cut_cross_entropy with a model that soft-caps or scales its logits",
        "cut_cross_entropy: LlamaConfig transforms the logits after its output layer (final_logit_softcapping: "
        "30.0), which the chunked loss does not reproduce; the chunked loss needs a model whose logits are its "
        "output layer's output.",
        "Remove `cut_cross_entropy` (and the plugin or Liger key that turns it on) for Gemma 2/3-, Cohere- and "
        "Granite-style models. Checked from the config before anything is loaded.",
    ),
    Entry(
        "activation-offloading-host-ram",
        SECTION,
        "activation_offloading needs more host RAM than the machine has",
        "activation_offloading: the offloaded layer inputs need",
        "The message gives the arithmetic (layers x tokens per process x hidden size x bytes, times the processes "
        "on the node) against 90% of the node's RAM (what it has available now, or `cptune validate "
        "--host-memory GIB` when planning for another machine). Use `activation_offloading: two_level` (half "
        "the layers' inputs offloaded, the others made again in the backward: the same bits), split each "
        "sequence over more processes (`context_parallel_size`), train shorter rows, or remove "
        "`activation_offloading`. `cptune validate` prints the host RAM a recipe needs and whether the host or "
        "the GPU limits the longest sequence. Checked before anything is loaded.",
    ),
    Entry(
        "tp-not-dividing",
        SECTION,
        "context_parallel_size × tensor_parallel_size does not divide the number of processes",
        "context_parallel_size=2 × tensor_parallel_size=2 = 4 does not divide the number of processes (6)",
        "Launch a multiple of dp_replicate_size × context_parallel_size × tensor_parallel_size processes, or "
        "change `tensor_parallel_size`.",
    ),
    Entry(
        "tp-nothing-to-shard",
        SECTION,
        "tensor_parallel_size uses every process",
        "tensor_parallel_size=2 uses every process, which leaves FSDP2 no ranks to shard over",
        "FSDP2 shards over dp_shard × context_parallel_size ranks, which must be 2 or more next to the "
        "tensor-parallel ranks. Launch twice the processes, or set `context_parallel_size: 2`.",
    ),
    Entry(
        "tp-heads-not-dividing",
        SECTION,
        "tensor_parallel_size does not divide the model's heads",
        "tensor_parallel_size: 3 does not divide the model's num_attention_heads (4)",
        "Each tensor-parallel rank computes whole attention heads: choose a `tensor_parallel_size` that "
        "divides both the attention heads and the key/value heads. Checked before anything is loaded.",
    ),
    Entry(
        "tp-model-without-plan",
        SECTION,
        "A model without a tensor-parallel plan",
        "has no tensor-parallel plan in transformers (config.base_model_tp_plan)",
        "cptune splits a model as transformers' plan for its architecture says (Llama, Qwen2/3, Mistral and "
        "most dense decoders have one). Remove `tensor_parallel_size` and shard with FSDP2 and "
        "`context_parallel_size` alone.",
    ),
)

DOCUMENTED: tuple[Documented, ...] = (
    Documented(
        "hub-id-unreachable",
        SECTION,
        "A hub id that is not cached, offline or without network",
        "is neither a local folder nor in the Hugging Face cache",
        "With `HF_HUB_OFFLINE=1` nothing is downloaded; without network the hub does not answer (cptune "
        "waits 2 s for a connection instead of the libraries' retries). Give the path of a local model "
        "folder, or download the model once where the hub is reachable (`hf download OWNER/NAME`) into "
        "the cache the message names; set `HF_HUB_OFFLINE=1` so that cached models load without trying "
        "the network. Checked before torch is imported.",
        raised_in="src/cptune/models/hub.py",
        why_not_in_catalogue="it depends on HF_HUB_OFFLINE and on the network of the machine that runs it",
        tested_by="tests/models/test_hub.py::test_an_uncached_hub_id_with_hf_hub_offline_fails_in_one_line",
    ),
    Documented(
        "model-config-override-unknown-field",
        SECTION,
        "overrides_of_model_config names a field the model's config does not have",
        "overrides_of_model_config: ",
        "Set only fields that the base model's `config.json` has (for a mixture-of-experts model, e.g. "
        "`output_router_logits` and `router_aux_loss_coef`); a misspelt field would otherwise change nothing. "
        "Raised when the model's config is loaded, in every process.",
        raised_in="src/cptune/models/loading.py",
        why_not_in_catalogue="it is raised while the model loads, after the processes started",
        tested_by="tests/models/test_loading.py::test_an_override_of_a_field_the_config_lacks_is_refused",
    ),
    Documented(
        "preference-with-router-loss",
        SECTION,
        "rl with a mixture-of-experts model that adds a router loss",
        "which cptune's preference loss does not include yet",
        "The preference loss does not carry the router's load-balancing term yet, and dropping it silently "
        "would train another objective. Set `overrides_of_model_config: {output_router_logits: false}` to "
        "train without it, or train without `rl`.",
        raised_in="src/cptune/run/training/preference_trainer.py",
        why_not_in_catalogue="it is raised when the trainer is built, after the model loaded",
        tested_by="tests/run/test_train_moe.py::test_preference_training_of_a_moe_model_with_its_router_loss_is_refused",
    ),
    Documented(
        "tiled-mlp-mixture-of-experts",
        SECTION,
        "tiled_mlp with a mixture-of-experts model",
        "the MLP of each decoder layer must be a dense, token-wise module. Remove tiled_mlp",
        "Remove `tiled_mlp`: the tiles run the MLP under `no_grad` (and recompute it in the backward), so the "
        "router logits that a mixture of experts' load-balancing loss reads would carry no gradient. Activation "
        "offloading and `recompute_norms` still apply. Checked from a weightless copy of the model before "
        "anything is loaded.",
        raised_in="src/cptune/models/memory_features.py",
        why_not_in_catalogue="a saved mixture-of-experts model is large for the catalogue's workspace",
        tested_by="tests/models/test_memory_features.py::test_check_memory_features_refuses_a_mixture_of_experts_before_loading",
    ),
    Documented(
        "lora-target-adapts-nothing",
        SECTION,
        "a lora_target_modules entry adapts nothing while the others do (e.g. down_proj on Mixtral)",
        "adapts nothing in",
        "peft refuses a target list only when none of its names matches, so one name that matches nothing "
        "would train without it. A mixture of experts' expert weights are fused parameters in transformers 5: "
        "`lora_target_linear: true` adapts them (with the attention and the router), or name them by the "
        "model's transformers 4 module names (Qwen3-MoE: `gate_proj`, `up_proj`, `down_proj`; Mixtral: `w1`, "
        "`w3`, `w2`). With `quantize_moe_experts` the experts are packed in 4 bits and take no adapter: remove "
        "the names only they match, or remove `quantize_moe_experts`. Checked on a weightless copy of the model "
        "before anything is loaded.",
        raised_in="src/cptune/models/lora_targets.py",
        why_not_in_catalogue="a saved mixture-of-experts model is large for the catalogue's workspace",
        tested_by="tests/models/test_lora_targets.py::test_a_target_that_adapts_nothing_beside_one_that_does_is_refused",
    ),
    Documented(
        "lora-target-unsupported-module",
        SECTION,
        "lora_target_modules names a module peft cannot adapt (e.g. experts)",
        "peft cannot adapt a",
        "Name linear layers, or use `lora_target_linear: true`, which also adapts a mixture of experts' fused "
        "expert weights; to name those, use the model's transformers 4 module names (Qwen3-MoE: `gate_proj`, "
        "`up_proj`, `down_proj`; Mixtral: `w1`, `w3`, `w2`).",
        raised_in="src/cptune/models/lora_targets.py",
        why_not_in_catalogue="a saved mixture-of-experts model is large for the catalogue's workspace",
        tested_by="tests/models/test_lora_targets.py::test_the_experts_module_or_its_fused_parameter_name_is_refused_in_one_line",
    ),
    Documented(
        "router-loss-padded-rows",
        SECTION,
        "a router loss with padded rows under cp_backend torch, deepspeed around sdpa, or batch_zigzag",
        "takes no document mask, so the padding would attend to",
        "The router load-balancing loss counts every token of a micro batch, the padding too. At cp=1 padding "
        "is a document of its own; torch's context-parallel attention, Ulysses around sdpa and ring-flash-attn's "
        "zigzag ring (`ring_attn_func: batch_zigzag`) take no document mask, so the padding would see the row's "
        "real tokens and route otherwise. Use `micro_batch_size: 1` (more `gradient_accumulation_steps`) without "
        "`pad_to_sequence_len`, or `cp_backend: ring-flash-attn` with `ring_attn_func: varlen_llama3`, or turn "
        "the router loss off (`overrides_of_model_config: {output_router_logits: false}`).",
        raised_in="src/cptune/parallel/router_padding.py",
        why_not_in_catalogue="a saved mixture-of-experts model is large for the catalogue's workspace",
        tested_by="tests/parallel/test_router_padding.py::test_padded_rows_with_a_router_loss_are_refused_with_the_reason",
    ),
    Documented(
        "router-jitter-under-cp",
        SECTION,
        "a model with router_jitter_noise under context parallelism",
        "its router noise is drawn per process, so a context-parallel run would draw other noise",
        "Mixtral's `router_jitter_noise` multiplies the router's input by noise from each process's random "
        "generator, so a process holding a slice of a row draws other noise than the run without CP. Set "
        "`router_jitter_noise: 0.0` in `overrides_of_model_config` (the default), or train at "
        "`context_parallel_size: 1`.",
        raised_in="src/cptune/parallel/backends/select.py",
        why_not_in_catalogue="a saved mixture-of-experts model is large for the catalogue's workspace",
        tested_by="tests/run/test_preflight.py::test_router_jitter_under_context_parallelism_is_refused_before_loading",
    ),
    Documented(
        "recompute-norms-without-rmsnorm",
        SECTION,
        "recompute_norms with a model that has no RMSNorm in its layers",
        "has nothing to recompute",
        "Remove `recompute_norms`: it recomputes the RMSNorm modules of the decoder layers (Llama, Qwen, "
        "Mistral...), and this model's layers normalise otherwise (a LayerNorm, or no norm module). Checked "
        "from a weightless copy of the model before anything is loaded.",
        raised_in="src/cptune/models/memory_features.py",
        why_not_in_catalogue="cptune's tests know no small model without RMSNorm; the test stands one in",
        tested_by="tests/models/test_recomputed_norms.py::test_a_model_without_rmsnorm_in_its_layers_is_refused_before_loading",
    ),
    Documented(
        "gpus-not-divisible-by-cp",
        SECTION,
        "A GPU count that is not a multiple of the CP group",
        "cannot be split into groups of context_parallel_size × dp_replicate_size",
        "Without `--nproc-per-node`, `cptune train` starts one process per visible GPU. Pass "
        "`--nproc-per-node` (a multiple of the group), or choose GPUs with `CUDA_VISIBLE_DEVICES`.",
        raised_in="src/cptune/run/launch/processes.py",
        why_not_in_catalogue="only on a machine with GPUs; the test fakes the GPU count",
        tested_by="tests/run/test_launch.py::test_default_processes_one_per_gpu",
    ),
)
