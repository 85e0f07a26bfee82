"""The serving benchmark's bookkeeping: what a run cut short (a GPU lease ending, a timeout)
keeps, and repeats merged more than once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import _ceiling, _prompts, serving
from benchmarks._stats import merge_repeats


def level(c: int, tok_s: float, **more: Any) -> dict[str, Any]:
    counts = {"requests": 4, "failures": 0, "completion_tokens": 32}
    spans = {"prompt_tokens_min": 30, "prompt_tokens_max": 32}
    return {"concurrency": c, "output_tok_s": tok_s, **counts, **spans, **more}


def test_repeats_merge_again_without_losing_raw_records() -> None:
    runs = [{"levels": [level(1, 10.0, raw=["a"])]}, {"levels": [level(1, 30.0, raw=["b"])]}]
    first, again = merge_repeats(runs), merge_repeats(runs)
    assert first["levels"][0]["raw"] == again["levels"][0]["raw"] == [["a"], ["b"]]
    assert "raw" in runs[0]["levels"][0]  # the inputs are left as they were
    assert all("raw" not in run for run in again["levels"][0]["runs"])


def test_a_run_cut_short_keeps_the_sources_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Cut(Exception):
        pass

    def ceiling(*args: Any) -> dict[str, Any]:
        return {"levels": [level(c, 100.0 * c) for c in args[-1]]}

    def first_server(*args: Any) -> dict[str, Any]:
        source = args[1]
        if source.name == "b":
            raise Cut  # the second server never answers: the run is killed here
        return {"levels": [level(c, 90.0 * c) for c in args[-1]]}

    monkeypatch.setattr(_ceiling, "run_inprocess", ceiling)
    monkeypatch.setattr(serving, "run_job", first_server)
    monkeypatch.setattr(_prompts, "PromptBank", lambda *args: None)
    out = tmp_path / "bench.json"
    argv = ["--inprocess", str(tmp_path), "--concurrency", "1,8", "--wait-idle", "0"]
    argv += ["--blas", "off", "--out", str(out)]
    argv += ["--target", "a=http://127.0.0.1:1", "--target", "b=http://127.0.0.1:2"]
    with pytest.raises(Cut):
        serving.main(argv)
    # interleaved (the default): c=1 on each source in turn, and b's c=1 never came
    (model,) = json.loads(out.read_text())["models"].values()
    assert [lv["output_tok_s"] for lv in model["inprocess"]["levels"]] == [100.0]
    assert [lv["output_tok_s"] for lv in model["targets"]["a"]["levels"]] == [90.0]
    assert "b" not in model["targets"]
    # all levels at once on each source (as benchmarks/h200.sh runs them)
    with pytest.raises(Cut):
        serving.main([*argv, "--no-interleave"])
    (model,) = json.loads(out.read_text())["models"].values()
    assert [lv["output_tok_s"] for lv in model["inprocess"]["levels"]] == [100.0, 800.0]
    assert [lv["output_tok_s"] for lv in model["targets"]["a"]["levels"]] == [90.0, 720.0]
    assert "b" not in model["targets"]
    # and its tables print from what was kept
    capsys.readouterr()
    assert serving.main(["--report", str(out)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[:3] for line in table[1:]] == [
        ["| inprocess", "1", "100.0"],
        ["| a", "1", "90.0"],
        ["| inprocess", "8", "800.0"],
        ["| a", "8", "720.0"],
    ]


def test_a_report_of_a_file_that_is_not_a_run_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other.json"
    other.write_text('{"rows": [1, 2]}')
    for path in (tmp_path / "missing.json", other):
        assert serving.main(["--report", str(path)]) == 2
        assert "not a serving run's JSON" in capsys.readouterr().err
