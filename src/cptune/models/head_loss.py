"""The loss of a rank's shard: from the model's logits, or from its final hidden states and head in chunks.

:func:`logits_loss` is the plain path: the model computes the logits of every token and
:func:`cptune.parallel.loss.token_loss_sum` takes the cross-entropy. :class:`HeadLoss` (the
recipe's ``cut_cross_entropy`` / ``liger_fused_linear_cross_entropy``) never materialises
the logits: the model is asked for the logits of its last token only (``logits_to_keep``),
forward hooks keep the last decoder layer's output (the final norm's input) and make the final
norm compute the last token only, and :func:`cptune.parallel.loss.head_token_loss_sum` runs the
model's own final norm and head module chunk by chunk, recomputing each chunk in the backward.
The norm and the head are called as modules, so a LoRA adapter on ``lm_head``, tied
input/output embeddings and the hooks of FSDP2 or DeepSpeed on them behave as in the model's
forward. Each token's loss and gradient are those of the model's own forward (the same
operations per token); what the chunks sum in parts is the head's and a trained norm's weight
gradients and the loss sum.

The chunks run under the autocast of the model's forward (captured when the decoder returns):
the Trainer calls the loss outside autocast (accelerate wraps only the model's forward), and the
logits path runs the head inside it, so a LoRA adapter on ``lm_head`` computes in the same
precision either way.

What the model does to the head's output before returning it (Gemma 2's logit
soft-capping, Cohere's and Granite's logit scaling) is not reproduced: such models are
refused from their config (:func:`check_head_loss_supported`), and every step checks that
the one token of logits the model returned is exactly the head's output for that token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cptune.errors import CptuneError
from cptune.models.autocast_state import AutocastState
from cptune.parallel.loss import LOSS_CHUNK_ELEMENTS, Segments, head_token_loss_sum, token_loss_sum

# (model, model_kwargs, shift_labels[, segments=]) of one rank's shard -> (token loss sum, model outputs); with
# ``segments`` (cptune.parallel.loss.Segments) the sum per segment, a vector.
ShardLoss = Callable[..., tuple[torch.Tensor, Any]]

# Config attributes of transformers models that change the logits after the head (name -> no-op value).
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,  # Gemma 2/3: cap * tanh(logits / cap)
    "logit_scale": 1.0,  # Cohere: logits * scale
    "logits_scaling": 1.0,  # Granite: logits / scaling
    "output_multiplier": 1.0,
}


def logits_loss(
    model: torch.nn.Module,
    model_kwargs: dict[str, Any],
    shift_labels: torch.Tensor,
    segments: Segments | None = None,
):
    """Token loss sum from the model's full logits (the default); per segment with ``segments``."""
    outputs = model(**model_kwargs, use_cache=False)
    return token_loss_sum(outputs.logits, shift_labels, segments=segments), outputs


