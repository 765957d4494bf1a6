"""The recipe's keys of the model: which base model and tokenizer, from where."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

# Axolotl's other name for a key of this group -> cptune's name (Axolotl accepts both).
AXOLOTL_OTHER_NAMES = {"revision_of_model": "model_revision", "model_config": "overrides_of_model_config"}


class ModelKeys(BaseModel):
    """Key group of :class:`~cptune.config.recipe.Recipe`: the base model and its tokenizer."""

    # --- model -----------------------------------------------------------
    base_model: str = Field(description="Local folder or hub id of the model to fine-tune.")
    tokenizer_config: str | None = Field(None, description="Tokenizer folder or hub id; default: base_model.")
    trust_remote_code: bool = Field(False, description="Allow code shipped with the model to run.")
    model_revision: str | None = Field(
        None, description="Hub revision of base_model (branch, tag or commit); Axolotl's revision_of_model."
    )
    low_cpu_mem_usage: bool = Field(
        True,
        description="Accepted for Axolotl recipes: transformers 5 always loads the weights without a second copy "
        "in CPU memory (it ignores the argument), so true and false load alike.",
    )
    overrides_of_model_config: dict[str, bool | int | float | str | None] | None = Field(
        None,
        description=(
            "Fields of the base model's config set before it is loaded (Axolotl's key; also read under its other "
            "name, model_config), e.g. "
            "output_router_logits: true and router_aux_loss_coef: 0.02 for a mixture-of-experts model's router "
            "loss; each must be a field the config has."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _axolotl_names(cls, data: Any) -> Any:
        # Axolotl's schema takes each of these keys under two names (a field and its alias). Both names with
        # different values stay as they are, and the other name is refused as such (cptune.config.axolotl.keys).
        if not isinstance(data, dict):
            return data
        for other, ours in AXOLOTL_OTHER_NAMES.items():
            if data.get(other) is None or data.get(ours) not in (None, data[other]):
                continue
            data = {**{k: v for k, v in data.items() if k != other}, ours: data[other]}
        return data

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer_config or self.base_model
