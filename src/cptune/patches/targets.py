"""Where a patch target lives, and how to read and write it without side effects.

A target is ``"module:Dotted.attr"`` (an attribute reached from a module) or
``"module:dotted.mapping['key']"`` (a key of a mapping reached the same way).
:func:`resolve` imports the module and walks to the :class:`Slot`; a slot reads
the raw object stored there (a ``staticmethod`` stays a ``staticmethod``) and
writes or deletes exactly that, so a revert puts back the very object it found.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import MutableMapping
from dataclasses import dataclass
from enum import Enum
from typing import Any


class _Missing(Enum):
    """Type of :data:`MISSING`; an enum so the sentinel is a typed singleton."""

    MISSING = "MISSING"


MISSING = _Missing.MISSING
"""Passed to a replacement factory when a ``create=True`` target does not exist yet."""


_TARGET_RE = re.compile(
    r"^(?P<module>[A-Za-z_][\w.]*):(?P<path>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
    r"(?:\[(?P<key>'[^']*'|\"[^\"]*\")\])?$"
)


@dataclass(frozen=True)
class Target:
    """A parsed target: a module, a dotted attribute path from it and an optional mapping key."""

    module: str
    path: tuple[str, ...]
    key: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Target:
        """Parses ``"pkg.mod:Class.attr"`` or ``"pkg.mod:dotted.mapping['key']"``.

        Raises:
            ValueError: ``spec`` has neither form (a bug in the patch definition).
        """
        match = _TARGET_RE.match(spec)
        if match is None:
            raise ValueError(
                f"patch target {spec!r} must look like 'pkg.module:Qualified.attr' "
                "or 'pkg.module:dotted.mapping[\"key\"]'"
            )
        key = match["key"]
        return cls(match["module"], tuple(match["path"].split(".")), ast.literal_eval(key) if key else None)


@dataclass(frozen=True, eq=False)
class Slot:
    """A resolved place: attribute ``name`` of ``owner``, or key ``name`` of the mapping ``owner``."""

    owner: Any
    name: str
    is_item: bool

    def own(self) -> Any:
        """The raw object stored directly in the owner's namespace, or MISSING."""
        if self.is_item:
            return self.owner.get(self.name, MISSING)
        namespace = getattr(self.owner, "__dict__", None)
        if namespace is None:  # __slots__ objects: no raw namespace to look into
            return getattr(self.owner, self.name, MISSING)
        return namespace.get(self.name, MISSING)

    def visible(self) -> Any:
        """What the replacement factory receives: the own object, else an inherited raw one."""
        if self.is_item:
            return self.owner.get(self.name, MISSING)
        if isinstance(self.owner, type):
            # getattr_static walks the MRO without invoking descriptors, so a staticmethod,
            # classmethod or property arrives as the object stored in the class __dict__.
            return inspect.getattr_static(self.owner, self.name, MISSING)
        # Modules and instances: plain getattr so a lazy module (transformers' _LazyModule)
        # can resolve the name; the raw object is then in its __dict__.
        value = getattr(self.owner, self.name, MISSING)
        own = self.own()
        return value if own is MISSING else own

    def write(self, value: Any) -> None:
        """Stores ``value`` as is; MISSING deletes what the owner holds (nothing inherited is touched)."""
        if value is MISSING:
            if self.own() is not MISSING:
                if self.is_item:
                    del self.owner[self.name]
                else:
                    delattr(self.owner, self.name)
        elif self.is_item:
            self.owner[self.name] = value
        else:
            setattr(self.owner, self.name, value)


def resolve(target: Target) -> Slot:
    """Imports the target's module and walks to the slot; raises LookupError/ImportError on failure."""
    owner: Any = importlib.import_module(target.module)
    for depth, part in enumerate(target.path[:-1], start=1):
        if not hasattr(owner, part):
            raise LookupError(f"{target.module}:{'.'.join(target.path[:depth])} does not exist")
        owner = getattr(owner, part)
    last = target.path[-1]
    if target.key is None:
        return Slot(owner, last, is_item=False)
    mapping = getattr(owner, last, MISSING)
    if not isinstance(mapping, MutableMapping):
        raise LookupError(f"{target.module}:{'.'.join(target.path)} is not a mutable mapping")
    return Slot(mapping, target.key, is_item=True)
