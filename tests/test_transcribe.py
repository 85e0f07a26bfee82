"""The speech-to-text worker parts over a real tiny Whisper (scripted: it says " hello world"
and hears German): the preprocessor's 400s, the engine's one terminal output per request with
segments and words when asked, language given or detected, translation, the order requests
go in, aborts, counts, and a request the model fails on failing alone."""

from __future__ import annotations

import io
import math
import shutil
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.config import EngineOptions, ModelConfig
from shared.protocol import Add
from shared.types import (
    AudioPart,
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    Priority,
    RequestKind,
    RequestOutput,
    SamplingParams,
)
from worker.loader import LoadError
from worker.preprocess import PreprocessError
from worker.speech.stt_modelgen import build_tiny_whisper
from worker.speech.transcribe import (
    Languages,
    PreparedTranscription,
    TranscriptionEngine,
    TranscriptionPreprocessor,
    _temperatures,
    open_transcriber,
)

TRANSCRIBE, TRANSLATE = RequestKind.TRANSCRIPTION, RequestKind.TRANSLATION


def wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buf.getvalue()


WAV = wav()


def frame(
    rid: str = "r",
    kind: RequestKind = TRANSCRIBE,
    *,
    audio: bytes | None = WAV,
    temperature: float = 0.0,
    priority: int = 0,
    **request: Any,
) -> Add:
    part = AudioPart(audio, "wav") if audio is not None else None
    return Add(
        rid,
        kind,
        CanonicalRequest(audio=part, **request),
        SamplingParams(temperature=temperature),
        priority,
    )


