"""Checked, reversible patches of upstream libraries.

A :class:`Patch` describes one replacement of an object inside transformers,
accelerate or another library: where it lives, which versions it was written
for, which parameters it relies on, why it exists and when it can go. A
:class:`PatchSet` turns a list of them into a :class:`PatchPlan` for a recipe
(no side effects, every incompatibility reported at once), applies the plan all
or nothing, and reverts it in reverse order, putting back the very objects it
found. Nothing here touches any library until ``apply`` is called.

Vocabulary: the *target* is the place (``"module:Dotted.attr"`` or
``"module:dotted.mapping['key']"``); the *original* is the object found there;
the *replacement* is the factory that builds what gets installed.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from cptune.errors import PatchError
from cptune.patches.targets import MISSING, Slot, Target, resolve

logger = logging.getLogger("cptune.patches")
IMPORT_TIME_LOG = "cptune.patches.import_time"
"""The logger of the patches applied around a library's import alone (a backend's ``import_patches``):
cptune's launcher lists them once, so its ranks, which import the library again, keep them quiet."""


Predicate = Callable[[Any], bool]
"""When a patch applies, given the recipe (give it a readable ``str`` or ``__name__``)."""


def always(recipe: Any) -> bool:
    """Default predicate: the patch applies to every recipe."""
    return True


@dataclass(frozen=True)
class ContextParallelWith:
    """Predicate: ``context_parallel_size > 1`` and ``cp_backend`` in ``backends``.

    With ``plain_ddp``, also no FSDP2 sharding of the model states (``fsdp_version`` unset).
    An object rather than a lambda so that ``cptune validate`` can print the condition.
    """

    backends: tuple[str, ...]
    plain_ddp: bool = False

    def __call__(self, recipe: Any) -> bool:
        if self.plain_ddp and getattr(recipe, "is_fsdp", False):
            return False
        return recipe.context_parallel_size > 1 and recipe.cp_backend in self.backends

    def __str__(self) -> str:
        text = f"context_parallel_size > 1 and cp_backend in ({', '.join(self.backends)})"
        return text + " and no fsdp_version" if self.plain_ddp else text


@dataclass(frozen=True)
class WithoutCuda:
    """Predicate: ``inner`` holds and this machine has no CUDA GPU (for patches that only CPU runs need).

    A GPU node's ranks train on CUDA tensors, where upstream code has its own handling; a CPU-only
    patch there would be applied for nothing, and its version gate would refuse a torch it was not
    written for.
    """

    inner: Predicate

    def __call__(self, recipe: Any) -> bool:
        import torch

        return self.inner(recipe) and not torch.cuda.is_available()

    def __str__(self) -> str:
        return f"{self.inner} on a machine without a CUDA GPU"


@dataclass(frozen=True)
class ShardsModelStates:
    """Predicate: the recipe shards model states with FSDP2 (``fsdp_version: 2``)."""

    def __call__(self, recipe: Any) -> bool:
        return bool(getattr(recipe, "is_fsdp", False))

    def __str__(self) -> str:
        return "fsdp_version: 2"


class SplitsTensors:
    """Predicate: the recipe splits weights over tensor-parallel ranks (``tensor_parallel_size`` > 1)."""

    def __call__(self, recipe: Any) -> bool:
        return int(getattr(recipe, "tensor_parallel_size", 1) or 1) > 1

    def __str__(self) -> str:
        return "tensor_parallel_size > 1"


@dataclass(frozen=True, eq=False)
class Patch:
    """One reversible replacement of an object inside an upstream library.

    Attributes:
        name: Short id used in logs and plans, e.g. ``"trainer-cp-inputs-noop"``.
        target: Where the object lives; see :class:`Target`.
        replacement: Factory called with the original object (the raw object as
            stored in the owner's namespace, so a ``staticmethod``/``property``
            arrives as such, or :data:`MISSING`); returns what gets installed.
        reason: Why the patch exists, citing upstream code. Its first line is the
            short summary used in logs and plans.
        remove_when: The condition under which the patch can be deleted.
        requires: Distribution name → PEP 440 specifier the patch was written for.
        signature: Parameter names the original callable must accept.
        applies_to: Predicate on the recipe; give it a readable ``str`` or name.
        create: The target may be absent; it is then created and deleted on revert.
    """

    name: str
    target: str
    replacement: Callable[[Any], Any]
    reason: str
    remove_when: str
    requires: Mapping[str, str] = field(default_factory=dict)
    signature: tuple[str, ...] | None = None
    applies_to: Callable[[Any], bool] = always
    create: bool = False
    parsed_target: Target = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Malformed definitions are cptune bugs, so they fail at construction time, not at plan time.
        object.__setattr__(self, "parsed_target", Target.parse(self.target))
        for dist, spec in self.requires.items():
            try:
                SpecifierSet(spec)
            except InvalidSpecifier as exc:
                raise ValueError(f"patch {self.name}: bad specifier {spec!r} for {dist}") from exc
        object.__setattr__(self, "requires", MappingProxyType(dict(self.requires)))

    @property
    def summary(self) -> str:
        """The first line of :attr:`reason`."""
        return self.reason.strip().splitlines()[0] if self.reason.strip() else ""


