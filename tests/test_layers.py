"""The package layers of ``src/cptune`` and where backend names may be compared, checked on the source.

Layers, lowest first; a package imports only from its own layer and those below it (at module
level or inside a function; imports under ``if TYPE_CHECKING:`` are for annotations and do not
count):

    errors, labels, svg,     shared leaves (versions: the upstream versions cptune was written for;
    versions, atomic         atomic: files and folders published whole)
    patches                  Patch/PatchSet and the patches of upstream libraries; backends come in as data
    parallel                 layout, sharding, loss, memory arithmetic, kernels, the CP backends and their table
    config                   the recipe (its rules ask the backend table)
    data, models             data preparation; model loading, LoRA and memory features
    run                      the run's plan, training runtime, launcher and commands: wires the layers
    cli                      the command line (and __main__)

Inside ``config`` and ``run`` the modules are layered the same way (:data:`INNER_LAYERS`): in
``config`` the key groups by domain, then the recipe that composes them, then the rules across
keys, then the loader; in ``run`` the run's plan, then the training runtime, then the launcher,
then the other commands. No module imports one that imports it back, even through imports made
for annotations only.

Backend names: nothing outside ``parallel/backends/`` and ``config/`` compares a value with a
``cp_backend`` name (``==``, ``!=``, ``in`` against a literal or a tuple of literals); it asks the
backend object (:mod:`cptune.parallel.backends.table`) instead.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from cptune.parallel.backends.rows import NAMES as BACKEND_NAMES

SRC = Path(__file__).resolve().parents[1] / "src" / "cptune"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "labels", "svg", "versions", "atomic", "console", "__init__", "py"),
    ("patches",),
    ("parallel",),
    ("config",),
    ("data", "models"),
    ("run",),
    ("cli", "__main__"),
)
LEVEL = {package: level for level, packages in enumerate(LAYERS) for package in packages}

# Layers of the modules inside a package, lowest first (module paths below the package; "" is its __init__).
INNER_LAYERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "config": (
        ("base", "unfrozen"),
        ("axolotl.keys", "axolotl.schema", "axolotl.fsdp1", "axolotl.plugins", "axolotl.mapped", "axolotl"),
        ("model", "data", "adapter", "training", "preference", "parallelism"),
        ("recipe",),
        ("rules", "axolotl.rules", "axolotl.notes"),
        ("loader", ""),
    ),
    "run": (
        ("plan", "memory_plan"),
        ("training",),
        ("launch",),
        ("commands",),
        ("",),
    ),
}

NAMES = frozenset(BACKEND_NAMES)
ALLOWED = ("parallel/backends/", "config/")


def _package(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` blocks."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                hidden.update(id(n) for n in ast.walk(child))
    return hidden


@functools.cache
def _imported_packages(path: Path) -> list[tuple[str, int]]:
    """(cptune package, line) of every runtime import in the file, at module level or in a function."""
    tree = ast.parse(path.read_text())
    hidden = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "cptune" and len(parts) > 1:
                found.append((parts[1], node.lineno))
    return found


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_every_package_has_a_layer():
    packages = {_package(path) for path in _sources()}
    assert packages <= set(LEVEL), f"add these to LAYERS: {sorted(packages - set(LEVEL))}"


def test_no_package_imports_a_higher_layer():
    """A lower layer importing a higher one (even inside a function) would make a cycle between packages."""
    wrong = []
    for path in _sources():
        own = _package(path)
        for imported, line in _imported_packages(path):
            if imported in LEVEL and LEVEL[imported] > LEVEL[own]:
                wrong.append(f"{path.relative_to(SRC)}:{line} ({own}) imports cptune.{imported}")
    assert not wrong, "imports against the layer order (see this module's docstring):\n" + "\n".join(wrong)


def test_no_import_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for path in _sources():
        own = _package(path)
        for imported, _ in _imported_packages(path):
            if imported != own:
                edges.setdefault(own, set()).add(imported)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(
        f"{a} -> {b} -> ... -> {a}" for a, targets in edges.items() for b in targets if reaches(b, a, {b})
    )
    assert not cycles, "import cycles between packages:\n" + "\n".join(cycles)


def _names_in(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names_in(element) for element in node.elts)) if node.elts else set()
    return set()


def backend_name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, name) of each comparison or membership test of a value against a backend name literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, name) for name in sorted(_names_in(operand))]
    return found


def test_backend_names_are_compared_only_in_backends_and_config():
    wrong = []
    for path in _sources():
        relative = path.relative_to(SRC).as_posix()
        if relative.startswith(ALLOWED):
            continue
        wrong += [
            f"{relative}:{line} compares with {name!r}"
            for line, name in backend_name_comparisons(path.read_text())
        ]
    assert not wrong, "ask the backend (cptune.parallel.backends.table) instead:\n" + "\n".join(wrong)


def test_the_name_check_finds_comparisons():
    source = 'a = r.cp_backend == "torch"\nb = x in ("deepspeed", "y")\nc = "ring-flash-attn" not in xs\nd = "torch" != y\n'
    assert [name for _, name in backend_name_comparisons(source)] == [
        "torch",
        "deepspeed",
        "ring-flash-attn",
        "torch",
    ]
    assert backend_name_comparisons('message = "cp_backend: torch"\nif x == "sdpa": pass\n') == []


# --- module-level cycles, annotations included ------------------------------------------------------


def _module_of(path: Path) -> str:
    parts = ("cptune", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (SRC / relative).with_suffix(".py").is_file() or (SRC / relative / "__init__.py").is_file()


@functools.cache
def module_imports(path: Path, annotations: bool = True) -> list[tuple[str, int]]:
    """(cptune module, line) of every import in the file: module level, in a function or (with
    ``annotations``) under TYPE_CHECKING.

    ``from a.b import c`` imports ``a.b.c`` when ``c`` is a module, else ``a.b``; importing a module also
    runs the ``__init__`` of each package above it that the importer is not inside already.
    """
    own = _module_of(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    tree = ast.parse(path.read_text())
    hidden = set() if annotations else _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            modules = [f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}")]
            # ``from package import module`` needs the module; the package's own names need its __init__.
            names = [*modules, *([base] if len(modules) < len(node.names) else [])]
        for name in names:
            if not name.startswith("cptune.") or not _is_module(name):
                continue
            parts = name.split(".")
            for depth in range(2, len(parts) + 1):
                target = ".".join(parts[:depth])
                if target == name or not own.startswith(target + "."):
                    found.append((target, node.lineno))
    return [(target, line) for target, line in found if target != own]


def import_cycles(paths: list[Path]) -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (Tarjan's strongly connected parts)."""
    graph = {_module_of(path): {target for target, _ in module_imports(path)} for path in paths}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_import_cycle_between_modules_even_under_type_checking():
    """No module imports one that imports it back, counting imports made for annotations only.

    The recipe's schema composes the backends' key groups and the backends' policies are typed with
    the recipe, which is why the table loads the policies by module name (parallel/backends/table.py).
    """
    cycles = import_cycles(_sources())
    assert not cycles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle_under_type_checking(tmp_path):
    package = tmp_path / "cptune"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cptune import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cptune.a import thing\n"
    )
    (package / "c.py").write_text("import cptune.b\n")
    global SRC
    saved, SRC = SRC, package
    try:
        assert import_cycles(sorted(package.glob("*.py"))) == [["cptune.a", "cptune.b"]]
    finally:
        SRC = saved


def _inner_unit(package: str, module: str) -> str | None:
    """The unit of INNER_LAYERS[package] that ``module`` (``cptune.<package>...``) belongs to: its longest prefix."""
    inner = module.removeprefix(f"cptune.{package}").removeprefix(".")
    units = [u for layer in INNER_LAYERS[package] for u in layer]
    matches = [u for u in units if inner == u or (u and inner.startswith(u + "."))]
    return max(matches, key=len) if matches else None


def test_the_modules_inside_a_package_keep_their_layers():
    wrong = []
    for package, layers in INNER_LAYERS.items():
        level = {unit: i for i, units in enumerate(layers) for unit in units}
        for path in sorted((SRC / package).rglob("*.py")):
            own = _inner_unit(package, _module_of(path))
            assert own is not None, f"add {_module_of(path)} to INNER_LAYERS[{package!r}]"
            for target, line in module_imports(path, annotations=False):
                theirs = _inner_unit(package, target) if target.startswith(f"cptune.{package}.") else None
                if theirs is not None and level[theirs] > level[own]:
                    wrong.append(f"{path.relative_to(SRC)}:{line} ({own}) imports {target} ({theirs})")
    assert not wrong, "imports against the inner layers:\n" + "\n".join(wrong)
