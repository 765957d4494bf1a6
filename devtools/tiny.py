"""A tiny Llama-architecture model and tokenizer, built locally without any model hub.

Tests, benchmarks and the shipped example (``examples/tiny-llama``) need a real
causal LM that loads through ``AutoModelForCausalLM`` and ``AutoTokenizer``, yet
is small enough to train on a laptop CPU in seconds. This module builds one:

* a byte-level BPE tokenizer trained with the ``tokenizers`` library. Every
  string encodes without unknown tokens because the 256 byte symbols are always
  in the vocabulary. ``tokenizer(text)`` prepends ``<s>`` and appends nothing
  (no ``</s>``); the chat template writes its own ``<s>``, so rendered chats must
  be tokenized with ``add_special_tokens=False`` (``apply_chat_template`` does so).
* a 2-layer, hidden-64 ``LlamaForCausalLM`` with grouped-query attention
  (4 query heads, 2 KV heads), so that code paths which depend on
  ``num_key_value_heads != num_attention_heads`` are exercised.
* :func:`pretrain_tiny_model`, a short deterministic next-token training run
  that turns the random weights into a base model that LoRA can adapt: a
  random model's frozen ``lm_head`` (std 0.02) and final norm keep every logit
  within about ``0.02 * hidden_size`` of zero, so LoRA alone cannot move the
  loss far.

Everything is deterministic: the same texts and seed give the same vocabulary,
merges and weights.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"

# Fixed order, so the ids below hold for every tokenizer this module builds.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, IM_START_TOKEN_ID, IM_END_TOKEN_ID = range(len(SPECIAL_TOKENS))

DEFAULT_VOCAB_SIZE = 768
DEFAULT_MAX_LENGTH = 8192

# ChatML. Each turn is "<|im_start|>{role}\n{content}<|im_end|>\n", so the text of
# messages[:i] plus the generation prompt is a prefix of the text of messages[:i+1]
# when message i is the assistant's; the tokenizer isolates every "\n" (see
# `_pre_tokenizer`) so that the text prefix is also a token prefix. The
# {% generation %} block lets `apply_chat_template(return_assistant_tokens_mask=True)`
# mark the assistant's content and its closing <|im_end|> as the trained tokens.
CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- for message in messages -%}
    {%- if message['role'] not in ['system', 'user', 'assistant'] -%}
        {{- raise_exception('Unknown role ' + message['role'] + '; use system, user or assistant.') -}}
    {%- endif -%}
    {{- '<|im_start|>' + message['role'] + '\\n' -}}
    {%- if message['role'] == 'assistant' -%}
        {%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}
    {%- else -%}
        {{- message['content'] + '<|im_end|>' -}}
    {%- endif -%}
    {{- '\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

# A small original corpus that puts common English pieces, digits, code and
# punctuation into the merges, so that text unlike the training data still
# encodes into fewer tokens than bytes. Byte fallback covers everything else.
GENERIC_CORPUS = (
    "The river runs past the old mill and under the stone bridge before it reaches the sea.",
    "In the morning the baker opens the shop, lights the oven and sets out the first loaves.",
    "A small model can learn a simple task quickly when the answers follow a clear rule.",
    "She counted the boats in the harbour: one, two, three, four, five, six, seven, eight, nine, ten.",
    "Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 25, 50, 64, 100, 128, 256, 512 and 1024 "
    "appear in tables, prices and sizes.",
    "Please write the answer in one short sentence, then stop.",
    "What is the capital of the country on this map? Where does the road end? Why is the sky blue?",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n",
    'config = {"name": "tiny", "layers": 2, "hidden": 64, "heads": [4, 2]}\n',
    "Line one.\nLine two,\twith a tab.\n\nA new paragraph after an empty line.",
    "Mixed CASE words, UPPER CASE words and lower case words all show up in real text.",
    "Punctuation: commas, full stops. Colons: semicolons; dashes - and (brackets) [lists] {sets} <tags>.",
    "Quotes 'single' and \"double\", the path /usr/local/bin, the address https://example.org/a?b=c#d.",
    "Weather report: cold in the north, warm in the south, light rain by the evening.",
    "The committee met on Tuesday, reviewed the budget and agreed to plant more trees in the park.",
    "Non-English text still encodes byte by byte: café, naïve, Straße, 東京, Москва, 😀.",
)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # GPT-2 style byte-level splitting, but with every "\n" isolated first: a
    # pre-token never spans a newline, so tokens never straddle the boundary
    # between a chat header ("<|im_start|>assistant\n") and the content after it.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def build_tiny_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer on ``texts``.

    The vocabulary holds the special tokens (ids 0-4: ``<pad>``, ``<s>``,
    ``</s>``, ``<|im_start|>``, ``<|im_end|>``), all 256 byte symbols (so any
    string encodes without an unknown token) and merges learnt from ``texts``.
    ``tokenizer(text)`` prepends ``<s>`` and adds no ``</s>``; callers that
    want an end of sequence append ``eos_token_id`` themselves. The tokenizer
    carries a ChatML :data:`CHAT_TEMPLATE` whose rendering starts with ``<s>``.

    Args:
        texts: Training texts; the same texts in the same order give the same
            vocabulary and merges.
        vocab_size: Upper bound on the vocabulary size, special tokens and byte
            symbols included. The result is smaller when ``texts`` are too
            small to support that many merges; use ``len(tokenizer)``.

    Returns:
        A ``PreTrainedTokenizerFast`` with bos, eos, pad and chat markers set,
        right padding and ``model_max_length`` 8192.

    Raises:
        ValueError: If ``vocab_size`` cannot hold the special tokens and the
            byte alphabet.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(SPECIAL_TOKENS) + len(alphabet):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level tokenizer needs at least "
            f"{len(SPECIAL_TOKENS) + len(alphabet)} entries (special tokens + 256 bytes)."
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = _pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(list(texts), trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=DEFAULT_MAX_LENGTH,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def tiny_llama_config(vocab_size: int, **overrides: object) -> LlamaConfig:
    """Return the config of the tiny Llama: 2 layers, hidden 64, 4 query and 2 KV heads.

    Args:
        vocab_size: Number of embedding rows; use ``len(tokenizer)``.
        **overrides: Any ``LlamaConfig`` field, applied over the defaults
            (e.g. ``num_hidden_layers=4`` or ``num_key_value_heads=4``).

    Returns:
        A float32 ``LlamaConfig`` whose pad/bos/eos ids match
        :func:`build_tiny_tokenizer`.
    """
    fields: dict[str, object] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": DEFAULT_MAX_LENGTH,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "pad_token_id": PAD_TOKEN_ID,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "dtype": "float32",
    }
    fields.update(overrides)
    return LlamaConfig(**fields)


def build_tiny_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """Build a randomly initialised float32 ``LlamaForCausalLM``, the same for the same seed.

    The caller's global RNG state is left untouched.

    Args:
        config: Model config, e.g. from :func:`tiny_llama_config`.
        seed: Seed for the weight initialisation.

    Returns:
        The model in training mode, on CPU, in float32.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(torch.float32)
    model.generation_config = _generation_config(config)
    return model


