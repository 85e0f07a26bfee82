"""benchmarks/tokenize_turns.py on the tiny chat model: a row per prompt size, the ids by
segments the template's, only the newest turn's segments encoded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import tokenize_turns


def test_a_row_per_size_with_the_same_ids(
    chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "turns.json"
    argv = [str(chat_model), "--tokens", "600,300", "--system", "100", "--user", "30"]
    argv += ["--answer", "10", "--repeats", "2", "--out", str(out)]
    assert tokenize_turns.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] >= size for r, size in zip(rows, (300, 600), strict=True)] == [True] * 2
    for row in rows:
        assert row["same"] and 0 < row["new"] < row["segments"]
        assert min(row["render_ms"], row["encode_ms"], row["segments_ms"]) > 0
    assert "segments" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--tokens", "0"], ["--repeats", "0"], ["--system", "0"]])
def test_bad_arguments_are_refused_before_loading(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tokenize_turns.main(["/nonexistent", *bad])
    assert exit_info.value.code == 2
