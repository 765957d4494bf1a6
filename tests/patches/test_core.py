"""Unit tests of the patch mechanism on throwaway modules (no upstream library involved)."""

from __future__ import annotations

import itertools
import logging
import sys
import types
from types import SimpleNamespace

import pytest

from cptune.errors import PatchError
from cptune.patches.core import MISSING, ContextParallelWith, Patch, PatchSet, Target

_counter = itertools.count()


class _Base:
    def inherited(self, x):
        return ("base", x)


@pytest.fixture
def mod():
    """A fresh module registered in sys.modules under a unique name, with a few kinds of targets."""
    name = f"_cptune_patch_target_{next(_counter)}"
    module = types.ModuleType(name)

    def func(a, b):
        return a + b

    class Thing(_Base):
        def method(self, x):
            return ("method", x)

        @staticmethod
        def static(x):
            return ("static", x)

        @classmethod
        def klass(cls, x):
            return (cls.__name__, x)

        @property
        def prop(self):
            return "prop"

    module.func = func
    module.Thing = Thing
    module.registry = {"present": "value"}
    sys.modules[name] = module
    yield module
    del sys.modules[name]


def _wrap(tag):
    """Replacement factory: a plain wrapper that tags the original's result."""

    def factory(original):
        def wrapper(*args, **kwargs):
            return (tag, original(*args, **kwargs))

        return wrapper

    return factory


def _patch(mod, attr, name="p", **kwargs):
    kwargs.setdefault("replacement", _wrap(name))
    return Patch(name=name, target=f"{mod.__name__}:{attr}", reason="test", remove_when="never", **kwargs)


RECIPE = SimpleNamespace(context_parallel_size=2, cp_backend="ring-flash-attn")


def test_target_parse_forms():
    assert Target.parse("a.b:C.d") == Target("a.b", ("C", "d"))
    assert Target.parse("sys:modules['flash_attn']") == Target("sys", ("modules",), "flash_attn")
    assert Target.parse('sys:modules["x.y"]').key == "x.y"
    with pytest.raises(ValueError):
        Target.parse("no_colon.attr")


def test_apply_and_revert_restore_identity(mod):
    func, method = mod.func, vars(mod.Thing)["method"]
    patch_set = PatchSet([_patch(mod, "func", "f"), _patch(mod, "Thing.method", "m")])
    patch_set.apply(RECIPE)
    assert mod.func(1, 2) == ("f", 3)
    assert mod.Thing().method(5) == ("m", ("method", 5))
    patch_set.revert()
    assert mod.func is func
    assert vars(mod.Thing)["method"] is method
    assert patch_set.applied_patches == ()


def test_apply_and_revert_are_idempotent(mod):
    func = mod.func
    patch_set = PatchSet([_patch(mod, "func")])
    patch_set.apply(RECIPE)
    installed = mod.func
    patch_set.apply(RECIPE)  # no second wrapper
    assert mod.func is installed
    assert mod.func(1, 1) == ("p", 2)
    patch_set.revert()
    patch_set.revert()
    assert mod.func is func


def test_revert_over_foreign_patch_raises_and_touches_nothing(mod):
    func = mod.func
    patch_set = PatchSet([_patch(mod, "func", "f"), _patch(mod, "Thing.method", "m")])
    patch_set.apply(RECIPE)
    ours_method = vars(mod.Thing)["method"]

    def foreign(a, b):
        return "foreign"

    mod.func = foreign
    with pytest.raises(PatchError, match=rf"{mod.__name__}:func \(f\)"):
        patch_set.revert()
    # Consistent state: the other patch is still in, and a later revert works once the foreign one is gone.
    assert vars(mod.Thing)["method"] is ours_method
    mod.func = patch_set._installed[0].installed
    patch_set.revert()
    assert mod.func is func


def test_signature_drift_is_reported(mod):
    plan = PatchSet([_patch(mod, "func", signature=("a", "b", "c"))]).plan(RECIPE)
    assert not plan.ok
    (problem,) = plan.problems
    assert "signature drift" in problem.message and "'c'" in problem.message


def test_signature_of_static_class_and_property_is_checked(mod):
    patches = [
        _patch(mod, "Thing.static", "s", signature=("x",)),
        _patch(mod, "Thing.klass", "k", signature=("cls", "x")),
        _patch(mod, "Thing.prop", "pr", signature=("self",)),
    ]
    assert PatchSet(patches).plan(RECIPE).ok