def _moe_fields(vocab_size: int) -> dict[str, object]:
    """The tiny Llama's sizes for the mixture-of-experts configs (their own expert widths come on top)."""
    llama = tiny_llama_config(vocab_size)
    names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    names += ("max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "pad_token_id")
    return {"vocab_size": vocab_size, **{name: getattr(llama, name) for name in names}}


def _seeded(build: Callable[[], torch.nn.Module], seed: int) -> torch.nn.Module:
    """``build()`` with its weights drawn from ``seed``, in float32; the caller's RNG is untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.to(torch.float32)


def build_tiny_qwen3_moe(vocab_size: int, seed: int, **overrides: object) -> torch.nn.Module:
    """A randomly initialised float32 ``Qwen3MoeForCausalLM`` of the tiny Llama's sizes, every layer sparse.

    4 experts of width 32, 2 per token; the router loss is on (``output_router_logits``,
    ``router_aux_loss_coef`` 0.02) unless ``overrides`` say otherwise. The caller's RNG is untouched.

    Args:
        vocab_size: Number of embedding rows.
        seed: Seed for the weight initialisation.
        **overrides: Any ``Qwen3MoeConfig`` field.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = _moe_fields(vocab_size)
    fields.update(
        intermediate_size=tiny_llama_config(vocab_size).intermediate_size,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    )
    fields.update(overrides)
    return _seeded(lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields)), seed)