@dataclass(frozen=True)
class PatchProblem:
    """One incompatibility between a patch and the installed libraries."""

    patch: str
    target: str
    message: str

    def __str__(self) -> str:
        return f"{self.patch} ({self.target}): {self.message}"


@dataclass(frozen=True)
class SkippedPatch:
    """A patch the recipe does not need, with the condition it failed."""

    patch: Patch
    why: str


@dataclass(frozen=True)
class PatchPlan:
    """What :meth:`PatchSet.apply` would do for one recipe, computed without side effects."""

    selected: tuple[Patch, ...]
    skipped: tuple[SkippedPatch, ...]
    problems: tuple[PatchProblem, ...]

    @property
    def ok(self) -> bool:
        """True when every selected patch fits the installed libraries."""
        return not self.problems

    def describe(self) -> str:
        """Human-readable lines for ``cptune validate``: what is patched, what is skipped, and why."""
        lines = [f"patches: {len(self.selected)} to apply, {len(self.skipped)} not needed"]
        for patch in self.selected:
            lines.append(f"  apply {patch.name}: {patch.target}")
            lines.append(f"        why: {patch.summary}")
        for skipped in self.skipped:
            lines.append(f"  skip  {skipped.patch.name}: {skipped.patch.target} ({skipped.why})")
        if self.problems:
            lines.append("problems:")
            lines.extend(f"  - {problem}" for problem in self.problems)
        return "\n".join(lines)

    def raise_for_problems(self) -> None:
        """Raises one :class:`PatchError` listing every problem, if there is any."""
        if not self.problems:
            return
        count = len(self.problems)
        raise PatchError(
            f"cptune cannot patch the installed libraries ({count} problem{'s' if count != 1 else ''}):\n"
            + "\n".join(f"  - {problem}" for problem in self.problems)
            + "\nInstall the versions cptune pins in its pyproject.toml (for example "
            "`pip install -e .` in a fresh environment), or use a cptune release made for these versions."
        )


def _check_requirements(patch: Any) -> list[str]:
    """Version problems of a :class:`Patch` (or an :class:`~cptune.patches.overrides.Override`)."""
    messages = []
    for dist, spec in patch.requires.items():
        try:
            installed = metadata.version(dist)
        except metadata.PackageNotFoundError:
            messages.append(f"needs {dist}{spec}, which is not installed")
            continue
        try:
            fits = SpecifierSet(spec).contains(Version(installed), prereleases=True)
        except InvalidVersion:
            fits = False
        if not fits:
            messages.append(f"written for {dist}{spec}, but {dist} {installed} is installed")
    return messages


def _check_target(patch: Any, original: Any = MISSING) -> list[str]:
    """Checks the target of a :class:`Patch` (or an ``Override``) exists and has the expected parameters.

    ``original`` is given when this patch is installed already: the check must
    look at the object it replaced, not at cptune's own replacement.
    """
    if original is MISSING:
        try:
            original = resolve(patch.parsed_target).visible()
        except Exception as exc:  # an import can fail with anything; report it instead of crashing the plan
            return [f"target cannot be found: {type(exc).__name__}: {exc}"]
    if original is MISSING:
        return [] if patch.create else ["target does not exist"]
    if patch.signature is None:
        return []
    # The parameters that matter are those of the function inside a static/class method or property.
    function = original.fget if isinstance(original, property) else getattr(original, "__func__", original)
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return [f"expected a callable with parameters {patch.signature}, found {type(original).__name__}"]
    missing = [name for name in patch.signature if name not in parameters]
    if missing:
        return [
            f"signature drift: parameters {missing} are gone; "
            f"found ({', '.join(parameters)}), expected ({', '.join(patch.signature)})"
        ]
    return []


@dataclass(frozen=True, eq=False)
class _Installed:
    """What one applied patch changed, enough to undo it exactly."""

    patch: Patch
    slot: Slot
    saved: Any  # the slot's own raw object before install, or MISSING
    original: Any  # what the replacement factory received
    installed: Any


