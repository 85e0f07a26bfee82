"""benchmarks/leaving.py on the tiny chat model: every way timed at every row count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import leaving


def test_every_way_is_timed_at_every_count(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(chat_model), "--rows", "1,3", "--length", "12", "--repeats", "2"]
    assert leaving.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["rows"], line["way"]) for line in lines] == [
        (rows, way) for rows in (1, 3) for way in ("per_row", "gather", "concat")
    ]
    assert all(0 < line["host_ms"] <= line["total_ms"] for line in lines)


@pytest.mark.parametrize(
    "bad", [["--rows", "0"], ["--length", "4"], ["--repeats", "0"], ["--rows", "x"]]
)
def test_bad_arguments_are_refused_before_loading(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        leaving.main(["/nonexistent-model", *bad])
    assert exit_info.value.code == 2
