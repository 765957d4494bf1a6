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
    run                      train/evaluate/merge/preflight: wires the layers
    cli                      the command line (and __main__)

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
    ("errors", "labels", "svg", "versions", "atomic", "__init__", "py"),
    ("patches",),
    ("parallel",),
    ("config",),
    ("data", "models"),
    ("run",),
    ("cli", "__main__"),
)
LEVEL = {package: level for level, packages in enumerate(LAYERS) for package in packages}

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
