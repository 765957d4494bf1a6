"""Load a recipe from YAML plus command-line overrides into a :class:`Recipe`.

Every problem is reported at once, each with its key path (``datasets[0].type``),
as one :class:`~cptune.errors.RecipeError`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from cptune.config.adapter import BnbConfig, Mxfp4Options
from cptune.config.axolotl.keys import (
    NO_COUNTERPART,
    UNSUPPORTED_DATASET_KEYS,
    UNSUPPORTED_FSDP_KEYS,
    UNSUPPORTED_RECIPE_KEYS,
)
from cptune.config.axolotl.schema import (
    AXOLOTL_DATASET_KEYS,
    AXOLOTL_PLUGIN_KEYS,
    AXOLOTL_PLUGIN_SWITCHES,
    AXOLOTL_RECIPE_KEYS,
    AXOLOTL_SWITCHES,
)
from cptune.config.data import (
    BUILT_IN_CHAT_TEMPLATES,
    PREFERENCE_TYPES,
    DatasetConfig,
    SpecialTokens,
    is_axolotl_preference_type,
)
from cptune.config.model import AXOLOTL_OTHER_NAMES
from cptune.config.parallelism import FsdpConfig
from cptune.config.recipe import Recipe
from cptune.config.rules import combination_problems
from cptune.errors import RecipeError, RecipeProblem


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe.

    Args:
        path: YAML file.
        overrides: ``key=value`` strings (a leading ``--`` is allowed); nested keys
            use dots and list indices, e.g. ``datasets.0.path=data.jsonl``. Values are
            parsed as YAML scalars, so ``true``, ``3`` and ``[a, b]`` get their types.

    Raises:
        RecipeError: the file is unreadable or the recipe is invalid.
    """
    data = read_recipe_file(path)
    for override in overrides:
        key, value = parse_override(override)
        set_by_path(data, key, value)
    return validate_recipe(data, source=str(path))


class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping.

    PyYAML keeps the last of two equal keys without a word, so a recipe that sets
    ``sequence_len`` twice would silently train with the second value. Keys that a
    merge (``<<: *anchor``) brings in may still be overridden.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base class says what is wrong
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {key!r} appears twice in one mapping (first at line {first.start_mark.line + 1}); "
                    "YAML would keep only the last value. Remove one of them.",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def read_recipe_file(path: str | Path) -> dict[str, Any]:
    """The recipe file's top-level mapping, read with a safe YAML loader that refuses duplicate keys."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(
            [RecipeProblem("", f"'{path}' is a folder, not a recipe file; give the path of the YAML file")],
            source=str(path),
        )
    if not path.is_file():
        raise RecipeError([RecipeProblem("", f"recipe file not found: {path}")], source=str(path))
    try:
        # _RecipeLoader is a SafeLoader: a recipe never builds Python objects or runs code.
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_RecipeLoader)
    except yaml.YAMLError as err:
        where = ""
        mark = getattr(err, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(err, "problem", None) or str(err)
        tag = re.search(r"constructor for the tag '([^']*)'", problem)
        if isinstance(err, yaml.constructor.ConstructorError) and tag:
            shown = tag.group(1).replace("tag:yaml.org,2002:", "!!")
            message = (
                f"the YAML tag '{shown}'{where} is not allowed: cptune reads recipes with YAML's safe "
                "loader, which never builds Python objects. Write the value as plain YAML (text, a "
                "number, a list or a mapping)."
            )
        else:
            message = f"not valid YAML{where}: {problem}"
        raise RecipeError([RecipeProblem("", message)], source=str(path)) from None
    except UnicodeDecodeError:
        raise RecipeError([RecipeProblem("", "the file is not UTF-8 text")], source=str(path)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            [RecipeProblem("", f"the recipe must be a mapping of keys to values, got {type(data).__name__}")],
            source=str(path),
        )
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``--key.path=value`` into the key path and the YAML-parsed value."""
    body = text[2:] if text.startswith("--") else text
    key, sep, raw = body.partition("=")
    if not sep or not key:
        raise RecipeError([RecipeProblem("", f"override {text!r} is not of the form --key=value")])
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key, value


