"""benchmarks/new_shapes.py on the tiny chat model: both drivers timed at every count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import new_shapes


def test_both_drivers_are_timed_at_every_count(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert new_shapes.main([str(chat_model), "--rows", "2,3", "--prompt", "12"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # which driver meets a count first alternates
    assert [(line["rows"], line["driver"], line["first"]) for line in lines] == [
        (2, "forward", True),
        (2, "compiled", False),
        (3, "compiled", True),
        (3, "forward", False),
    ]
    assert all(line["first_ms"] > 0 and line["later_ms"] > 0 for line in lines)


@pytest.mark.parametrize("bad", [["--rows", "0"], ["--rows", "x"], ["--prompt", "4"]])
def test_bad_arguments_are_refused_before_loading(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        new_shapes.main(["/nonexistent-model", *bad])
    assert exit_info.value.code == 2