class PatchSet:
    """An ordered list of patches that are planned, applied and reverted together.

    The instance holds what it applied (no module-level state), so idempotence
    is per instance: applying the same set twice is a no-op, while two
    separate instances would stack their wrappers.
    """

    def __init__(self, patches: Sequence[Patch], log: logging.Logger = logger):
        """Holds ``patches`` (applied in this order), announcing each installed one on ``log``.

        Args:
            patches: The patches, in the order they are applied.
            log: Where each installed patch is announced (one ``patched ...`` line at info level).
        """
        names = [patch.name for patch in patches]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"duplicate patch names: {duplicates}")
        self.patches: tuple[Patch, ...] = tuple(patches)
        self._installed: list[_Installed] = []
        self._log = log

    @property
    def applied_patches(self) -> tuple[Patch, ...]:
        """The patches currently installed by this set, in order of installation."""
        return tuple(entry.patch for entry in self._installed)

    def plan(self, recipe: Any = None) -> PatchPlan:
        """Selects the patches the recipe needs and checks them against the installed libraries.

        Imports target modules but modifies nothing and calls no replacement factory.
        """
        selected, skipped, problems = [], [], []
        originals = {entry.patch.name: entry.original for entry in self._installed}
        for patch in self.patches:
            if not patch.applies_to(recipe):
                # Functions print their name, predicate objects their condition.
                when = getattr(patch.applies_to, "__name__", None) or str(patch.applies_to)
                skipped.append(SkippedPatch(patch, f"needs {when}"))
                continue
            selected.append(patch)
            target_messages = _check_target(patch, originals.get(patch.name, MISSING))
            for message in _check_requirements(patch) + target_messages:
                problems.append(PatchProblem(patch.name, patch.target, message))
        return PatchPlan(tuple(selected), tuple(skipped), tuple(problems))

    def apply(self, recipe: Any = None) -> PatchPlan:
        """Plans for ``recipe`` and installs the selected patches, all or nothing.

        Returns:
            The plan that was applied.

        Raises:
            PatchError: The plan has problems; nothing was touched.
            RuntimeError: This set is already applied with a different selection.
            Exception: Whatever a replacement factory or an install raised, after
                the patches installed so far were reverted.
        """
        plan = self.plan(recipe)
        plan.raise_for_problems()
        if self._installed:
            if self.applied_patches == plan.selected:
                return plan  # idempotent: already installed exactly this selection
            raise RuntimeError(
                f"patch set already applied with {[p.name for p in self.applied_patches]}; revert it before "
                f"applying {[p.name for p in plan.selected]}"
            )
        installed: list[_Installed] = []
        try:
            for patch in plan.selected:
                slot = resolve(patch.parsed_target)
                saved, original = slot.own(), slot.visible()
                new = patch.replacement(original)
                slot.write(new)
                installed.append(_Installed(patch, slot, saved, original, new))
        except BaseException:
            # All or nothing: undo what this call installed, newest first, then re-raise.
            for entry in reversed(installed):
                entry.slot.write(entry.saved)
            raise
        self._installed = installed
        # Logged only once everything is in, so a rolled-back apply leaves no misleading lines.
        for entry in installed:
            self._log.info("patched %s (%s): %s", entry.patch.target, entry.patch.name, entry.patch.summary)
        return plan

    def revert(self) -> None:
        """Restores every original object, newest patch first; a no-op when nothing is applied.

        Raises:
            PatchError: Some target no longer holds the object this set installed
                (someone patched over it). Nothing is reverted then, so the
                process keeps one consistent state instead of a half-undone one.
        """
        if not self._installed:
            return
        # Walk newest-first, simulating each restore, so two patches stacked on one slot check out.
        expected: dict[tuple[int, str, bool], Any] = {}
        foreign = []
        for entry in reversed(self._installed):
            key = (id(entry.slot.owner), entry.slot.name, entry.slot.is_item)
            current = expected[key] if key in expected else entry.slot.own()
            if current is not entry.installed:
                foreign.append(entry)
            expected[key] = entry.saved
        if foreign:
            targets = ", ".join(f"{entry.patch.target} ({entry.patch.name})" for entry in foreign)
            raise PatchError(
                f"cannot revert cptune's patches: {targets} was replaced by other code after cptune "
                "patched it. Nothing was reverted. Undo the other patch first (or stop applying it "
                "inside a cptune run) and revert again."
            )
        for entry in reversed(self._installed):
            entry.slot.write(entry.saved)
            logger.debug("reverted %s (%s)", entry.patch.target, entry.patch.name)
        self._installed = []

    @contextlib.contextmanager
    def applied(self, recipe: Any = None) -> Iterator[PatchPlan]:
        """Context manager: applies for ``recipe`` and always reverts on exit.

        If this set was already applied when the block was entered, the block
        neither applies nor reverts, so nested use leaves the outer one intact.
        """
        if self._installed:
            yield self.apply(recipe)
            return
        plan = self.apply(recipe)
        try:
            yield plan
        finally:
            self.revert()
