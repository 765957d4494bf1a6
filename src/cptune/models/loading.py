"""Load the tokenizer and model a recipe names, and wrap the model in a LoRA adapter."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from cptune.config.recipe import Recipe
from cptune.errors import CptuneError

log = logging.getLogger("cptune.models")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def load_tokenizer(recipe: Recipe) -> Any:
    """The recipe's tokenizer with its special_tokens and tokens, and a pad token (eos when it has none)."""
    return load_tokenizer_with_additions(recipe)[0]


def load_tokenizer_with_additions(recipe: Recipe) -> tuple[Any, list[str]]:
    """:func:`load_tokenizer`, and the tokens the recipe added to it (new ids, in order)."""
    from transformers import AutoTokenizer

    from cptune.models.added_tokens import add_recipe_tokens
    from cptune.models.hub import check_hub_ids

    check_hub_ids(recipe)
    key = "tokenizer_config" if recipe.tokenizer_config else "base_model"
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            recipe.tokenizer_path, trust_remote_code=recipe.trust_remote_code, revision=recipe.model_revision
        )
    except (OSError, ValueError, TypeError) as err:
        raise CptuneError(
            f"{key}: cannot load a tokenizer from '{recipe.tokenizer_path}' ({_first_line(err)}). "
            "Give a local folder that holds the tokenizer files, or a hub id that is reachable from here."
        ) from None
    added = add_recipe_tokens(tokenizer, recipe)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise CptuneError(
                f"{key}: the tokenizer at '{recipe.tokenizer_path}' has neither a pad nor an eos token; "
                "cptune needs one of them to pad batches."
            )
        tokenizer.pad_token = tokenizer.eos_token
        log.info("the tokenizer has no pad token; using its eos token %r for padding", tokenizer.eos_token)
    return tokenizer, added


# What a model's weights are saved as (one file, shards, or their index all end so).
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def check_local_weights(recipe: Recipe) -> None:
    """Refuse a local ``base_model`` folder without usable weight files.

    Refused: a folder that holds no weight files (e.g. only config.json was copied), and a
    safetensors file whose header does not describe the file (truncated or damaged; reading the
    header is cheap, the weights are not read). Checked before launching, so the mistake does not
    surface in every rank after the data was prepared. A hub id is left to the hub.
    """
    from safetensors import SafetensorError, safe_open

    folder = Path(recipe.base_model)
    if not folder.is_dir():
        return
    weights = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    for path in (p for p in weights if p.suffix == ".safetensors"):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except SafetensorError as err:
            raise CptuneError(
                f"base_model: the weight file '{path}' is damaged or incomplete ({_first_line(err)}). "
                "Copy or download it again (an interrupted copy or download leaves such a file)."
            ) from None
    if weights:
        return
    raise CptuneError(
        f"base_model: the folder '{folder}' holds no weight files (*.safetensors or *.bin), only "
        f"{', '.join(sorted(p.name for p in folder.iterdir())[:6]) or 'nothing'}. Copy or download the "
        "model's weights into it, or point base_model at a complete model folder or a hub id."
    )


def check_causal_lm(recipe: Recipe, config: Any) -> None:
    """Refuse a ``base_model`` that transformers cannot load as a causal language model.

    Checked from config.json before launching: an encoder-decoder (T5) or vision model otherwise
    fails in every rank, after the data was prepared.
    """
    from transformers import AutoModelForCausalLM

    if type(config) in AutoModelForCausalLM._model_mapping:
        return
    if recipe.trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return  # the model's own code provides the class
    raise CptuneError(
        f"base_model: '{recipe.base_model}' is a {config.model_type} model ({type(config).__name__}), which "
        "transformers cannot load as a causal language model (AutoModelForCausalLM). cptune fine-tunes "
        "decoder language models, also for causal: false (e.g. Llama, Qwen2/3, Mistral); pick one of those."
    )