def check_head_loss_supported(config: Any, model_class: type | None) -> None:
    """Refuse a model whose logits are not its head's output, or whose forward cannot skip the logits.

    Raises:
        ValueError: with the reason, for the caller to name the recipe key.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name, neutral in LOGIT_TRANSFORMS.items():
        value = getattr(text, name, neutral)
        if value is not None and value != neutral:
            raise ValueError(
                f"{type(config).__name__} transforms the logits after its output layer ({name}: {value}), "
                "which the chunked loss does not reproduce"
            )
    if model_class is not None and "logits_to_keep" not in inspect.signature(model_class.forward).parameters:
        raise ValueError(
            f"{model_class.__name__}'s forward has no logits_to_keep, so it computes every logit"
        )


class HeadLoss:
    """Token loss sum from the final hidden states and the model's head, one chunk of tokens at a time.

    When the decoder ends with a final norm (its ``norm`` module, as Llama, Mistral, Qwen and Gemma
    have), the norm runs inside each chunk too: a hook hands the norm, in the model's forward, the
    last token only (the one the model's logits are for), and keeps the norm's input, the last
    layer's output, from which the chunks compute the loss. So the loss keeps nothing of the
    sequence's size but that input (the norm's fp32 copy, its output and their gradients are
    never whole). Without such a norm, the chunks start from the decoder's output.

    Args:
        chunk_elements: Most logits per chunk (:data:`cptune.parallel.loss.LOSS_CHUNK_ELEMENTS`).
        model: The model as built (a transformers causal LM, possibly wrapped by peft); the
            hooks go on its decoder, final norm and head, so the model may be wrapped further
            (DDP, DeepSpeed) afterwards.
    """

    def __init__(self, model: torch.nn.Module, chunk_elements: int = LOSS_CHUNK_ELEMENTS):
        self.chunk_elements = chunk_elements
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        check_head_loss_supported(base.config, type(base))
        self.head = base.get_output_embeddings()
        decoder = base.get_decoder()
        if self.head is None or decoder is None:
            raise ValueError(f"{type(base).__name__} has no output layer or decoder to compute the loss from")
        norm = getattr(decoder, "norm", None)
        self.norm: torch.nn.Module | None = norm if isinstance(norm, torch.nn.Module) else None
        self.vocab = base.config.get_text_config().vocab_size
        self._armed = False
        self._seen = _Seen()
        self._handles = [
            decoder.register_forward_hook(self._keep_hidden),
            self.head.register_forward_hook(self._keep_head_io),
        ]
        if self.norm is not None:
            self._handles += [
                self.norm.register_forward_pre_hook(self._narrow_norm),
                self.norm.register_forward_hook(self._keep_norm_output),
            ]

    def _keep_hidden(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._armed:
            self._seen.decoder_output = output[0] if isinstance(output, tuple) else output.last_hidden_state
            self._seen.autocast = AutocastState.capture(self._seen.decoder_output.device)

    def _keep_head_io(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._armed:
            self._seen.head_io = (args[0], output)

    def _narrow_norm(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        if not self._armed:
            return None
        (x,) = args
        self._seen.norm_calls += 1
        self._seen.norm_input = x
        # The model's logits are for its last token only (logits_to_keep=1): the norm computes that one.
        return (x[..., -1:, :],)

    def _keep_norm_output(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._armed:
            self._seen.norm_output = output

    def __call__(
        self,
        model: torch.nn.Module,
        model_kwargs: dict[str, Any],
        shift_labels: torch.Tensor,
        segments: Segments | None = None,
    ):
        self._armed, self._seen = True, _Seen()
        try:
            # The logits of one token only: what the model returns is checked against the head.
            outputs = model(**model_kwargs, use_cache=False, logits_to_keep=1)
        finally:
            self._armed = False
        seen, self._seen = self._seen, _Seen()
        self._check(outputs, seen)
        hidden = seen.decoder_output if self.norm is None else seen.norm_input
        with seen.autocast.entered():
            loss_sum = head_token_loss_sum(
                self.head,
                hidden,
                shift_labels,
                self.vocab,
                self.chunk_elements,
                norm=self.norm,
                segments=segments,
            )
        return loss_sum, outputs

    def _check(self, outputs: Any, seen: _Seen) -> None:
        if seen.decoder_output is None or seen.head_io is None:
            raise RuntimeError("the chunked loss did not see the model's decoder output or head call")
        if self.norm is not None and (seen.norm_calls != 1 or seen.norm_output is None):
            raise CptuneError(
                f"cut_cross_entropy: the decoder called its final norm {seen.norm_calls} times in one forward "
                "(the chunked loss runs it once per chunk, in place of the model's one call); remove "
                "cut_cross_entropy."
            )
        head_input, head_output = seen.head_io
        logits = outputs.logits
        if logits.shape[-2] != 1:
            raise CptuneError(
                f"cut_cross_entropy: the model ignored logits_to_keep and computed {logits.shape[-2]} tokens of "
                "logits, so the chunked loss saves no memory with it; remove cut_cross_entropy."
            )
        last = seen.decoder_output[..., -1:, :]
        if self.norm is not None and not torch.equal(seen.norm_output[..., -1:, :], last):
            raise CptuneError(
                "cut_cross_entropy: the decoder's output is not its final norm's output (it transforms the hidden "
                "states after the norm), which the chunked loss does not reproduce; remove cut_cross_entropy."
            )
        if not torch.equal(head_input, last) or not torch.equal(logits, head_output.to(logits.dtype)):
            raise CptuneError(
                "cut_cross_entropy: the model's logits are not its output layer applied to its decoder's output "
                "(it transforms the hidden states or the logits in between), which the chunked loss does not "
                "reproduce; remove cut_cross_entropy."
            )

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()


@dataclass
class _Seen:
    """What the hooks saw in one forward of the model."""

    decoder_output: torch.Tensor | None = None
    autocast: AutocastState | None = None
    head_io: tuple[torch.Tensor, torch.Tensor] | None = None
    norm_input: torch.Tensor | None = None
    norm_output: torch.Tensor | None = None
    norm_calls: int = 0
