"""benchmarks/arrivals.py on the tiny chat model: both modes run and report their figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import arrivals


def _measure(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    """arrivals' JSON lines for these arguments."""
    assert arrivals.main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_waves_and_spread_arrivals_are_measured(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(chat_model), "--concurrency", "2", "--requests", "4", "--batchers", "mlx_lm,rows"]
    rows = _measure(argv, capsys)
    assert [(r["mode"], r["batcher"]) for r in rows] == [
        ("waves", "mlx_lm"),
        ("waves", "rows"),
        ("spread", "mlx_lm"),
        ("spread", "rows"),
    ]
    for row in rows:
        assert row["concurrency"] == 2 and row["tok_s"] > 0 and row["step_ms"] > 0
        assert row["ttft_p50_ms"] is not None and row["steps"] > arrivals.WARM_STEPS


def test_the_cost_of_one_join_is_measured(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(chat_model), "--modes", "join", "--concurrency", "2", "--join", "1,3"]
    rows = _measure(argv, capsys)
    assert [(r["mode"], r["k"]) for r in rows] == [("join", 1), ("join", 3)]
    for row in rows:
        # a prompt's token comes after its prefill and its first step: two calls at least
        assert row["next_calls"] >= 2 and row["plain_steps_ms"] > 0
        assert row["first_ms"] > 0 and row["reuse_ms"] > 0


def test_the_rows_batch_is_measured_for_each_settle(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(chat_model), "--modes", "join,spread", "--concurrency", "2", "--join", "2"]
    argv += ["--requests", "4", "--batchers", "rows,mlx_lm", "--settle", "0,2"]
    rows = _measure(argv, capsys)
    labels = [("rows", 0), ("rows", 2), ("mlx_lm", None)]
    assert [(r["mode"], r["batcher"], r.get("settle")) for r in rows] == [
        *[("join", b, settle) for b, settle in labels],
        *[("spread", b, settle) for b, settle in labels],
    ]
    for row in rows[:3]:
        assert row["next_calls"] >= 2 and row["first_ms"] > 0 and row["reuse_ms"] > 0
    for row in rows[3:]:
        assert row["tok_s"] > 0 and row["steps"] > arrivals.WARM_STEPS


@pytest.mark.parametrize(
    "bad",
    [
        ["--modes", "bursts"],
        ["--concurrency", "x"],
        ["--concurrency", "0"],
        ["--requests", "0"],
        ["--join", "0"],
        ["--batchers", "vllm"],
        ["--settle", "x"],
        ["--settle", "-2"],
    ],
)
def test_bad_arguments_are_refused_before_loading(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        arrivals.main(["/nonexistent-model", *bad])
    assert exit_info.value.code == 2  # argparse's usage error, not a failed load
    assert "error:" in capsys.readouterr().err
