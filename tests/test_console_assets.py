"""The console's files: nothing fetched from elsewhere, the vendored library as recorded."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from gateway.console.routes import STATIC

VENDOR = STATIC / "assets" / "vendor"
URL = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")


def test_the_page_loads_only_its_own_files() -> None:
    page = (STATIC / "index.html").read_text()
    for ref in URL.findall(page):
        assert ref.startswith("/console/assets/") or ref.startswith(("#", "data:")), ref
        if ref.startswith("/console/assets/"):
            assert (STATIC / "assets" / ref.removeprefix("/console/assets/")).is_file(), ref
    for own in ("console.js", "console.css"):
        text = (STATIC / "assets" / own).read_text()
        assert not re.search(r"https?://", text), f"{own} names an address elsewhere"


def test_the_vendored_library_is_the_pinned_release_with_its_licence() -> None:
    record = (VENDOR / "README.md").read_text()
    folders = [p for p in VENDOR.iterdir() if p.is_dir()]
    assert [p.name for p in folders] == ["uplot-1.6.32"]
    for folder in folders:
        assert "MIT License" in (folder / "LICENSE").read_text()
        for file in folder.iterdir():
            if file.name == "LICENSE":
                continue
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
            assert f"`{file.name}` {digest}" in record, f"{file} differs from its record"


def test_the_package_ships_the_console_files() -> None:
    """pyproject's package data names every file the page needs (a wheel has only those)."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    globs = re.search(r'"gateway\.console" = \[(.*?)\]', pyproject)
    assert globs is not None
    patterns = re.findall(r'"([^"]+)"', globs.group(1))
    needed = [p for p in STATIC.rglob("*") if p.is_file() and p.suffix != ".md"]
    base = STATIC.parent
    for file in needed:
        assert any(file.relative_to(base).match(pattern) for pattern in patterns), file
