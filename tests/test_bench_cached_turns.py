"""benchmarks/cached_turns.py on the tiny chat model: a line per setting and trace, the
cache's turns finding the history before them, the uncached ones nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import cached_turns


@pytest.mark.usefixtures("no_mlx_settings")
def test_turns_with_and_without_the_prefix_cache(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(chat_model), "--system", "96", "--turns", "3", "--reply", "4", "--traces", "2"]
    assert cached_turns.main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["setting"], line["trace"]) for line in lines] == [
        ("cache", 0),
        ("cache", 1),
        ("nocache", 0),
        ("nocache", 1),
    ]
    for line in lines:
        assert line["cudnn_sdpa"] == "0"  # MLX as a worker runs it
        prompts = line["prompt"]
        assert prompts[0] == 96 and prompts[1] == 96 + 4 + 150 and prompts[2] > prompts[1]
        assert all(ms > 0 for ms in line["ms"])
        if line["setting"] == "nocache":
            assert line["cached"] == [0, 0, 0]
        else:  # each later turn finds the turn before it, its reply included
            assert line["cached"][0] < 16
            for t in (1, 2):
                assert prompts[t - 1] <= line["cached"][t] < prompts[t]


@pytest.mark.usefixtures("no_mlx_settings")
def test_settings_chosen_run_in_their_order(
    chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(chat_model), "--system", "40", "--turns", "2", "--reply", "2", "--traces", "1"]
    assert cached_turns.main([*argv, "--settings", "nocache-mlxattn,cache-mlxattn"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["setting"] for line in lines] == ["nocache-mlxattn", "cache-mlxattn"]
    assert lines[0]["cached"] == [0, 0] and lines[1]["cached"][1] >= 40


@pytest.mark.usefixtures("no_mlx_settings")
def test_an_idle_spell_before_each_later_turn(
    chat_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    idled: list[tuple[float, bool]] = []
    monkeypatch.setattr(cached_turns, "_idle", lambda s, spin: idled.append((s, spin)))
    argv = [str(chat_model), "--system", "40", "--turns", "3", "--reply", "2", "--traces", "1"]
    assert cached_turns.main([*argv, "--settings", "cache", "--idle-ms", "25"]) == 0
    [line] = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert idled == [(0.025, False), (0.025, False)]  # before turns 2 and 3, asleep
    assert (line["idle_ms"], line["idle_spin"]) == (25, False)
    assert cached_turns.main([*argv, "--settings", "cache", "--idle-ms", "25", "--idle-spin"]) == 0
    assert idled[2:] == [(0.025, True), (0.025, True)]
    assert json.loads(capsys.readouterr().out)["idle_spin"] is True


def test_idle_sleeps_or_spins(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(cached_turns.time, "sleep", slept.append)
    cached_turns._idle(0.002, spin=False)
    assert slept == [0.002]
    started = cached_turns.time.perf_counter()
    cached_turns._idle(0.002, spin=True)
    assert slept == [0.002] and cached_turns.time.perf_counter() - started >= 0.002


@pytest.mark.parametrize(
    "argv",
    [["--turns", "0"], ["--settings", "cache,fast"], ["--idle-ms", "-1"], ["--idle-spin"]],
)
def test_bad_arguments_are_refused_before_loading(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cached_turns.main(["/nonexistent-model", *argv])
    assert exit_info.value.code == 2


def test_the_engine_alone_benchmarks_import_no_mlx_before_their_settings() -> None:
    """MLX reads its settings once: the benchmarks set the workers' before they load it."""
    code = (
        "import sys, benchmarks.cached_turns, benchmarks.first_token, benchmarks.cached_prefill, "
        "benchmarks.turn_kernels; "
        "assert 'mlx' not in sys.modules and 'mlx.core' not in sys.modules"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
