"""The recipe's keys of the model: which base model and tokenizer, from where."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ModelKeys(BaseModel):
    """Key group of :class:`~cptune.config.recipe.Recipe`: the base model and its tokenizer."""

    # --- model -----------------------------------------------------------
    base_model: str = Field(description="Local folder or hub id of the model to fine-tune.")
    tokenizer_config: str | None = Field(None, description="Tokenizer folder or hub id; default: base_model.")
    trust_remote_code: bool = Field(False, description="Allow code shipped with the model to run.")
    model_revision: str | None = Field(None, description="Hub revision of base_model.")
    overrides_of_model_config: dict[str, bool | int | float | str | None] | None = Field(
        None,
        description=(
            "Fields of the base model's config set before it is loaded (Axolotl's key), e.g. "
            "output_router_logits: true and router_aux_loss_coef: 0.02 for a mixture-of-experts model's router "
            "loss; each must be a field the config has."
        ),
    )

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_config or self.base_model
