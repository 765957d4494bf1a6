"""The recipe's keys of preference training (``rl: dpo``, ``rl: ipo``), with Axolotl's names.

How a pair is trained under context parallelism: ``docs/preference-training.md`` and
:mod:`cptune.parallel.preference`.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

PREFERENCE_LOSSES = ("dpo", "ipo")
"""The ``rl`` values cptune trains."""

# Axolotl's other rl values, and what each would need (a reason, not a promise).
NOT_BUILT = {
    "kto": "KTO trains unpaired examples with a desirability label, which cptune's pair rows do not hold",
    "grpo": "GRPO generates completions during training, which cptune does not do",
    "orpo": "ORPO adds an odds-ratio term to the SFT loss of the chosen side, which is not built yet",
    "simpo": "SimPO's reference-free, length-normalised loss is not built yet",
}

DEFAULT_BETA = 0.1
"""β when neither rl_beta nor dpo_beta is set (TRL's default)."""


class PreferenceKeys(BaseModel):
    """Key group of :class:`~cptune.config.recipe.Recipe`: preference training instead of supervised fine-tuning."""

    # --- preference training -----------------------------------------------------
    rl: str | None = Field(
        None,
        description="Preference training on chosen/rejected pairs instead of supervised fine-tuning: `dpo` "
        "(DPO's sigmoid loss) or `ipo`; with adapter: lora or qlora, the reference is the base model with the "
        "adapter disabled (docs/preference-training.md). Axolotl's other values (kto, grpo, orpo, simpo) are "
        "refused.",
    )
    rl_beta: float | None = Field(
        None, gt=0, description="β of the preference loss (how far the policy may move from the reference)."
    )
    dpo_beta: float | None = Field(None, gt=0, description="Axolotl's other name for rl_beta.")
    dpo_label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="rl: dpo: the share of pairs assumed mislabelled (conservative DPO: "
        "-(1-ε)·log σ(s) - ε·log σ(-s)); 0 is the plain sigmoid loss.",
    )

    precompute_ref_log_probs: bool = Field(
        False,
        description="Compute the reference's log-prob sums of every training pair in a first pass before training "
        "(the model as loaded), and train against them: no reference forward per step. Needed by a full "
        "fine-tune (no adapter to disable); allowed with LoRA.",
    )

    def rl_refusal(self) -> str | None:
        """Why ``rl`` cannot be trained (an rl value not built, or not known); None for dpo, ipo and unset."""
        if self.rl is None or self.rl in PREFERENCE_LOSSES:
            return None
        built = " or ".join(f"rl: {name}" for name in PREFERENCE_LOSSES)
        reason = NOT_BUILT.get(self.rl)
        if reason is None:
            return f"{self.rl!r} is not a preference loss cptune knows; use {built}"
        return f"{self.rl} is not built in cptune ({reason}); cptune trains {built}"

    @property
    def is_preference(self) -> bool:
        """The recipe trains preference pairs (``rl`` is set)."""
        return self.rl is not None

    @property
    def resolved_beta(self) -> float:
        """β: rl_beta, else dpo_beta, else TRL's default 0.1."""
        for value in (self.rl_beta, self.dpo_beta):
            if value is not None:
                return value
        return DEFAULT_BETA