def check_model_type(recipe: Recipe, config: Any) -> None:
    """Refuse a ``model_type`` (Axolotl's model class key) that is not the model's causal LM class."""
    if recipe.model_type in (None, "AutoModelForCausalLM"):
        return
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    names = {getattr(model_class, "__name__", None), *(getattr(config, "architectures", None) or ())}
    if recipe.model_type in names:
        return
    actual = getattr(model_class, "__name__", None) or "no causal LM class"
    raise CptuneError(
        f"model_type: {recipe.model_type} is not the class of '{recipe.base_model}' (a {config.model_type} "
        f"model, loaded as {actual}). cptune loads the class the model's config names; set model_type: "
        "AutoModelForCausalLM or remove it."
    )


def check_token_ids(prepared: Any, tokenizer: Any, embedded: int | None, recipe: Recipe) -> None:
    """Refuse data with token ids that the model has no embedding for (a tokenizer of another model).

    The recipe's own tokens are left out (:func:`cptune.models.added_tokens.recipe_token_ids`): the
    embeddings grow to hold them.

    Args:
        prepared: The prepared data (:class:`cptune.data.prepare.PreparedData`).
        tokenizer: The recipe's tokenizer, its tokens added.
        embedded: Rows of the base model's input embedding (config ``vocab_size``); None when unknown.
    """
    from cptune.data.prepare import highest_token_id
    from cptune.models.added_tokens import recipe_token_ids

    highest_id = highest_token_id(prepared, ignoring=recipe_token_ids(tokenizer, recipe))
    if highest_id is None or embedded is None or highest_id < embedded:
        return
    tokenizer = recipe.tokenizer_config or recipe.base_model
    raise CptuneError(
        f"base_model: the tokenized data holds token id {highest_id}, but the model embeds only "
        f"{embedded} tokens (vocab_size), so the tokenizer from '{tokenizer}' does not belong to this "
        "model. Use the model's own tokenizer (remove tokenizer_config, or point it at the tokenizer "
        "the model was trained with)."
    )


def torch_dtype(recipe: Recipe) -> torch.dtype:
    """The training dtype: bf16, fp16 or fp32 as the recipe says (``bf16: auto`` → bf16 when supported)."""
    if recipe.bf16 is True:
        return torch.bfloat16
    if recipe.bf16 == "auto" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if recipe.fp16:
        return torch.float16
    return torch.float32


def model_config(recipe: Recipe, path: str | None = None) -> Any:
    """The config of the recipe's base model (or of the full model saved at ``path``), without weights.

    Raises:
        CptuneError: it cannot be read (no such folder, no config.json, an unreachable hub id).
    """
    from transformers import AutoConfig

    from cptune.models.hub import check_hub_ids

    if path is None:
        check_hub_ids(recipe)
    source = path or recipe.base_model
    try:
        config = AutoConfig.from_pretrained(
            source,
            trust_remote_code=recipe.trust_remote_code,
            revision=None if path else recipe.model_revision,
        )
    except (OSError, ValueError) as err:
        raise CptuneError(
            f"base_model: cannot load a model config from '{source}' ({_first_line(err)}). "
            "Give a local folder with config.json and weights, or a hub id that is reachable from here."
        ) from None
    if path is None:
        override_config(config, recipe.overrides_of_model_config or {})
    return config


