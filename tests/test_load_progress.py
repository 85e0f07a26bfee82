"""Load progress: the loader reports huggingface_hub's download bar; gatewayctl draws it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.ctl.cli import _progress_line
from shared.config import ModelConfig
from worker import loader


def test_hub_download_progress_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[tuple[str, float]] = []

    def report(stage: str, fraction: float) -> None:
        seen.append((stage, fraction))

    def fake_snapshot_download(repo_id: str, **kwargs: Any) -> str:
        bar = kwargs["tqdm_class"](total=4, disable=True)
        for _ in range(4):
            bar.update(1)
        bar.close()
        return str(tmp_path)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    path = loader.resolve_source(ModelConfig(name="m", source="owner/model"), report)
    assert path == tmp_path
    assert seen[0] == ("downloading", -1.0)
    assert [p for _, p in seen[1:]] == [0.25, 0.5, 0.75, 1.0]


def test_progress_line() -> None:
    row = {"stage": "downloading", "progress": 0.5, "memory_bytes": 2**30}
    line = _progress_line("qwen", row, 12.34)
    assert line == "loading qwen  downloading [##########..........]  50%  12.3s  1.00 GiB"
    assert _progress_line("qwen", {"stage": "probing", "progress": -1}, 1.0) == (
        "loading qwen  probing  1.0s"
    )
