"""benchmarks/first_use.py on the tiny chat model: the probe's line, then the loop's; the
modules listed are the PTX cache's files, those written during the loop apart."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import first_use


def test_the_probe_then_the_loop(
    chat_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    cache = tmp_path / "ptx"
    argv = [str(chat_model), "--ptx-cache", str(cache), "--requests", "10", "--inflight", "4"]
    assert first_use.main([*argv, "--slow-ms", "0.001", "--label", "fresh"]) == 0
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(cache)
    probe, loop = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert probe["label"] == loop["label"] == "fresh"
    assert probe["probe_s"] > 0 and probe["ptx_cache"] == str(cache)
    assert probe["compiled_by_probe"] == {} and loop["compiled_after_probe"] == {}  # MLX's CPU
    # every step is slower than 1 us: each is listed, by index
    assert loop["steps"] >= 10 and [s[0] for s in loop["slow_steps"]] == list(
        range(1, loop["steps"] + 1)
    )


def test_modules_are_the_cache_s_files_by_when_they_were_written(tmp_path: Path) -> None:
    (tmp_path / "long").mkdir()
    for name in ("gather_a.ptx", "long/gather_b.ptx", "gather_a.txt"):
        (tmp_path / name).write_text("x")
    os.utime(tmp_path / "gather_a.ptx", (100.0, 100.0))
    os.utime(tmp_path / "long/gather_b.ptx", (102.5, 102.5))
    assert first_use.compiled(tmp_path, 100.0) == {"gather_a": 0.0, "gather_b": 2.5}
    assert first_use.compiled(None, 0.0) == {} == first_use.compiled(tmp_path / "none", 0.0)


@pytest.mark.parametrize("bad", [["--requests", "0"], ["--inflight", "0"], ["--slow-ms", "0"]])
def test_bad_arguments_are_refused_before_loading(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        first_use.main(["/nonexistent", *bad])
    assert exit_info.value.code == 2