def _tiny_fields(vocab_size: int) -> dict[str, object]:
    """The tiny Llama's sizes and special-token ids, for configs of other families."""
    llama = tiny_llama_config(vocab_size)
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    names += ("num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps")
    names += ("tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id")
    return {name: getattr(llama, name) for name in names}


def build_tiny_mistral(
    vocab_size: int, seed: int, sliding_window: int = 5, **overrides: object
) -> torch.nn.Module:
    """A randomly initialised float32 ``MistralForCausalLM`` of the tiny Llama's sizes, every layer windowed.

    Mistral predates ``layer_types``: with ``sliding_window`` set, every layer's queries see their last
    ``sliding_window`` keys (their own included). The caller's RNG is untouched.
    """
    from transformers import MistralConfig, MistralForCausalLM

    fields = {**_tiny_fields(vocab_size), "sliding_window": sliding_window, **overrides}
    return _seeded(lambda: MistralForCausalLM(MistralConfig(**fields)), seed)


def build_tiny_gemma3_text(
    vocab_size: int, seed: int, sliding_window: int = 5, **overrides: object
) -> torch.nn.Module:
    """A randomly initialised float32 Gemma 3 text model (``Gemma3ForCausalLM``) of the tiny Llama's sizes.

    3 layers: sliding, sliding, full (``layer_types``; Gemma 3 itself has 5 local : 1 global), each
    with its own RoPE base as Gemma 3's; no soft-capping (Gemma 3 has none). The caller's RNG is untouched.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    fields = {
        **_tiny_fields(vocab_size),
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": sliding_window,
        "query_pre_attn_scalar": 16,
        **overrides,
    }
    return _seeded(lambda: Gemma3ForCausalLM(Gemma3TextConfig(**fields)), seed)


def build_tiny_mixtral(vocab_size: int, seed: int, **overrides: object) -> torch.nn.Module:
    """A randomly initialised float32 ``MixtralForCausalLM`` of the tiny Llama's sizes, full attention.

    4 experts of width 32, 2 per token (``num_local_experts``, Mixtral's name); no sliding window;
    the router loss is on (``output_router_logits``, ``router_aux_loss_coef`` 0.02) unless
    ``overrides`` say otherwise. The caller's RNG is untouched.

    Args:
        vocab_size: Number of embedding rows.
        seed: Seed for the weight initialisation.
        **overrides: Any ``MixtralConfig`` field.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    fields = _moe_fields(vocab_size)
    fields.update(
        intermediate_size=32,  # each expert's width
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    )
    fields.update(overrides)
    return _seeded(lambda: MixtralForCausalLM(MixtralConfig(**fields)), seed)


def build_tiny_gpt_oss(
    vocab_size: int, seed: int, sliding_window: int = 5, **overrides: object
) -> torch.nn.Module:
    """A randomly initialised float32 ``GptOssForCausalLM`` of the tiny Llama's sizes.

    gpt-oss's attention: 2 layers, sliding then full (``layer_types``: gpt-oss alternates them), a learned
    sink logit per query head in every layer's softmax (``sinks``), biased projections, YaRN RoPE; its
    MoE block: 4 experts of width 32 with biases, 2 per token, a biased router. The router loss is on
    (``output_router_logits``, ``router_aux_loss_coef`` 0.02) unless ``overrides`` say otherwise. The
    caller's RNG is untouched.

    Args:
        vocab_size: Number of embedding rows.
        seed: Seed for the weight initialisation.
        sliding_window: Keys a query of a sliding layer sees, its own included.
        **overrides: Any ``GptOssConfig`` field.
    """
    from transformers import GptOssConfig, GptOssForCausalLM

    fields = _moe_fields(vocab_size)
    fields.update(
        intermediate_size=32,  # each expert's width
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        # gpt-oss's YaRN, its factor matching max_position_embeddings / original_max_position_embeddings
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": DEFAULT_MAX_LENGTH / 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    )
    fields.update(overrides)
    return _seeded(lambda: GptOssForCausalLM(GptOssConfig(**fields)), seed)


def _generation_config(config: LlamaConfig) -> GenerationConfig:
    # Stop at </s> (alpaca-style data) and at <|im_end|> (chat-style data).
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, IM_END_TOKEN_ID],
        pad_token_id=config.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    )


