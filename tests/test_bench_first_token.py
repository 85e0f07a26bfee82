"""benchmarks/first_token.py on the tiny chat model: one line per case, both settings timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import first_token
from shared.blas import CUDNN_SDPA


@pytest.mark.usefixtures("no_mlx_settings")
def test_each_case_times_both_settings(
    chat_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CUDNN_SDPA, "1")  # set: it wins over the worker's default
    argv = [str(chat_model), "--cases", "0x12,2x12x3", "--trials", "2"]
    assert first_token.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(c["running"], c["prompt"], c["joiners"]) for c in lines] == [(0, 12, 1), (2, 12, 3)]
    assert {c["cudnn_sdpa"] for c in lines} == {"1"}
    for case in lines:
        for setting in ("prefill", "step"):
            low, median, high = case[setting]
            assert 0 < low <= median <= high
        assert case["step_step_ms"] > 0 if case["running"] else case["step_step_ms"] >= 0


@pytest.mark.parametrize("bad", [["--cases", "8"], ["--cases", "1x2x2"], ["--trials", "1"]])
def test_bad_arguments_are_refused_before_loading(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        first_token.main(["/nonexistent-model", *bad])
    assert exit_info.value.code == 2