def test_version_mismatch_is_reported(mod):
    patches = [
        _patch(mod, "func", "old", requires={"pytest": "<1"}),
        _patch(mod, "Thing.method", "absent", requires={"surely-not-installed-dist": ">=1"}),
    ]
    messages = [p.message for p in PatchSet(patches).plan(RECIPE).problems]
    assert len(messages) == 2
    assert "written for pytest<1, but pytest" in messages[0]
    assert "not installed" in messages[1]


def test_all_problems_reported_at_once_before_touching_anything(mod):
    func = mod.func
    patches = [
        _patch(mod, "func", "fine"),
        _patch(mod, "nope", "missing-target"),
        _patch(mod, "Thing.method", "drift", signature=("y",)),
        Patch(
            name="no-module",
            target="_cptune_no_such_module:x",
            replacement=_wrap("x"),
            reason="t",
            remove_when="t",
        ),
    ]
    with pytest.raises(PatchError) as info:
        PatchSet(patches).apply(RECIPE)
    text = str(info.value)
    assert "3 problems" in text
    for name in ("missing-target", "drift", "no-module"):
        assert name in text
    assert mod.func is func


def test_partial_failure_rolls_back(mod):
    func, method = mod.func, vars(mod.Thing)["method"]

    def broken_factory(original):
        raise RuntimeError("factory failed")

    patch_set = PatchSet(
        [_patch(mod, "func", "first"), _patch(mod, "Thing.method", "second", replacement=broken_factory)]
    )
    with pytest.raises(RuntimeError, match="factory failed"):
        patch_set.apply(RECIPE)
    assert mod.func is func
    assert vars(mod.Thing)["method"] is method
    assert patch_set.applied_patches == ()


def test_create_and_delete_missing_attribute(mod):
    seen = []

    def factory(original):
        seen.append(original)
        return True

    patch_set = PatchSet([_patch(mod, "flag", replacement=factory, create=True)])
    assert patch_set.plan(RECIPE).ok
    with patch_set.applied(RECIPE):
        assert mod.flag is True
    assert seen == [MISSING]
    assert not hasattr(mod, "flag")


def test_missing_attribute_without_create_is_a_problem(mod):
    (problem,) = PatchSet([_patch(mod, "flag")]).plan(RECIPE).problems
    assert problem.message == "target does not exist"


def test_mapping_item_target(mod):
    present = mod.registry["present"]
    patch_set = PatchSet(
        [
            _patch(mod, "registry['present']", "present", replacement=lambda original: original.upper()),
            _patch(mod, "registry['fresh']", "fresh", replacement=lambda original: "new", create=True),
        ]
    )
    with patch_set.applied(RECIPE):
        assert mod.registry == {"present": "VALUE", "fresh": "new"}
    assert mod.registry == {"present": "value"}
    assert mod.registry["present"] is present


def test_sys_modules_item_target(mod):
    patch = Patch(
        name="shim",
        target=f"sys:modules[{mod.__name__ + '_shim'!r}]",
        replacement=lambda original: types.ModuleType("shim"),
        reason="t",
        remove_when="t",
        create=True,
    )
    with PatchSet([patch]).applied():
        assert sys.modules[mod.__name__ + "_shim"].__name__ == "shim"
    assert mod.__name__ + "_shim" not in sys.modules


def test_context_manager_reverts_on_exception(mod):
    func = mod.func
    with pytest.raises(KeyError), PatchSet([_patch(mod, "func")]).applied(RECIPE):
        assert mod.func is not func
        raise KeyError("boom")
    assert mod.func is func


def test_nested_context_keeps_outer_application(mod):
    patch_set = PatchSet([_patch(mod, "func")])
    with patch_set.applied(RECIPE):
        installed = mod.func
        with patch_set.applied(RECIPE):
            pass
        assert mod.func is installed


def test_one_log_line_per_applied_patch(mod, caplog):
    patch_set = PatchSet(
        [
            _patch(mod, "func", "f"),
            _patch(mod, "Thing.method", "m"),
            _patch(mod, "Thing.static", "skipped", applies_to=lambda recipe: False),
        ]
    )
    with caplog.at_level(logging.INFO, logger="cptune.patches"):
        patch_set.apply(RECIPE)
        patch_set.apply(RECIPE)  # idempotent: logs nothing more
    patch_set.revert()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines == [
        f"patched {mod.__name__}:func (f): test",
        f"patched {mod.__name__}:Thing.method (m): test",
    ]