def override_config(config: Any, overrides: dict[str, Any]) -> None:
    """Set the recipe's ``overrides_of_model_config`` on the (text) config, each a field it already has.

    A saved full model's config (``path``) already carries them and is left as saved.

    Raises:
        CptuneError: naming the first field the config does not have.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name, value in overrides.items():
        if not hasattr(text, name):
            raise CptuneError(
                f"overrides_of_model_config: {type(text).__name__} has no field '{name}'. Set only fields of the "
                "base model's config.json (e.g. output_router_logits, router_aux_loss_coef)."
            )
        setattr(text, name, value)


def load_model(
    recipe: Recipe, attn_implementation: str | None, path: str | None = None, *, local_rank: int = 0
) -> Any:
    """The base model (or the full model saved at ``path``) in the recipe's dtype and attention.

    ``attn_implementation`` None: transformers' own attention, ``sdpa`` or ``eager`` where the model has
    no sdpa path (:func:`cptune.parallel.backends.local.runtime.transformers_attention`). A base model is
    quantized as the recipe says (load_in_4bit, load_in_8bit; ``local_rank`` picks the GPU a quantized
    copy goes to), and a base stored in MXFP4 is dequantized (model_quantization_config).
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from cptune.models.quantization import device_map, mxfp4_config, quantization_config

    source = path or recipe.base_model
    revision = None if path else recipe.model_revision
    config = model_config(recipe, path)
    if attn_implementation is None:
        from cptune.parallel.backends.local.runtime import transformers_attention

        attn_implementation = transformers_attention(config)
    quantized = {}
    if path is None and recipe.is_quantized:
        quantized = {
            "quantization_config": quantization_config(recipe, torch_dtype(recipe)),
            "device_map": device_map(recipe, local_rank),
        }
    elif path is None and recipe.dequantizes_mxfp4:
        quantized = {"quantization_config": mxfp4_config(recipe)}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            config=config,
            dtype=torch_dtype(recipe),
            attn_implementation=attn_implementation,
            trust_remote_code=recipe.trust_remote_code,
            revision=revision,
            **quantized,
        )
    except ValueError as err:
        if "attn_implementation" in str(err):
            raise CptuneError(
                f"base_model: '{source}' cannot use the attention implementation "
                f"'{attn_implementation}' that this recipe needs ({_first_line(err)}). Context parallelism "
                "needs a model whose attention goes through transformers' AttentionInterface."
            ) from None
        raise CptuneError(f"base_model: cannot load '{source}' ({_first_line(err)}).") from None
    except (OSError, RuntimeError, SafetensorError) as err:
        # A damaged weight file (torch's zip reader raises RuntimeError, safetensors its own error)
        # or weights that do not fit the config: the user's files, not a bug in cptune.
        raise CptuneError(
            f"base_model: cannot load '{source}' ({_first_line(err)}). Check that its weight files are "
            "complete and belong to this config; copy or download them again."
        ) from None
    if path is None and recipe.is_quantized:
        from cptune.models.quantization import keep_cpu_layers_differentiable

        keep_cpu_layers_differentiable(model)
        if recipe.quantize_moe_experts:
            from cptune.models.expert_quantization import quantize_experts

            packed = quantize_experts(model, recipe)
            log.info(
                "quantize_moe_experts: %s weights of the experts stored in 4 bits (frozen, no adapter)",
                f"{packed:,}",
            )
    elif path is None and recipe.dequantizes_mxfp4:
        from cptune.models.quantization import save_dequantized_experts_as_plain

        save_dequantized_experts_as_plain(model)
    if recipe.resolved_gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    from cptune.parallel.backends.attention import runs_samples_apart

    if recipe.sample_packing and runs_samples_apart(model.config.get_text_config()):
        from cptune.models.document_recurrence import enable_document_recurrence

        enable_document_recurrence(model)
    return model


def lora_config(recipe: Recipe) -> Any:
    """The adapter's peft config: the one saved in ``lora_model_dir``, or one built from the recipe."""
    from peft import LoraConfig

    if recipe.lora_model_dir is not None:
        return LoraConfig.from_pretrained(recipe.lora_model_dir)
    if recipe.lora_target_modules:
        targets: Any = list(recipe.lora_target_modules)
    else:
        # lora_target_linear, or nothing said: every linear layer except the output head.
        targets = "all-linear"
    return LoraConfig(
        r=recipe.lora_r,
        lora_alpha=recipe.lora_alpha,
        lora_dropout=recipe.lora_dropout,
        target_modules=targets,
        modules_to_save=list(recipe.lora_modules_to_save) if recipe.lora_modules_to_save else None,
        task_type="CAUSAL_LM",
    )


