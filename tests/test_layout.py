"""The layout's rules, checked on the source: who may import the MLX libraries, file sizes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "worker", "shared")


def modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_the_backends_import_mlx_lm() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in modules(*PACKAGES)
        if "backends" not in path.parts
        and any(name.split(".")[0] == "mlx_lm" for name in imported(path))
    ]
    assert offenders == []


def test_the_gateway_and_shared_never_import_mlx() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in modules("gateway", "shared")
        if any(name.split(".")[0] in ("mlx", "mlx_lm") for name in imported(path))
    ]
    assert offenders == []


@pytest.mark.parametrize("path", modules("worker"), ids=lambda p: str(p.relative_to(ROOT)))
def test_worker_files_stay_under_500_lines(path: Path) -> None:
    assert len(path.read_text(encoding="utf-8").splitlines()) <= 500
