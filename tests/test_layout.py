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


@pytest.mark.parametrize("library", ["mlx_lm", "mlx_vlm"])
def test_only_the_backends_import_the_model_libraries(library: str) -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in modules(*PACKAGES)
        if "backends" not in path.parts
        and any(name.split(".")[0] == library for name in imported(path))
    ]
    assert offenders == []


def test_the_gateway_and_shared_never_import_mlx() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in modules("gateway", "shared")
        if any(name.split(".")[0] in ("mlx", "mlx_lm") for name in imported(path))
    ]
    assert offenders == []


@pytest.mark.parametrize(
    "path", modules("worker", "gateway"), ids=lambda p: str(p.relative_to(ROOT))
)
def test_files_stay_under_500_lines(path: Path) -> None:
    assert len(path.read_text(encoding="utf-8").splitlines()) <= 500


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _gateway_imports(path: Path, top_level: bool) -> set[str]:
    """The gateway modules `path` imports: at module level (TYPE_CHECKING blocks included),
    or inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = [n for n in tree.body]
    body += [c for n in tree.body if isinstance(n, ast.If) for c in n.body]
    nodes = body if top_level else [n for n in ast.walk(tree) if n not in body]
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.split(".")[0] == "gateway"}


def _gateway_graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in modules("gateway")}
    return {
        name: {m for m in _gateway_imports(path, top_level=True) if m in paths and m != name}
        for name, path in paths.items()
    }


def test_the_gateway_has_no_import_cycle() -> None:
    graph = _gateway_graph()
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(name) :]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_only_gatewayctl_imports_gateway_modules_lazily() -> None:
    """Function-level imports would hide a cycle; gatewayctl's keep its commands quick to
    start (`serve` imports the server only when it runs)."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in modules("gateway")
        if "ctl" not in path.parts and _gateway_imports(path, top_level=False)
    ]
    assert offenders == []


def test_nothing_on_the_request_path_imports_gatewayctl() -> None:
    offenders = sorted(
        name
        for name, deps in _gateway_graph().items()
        if not name.startswith(("gateway.ctl", "gateway.__main__"))
        and any(dep.startswith("gateway.ctl") for dep in deps)
    )
    assert offenders == []


def test_the_request_path_reaches_the_workers_only_through_their_client() -> None:
    """gateway/edge and gateway/api see WorkerClient, its views and streams, never a slot, a
    process or the supervisor behind them."""
    graph = _gateway_graph()
    offenders = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        if name.startswith(("gateway.edge", "gateway.api"))
        for dep in deps
        if dep.startswith("gateway.workers") and dep != "gateway.workers.client"
    )
    assert offenders == []
