"""benchmarks/speech.py at its smallest: the tests' tiny Whisper and tiny Qwen3-TTS built for
the run, one request a level through mlx-audio, the engines and a launched gateway, every
source measured and every source doing the same work."""

from __future__ import annotations

import json

import pytest

from benchmarks import speech

pytest.importorskip("mlx_audio")


def test_every_source_is_measured_for_both_tasks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # restored after (the script sets it for itself)
    monkeypatch.setattr(speech.signal, "signal", lambda *_: None)  # pytest keeps its SIGTERM
    argv = ["--stt-shape", "tiny", "--seconds", "1", "--tts-frames", "4", "--concurrency", "1"]
    argv += ["--requests", "1", "--repeats", "1", "--wait-idle", "0"]
    assert speech.main(argv) == 0
    facts, *lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert facts["machine"]["cores"] and facts["machine"]["mlx_audio"]
    assert facts["models"]["transcription"]["n_state"] == 32
    assert facts["models"]["speech"]["frames"] == 4
    assert [(line["task"], line["concurrency"], "median" in line) for line in lines] == [
        (task, 1, median) for task in speech.TASKS for median in (False, True)
    ]
    for line in lines:
        seconds = 1.0 if line["task"] == "transcription" else 4 / 12.5
        for source in speech.SOURCES:
            assert line[source]["rtf"] > 0 and line[source]["audio_s_per_s"] > 0, line
            assert line[source]["audio_s_per_request"] == pytest.approx(seconds, abs=0.01)
        tokens = {line[source]["tokens_per_request"] for source in speech.SOURCES}
        assert len(tokens) == 1 and tokens.pop() > 0, line
    for median in lines[1::2]:
        assert median["same_tokens"] is True
        assert median["gateway/mlx-audio"]["audio_s_per_s"] > 0
        assert median["engine/mlx-audio"]["rtf"] > 0


def test_a_wav_streamed_with_placeholder_sizes_is_timed_by_its_bytes() -> None:
    header = bytearray(speech.clips(0.5, 0, 1)[0].wav[:44])
    header[4:8] = header[40:44] = b"\xff\xff\xff\xff"  # as a streamed WAV's
    assert speech.wav_seconds(bytes(header) + bytes(2 * 8000)) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "bad",
    [["--concurrency", "0"], ["--concurrency", "x"], ["--tasks", "vision"], ["--seconds", "0"]],
)
def test_bad_arguments_are_refused_before_loading(
    bad: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        speech.main(bad)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err
