"""``cptune inference``: try the trained model, with prompts in the format it was trained on.

The model is the recipe's base model with the trained LoRA adapter (or a full
model a run saved), in one process, on the GPU when there is one and else on the
CPU. Prompts are built by :class:`cptune.data.prompts.Prompter` from the format
of the recipe's first dataset, so they are token for token what training put
before an answer. Generation is greedy unless ``do_sample`` is set; the sampling
options are transformers' ``generate`` options of the same names, and tokens are
streamed to the terminal as they come (``TextStreamer``). ``score`` gives the
log-likelihood of a given completion instead of generating.

Everything that can be refused (options, the weights folder, prompt lengths) is
checked before the weights are loaded.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from cptune.config.recipe import Recipe
from cptune.data.prompts import Prompter, PromptItem, prepare_prompt, prompt_items
from cptune.errors import CptuneError
from cptune.models.loading import load_tokenizer
from cptune.run.commands.weights import (
    ADAPTER_CONFIG,
    MODEL_CONFIG,
    ModelSource,
    load_source_model,
    model_source,
)

log = logging.getLogger("cptune.inference")

__all__ = [
    "Generated",
    "GenerationOptions",
    "InferenceSession",
    "Score",
    "check_options",
    "context_length",
    "generate",
    "load_inference_model",
    "prompter_for",
    "run_inference",
    "score",
    "weights_source",
]


@dataclass(frozen=True)
class GenerationOptions:
    """transformers ``generate`` options; None leaves transformers' default."""

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


@dataclass(frozen=True)
class Generated:
    """One answer: the prompt's tokens, the generated tokens, and their text (special tokens left out)."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str


@dataclass(frozen=True)
class Score:
    """Log-likelihood (natural log) of a completion's tokens given its prompt."""

    log_likelihood: float
    tokens: int

    def format(self) -> str:
        mean = self.log_likelihood / self.tokens if self.tokens else float("nan")
        return (
            f"log-likelihood {self.log_likelihood:.4f} over {self.tokens} completion tokens "
            f"(mean {mean:.4f} per token)"
        )


def check_options(options: GenerationOptions) -> None:
    """Refuse sampling options without ``--do-sample`` (greedy decoding would ignore them)."""
    given = [
        f"--{name.replace('_', '-')}"
        for name in ("temperature", "top_p", "top_k")
        if getattr(options, name) is not None
    ]
    if given and not options.do_sample:
        raise CptuneError(
            f"{', '.join(given)}: sampling options apply only with --do-sample; without it generation is "
            "greedy and ignores them. Add --do-sample, or leave them out."
        )
    if options.max_new_tokens < 1:  # the CLI refuses it as a bad option value
        raise ValueError(f"max_new_tokens must be 1 or more, got {options.max_new_tokens}")


def weights_source(recipe: Recipe, checkpoint: str | Path | None, base: bool) -> ModelSource:
    """The weights to use: ``--base``, ``--checkpoint``, or by default what the run saved in output_dir."""
    if base and checkpoint is not None:
        raise CptuneError(
            "--base and --checkpoint: give one of them (--base uses the base model alone, --checkpoint "
            "a trained adapter or model)."
        )
    if base:
        return ModelSource("base")
    if checkpoint is None:
        out = Path(recipe.output_dir)
        if not ((out / ADAPTER_CONFIG).is_file() or (out / MODEL_CONFIG).is_file()):
            raise CptuneError(
                f"inference: output_dir '{out}' holds no trained adapter or model yet. Train first "
                "(cptune train), pass --checkpoint with a folder that holds one, or --base to try the "
                "base model alone."
            )
        checkpoint = out
    return model_source(checkpoint)


def prompter_for(recipe: Recipe, tokenizer: Any) -> Prompter:
    """Prompts in the format of the recipe's first dataset."""
    return Prompter(
        recipe.datasets[0], tokenizer, recipe.chat_template, recipe.chat_template_jinja, recipe.eot_tokens
    )


def context_length(recipe: Recipe, source: ModelSource) -> int | None:
    """The model's context (``max_position_embeddings``), read from its config alone."""
    from transformers import AutoConfig

    path = str(source.path) if source.kind == "full" else recipe.base_model
    config = AutoConfig.from_pretrained(path, trust_remote_code=recipe.trust_remote_code)
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def load_inference_model(recipe: Recipe, source: ModelSource, tokenizer: Any) -> Any:
    """The model to generate with, in eval mode, with a KV cache, on the GPU if there is one.

    ``tokenizer`` is the recipe's (with the tokens it adds, whose embeddings training grew).
    """
    model = load_source_model(recipe, source, None, tokenizer)  # transformers' own attention
    # Training turned the KV cache off (see load_model); generation wants it.
    model.config.use_cache = True
    if not recipe.causal:
        log.warning(
            "the recipe trains with bidirectional attention (causal: false); generation runs with the "
            "model's own causal attention."
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device).eval()


