"""The loss of a rank's shard: from the model's logits, or from its final hidden states and head in chunks.

:func:`logits_loss` is the plain path: the model computes the logits of every token and
:func:`cptune.parallel.loss.token_loss_sum` takes the cross-entropy. :class:`HeadLoss` (the
recipe's ``cut_cross_entropy`` / ``liger_fused_linear_cross_entropy``) never materialises
the logits: the model is asked for the logits of its last token only (``logits_to_keep``),
a forward hook on the decoder keeps the final hidden states, and
:func:`cptune.parallel.loss.head_token_loss_sum` projects them through the model's own head
module chunk by chunk, recomputing each chunk in the backward. The head is called as a
module, so a LoRA adapter on ``lm_head``, tied input/output embeddings and the hooks of
FSDP2 or DeepSpeed on it behave as in the model's forward.

What the model does to the head's output before returning it (Gemma 2's logit
soft-capping, Cohere's and Granite's logit scaling) is not reproduced: such models are
refused from their config (:func:`check_head_loss_supported`), and every step checks that
the one token of logits the model returned is exactly the head's output for that token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from cptune.errors import CptuneError
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

    Args:
        chunk_elements: Most logits per chunk (:data:`cptune.parallel.loss.LOSS_CHUNK_ELEMENTS`).
        model: The model as built (a transformers causal LM, possibly wrapped by peft); the
            hooks go on its decoder and head, so the model may be wrapped further (DDP,
            DeepSpeed) afterwards.
    """

    def __init__(self, model: torch.nn.Module, chunk_elements: int = LOSS_CHUNK_ELEMENTS):
        self.chunk_elements = chunk_elements
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        check_head_loss_supported(base.config, type(base))
        self.head = base.get_output_embeddings()
        decoder = base.get_decoder()
        if self.head is None or decoder is None:
            raise ValueError(f"{type(base).__name__} has no output layer or decoder to compute the loss from")
        self.vocab = base.config.get_text_config().vocab_size
        self._armed = False
        self._hidden: torch.Tensor | None = None
        self._head_io: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handles = [
            decoder.register_forward_hook(self._keep_hidden),
            self.head.register_forward_hook(self._keep_head_io),
        ]

    def _keep_hidden(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._armed:
            self._hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def _keep_head_io(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._armed:
            self._head_io = (args[0], output)

    def __call__(
        self,
        model: torch.nn.Module,
        model_kwargs: dict[str, Any],
        shift_labels: torch.Tensor,
        segments: Segments | None = None,
    ):
        self._armed, self._hidden, self._head_io = True, None, None
        try:
            # The logits of one token only: what the model returns is checked against the head.
            outputs = model(**model_kwargs, use_cache=False, logits_to_keep=1)
        finally:
            self._armed = False
        hidden, head_io = self._hidden, self._head_io
        self._hidden = self._head_io = None
        self._check(outputs, hidden, head_io)
        loss_sum = head_token_loss_sum(
            self.head, hidden, shift_labels, self.vocab, self.chunk_elements, segments=segments
        )
        return loss_sum, outputs

    def _check(self, outputs: Any, hidden: torch.Tensor | None, head_io: tuple | None) -> None:
        if hidden is None or head_io is None:
            raise RuntimeError("the chunked loss did not see the model's decoder output or head call")
        head_input, head_output = head_io
        logits = outputs.logits
        if logits.shape[-2] != 1:
            raise CptuneError(
                f"cut_cross_entropy: the model ignored logits_to_keep and computed {logits.shape[-2]} tokens of "
                "logits, so the chunked loss saves no memory with it; remove cut_cross_entropy."
            )
        if not torch.equal(head_input, hidden[..., -1:, :]) or not torch.equal(
            logits, head_output.to(logits.dtype)
        ):
            raise CptuneError(
                "cut_cross_entropy: the model's logits are not its output layer applied to its decoder's output "
                "(it transforms the hidden states or the logits in between), which the chunked loss does not "
                "reproduce; remove cut_cross_entropy."
            )

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
