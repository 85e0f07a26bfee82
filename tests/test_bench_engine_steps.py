"""benchmarks/engine_steps.py on the tiny chat model: every driver's step is timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import engine_steps


def test_every_driver_is_timed_at_every_size(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        str(chat_model),
        "--rows",
        "1,3",
        "--steps",
        "5",
        "--repeats",
        "1",
        "--max-running",
        "4",
    ]
    assert engine_steps.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["rows"], line["repeat"]) for line in lines] == [(1, 0), (3, 0)]
    for line in lines:
        # generate_step is single-stream: timed at one row only
        drivers = [d for d in engine_steps.DRIVERS if d != "generate_step" or line["rows"] == 1]
        assert all(line[driver] > 0 for driver in drivers), line
    assert "generate_step" in lines[0] and "generate_step" not in lines[1]


def test_drivers_can_be_picked(chat_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(chat_model), "--rows", "2", "--steps", "3", "--repeats", "1"]
    argv += ["--max-running", "2", "--drivers", "engine-rows,engine-compiled"]
    assert engine_steps.main(argv) == 0
    (line,) = [json.loads(text) for text in capsys.readouterr().out.splitlines()]
    assert set(line) == {"rows", "repeat", "engine-rows", "engine-compiled"}


def test_ragged_rows_are_of_different_lengths_and_timed(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lengths = {len(p) for p in engine_steps.prompts(32, ragged=True)}
    assert len(lengths) == 16 and max(lengths) == len(engine_steps.PROMPT)
    assert {len(p) for p in engine_steps.prompts(32, ragged=False)} == {len(engine_steps.PROMPT)}
    argv = [str(chat_model), "--rows", "3", "--steps", "3", "--repeats", "1", "--ragged"]
    argv += ["--max-running", "3", "--drivers", "batchgenerator,engine-fused"]
    assert engine_steps.main(argv) == 0
    (line,) = [json.loads(text) for text in capsys.readouterr().out.splitlines()]
    assert line["ragged"] is True and line["batchgenerator"] > 0 and line["engine-fused"] > 0


def test_a_compiled_step_that_cannot_be_built_is_null_not_the_forward_pass(
    chat_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.backends import decode_step

    monkeypatch.setattr(decode_step, "build", lambda *args, **kwargs: None)
    argv = [str(chat_model), "--rows", "1", "--steps", "3", "--repeats", "1", "--max-running", "1"]
    argv += ["--drivers", "engine-rows,engine-compiled,engine-fused"]
    assert engine_steps.main(argv) == 0
    (line,) = [json.loads(text) for text in capsys.readouterr().out.splitlines()]
    assert line["engine-rows"] > 0 and line["engine-compiled"] is None
    assert line["engine-fused"] is None


@pytest.mark.parametrize(
    "bad",
    [
        ["--rows", "0"],
        ["--rows", "x"],
        ["--steps", "0"],
        ["--rows", "8", "--max-running", "4"],
        ["--drivers", "engine-rows,warp"],
    ],
)
def test_bad_arguments_are_refused_before_loading(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        engine_steps.main(["/nonexistent-model", *bad])
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err