def apply_lora(model: Any, recipe: Recipe, *, load_weights: bool = True) -> Any:
    """Wrap ``model`` in a LoRA adapter as the recipe describes.

    Args:
        model: The base model.
        recipe: The recipe.
        load_weights: Load the trained weights of ``lora_model_dir`` when the recipe names one (a
            meta-device model for checks and sizing gets its shapes only).
    """
    from peft import PeftModel, get_peft_model

    try:
        if recipe.lora_model_dir is not None and load_weights:
            model = PeftModel.from_pretrained(model, recipe.lora_model_dir, is_trainable=True)
        else:
            model = get_peft_model(model, lora_config(recipe))
    except ValueError as err:
        from cptune.models.lora_targets import check_supported_module

        check_supported_module(err)
        raise CptuneError(f"lora_target_modules: {_first_line(err)}") from None
    if recipe.resolved_gradient_checkpointing:
        model.enable_input_require_grads()
    return model


def check_lora_model_dir(recipe: Recipe) -> None:
    """Refuse a ``lora_model_dir`` that holds no adapter."""
    if recipe.lora_model_dir is None:
        return
    folder = Path(recipe.lora_model_dir)
    if not (folder / "adapter_config.json").is_file():
        found = "does not exist" if not folder.exists() else "holds no adapter_config.json"
        raise CptuneError(
            f"lora_model_dir: '{folder}' {found}. Point it at the folder of a trained LoRA adapter (a run's "
            "output_dir or a checkpoint-N folder), or remove it to start a fresh adapter."
        )


def check_unfrozen_parameters(recipe: Recipe, config: Any) -> None:
    """Refuse, before any weight is loaded, a pattern of ``unfrozen_parameters`` that selects no parameter.

    The patterns are matched against the model built on PyTorch's ``meta`` device (every name, no memory).
    """
    if not recipe.unfrozen_parameters:
        return
    from cptune.models.freezing import freeze_all_but

    try:
        model = meta_model(recipe, config)
    except ValueError:
        return  # not a causal LM that transformers knows: load_model says so when it loads the model
    freeze_all_but(model, recipe.unfrozen_parameters)


def check_lora_targets(recipe: Recipe, config: Any) -> None:
    """Refuse ``lora_target_modules`` that name no module of the model, before any weight is loaded.

    The adapter is applied to a copy of the model on PyTorch's ``meta`` device (no memory, no
    weights), so a misspelt module name fails before launching instead of in every rank after the
    data was prepared and the weights loaded.

    Raises:
        CptuneError: peft finds no module of that name, one of the named targets adapts nothing
            (:mod:`cptune.models.lora_targets`), or a lora_modules_to_save name matches none.
    """
    if not (recipe.is_lora and (recipe.lora_target_modules or recipe.lora_modules_to_save)):
        return  # every linear layer: nothing a user named can be missing
    try:
        model = meta_model(recipe, config)
    except ValueError:
        return  # not a causal LM that transformers knows: load_model says so when it loads the model
    packed_experts = recipe.quantize_moe_experts and recipe.load_in_4bit
    if packed_experts:
        from cptune.models.expert_quantization import parametrize_like_packed

        # The packed experts take no adapter: a target that names only them matches nothing.
        parametrize_like_packed(model)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in recipe.lora_modules_to_save or () if m not in names]
    if missing:
        raise CptuneError(
            f"lora_modules_to_save: the model has no module named {', '.join(repr(m) for m in missing)}. Name "
            "modules by their last name, e.g. embed_tokens and lm_head for the embeddings of Llama-style models."
        )
    adapted = apply_lora(model, recipe, load_weights=False)
    if recipe.lora_target_modules and recipe.lora_model_dir is None:
        from cptune.models.lora_targets import check_every_target_matched

        check_every_target_matched(adapted, recipe.lora_target_modules, packed_experts)


def meta_model(recipe: Recipe, config: Any) -> Any:
    """The recipe's model built from ``config`` on PyTorch's ``meta`` device: every shape, no memory, no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.trust_remote_code)


def trainable_parameter_count(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
