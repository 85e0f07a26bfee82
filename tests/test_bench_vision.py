"""benchmarks/vision.py at its smallest: a tiny Qwen2-VL built for the run, two requests a
level through mlx-vlm, the engine and a launched gateway, every source measured."""

from __future__ import annotations

import json

import pytest

from benchmarks import vision

pytest.importorskip("mlx_vlm")


def test_every_source_is_measured_at_every_concurrency(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # restored after (the script sets it for itself)
    argv = ["--shape", "tiny", "--concurrency", "1,2", "--requests", "2", "--repeats", "1"]
    argv += ["--max-tokens", "4", "--image", "56", "--wait-idle", "0", "--retries", "0"]
    assert vision.main(argv) == 0
    facts, *lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert facts["machine"]["cores"] and facts["machine"]["mlx_device"]
    assert facts["model"]["shape"] == "tiny" and facts["model"]["image_tokens"] > 0
    assert [(line["concurrency"], "median" in line) for line in lines] == [
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    ]
    for line in lines:
        for source in vision.SOURCES:
            assert line[source]["req_s"] > 0 and line[source]["tok_s"] > 0, line
        # the engine and the gateway ignore EOS; mlx-vlm stops where the model does
        assert line["engine"]["tokens_per_request"] == 4
        assert line["gateway"]["tokens_per_request"] == 4
        assert 0 < line["mlx-vlm"]["tokens_per_request"] <= 4
    assert lines[1]["gateway/mlx-vlm"]["req_s"] > 0 and lines[1]["engine/mlx-vlm"]["tok_s"] > 0


@pytest.mark.parametrize(
    "bad",
    [["--concurrency", "0"], ["--concurrency", "x"], ["--requests", "0"], ["--sources", "vllm"]],
)
def test_bad_arguments_are_refused_before_loading(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        vision.main(["/nonexistent-model", *bad])
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err
