"""benchmarks/prefill_shapes.py on the tiny chat model: every shape timed, then the long
prompt, then the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import prefill_shapes


def test_every_shape_then_the_long_prompt_then_the_summary(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(chat_model), "--rows", "1,3", "--lengths", "6,9", "--prefix", "4"]
    assert prefill_shapes.main([*argv, "--long", "20", "--chunk", "8"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    shapes, long, summary = lines[:4], lines[4], lines[5]
    assert [(s["rows"], s["length"]) for s in shapes] == [(1, 6), (1, 9), (3, 6), (3, 9)]
    assert all(s["first_ms"] > 0 and s["later_ms"] > 0 for s in shapes)
    assert long["long"] == 20 and long["chunk"] == 8 and long["first_ms"] > 0
    assert summary["shapes"] == 4 and summary["long_again_ms"] == long["again_ms"]
    assert summary["later_ms_median"] > 0


def test_first_uses_only(chat_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(chat_model), "--rows", "2", "--lengths", "5", "--long", "0", "--again", "0"]
    assert prefill_shapes.main(argv) == 0
    shape, summary = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert "later_ms" not in shape and "later_ms_median" not in summary
    assert "long_first_ms" not in summary


@pytest.mark.parametrize(
    "bad", [["--rows", "0"], ["--lengths", "x"], ["--prefix", "-1"], ["--chunk", "0"]]
)
def test_bad_arguments_are_refused_before_loading(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        prefill_shapes.main(["/nonexistent-model", *bad])
    assert exit_info.value.code == 2