def test_a_set_announces_its_patches_on_the_logger_it_is_given(mod, caplog):
    """Import-time patches go to their own logger, which a rank of cptune's launcher quiets (its launcher listed them)."""
    from cptune.patches.core import IMPORT_TIME_LOG

    quiet = PatchSet([_patch(mod, "func", "f")], log=logging.getLogger(IMPORT_TIME_LOG))
    with (
        caplog.at_level(logging.INFO, logger="cptune.patches"),
        caplog.at_level(logging.WARNING, logger=IMPORT_TIME_LOG),
        quiet.applied(RECIPE),
    ):
        pass
    assert [r.getMessage() for r in caplog.records] == []
    with caplog.at_level(logging.INFO, logger=IMPORT_TIME_LOG), quiet.applied(RECIPE):
        pass
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        (IMPORT_TIME_LOG, f"patched {mod.__name__}:func (f): test")
    ]


def test_plan_has_no_side_effects(mod):
    calls = []
    before = (dict(vars(mod)), dict(vars(mod.Thing)), dict(mod.registry))
    patch_set = PatchSet(
        [
            _patch(mod, "func", replacement=lambda original: calls.append(original)),
            _patch(mod, "registry['fresh']", "fresh", replacement=calls.append, create=True),
        ]
    )
    plan = patch_set.plan(RECIPE)
    assert plan.ok and len(plan.selected) == 2
    assert calls == []
    assert before == (dict(vars(mod)), dict(vars(mod.Thing)), dict(mod.registry))
    assert "apply p:" in plan.describe()


def test_predicate_selects_and_describe_explains(mod):
    patch_set = PatchSet(
        [
            _patch(mod, "func", "ring", applies_to=ContextParallelWith(("ring-flash-attn",))),
            _patch(mod, "Thing.method", "ds", applies_to=ContextParallelWith(("deepspeed",))),
        ]
    )
    plan = patch_set.plan(RECIPE)
    assert [p.name for p in plan.selected] == ["ring"]
    assert "skip  ds" in plan.describe()
    assert "cp_backend in (deepspeed)" in plan.describe()
    assert not ContextParallelWith(("ring-flash-attn",))(
        SimpleNamespace(context_parallel_size=1, cp_backend="ring-flash-attn")
    )


def test_inherited_attribute_restored_by_deletion(mod):
    received = []

    def factory(original):
        received.append(original)
        return lambda self, x: ("sub", original(self, x))

    with PatchSet([_patch(mod, "Thing.inherited", replacement=factory)]).applied(RECIPE):
        assert mod.Thing().inherited(1) == ("sub", ("base", 1))
    assert received == [vars(_Base)["inherited"]]
    assert "inherited" not in vars(mod.Thing)
    assert mod.Thing.inherited is _Base.inherited


def test_staticmethod_and_property_restored_exactly(mod):
    static, prop = vars(mod.Thing)["static"], vars(mod.Thing)["prop"]
    received = []

    def static_factory(original):
        received.append(original)
        return staticmethod(lambda x: ("patched", original.__func__(x)))

    patch_set = PatchSet(
        [
            _patch(mod, "Thing.static", "s", replacement=static_factory),
            _patch(mod, "Thing.prop", "pr", replacement=lambda original: property(lambda self: "patched")),
        ]
    )
    with patch_set.applied(RECIPE):
        assert mod.Thing.static(3) == ("patched", ("static", 3))
        assert mod.Thing().prop == "patched"
    assert received == [static]  # the raw staticmethod object, not the function getattr would give
    assert vars(mod.Thing)["static"] is static
    assert vars(mod.Thing)["prop"] is prop
    assert mod.Thing.static(3) == ("static", 3)


def test_two_patches_on_one_target_stack_and_unstack(mod):
    func = mod.func
    patch_set = PatchSet([_patch(mod, "func", "inner"), _patch(mod, "func", "outer")])
    with patch_set.applied(RECIPE):
        assert mod.func(1, 1) == ("outer", ("inner", 2))
    assert mod.func is func


def test_reapply_with_other_selection_is_refused(mod):
    patch_set = PatchSet([_patch(mod, "func", applies_to=lambda recipe: recipe.context_parallel_size > 1)])
    with patch_set.applied(RECIPE), pytest.raises(RuntimeError, match="already applied"):
        patch_set.apply(SimpleNamespace(context_parallel_size=1, cp_backend="ring-flash-attn"))


def test_bad_patch_definitions_fail_at_construction(mod):
    with pytest.raises(ValueError, match="specifier"):
        _patch(mod, "func", requires={"torch": "~~2"})
    with pytest.raises(ValueError, match="duplicate"):
        PatchSet([_patch(mod, "func"), _patch(mod, "func")])
