"""The project's version: the installed distribution's, or a source checkout's pyproject.toml
(run from a tree on PYTHONPATH, not installed), else "0+unknown"."""

from __future__ import annotations

import functools
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DISTRIBUTION = "mlx-gateway"


@functools.cache
def project_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return "0+unknown"
    return str(project.get("version", "0+unknown"))
