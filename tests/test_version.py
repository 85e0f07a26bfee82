"""shared/version.py: the installed version, or a source tree's pyproject.toml when the
project runs from a checkout on PYTHONPATH without being installed (the gateway must start)."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest

from shared import version


def test_the_installed_version() -> None:
    version.project_version.cache_clear()
    assert version.project_version() == version.version("mlx-gateway")


def test_a_source_tree_not_installed_reads_its_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(version, "version", missing)
    version.project_version.cache_clear()
    try:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        expected = tomllib.loads(pyproject.read_text())["project"]["version"]
        assert version.project_version() == expected
    finally:
        version.project_version.cache_clear()
