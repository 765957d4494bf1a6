"""The recipe's keys of preference training (``rl: dpo``, ``ipo``, ``orpo``, ``simpo``), with Axolotl's names.

How a pair is trained under context parallelism: ``docs/preference-training.md`` and
:mod:`cptune.parallel.preference`.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

PREFERENCE_LOSSES = ("dpo", "ipo", "orpo", "simpo")
"""The ``rl`` values cptune trains."""

REFERENCE_FREE_LOSSES = ("orpo", "simpo")
"""The ``rl`` values whose loss reads no reference model (the policy's per-token mean log-probs only)."""

# Axolotl's other rl values, and what each would need (a reason, not a promise).
NOT_BUILT = {
    "kto": "KTO trains unpaired examples with a desirability label, which cptune's pair rows do not hold",
    "grpo": "GRPO generates completions during training, which cptune does not do",
}

DEFAULT_BETA = 0.1
"""β when neither rl_beta nor dpo_beta is set (TRL's default), and ORPO's λ without orpo_alpha."""

DEFAULT_SIMPO_GAMMA = 0.5
"""SimPO's target margin γ without simpo_gamma (TRL's CPOConfig default)."""

DEFAULT_CPO_ALPHA = 1.0
"""The weight of SimPO's NLL term without cpo_alpha (TRL's CPOConfig default, which Axolotl's rl: simpo keeps)."""


class PreferenceKeys(BaseModel):
    """Key group of :class:`~cptune.config.recipe.Recipe`: preference training instead of supervised fine-tuning."""

    # --- preference training -----------------------------------------------------
    rl: str | None = Field(
        None,
        description="Preference training on chosen/rejected pairs instead of supervised fine-tuning: `dpo` "
        "(DPO's sigmoid loss) or `ipo`, against a reference model (with adapter: lora or qlora, the base model "
        "with the adapter disabled); or `orpo` or `simpo`, which need no reference model "
        "(docs/preference-training.md). Axolotl's other values (kto, grpo) are refused.",
    )
    rl_beta: float | None = Field(
        None,
        gt=0,
        description="β of the preference loss (dpo, ipo: how far the policy may move from the reference; simpo: "
        "the scale of its rewards).",
    )
    dpo_beta: float | None = Field(None, gt=0, description="Axolotl's other name for rl_beta.")
    dpo_label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="rl: dpo: the share of pairs assumed mislabelled (conservative DPO: "
        "-(1-ε)·log σ(s) - ε·log σ(-s)); 0 is the plain sigmoid loss.",
    )

    orpo_alpha: float | None = Field(
        None,
        gt=0,
        description="rl: orpo: λ, the weight of the odds-ratio term added to the chosen side's NLL (TRL's "
        "ORPOConfig beta, default 0.1).",
    )
    simpo_gamma: float | None = Field(
        None,
        ge=0,
        description=f"rl: simpo: γ, the target margin of the rewards (default {DEFAULT_SIMPO_GAMMA}, TRL's).",
    )
    cpo_alpha: float | None = Field(
        None,
        ge=0,
        description="rl: simpo: the weight of the chosen side's NLL (mean per token) added to each pair's loss "
        f"(default {DEFAULT_CPO_ALPHA}, TRL's, as Axolotl runs it; 0 is SimPO's loss alone).",
    )

    precompute_ref_log_probs: bool = Field(
        False,
        description="Compute the reference's log-prob sums of every training pair in a first pass before training "
        "(the model as loaded), and train against them: no reference forward per step. Needed by a full "
        "fine-tune (no adapter to disable); allowed with LoRA. The sums are stored with the prepared data "
        "(dataset_prepared_path/<fingerprint>/reference_log_probs/), and a later or resumed run of the same data "
        "and base model reads them instead of running the pass again.",
    )

    def rl_refusal(self) -> str | None:
        """Why ``rl`` cannot be trained (an rl value not built, or not known); None for the built ones and unset."""
        if self.rl is None or self.rl in PREFERENCE_LOSSES:
            return None
        built = (
            ", ".join(f"rl: {name}" for name in PREFERENCE_LOSSES[:-1]) + f" or rl: {PREFERENCE_LOSSES[-1]}"
        )
        reason = NOT_BUILT.get(self.rl)
        if reason is None:
            return f"{self.rl!r} is not a preference loss cptune knows; use {built}"
        return f"{self.rl} is not built in cptune ({reason}); cptune trains {built}"

    @property
    def is_preference(self) -> bool:
        """The recipe trains preference pairs (``rl`` is set)."""
        return self.rl is not None

    @property
    def needs_reference(self) -> bool:
        """The loss compares the policy with a reference model (dpo, ipo; not orpo, simpo)."""
        return self.is_preference and self.rl not in REFERENCE_FREE_LOSSES

    @property
    def resolved_beta(self) -> float:
        """β (ORPO's λ): orpo_alpha with rl: orpo, else rl_beta, else dpo_beta, else TRL's default 0.1."""
        for value in (self.orpo_alpha, self.rl_beta, self.dpo_beta):
            if value is not None:
                return value
        return DEFAULT_BETA

    @property
    def resolved_simpo_gamma(self) -> float:
        return DEFAULT_SIMPO_GAMMA if self.simpo_gamma is None else self.simpo_gamma

    @property
    def resolved_cpo_alpha(self) -> float:
        return DEFAULT_CPO_ALPHA if self.cpo_alpha is None else self.cpo_alpha