def set_by_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``value`` at ``a.b.0.c`` inside nested dicts/lists, creating dicts as needed."""
    parts = dotted.split(".")
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(
                    [RecipeProblem(dotted, f"override index {part!r} is out of range (list of {len(node)})")]
                )
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            parent = ".".join(parts[:i])
            raise RecipeError(
                [
                    RecipeProblem(
                        dotted,
                        f"{parent} holds a value of type {type(node).__name__}, which has no keys; override "
                        f"{parent} itself (--{parent}=...) or fix the key path.",
                    )
                ]
            )


def validate_recipe(data: Mapping[str, Any], source: str | None = None) -> Recipe:
    """Validate a recipe mapping, reporting field and combination problems together.

    Empty (null) values of keys cptune or Axolotl defines mean "not set" (Axolotl's example recipes
    carry them as placeholders), as does ``false`` for an Axolotl switch cptune has no key for.
    """
    data, early = _without_unset(data)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        errors = _without_echoes(err.errors())
        problems = early + [_problem_from_error(e) for e in errors]
        broken = {_top_key(e["loc"]) for e in errors} | {p.key for p in early}
        partial = _partial_recipe(data, broken)
        if partial is not None:
            missing = (
                frozenset(name for name, info in Recipe.model_fields.items() if info.is_required()) & broken
            )
            problems += [
                RecipeProblem(k, m) for k, m in combination_problems(partial, missing) if k not in broken
            ]
        raise RecipeError(_unique(problems), source=source) from None
    problems = early + [RecipeProblem(k, m) for k, m in combination_problems(recipe)]
    if problems:
        raise RecipeError(problems, source=source)
    return recipe


# Sections whose keys may be left empty, and the keys each knows (beyond its model's fields).
_UNSET_SECTIONS: dict[str, tuple[type[BaseModel], frozenset[str]]] = {
    "fsdp_config": (FsdpConfig, frozenset(UNSUPPORTED_FSDP_KEYS)),
    "special_tokens": (SpecialTokens, frozenset()),
    "bnb_config_kwargs": (BnbConfig, frozenset()),
    "model_quantization_config_kwargs": (Mxfp4Options, frozenset()),
}


def _without_unset(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[RecipeProblem]]:
    """The recipe without the keys it leaves unset, and problems found on the way.

    Dropped: a null value of a key that cptune or Axolotl defines (anywhere a recipe, dataset or
    section key is known), and ``false`` for an Axolotl switch that cptune has no key for. An
    unknown key stays, so that it fails with a "did you mean".
    """
    known = (
        set(Recipe.model_fields)
        | AXOLOTL_RECIPE_KEYS
        | set(UNSUPPORTED_RECIPE_KEYS)
        | set(AXOLOTL_PLUGIN_KEYS)
    )
    switches = AXOLOTL_SWITCHES | AXOLOTL_PLUGIN_SWITCHES
    out: dict[str, Any] = {}
    early: list[RecipeProblem] = []
    offload = False
    for key, value in data.items():
        if value is None and key in known:
            continue
        if value is False and key in switches and key not in Recipe.model_fields:
            continue
        if key == "gradient_checkpointing" and value == "offload":
            # Axolotl reads it as gradient_checkpointing: true plus activation_offloading: true.
            value = offload = True
        if key in ("datasets", "test_datasets") and isinstance(value, list):
            value = [_dataset_without_unset(entry) for entry in value]
        elif key in _UNSET_SECTIONS and isinstance(value, dict):
            model, extra = _UNSET_SECTIONS[key]
            names = set(model.model_fields) | extra
            value = {
                k: v
                for k, v in value.items()
                if not (
                    v is None and (k in names or (isinstance(k, str) and k.removeprefix("fsdp_") in names))
                )
            }
        out[key] = value
    if offload and out.get("activation_offloading") in (None, False):
        out["activation_offloading"] = True
    return out, early


def _dataset_without_unset(entry: Any) -> Any:
    if not isinstance(entry, dict):
        return entry
    known = set(DatasetConfig.model_fields) | AXOLOTL_DATASET_KEYS | set(UNSUPPORTED_DATASET_KEYS)
    return {k: v for k, v in entry.items() if not (v is None and k in known)}


def key_path(loc: Iterable[Any]) -> str:
    """``("datasets", 0, "type")`` → ``datasets[0].type``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _top_key(loc: tuple[Any, ...]) -> str:
    return str(loc[0]) if loc else ""


