"""What the GPU machine's image holds, and a walk of the imports the GPU-side scripts make.

The lent GPU machine (the device tool's KINDS.md) has Python 3.12 with torch 2.11, transformers
5.17, accelerate 1.15, peft and the packages in :data:`IMAGE`, and no network: anything else
must travel as a wheel (:data:`CARRIED`, written by ``benchmarks/gpu/wheels.sh``). A GPU-side
module that imports anything else fails on every rank there, which a CPU dry run in ``.venv``
cannot show. :func:`outside_image` reads the source of the scripts a lease runs and of every
repository module they reach, and names each import of a package the machine will not have.

What it counts: every ``import`` statement, at module level or inside a function (a function
the lease calls runs it), except those under ``if TYPE_CHECKING:``, those inside a ``try``
whose handler catches ``ImportError`` (optional imports, such as flash-attn), and imports inside
a function of the packages in :data:`OTHER_PATHS`, which only code the lease never runs calls.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The image's packages, as KINDS.md lists them (read 2026-11-17), by distribution name.
IMAGE = frozenset(
    [
        "absl-py",
        "accelerate",
        "aiofiles",
        "aiohappyeyeballs",
        "aiohttp",
        "aiosignal",
        "annotated-doc",
        "anyio",
        "attrs",
        "botorch",
        "build",
        "certifi",
        "charset-normalizer",
        "chex",
        "click",
        "cloudpickle",
        "cmake",
        "colorama",
        "contourpy",
        "coverage",
        "cuda-bindings",
        "cuda-core",
        "cuda-pathfinder",
        "cuda-toolkit",
        "cupy-cuda13x",
        "cycler",
        "cython",
        "diffrax",
        "e3nn",
        "einops",
        "equinox",
        "etils",
        "execnet",
        "filelock",
        "flatbuffers",
        "flax",
        "fonttools",
        "formulaic",
        "frozenlist",
        "fsspec",
        "gpytorch",
        "grpcio",
        "h11",
        "h5py",
        "hf-xet",
        "httpcore",
        "httpx",
        "huggingface-hub",
        "humanize",
        "hypothesis",
        "idna",
        "imageio",
        "iniconfig",
        "interface-meta",
        "jax",
        "jax-cuda13-pjrt",
        "jax-cuda13-plugin",
        "jaxlib",
        "jaxtyping",
        "jinja2",
        "joblib",
        "kiwisolver",
        "lazy-loader",
        "lightning",
        "lightning-utilities",
        "linear-operator",
        "lineax",
        "llvmlite",
        "lxml",
        "markdown",
        "markdown-it-py",
        "markupsafe",
        "matplotlib",
        "mdurl",
        "meson",
        "ml-dtypes",
        "mpi4py",
        "mpmath",
        "msgpack",
        "multidict",
        "multipledispatch",
        "mypy-extensions",
        "nanobind",
        "narwhals",
        "networkx",
        "ninja",
        "numba",
        "numba-cuda",
        "numpy",
        "numpyro",
        "nvidia-ml-py",
        "onnx",
        "onnx-ir",
        "onnxruntime",
        "onnxscript",
        "opencv-python-headless",
        "optax",
        "opt-einsum",
        "opt-einsum-fx",
        "optimistix",
        "orbax-checkpoint",
        "packaging",
        "pandas",
        "pathspec",
        "patsy",
        "peft",
        "pillow",
        "pip",
        "pluggy",
        "portalocker",
        "prometheus-client",
        "propcache",
        "protobuf",
        "psutil",
        "pyarrow",
        "pybind11",
        "py-cpuinfo",
        "pygments",
        "pyparsing",
        "pyproject-hooks",
        "pyre-extensions",
        "pytest",
        "pytest-benchmark",
        "pytest-cov",
        "pytest-mock",
        "pytest-timeout",
        "pytest-xdist",
        "python-dateutil",
        "pytorch-lightning",
        "pyyaml",
        "regex",
        "requests",
        "rich",
        "sacrebleu",
        "safetensors",
        "scikit-build-core",
        "scikit-image",
        "scikit-learn",
        "scipy",
        "seaborn",
        "sentencepiece",
        "sentence-transformers",
        "setuptools",
        "shellingham",
        "simplejson",
        "six",
        "sortedcontainers",
        "statsmodels",
        "sympy",
        "tabulate",
        "tensorboard",
        "tensorboard-data-server",
        "tensorstore",
        "threadpoolctl",
        "tifffile",
        "tiktoken",
        "timm",
        "tokenizers",
        "toolz",
        "torch",
        "torchaudio",
        "torchdiffeq",
        "torch-geometric",
        "torchmetrics",
        "torchvision",
        "tqdm",
        "transformers",
        "treescope",
        "triton",
        "typer",
        "typing-extensions",
        "typing-inspect",
        "urllib3",
        "uvloop",
        "wadler-lindig",
        "werkzeug",
        "wheel",
        "wrapt",
        "xarray",
        "xxhash",
        "yarl",
        "zipp",
    ]
)

# What a lease carries as wheels (benchmarks/gpu/wheels.sh), by distribution name.
CARRIED = frozenset({"transformers", "peft", "ring-flash-attn"})

# Import names that differ from the distribution's name.
_IMPORT_NAMES = {
    "pyyaml": "yaml", "pillow": "PIL", "scikit-learn": "sklearn", "scikit-image": "skimage",
    "opencv-python-headless": "cv2", "protobuf": "google", "python-dateutil": "dateutil",
    "huggingface-hub": "huggingface_hub", "nvidia-ml-py": "pynvml", "py-cpuinfo": "cpuinfo",
    "pytorch-lightning": "pytorch_lightning", "torch-geometric": "torch_geometric",
}  # fmt: skip

# Packages that cptune imports only inside the functions of another path than the lease's: an import
# of one of them inside a function is not counted; at module level it is.
OTHER_PATHS = {"deepspeed": "the deepspeed backend and DeepSpeed ZeRO, which the lease does not run"}

# Repository packages: their modules are walked, not looked up.
LOCAL = ("cptune", "benchmarks", "devtools")

# The modules a lease runs (benchmarks/gpu/lease.sh's phases).
GPU_ENTRY_POINTS = (
    "benchmarks.gpu.check_kernels",
    "benchmarks.gpu.multirank",
    "benchmarks.gpu.multirank_cases",
    "benchmarks.gpu.attention_paths",
    "benchmarks.gpu.lease_report",
    "benchmarks.gpu.feature_speed",
    "benchmarks.gpu.lease_env",
)


def import_names(distributions: frozenset[str]) -> frozenset[str]:
    return frozenset(_IMPORT_NAMES.get(d, d.replace("-", "_")) for d in distributions)


AVAILABLE = import_names(IMAGE | CARRIED) | frozenset(sys.stdlib_module_names)


@dataclass(frozen=True)
class Missing:
    package: str
    module: str  # the repository module whose import needs it
    line: int
    chain: tuple[str, ...]  # entry point -> ... -> module

    def __str__(self) -> str:
        return f"{self.package} (imported by {self.module}:{self.line}; reached by {' -> '.join(self.chain)})"


def _source(module: str) -> Path | None:
    base = ROOT / "src" if module.split(".")[0] == "cptune" else ROOT
    path = base.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _optional(handlers: list[ast.ExceptHandler]) -> bool:
    names = set()
    for handler in handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names |= {k.id for k in kinds if isinstance(k, ast.Name)}
    return bool(names & {"ImportError", "ModuleNotFoundError", "Exception"})


def _imports(tree: ast.AST, package: str) -> list[tuple[str, int]]:
    """(module, line) of every counted import in ``tree``; see the module docstring."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, in_function: bool = False) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            in_function = True
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Try) and _optional(node.handlers):
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            found.extend(
                (alias.name, node.lineno)
                for alias in node.names
                if not (in_function and alias.name.split(".")[0] in OTHER_PATHS)
            )
        elif (
            isinstance(node, ast.ImportFrom)
            and in_function
            and (node.module or "").split(".")[0] in OTHER_PATHS
        ):
            pass
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            found.append((base, node.lineno))
            found.extend((f"{base}.{alias.name}", node.lineno) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(tree)
    return found


def outside_image(entry_points: tuple[str, ...] = GPU_ENTRY_POINTS) -> list[Missing]:
    """Every import of a package the GPU image lacks, reachable from ``entry_points``."""
    missing: dict[tuple[str, str], Missing] = {}
    seen: set[str] = set()
    queue: list[tuple[str, tuple[str, ...]]] = [(m, (m,)) for m in entry_points]
    while queue:
        module, chain = queue.pop(0)
        if module in seen:
            continue
        seen.add(module)
        path = _source(module)
        if path is None:
            continue  # ``from package import name`` where name is not a module
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        parents = [".".join(module.split(".")[:i]) for i in range(1, len(module.split(".")))]
        for target in parents:
            queue.append((target, (*chain, target)))
        for target, line in _imports(ast.parse(path.read_text(), str(path)), package):
            top = target.split(".")[0]
            if top in LOCAL:
                queue.append((target, (*chain, target)))
            elif top and top not in AVAILABLE and (top, module) not in missing:
                missing[(top, module)] = Missing(top, module, line, chain)
    return sorted(missing.values(), key=lambda m: (m.package, m.module))


if __name__ == "__main__":
    problems = outside_image()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} import(s) of packages the GPU image lacks")
    sys.exit(1 if problems else 0)