def pretrain_tiny_model(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    texts: Sequence[str],
    *,
    steps: int,
    seed: int,
    batch_size: int = 16,
    lr: float = 5e-3,
) -> list[float]:
    """Train ``model`` in place on next-token prediction over ``texts``, deterministically.

    Each text is one sequence (``<s>`` + tokens + ``</s>``); batches are drawn
    with a seeded shuffle, AdamW with a linear warm-up and cosine decay, in
    float32 on one thread so that the result does not depend on the machine's
    core count.

    Args:
        model: The model to train; left in eval mode.
        tokenizer: Tokenizer used to encode ``texts``.
        texts: Training texts, each no longer than the model's context.
        steps: Number of optimizer steps.
        seed: Seed for the batch order.
        batch_size: Sequences per step.
        lr: Peak learning rate.

    Returns:
        The loss of every step.
    """
    encoded = [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for text in texts]
    order_rng = random.Random(seed)
    order: list[int] = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 10)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    losses: list[float] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for _ in range(steps):
            batch: list[list[int]] = []
            while len(batch) < batch_size:
                if not order:
                    order = list(range(len(encoded)))
                    order_rng.shuffle(order)
                batch.append(encoded[order.pop()])
            input_ids, labels, attention_mask = _pad_batch(batch, tokenizer.pad_token_id)
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
        model.eval()
    return losses


def _pad_batch(batch: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    return input_ids, labels, attention_mask


def save_tiny_model_dir(
    out_dir: str | Path,
    texts: Iterable[str],
    seed: int = 0,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    pretrain_texts: Sequence[str] = (),
    pretrain_steps: int = 0,
    **config_overrides: object,
) -> Path:
    """Build a tokenizer and model and save both into ``out_dir``.

    The folder then loads offline with ``AutoTokenizer.from_pretrained(out_dir)``
    and ``AutoModelForCausalLM.from_pretrained(out_dir)``.

    Args:
        out_dir: Folder to write; created if missing, files in it overwritten.
        texts: Tokenizer training texts.
        seed: Seed for the weight initialisation and the pre-training order.
        vocab_size: Upper bound on the vocabulary size.
        pretrain_texts: Texts for :func:`pretrain_tiny_model`.
        pretrain_steps: Pre-training steps; 0 saves the random initialisation.
        **config_overrides: Passed to :func:`tiny_llama_config`.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(texts, vocab_size=vocab_size)
    model = build_tiny_model(tiny_llama_config(len(tokenizer), **config_overrides), seed=seed)
    if pretrain_steps:
        pretrain_tiny_model(model, tokenizer, pretrain_texts, steps=pretrain_steps, seed=seed)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    return out_dir