def _without_echoes(errors: list[Any]) -> list[Any]:
    """Drop a container's length error when an item inside it already failed.

    pydantic reports ``datasets: at least 1 item`` when the only dataset is
    invalid; that echo would send the user looking for the wrong problem.
    """
    locs = [tuple(e["loc"]) for e in errors]
    return [
        e
        for e in errors
        if not (
            e["type"] == "too_short"
            and any(len(o) > len(e["loc"]) and o[: len(e["loc"])] == tuple(e["loc"]) for o in locs)
        )
    ]


def _problem_from_error(error: Mapping[str, Any]) -> RecipeProblem:
    # pydantic adds the tagged-union / type name to loc for unions; drop those parts.
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS)))
    path = key_path(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        return RecipeProblem(path, _unknown_key_message(loc))
    if kind == "missing":
        return RecipeProblem(path, "is required but missing.")
    got = error.get("input")
    text = error["msg"]
    if kind == "value_error":
        # A validator of cptune's own: its message already says what is wrong and what to do.
        return RecipeProblem(path, text.removeprefix("Value error, ") + ".")
    # Lists in the recipe are tuples in the frozen Recipe; the user wrote (or should write) a list.
    text = text.replace("Tuple should", "List should").replace("a valid tuple", "a valid list")
    message = f"{text}; got {_short(got)}."
    if path == "chat_template" and kind == "literal_error" and isinstance(got, str):
        return RecipeProblem(path, _chat_template_message(got))
    if kind == "literal_error" and loc[-1:] == ("type",) and is_axolotl_preference_type(got):
        return RecipeProblem(path, _preference_type_message(got))
    if kind == "literal_error" and isinstance(got, str):
        choices = re.findall(r"'([^']*)'", str(error.get("ctx", {}).get("expected", "")))
        close = difflib.get_close_matches(got, choices, n=1, cutoff=0.6)
        if close:
            message += f" Did you mean '{close[0]}'?"
    return RecipeProblem(path, message)


_UNION_TAGS = {"str", "int", "float", "bool", "tuple", "list", "dict", "none", "literal"}


def _chat_template_message(name: str) -> str:
    built_in = ", ".join(BUILT_IN_CHAT_TEMPLATES)
    return (
        f"'{name}' is not a chat template cptune renders itself (built in: {built_in}). Use chat_template: "
        "tokenizer_default when the model's tokenizer ships its template, or give the template in "
        "chat_template_jinja."
    )


def _preference_type_message(name: str) -> str:
    return (
        f"'{name}' is not a preference (rl) dataset type cptune reads (Axolotl's user_defined.default, "
        "zephyr.nectar and mistral.* are not built yet). cptune reads "
        f"{', '.join(PREFERENCE_TYPES)}. Rows of prompt, chosen and rejected text already in the model's format "
        "can use passthrough.default (field_prompt, field_chosen, field_rejected); rows of messages, "
        "chat_template.default (field_messages, field_chosen, field_rejected), rendered with the chat template."
    )


# Sections of the recipe that are models of their own: their fields and the Axolotl keys they refuse.
_SECTIONS: dict[str, tuple[type[BaseModel], dict[str, str]]] = {
    "datasets": (DatasetConfig, UNSUPPORTED_DATASET_KEYS),
    "test_datasets": (DatasetConfig, UNSUPPORTED_DATASET_KEYS),
    "fsdp_config": (FsdpConfig, UNSUPPORTED_FSDP_KEYS),
}


# Axolotl keys without a cptune field, by section (the recipe's top level under "").
_AXOLOTL_KEYS = {
    "": AXOLOTL_RECIPE_KEYS,
    "datasets": AXOLOTL_DATASET_KEYS,
    "test_datasets": AXOLOTL_DATASET_KEYS,
}


def _unknown_key_message(loc: tuple[Any, ...]) -> str:
    key = str(loc[-1])
    section = str(loc[0]) if len(loc) >= 2 and loc[0] in _SECTIONS else ""
    model, unsupported = _SECTIONS[section] if section else (Recipe, UNSUPPORTED_RECIPE_KEYS)
    if not section and key in AXOLOTL_OTHER_NAMES:
        ours = AXOLOTL_OTHER_NAMES[key]
        return f"is Axolotl's other name for {ours}, which the recipe also sets, to another value; keep one of the two."
    if key in unsupported:
        return f"is an Axolotl key that cptune does not support: {unsupported[key]}"
    if not section and key in AXOLOTL_PLUGIN_KEYS:
        return (
            f"is a key of Axolotl's {AXOLOTL_PLUGIN_KEYS[key]} integration (a plugin), which cptune does not run; "
            "remove it (an empty value, or false for a switch, is accepted as not set)."
        )
    if key in _AXOLOTL_KEYS.get(section, frozenset()) and len(loc) <= 3:
        return f"is an Axolotl key that cptune does not support: {NO_COUNTERPART}"
    close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"is not a known key.{hint}"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _partial_recipe(data: Mapping[str, Any], broken: set[str]) -> Recipe | None:
    """A recipe of the keys that passed validation (defaults elsewhere), for combination rules.

    Values are typed as their fields after the recipe's own rewriting of keys; one that still does not
    type (it failed validation for a reason the rules need not know) stands in as the field's default.
    """
    data = _keys_as_the_recipe_reads_them(data)
    values: dict[str, Any] = {}
    for name, info in Recipe.model_fields.items():
        typed = _typed(info.annotation, data[name]) if name in data and name not in broken else _UNTYPED
        if typed is not _UNTYPED:
            values[name] = typed
        elif not info.is_required():
            values[name] = info.get_default(call_default_factory=True)
    try:
        return Recipe.model_construct(**values)
    except Exception:  # best effort: never let this hide the real errors
        return None


def _keys_as_the_recipe_reads_them(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` after the recipe's own rewriting of keys (its model-level "before" validators).

    They move keys between sections (``fsdp_config.fsdp_version`` to the top level) and imply others
    (``fsdp`` sets ``fsdp_version: 2``), so a field's value is only its type after them. pydantic runs
    the last defined first; so does this.
    """
    validators = Recipe.__pydantic_decorators__.model_validators.values()
    for validator in reversed([v for v in validators if v.info.mode == "before"]):
        try:
            data = validator.func(data)
        except (ValueError, TypeError):  # reported by the full validation already
            continue
    return data


_UNTYPED = object()


def _typed(annotation: Any, value: Any) -> Any:
    """``value`` as its field's type (nested sections become their models), so rules can read it;
    ``_UNTYPED`` when it is not (the field's default stands in: rules read typed values only)."""
    try:
        return TypeAdapter(annotation).validate_python(value)
    except ValidationError:
        return _UNTYPED


def _unique(problems: list[RecipeProblem]) -> list[RecipeProblem]:
    seen: set[tuple[str, str]] = set()
    out = []
    for p in problems:
        if (p.key, p.message) not in seen:
            seen.add((p.key, p.message))
            out.append(p)
    return out