def generate(
    model: Any,
    tokenizer: Any,
    prompt_ids: list[int],
    options: GenerationOptions,
    *,
    stops: list[int],
    stream: bool,
) -> Generated:
    """Generate an answer to ``prompt_ids`` (streamed to stdout when ``stream``)."""
    from transformers import GenerationConfig, TextStreamer

    # Output rows that no token has (resize_token_embeddings_to_32x's padding, a vocab_size with spare
    # rows) are never generated.
    rows = model.get_output_embeddings().weight.shape[0]
    unused = sorted(set(range(rows)) - set(tokenizer.get_vocab().values()) - set(stops))
    config = GenerationConfig(
        max_new_tokens=options.max_new_tokens,
        do_sample=options.do_sample,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
        suppress_tokens=unused or None,
        **{
            name: getattr(options, name)
            for name in ("temperature", "top_p", "top_k")
            if getattr(options, name) is not None
        },
    )
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids], device=device)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            streamer=streamer,
        )
    output_ids = out[0, len(prompt_ids) :].tolist()
    return Generated(prompt_ids, output_ids, tokenizer.decode(output_ids, skip_special_tokens=True))


def score(model: Any, input_ids: list[int], scored: list[int]) -> Score:
    """Sum of log p(token | everything before it) over the positions ``scored``."""
    if not scored or scored[0] < 1:
        raise ValueError(f"positions to score must be 1 or more, got {scored}")
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([input_ids], device=device)).logits[0].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    positions = torch.tensor(scored, device=device)
    targets = torch.tensor([input_ids[i] for i in scored], device=device)
    # The logits at position i - 1 predict token i.
    total = log_probs[positions - 1, targets].sum()
    return Score(float(total), len(scored))


class InferenceSession:
    """The weights, tokenizer and prompt format of a recipe, for many prompts; the model loads on first use.

    Args:
        recipe: The recipe the model was trained with (its base model, data format, chat template).
        checkpoint: A folder with a LoRA adapter or a full model; default: ``output_dir``.
        base: Use the base model alone.

    Raises:
        CptuneError: ``checkpoint`` (or ``output_dir``) holds no usable adapter or model.
    """

    def __init__(self, recipe: Recipe, *, checkpoint: str | Path | None = None, base: bool = False):
        self.recipe = recipe
        self.source = weights_source(recipe, checkpoint, base)
        self.tokenizer = load_tokenizer(recipe)
        # Prompts are checked against the model's context here (prepare_prompt), with a clear error;
        # the tokenizer's own warning about its model_max_length would only add noise before it.
        self.tokenizer.model_max_length = sys.maxsize
        self.prompter = prompter_for(recipe, self.tokenizer)
        self.context = context_length(recipe, self.source)
        self._model: Any = None

    @property
    def model(self) -> Any:
        return self._loaded_model(scoring=False)

    def _loaded_model(self, *, scoring: bool) -> Any:
        # The line says what the first use does with the weights: a --score run generates nothing.
        if self._model is None:
            self._model = load_inference_model(self.recipe, self.source, self.tokenizer)
            log.info("%s with %s", "scoring" if scoring else "generating", self.source.describe(self.recipe))
        return self._model

    def run(
        self,
        *,
        prompt: str | None = None,
        prompts: str | Path | None = None,
        completion: str | None = None,
        options: GenerationOptions = GenerationOptions(),
        stdin: Iterable[str] = (),
        stream: bool = True,
        echo: Any = print,
        seed: int | None = None,
    ) -> list[Generated | Score]:
        """Generate an answer to (or score ``completion`` after) every prompt.

        Prompts given by ``prompt`` or ``prompts`` are all built and checked before the weights
        load; prompts read from ``stdin`` are answered as they come.

        Args:
            prompt: One prompt.
            prompts: A file of prompts (see :func:`prompt_items`).
            completion: Score this completion after each prompt instead of generating.
            options: Generation options.
            stdin: Prompt lines when neither ``prompt`` nor ``prompts`` is given.
            stream: Stream the generated text to stdout.
            echo: Prints lines (a prompt's heading, scores, answers when not streamed).
            seed: Seeds sampling (with ``options.do_sample``); default: the recipe's seed.

        Returns:
            One :class:`Generated` (or :class:`Score`, with ``completion``) per prompt.
        """
        check_options(options)
        items: Iterable[PromptItem] = prompt_items(self.prompter, prompt, prompts, stdin)
        from_file = prompts is not None
        if prompt is not None or from_file:
            items = [prepare_prompt(item, self.prompter, completion, self.context).item for item in items]
        model = self._loaded_model(scoring=completion is not None)
        stops = self.prompter.stop_token_ids()
        if options.do_sample:
            from transformers import set_seed

            set_seed(self.recipe.seed if seed is None else seed)
        results: list[Generated | Score] = []
        for item in items:
            prepared = prepare_prompt(item, self.prompter, completion, self.context)
            if from_file:
                echo(f">>> {item.shown}")
            if prepared.scored is not None:
                result: Generated | Score = score(model, prepared.input_ids, prepared.scored)
                echo(result.format())
            else:
                room = options.max_new_tokens
                if self.context is not None:
                    room = min(room, self.context - len(prepared.input_ids))
                result = generate(
                    model,
                    self.tokenizer,
                    prepared.input_ids,
                    replace(options, max_new_tokens=room),
                    stops=stops,
                    stream=stream,
                )
                if not stream:
                    echo(result.text)
            results.append(result)
        return results


def run_inference(
    recipe: Recipe, *, checkpoint: str | Path | None = None, base: bool = False, **run: Any
) -> list[Generated | Score]:
    """``cptune inference``: :meth:`InferenceSession.run` on a new session (options checked first)."""
    check_options(run.get("options", GenerationOptions()))
    return InferenceSession(recipe, checkpoint=checkpoint, base=base).run(**run)