@pytest.fixture(scope="module")
def opened(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[TranscriptionEngine, TranscriptionPreprocessor, list[str]]:
    path = build_tiny_whisper(tmp_path_factory.mktemp("whisper"))
    return open_transcriber(ModelConfig("whisper", str(path)), path)


@pytest.fixture
def prep(opened: tuple[Any, TranscriptionPreprocessor, Any]) -> TranscriptionPreprocessor:
    return opened[1]


@pytest.fixture
def engine(opened: tuple[TranscriptionEngine, Any, Any]) -> TranscriptionEngine:
    """A fresh engine over the module's loaded model."""
    return TranscriptionEngine(opened[0].model, EngineOptions())


@pytest.fixture
def calls(engine: TranscriptionEngine, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What the engine asks of the model (it still runs): each call's keyword arguments."""
    seen: list[dict[str, Any]] = []
    real = engine.model.generate

    def generate(audio: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real(audio, **kwargs)

    monkeypatch.setattr(engine.model, "generate", generate)
    return seen


def run(engine: TranscriptionEngine) -> list[RequestOutput]:
    """Step until idle; every output in order."""
    outputs: list[RequestOutput] = []
    for _ in range(20):
        if not engine.has_work:
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine did not finish")


def transcribe(
    engine: TranscriptionEngine, prep: TranscriptionPreprocessor, add: Add
) -> RequestOutput:
    assert engine.add(prep(add)) is None
    [output] = run(engine)
    assert output.request_id == add.request_id
    return output


def rejected(prep: TranscriptionPreprocessor, add: Add) -> tuple[str, str | None]:
    with pytest.raises(PreprocessError) as caught:
        prep(add)
    assert caught.value.error.code == ErrorCode.INVALID_REQUEST
    return caught.value.error.message, caught.value.error.param


# ---- opening and the plain answer ---------------------------------------------------------


def test_a_multilingual_whisper_serves_transcription_and_translation(opened: Any) -> None:
    engine, prep, served = opened
    assert served == ["transcription", "translation"]
    assert prep.languages.multilingual and len(prep.languages.codes) == 99
    assert engine.backend.device in ("cpu", "gpu") and engine.prefix_stats() is None
    engine.probe()


def test_a_transcription_is_one_terminal_output_with_the_text(
    engine: TranscriptionEngine, prep: TranscriptionPreprocessor
) -> None:
    out = transcribe(engine, prep, frame("a"))
    assert out.finish_reason is FinishReason.STOP and out.error is None
    assert out.text == "hello world"
    assert out.language == "de"  # detected: what the scripted model hears
    assert out.duration == 1.0
    assert out.segments == []  # none asked
    # <|0.00|> and <|1.00|> around the text's tokens
    assert out.usage is not None and out.usage.prompt_tokens == 0
    assert out.usage.completion_tokens >= 4
    assert out.timings is not None and out.timings.prefill_s > 0


def test_segments_when_asked_and_words_only_for_word(
    engine: TranscriptionEngine, prep: TranscriptionPreprocessor
) -> None:
    out = transcribe(engine, prep, frame("s", timestamps=["segment"]))
    [segment] = out.segments
    assert (segment.id, segment.start, segment.end) == (0, 0.0, 1.0)
    assert segment.text == " hello world" and segment.words == []
    assert len(segment.tokens) == out.usage.completion_tokens  # type: ignore[union-attr]
    assert segment.temperature == 0.0 and segment.avg_logprob < 0
    assert segment.compression_ratio > 0 and 0 <= segment.no_speech_prob < 0.5

    out = transcribe(engine, prep, frame("w", timestamps=["word"], language="en"))
    [segment] = out.segments
    assert [w.word for w in segment.words] == ["hello", "world"]
    times = [t for w in segment.words for t in (w.start, w.end)]
    assert times == sorted(times) and times[0] >= 0.0 and times[-1] <= segment.end <= 1.0


def test_a_language_given_by_code_or_name_is_used_and_an_unknown_one_is_a_400(
    engine: TranscriptionEngine, prep: TranscriptionPreprocessor, calls: list[dict[str, Any]]
) -> None:
    assert transcribe(engine, prep, frame("en", language="en")).language == "en"
    assert transcribe(engine, prep, frame("fr", language="French")).language == "fr"
    assert [c["language"] for c in calls] == ["en", "fr"]
    for unknown in ("xx", "klingon", "yue"):  # yue: large-v3's 100th, not this model's
        message, param = rejected(prep, frame(language=unknown))
        assert param == "language" and repr(unknown) in message


def test_a_translation_asks_the_model_to_translate(
    engine: TranscriptionEngine, prep: TranscriptionPreprocessor, calls: list[dict[str, Any]]
) -> None:
    out = transcribe(engine, prep, frame("t", TRANSLATE, language="de"))
    assert out.finish_reason is FinishReason.STOP and out.text == "hello world"
    assert out.language == "de"  # the language heard
    assert calls[0]["task"] == "translate" and calls[0]["language"] == "de"


def test_the_prompt_goes_before_the_audio(
    engine: TranscriptionEngine, prep: TranscriptionPreprocessor, calls: list[dict[str, Any]]
) -> None:
    prepared = prep(frame("p", prompt="hello"))
    assert prepared.initial_prompt == "hello"
    assert not hasattr(prepared, "prompt")  # the worker logs len(prompt) when there is one
    engine.add(prepared)
    [out] = run(engine)
    assert calls[0]["initial_prompt"] == "hello"
    # the scripted model's words follow positions: text before the audio changes them
    assert out.finish_reason is FinishReason.STOP and out.text != "hello world"


def test_temperature_starts_whispers_fallback_schedule(
    engine: TranscriptionEngine, prep: TranscriptionPreprocessor, calls: list[dict[str, Any]]
) -> None:
    assert _temperatures(0.0) == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert _temperatures(0.5) == (0.5, 0.7, 0.9)
    assert _temperatures(1.0) == (1.0,)
    transcribe(engine, prep, frame("warm", language="en", temperature=0.9))
    assert calls[0]["temperature"] == (0.9,)
    for bad in (-0.1, 1.5, math.nan):
        assert rejected(prep, frame(temperature=bad))[1] == "temperature"


# ---- the preprocessor's 400s --------------------------------------------------------------


def test_requests_the_model_cannot_serve_are_400s_naming_the_field(
    prep: TranscriptionPreprocessor,
) -> None:
    assert rejected(prep, frame(kind=RequestKind.CHAT))[1] == "model"
    message, param = rejected(prep, frame(timestamps=["segment", "sentence"]))
    assert param == "timestamp_granularities" and "'sentence'" in message
    assert rejected(prep, frame(audio=None))[1] == "file"
    assert rejected(prep, frame(audio=b"\x00garbage" * 64))[1] == "file"
    assert rejected(prep, frame(audio=b""))[1] == "file"
    short = TranscriptionPreprocessor(prep.languages, max_seconds=0.5)
    message, param = rejected(short, frame())
    assert param == "file" and "longer than 0.5 s" in message


def test_a_prepared_request_carries_what_the_engine_needs(prep: TranscriptionPreprocessor) -> None:
    prepared = prep(
        frame("x", TRANSLATE, temperature=0.2, priority=Priority.BATCH, timestamps=["word"])
    )
    assert (prepared.task, prepared.temperature, prepared.priority) == ("translate", 0.2, 1)
    assert prepared.segments and prepared.words and prepared.language is None
    assert prepared.audio.dtype == np.float32 and prepared.audio.shape == (16000,)
    assert prepared.duration == 1.0


def test_an_english_only_model_refuses_translation_and_other_languages() -> None:
    english = TranscriptionPreprocessor(Languages(("en",), {"english": "en"}, multilingual=False))
    message, param = rejected(english, frame(kind=TRANSLATE))
    assert param == "model" and "English-only" in message
    assert rejected(english, frame(language="de"))[1] == "language"
    assert english(frame(language="English")).language == "en"


# ---- the engine: order, aborts, counts, faults --------------------------------------------


def test_interactive_requests_go_first_and_counts_follow(
    engine: TranscriptionEngine, prep: TranscriptionPreprocessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.add(prep(frame("batch", priority=Priority.BATCH, language="en")))
    engine.add(prep(frame("i1", language="en")))
    engine.add(prep(frame("i2", language="en")))
    assert engine.has_work and engine.counts() == (0, 3)
    assert engine.request_ids() == ["batch", "i1", "i2"]
    during: list[tuple[tuple[int, int], list[str]]] = []
    real = engine.model.generate

    def generate(audio: Any, **kwargs: Any) -> Any:
        during.append((engine.counts(), engine.request_ids()))
        return real(audio, **kwargs)

    monkeypatch.setattr(engine.model, "generate", generate)
    order = [o.request_id for o in run(engine)]
    assert order == ["i1", "i2", "batch"]
    assert during[0] == ((1, 2), ["i1", "batch", "i2"])
    assert during[2] == ((1, 0), ["batch"])
    assert not engine.has_work and engine.counts() == (0, 0) and engine.request_ids() == []
    assert engine.steps == 3


def test_an_abort_ends_a_waiting_request_and_nothing_else(
    engine: TranscriptionEngine, prep: TranscriptionPreprocessor
) -> None:
    for rid in ("a", "b", "c"):
        engine.add(prep(frame(rid, language="en")))
    aborted = engine.abort(["b", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in aborted] == [("b", FinishReason.ABORT)]
    assert engine.abort(["b"]) == [] and engine.counts() == (0, 2)
    outputs = run(engine)
    assert [(o.request_id, o.text) for o in outputs] == [("a", "hello world"), ("c", "hello world")]


def test_a_request_the_model_fails_on_fails_alone(
    engine: TranscriptionEngine, prep: TranscriptionPreprocessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    poison = len(prep(frame(audio=wav(0.5))).audio)
    real = engine.model.generate

    def generate(audio: Any, **kwargs: Any) -> Any:
        if len(audio) == poison:
            raise RuntimeError("decoder blew up")
        return real(audio, **kwargs)

    monkeypatch.setattr(engine.model, "generate", generate)
    engine.add(prep(frame("ok1", language="en")))
    engine.add(prep(frame("bad", audio=wav(0.5), language="en")))
    engine.add(prep(frame("ok2", language="en")))
    outputs = {o.request_id: o for o in run(engine)}
    bad = outputs["bad"]
    assert bad.finish_reason is FinishReason.ERROR and bad.error is not None
    assert bad.error.code == ErrorCode.INTERNAL and "decoder blew up" in bad.error.message
    for rid in ("ok1", "ok2"):
        assert outputs[rid].finish_reason is FinishReason.STOP
        assert outputs[rid].text == "hello world"
    assert not engine.has_work


def test_the_probe_raises_when_the_model_cannot_transcribe(
    engine: TranscriptionEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(audio: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no weights")

    monkeypatch.setattr(engine.model, "generate", broken)
    with pytest.raises(RuntimeError, match="no weights"):
        engine.probe()


def test_duplicates_are_refused_and_a_full_engine_answers_overloaded(
    opened: tuple[TranscriptionEngine, TranscriptionPreprocessor, Any],
) -> None:
    model, prep = opened[0].model, opened[1]
    engine = TranscriptionEngine(model, EngineOptions(max_running=1, max_waiting=1))
    prepared: Callable[[str], PreparedTranscription] = lambda rid: prep(frame(rid))  # noqa: E731
    assert engine.add(prepared("a")) is None
    with pytest.raises(ValueError, match="already"):
        engine.add(prepared("a"))
    assert engine.add(prepared("b")) is None
    full = engine.add(prepared("c"))
    assert full is not None and full.finish_reason is FinishReason.ERROR
    assert full.error is not None and full.error.code == ErrorCode.OVERLOADED
    assert engine.request_ids() == ["a", "b"]
    # waiting audio is bounded too: the first request always goes in
    engine = TranscriptionEngine(model, EngineOptions(), max_waiting_audio_s=1.5)
    assert engine.add(prep(frame("long", audio=wav(2.0)))) is None
    refused = engine.add(prepared("next"))
    assert refused is not None and refused.error is not None
    assert refused.error.code == ErrorCode.OVERLOADED and "2 s of audio" in refused.error.message


def test_a_folder_that_is_no_whole_whisper_is_a_load_error(
    opened: tuple[TranscriptionEngine, Any, Any], tmp_path: Path
) -> None:
    with pytest.raises(LoadError, match="cannot load"):
        open_transcriber(ModelConfig("empty", str(tmp_path)), tmp_path)
    source = build_tiny_whisper(tmp_path / "whole")
    headless = tmp_path / "no-tokenizer"
    headless.mkdir()
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        shutil.copy(source / name, headless / name)
    with pytest.raises(LoadError, match="no Whisper tokenizer"):
        open_transcriber(ModelConfig("headless", str(headless)), headless)


def test_a_long_transcription_keeps_the_step_counter_moving_until_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Heartbeats carry `steps`: it goes on while one request is transcribed (a second at a
    time), up to twice its audio plus a minute, then stands still (a wedge)."""
    import worker.speech.transcribe as transcribe

    clock = [1000.0]
    monkeypatch.setattr(transcribe.time, "monotonic", lambda: clock[0])
    engine = TranscriptionEngine.__new__(TranscriptionEngine)
    engine._steps, engine._busy = 3, (1000.0, 1000.0 + 2 * 10 + 60)
    assert engine.steps == 3
    clock[0] += 5.5
    assert engine.steps == 8
    clock[0] += 1000
    assert engine.steps == 3 + 80  # stands still past the deadline
    engine._busy = None
    assert engine.steps == 3
