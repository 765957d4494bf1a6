"""cptune.versions states the ranges pyproject.toml installs."""

from __future__ import annotations

import pytest
from packaging.requirements import Requirement

from cptune import versions
from tests.conftest import REPO

tomllib = pytest.importorskip("tomllib")


def test_versions_agree_with_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = [
        *project["dependencies"],
        *(d for extra in project["optional-dependencies"].values() for d in extra),
    ]
    installed = {Requirement(line).name: str(Requirement(line).specifier) for line in lines}
    for dist, spec in versions.SPECIFIERS.items():
        assert sorted(installed[dist].split(",")) == sorted(spec.split(",")), dist
    torch_range = Requirement(next(line for line in lines if line.startswith("torch"))).specifier
    assert all(torch_range.contains(v) for v in ("2.13.0", "2.13.9")), "the patched torch minor must install"
