"""Private upstream members that cptune's subclasses override or call, checked like patches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from packaging.specifiers import SpecifierSet

from cptune.patches.core import PatchPlan, PatchProblem, _check_requirements, _check_target
from cptune.patches.targets import Target


@dataclass(frozen=True, eq=False)
class Override:
    """A private member of an upstream class that a cptune subclass overrides or calls.

    Python's subclassing installs it, not a :class:`PatchSet`, but it leans on upstream code
    exactly as a patch does, so it is declared the same way and checked with the same checks
    (:func:`check_overrides`): the versions it was written for, and the parameters it relies on.

    Attributes:
        name: ``Subclass.member``, e.g. ``"CptuneTrainer._save_checkpoint"``.
        target: The upstream member (``"module:Class.member"``).
        reason: Why cptune relies on it; its first line is the summary.
        remove_when: The supported extension point that would replace it.
        requires: Distribution name → PEP 440 specifier it was written for.
        signature: Parameter names the upstream member must accept.
    """

    name: str
    target: str
    reason: str
    remove_when: str
    requires: Mapping[str, str] = field(default_factory=dict)
    signature: tuple[str, ...] | None = None
    create: bool = field(default=False, init=False)  # read by the target check: the member must exist
    parsed_target: Target = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parsed_target", Target.parse(self.target))
        for spec in self.requires.values():
            SpecifierSet(spec)  # a malformed definition is a cptune bug: fail at construction
        object.__setattr__(self, "requires", MappingProxyType(dict(self.requires)))

    @property
    def summary(self) -> str:
        """The first line of :attr:`reason`."""
        return self.reason.strip().splitlines()[0] if self.reason.strip() else ""


def check_overrides(overrides: Sequence[Override]) -> PatchPlan:
    """The patch checks (versions, target, parameters) for each override: a plan with nothing to apply.

    ``check_overrides(o).raise_for_problems()`` fails as a patch set's plan would.
    """
    problems = [
        PatchProblem(override.name, override.target, message)
        for override in overrides
        for message in _check_requirements(override) + _check_target(override)
    ]
    return PatchPlan((), (), tuple(problems))
