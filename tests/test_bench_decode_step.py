"""benchmarks/decode_step.py on the tiny chat model: both step kinds decode, the report has
one level per concurrency, and bad arguments are refused before any model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import decode_step


@pytest.mark.parametrize("fused", [False, True])
def test_both_steps_are_measured_per_level(chat_model: Path, tmp_path: Path, fused: bool) -> None:
    out = tmp_path / "steps.json"
    argv = ["--model", str(chat_model), "--concurrency", "1,3", "--prompt-tokens", "8"]
    argv += ["--blocks", "2", "--steps", "3", "--out", str(out)] + (["--fused"] if fused else [])
    assert decode_step.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["fused"] is fused
    levels = report["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    for lv in levels:
        assert [len(lv["blocks"][k]) for k in ("upstream", "lean")] == [2, 2]
        assert lv["upstream_ms"] > 0 and lv["lean_ms"] > 0 and lv["lean_vs_upstream"] > 0


@pytest.mark.parametrize(
    "extra", [["--concurrency", "4,x"], ["--concurrency", "0"], ["--blocks", "-1"]]
)
def test_bad_arguments_are_refused(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        decode_step.main(["--model", "/nonexistent", *extra])
    assert exit_info.value.code == 2
    assert "decode_step" in capsys.readouterr().err
