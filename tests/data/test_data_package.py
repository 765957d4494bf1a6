"""Importing cptune.data runs nothing heavy; its names load on first use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import cptune
import cptune.data
from cptune.data.collator import PackedCollator


@pytest.mark.e2e  # a fresh interpreter
def test_import_is_lazy() -> None:
    code = "import sys, cptune.data; print(sorted({'torch', 'datasets', 'transformers'} & set(sys.modules)))"
    src = str(Path(cptune.__file__).parents[1])
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": src}
    )
    assert out.stdout.strip() == "[]", out.stderr


def test_exports_resolve() -> None:
    assert cptune.data.PackedCollator is PackedCollator
    with pytest.raises(AttributeError):
        _ = cptune.data.no_such_name
