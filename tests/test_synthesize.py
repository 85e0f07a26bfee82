"""The text-to-speech worker parts over a real tiny Qwen3-TTS (random weights: noise at
2 kHz, at most 12 frames a sentence): the preprocessor's 400s, every format decoding to the
duration the terminal output reports, streaming in chunks, concurrent requests progressing
in the same steps, seeds, speed, aborts, a request the model fails on failing alone, the
probe; a fake model injects faults and stands for a model without voices or streaming."""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest

from shared.config import EngineOptions, ModelConfig
from shared.protocol import Add
from shared.types import (
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
from worker.speech.encode import FORMATS, OUTPUT_RATE, wav_header
from worker.speech.synthesize import (
    MAX_INPUT_CHARS,
    PreparedSpeech,
    SpeechEngine,
    SpeechModel,
    SpeechPreprocessor,
    open_synthesizer,
    sentences,
)
from worker.speech.tts_modelgen import build_tiny_tts

ONE = "Hello there, this is one sentence."
TWO = "This is the first sentence of the two we send. And here comes the second one of them."
CHUNK_S = 0.16  # two frames a streamed chunk: a sentence streams in up to six


@pytest.fixture(scope="module")
def opened(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[SpeechEngine, SpeechPreprocessor, list[str]]:
    path = build_tiny_tts(tmp_path_factory.mktemp("tts") / "model")
    with pytest.MonkeyPatch.context() as patch:  # open_synthesizer sets it for its process
        patch.setenv("HF_HUB_OFFLINE", "1")
        return open_synthesizer(ModelConfig("tts", str(path)), path)


@pytest.fixture(scope="module")
def model(opened: tuple[SpeechEngine, SpeechPreprocessor, list[str]]) -> SpeechModel:
    return opened[0].model


@pytest.fixture(scope="module")
def pre(opened: tuple[SpeechEngine, SpeechPreprocessor, list[str]]) -> SpeechPreprocessor:
    return opened[1]


def engine_of(model: SpeechModel, max_running: int = 8, interval: float = CHUNK_S) -> SpeechEngine:
    return SpeechEngine(model, EngineOptions(max_running=max_running), streaming_interval=interval)


def frame(
    rid: str = "r",
    text: str | None = ONE,
    *,
    seed: int | None = 7,
    temperature: float = 1.0,
    priority: int = 0,
    kind: RequestKind = RequestKind.SPEECH,
    **request: Any,
) -> Add:
    request.setdefault("audio_format", "pcm")
    sampling = SamplingParams(temperature=temperature, seed=seed)
    return Add(rid, kind, CanonicalRequest(prompt=text, **request), sampling, priority)


def run(engine: SpeechEngine, *prepared: PreparedSpeech) -> list[list[RequestOutput]]:
    """Every step's outputs until the engine has no work."""
    for request in prepared:
        engine.add(request)
    steps = []
    while engine.has_work:
        steps.append(engine.step())
        assert len(steps) < 100, "the engine does not finish"
    return steps


def by_request(steps: list[list[RequestOutput]]) -> dict[str, list[RequestOutput]]:
    out: dict[str, list[RequestOutput]] = {}
    for outputs in steps:
        for output in outputs:
            out.setdefault(output.request_id, []).append(output)
    return out


def audio_of(outputs: list[RequestOutput]) -> bytes:
    assert [o.finish_reason for o in outputs[:-1]] == [None] * (len(outputs) - 1)
    assert outputs[-1].finish_reason is FinishReason.STOP, outputs[-1].error
    return b"".join(o.audio for o in outputs)


def pcm(outputs: list[RequestOutput]) -> np.ndarray:
    return np.frombuffer(audio_of(outputs), "<i2").astype(np.int32)


def decoded_seconds(data: bytes) -> float:
    with av.open(io.BytesIO(data), "r") as container:
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="s16", layout="mono", rate=OUTPUT_RATE)
        samples = sum(f.samples for x in container.decode(stream) for f in resampler.resample(x))
        samples += sum(f.samples for f in resampler.resample(None))
    return samples / OUTPUT_RATE


# ---- the preprocessor -----------------------------------------------------------------


def test_a_request_is_prepared_with_its_voice_speed_format_and_tokens(
    pre: SpeechPreprocessor, model: SpeechModel
) -> None:
    prepared = pre(frame("a", voice="Echo", speed=1.5, audio_format="FLAC", priority=1))
    assert (prepared.request_id, prepared.text, prepared.voice) == ("a", ONE, "echo")
    assert (prepared.speed, prepared.format, prepared.priority, prepared.seed) == (
        1.5,
        "flac",
        1,
        7,
    )
    assert prepared.temperature is None  # the frame's default: the model's own
    assert model.tokenizer is not None
    assert prepared.prompt == model.tokenizer.encode(ONE) and prepared.prompt
    plain = pre(frame(audio_format=None, temperature=0.0))
    assert (plain.voice, plain.speed, plain.format, plain.temperature) == ("alloy", 1.0, "mp3", 0.0)


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"voice": "onyx"}, "voice", "'onyx' is not one of this model's: alloy, echo, nova"),
        ({"speed": 0.2}, "speed", "between 0.25 and 4.0"),
        ({"speed": 4.5}, "speed", "between 0.25 and 4.0"),
        ({"speed": float("nan")}, "speed", "between"),
        ({"text": ""}, "input", "empty"),
        ({"text": " \n "}, "input", "empty"),
        ({"text": None}, "input", "empty"),
        ({"text": "a" * (MAX_INPUT_CHARS + 1)}, "input", f"at most {MAX_INPUT_CHARS}"),
        ({"audio_format": "ogg"}, "response_format", "not one of mp3, opus, aac, flac, wav, pcm"),
        ({"temperature": -1.0}, "temperature", ">= 0"),
        ({"kind": RequestKind.TRANSCRIPTION}, "model", "/v1/audio/speech"),
    ],
)
def test_a_bad_request_is_a_400_naming_its_field(
    pre: SpeechPreprocessor, change: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(PreprocessError) as caught:
        pre(frame(**change))
    assert caught.value.error.code is ErrorCode.INVALID_REQUEST
    assert caught.value.error.param == param and words in caught.value.error.message


def test_a_format_without_its_encoder_is_refused_by_name(model: SpeechModel) -> None:
    only = SpeechPreprocessor(model, EngineOptions(), formats=["wav", "pcm"])
    with pytest.raises(PreprocessError) as caught:
        only(frame(audio_format="mp3"))
    error = caught.value.error
    assert error.param == "response_format"
    assert error.message.startswith("mp3 is not available") and "wav, pcm" in error.message
    limited = SpeechPreprocessor(model, EngineOptions(max_prompt_tokens=3))
    with pytest.raises(PreprocessError, match="max_prompt_tokens"):
        limited(frame())


def test_sentences_are_cut_at_their_ends_and_short_ones_joined() -> None:
    assert sentences(TWO) == [
        "This is the first sentence of the two we send.",
        "And here comes the second one of them.",
    ]
    assert sentences("Hi. Yes.\nOK then, this line is long enough to stand alone.") == [
        "Hi. Yes. OK then, this line is long enough to stand alone."
    ]
    assert sentences("e.g. 3.14 is pi") == ["e.g. 3.14 is pi"]
    full_stop, exclamation = "\u3002", "\uff01"  # ideographic, full-width
    assert sentences(f"A{full_stop}B{exclamation}", min_chars=1) == [
        f"A{full_stop}",
        f"B{exclamation}",
    ]


# ---- the engine -----------------------------------------------------------------------


def test_each_format_decodes_to_the_duration_it_reports(
    model: SpeechModel, pre: SpeechPreprocessor
) -> None:
    engine = engine_of(model)
    steps = run(engine, *(pre(frame(f, ONE, audio_format=f)) for f in FORMATS))
    outputs = by_request(steps)
    assert sorted(outputs) == sorted(FORMATS)
    for fmt, outs in outputs.items():
        data, last = audio_of(outs), outs[-1]
        assert last.duration is not None and 0.2 < last.duration <= 12 / 12.5 + 0.01
        if fmt == "pcm":
            assert len(data) == 2 * round(last.duration * OUTPUT_RATE)
            continue
        slack = 0.1 if fmt in ("mp3", "aac") else 0.01  # their encoders' padding
        assert last.duration - 0.01 <= decoded_seconds(data) <= last.duration + slack, fmt
    wav = outputs["wav"]
    assert wav[0].audio.startswith(wav_header())  # a streaming header, sizes unknown
    assert engine.counts() == (0, 0) and engine.streamer is None


def test_a_sentence_streams_in_chunks_before_the_terminal_output(
    model: SpeechModel, pre: SpeechPreprocessor
) -> None:
    engine = engine_of(model)
    steps = run(engine, pre(frame("s", ONE)))
    outputs = by_request(steps)["s"]
    assert len(outputs) >= 4 and all(o.audio for o in outputs[:-1])  # 3+ chunks, then the end
    assert [len(step) for step in steps] == [1] * len(steps)  # one output a step
    last = outputs[-1]
    assert last.usage is not None and last.usage.prompt_tokens == len(pre(frame()).prompt)
    assert 3 <= last.usage.completion_tokens <= 12
    assert outputs[0].timings is not None and outputs[-1].timings is None
    assert last.duration is not None
    assert len(pcm(outputs)) == round(last.duration * OUTPUT_RATE)


def test_concurrent_requests_progress_in_the_same_steps(
    model: SpeechModel, pre: SpeechPreprocessor
) -> None:
    engine = engine_of(model)
    steps = run(engine, pre(frame("a", ONE)), pre(frame("b", TWO)))
    for step in steps[:2]:  # a streams its chunks while b's sentences come whole
        assert sorted(o.request_id for o in step if o.audio) == ["a", "b"]
    outputs = by_request(steps)
    assert len(outputs["b"]) == 3  # two sentences, then the end
    assert len(outputs["a"]) > 3
    assert outputs["a"][-1].finish_reason is outputs["b"][-1].finish_reason is FinishReason.STOP


def test_a_seed_gives_the_same_audio_alone_beside_another_and_whole(
    model: SpeechModel, pre: SpeechPreprocessor
) -> None:
    alone = by_request(run(engine_of(model), pre(frame("x", ONE, seed=11))))["x"]
    engine = engine_of(model)
    other, x = pre(frame("other", TWO, seed=5)), pre(frame("x", ONE, seed=11))
    beside = by_request(run(engine, other, x))
    assert len(beside["x"]) == 2  # "other" held the streaming state: x came whole
    one, two = pcm(alone), pcm(beside["x"])
    assert len(one) == len(two) and np.abs(one - two).max() <= 2  # the vocoders' last bits
    third = pcm(by_request(run(engine_of(model), pre(frame("y", ONE, seed=12))))["y"])
    assert len(third) != len(one) or np.abs(third - one).max() > 100


def test_speed_shortens_the_same_speech_without_the_model(
    model: SpeechModel, pre: SpeechPreprocessor
) -> None:
    outputs = by_request(
        run(engine_of(model), pre(frame("n", ONE, seed=3)), pre(frame("f", ONE, seed=3, speed=2.0)))
    )
    normal, fast = outputs["n"][-1], outputs["f"][-1]
    assert normal.usage == fast.usage  # the same frames, tempo changed after
    assert normal.duration and fast.duration
    assert fast.duration == pytest.approx(normal.duration / 2, rel=0.05)
    assert len(pcm(outputs["f"])) == round(fast.duration * OUTPUT_RATE)


def test_requests_beyond_max_running_wait_interactive_first(
    model: SpeechModel, pre: SpeechPreprocessor
) -> None:
    engine = engine_of(model, max_running=1, interval=1.0)
    engine.add(pre(frame("batch", priority=Priority.BATCH)))
    engine.add(pre(frame("first")))
    engine.add(pre(frame("second")))
    assert engine.counts() == (0, 3) and engine.request_ids() == ["first", "second", "batch"]
    order: list[str] = []
    while engine.has_work:
        for output in engine.step():
            if output.finish_reason is not None:
                order.append(output.request_id)
        assert engine.counts()[0] <= 1
    assert order == ["first", "second", "batch"]
    with pytest.raises(ValueError, match="already running"):
        engine.add(pre(frame("dup")))
        engine.add(pre(frame("dup")))


def test_abort_ends_running_and_waiting_requests_and_frees_the_stream(
    model: SpeechModel, pre: SpeechPreprocessor
) -> None:
    engine = engine_of(model, max_running=1)
    engine.add(pre(frame("a", TWO)))
    engine.add(pre(frame("b")))
    assert engine.step()[0].request_id == "a"
    assert engine.streamer is not None and engine.counts() == (1, 1)
    aborted = engine.abort(["b", "a", "unknown"])
    assert sorted((o.request_id, o.finish_reason) for o in aborted) == [
        ("a", FinishReason.ABORT),
        ("b", FinishReason.ABORT),
    ]
    assert not engine.has_work and engine.streamer is None and engine.request_ids() == []
    assert engine.abort(["a"]) == []
    after = pcm(by_request(run(engine, pre(frame("c", ONE, seed=9))))["c"])
    fresh = pcm(by_request(run(engine_of(model), pre(frame("c", ONE, seed=9))))["c"])
    assert len(after) == len(fresh) and np.abs(after - fresh).max() <= 2


def test_a_request_the_model_fails_on_fails_alone(
    model: SpeechModel, pre: SpeechPreprocessor
) -> None:
    engine = engine_of(model)
    bad = PreparedSpeech("bad", ONE, voice="nosuch", format="wav")  # past the preprocessor
    steps = run(engine, bad, pre(frame("good", ONE)))
    outputs = by_request(steps)
    (failed,) = outputs["bad"]
    assert failed.finish_reason is FinishReason.ERROR and failed.error is not None
    assert failed.error.code is ErrorCode.INTERNAL and "nosuch" in failed.error.message
    assert len(audio_of(outputs["good"])) > 0 and engine.streamer is None


def test_the_probe_makes_speech_and_leaves_no_work(model: SpeechModel) -> None:
    engine = engine_of(model)
    engine.probe()
    assert not engine.has_work and engine.steps >= 2 and engine.prefix_cache is None
    assert engine.backend.device in ("cpu", "gpu") and engine.voices == ["alloy", "echo", "nova"]
    engine.backend.release_memory()


def test_open_synthesizer_serves_speech_and_refuses_a_folder_it_cannot_load(
    opened: tuple[SpeechEngine, SpeechPreprocessor, list[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    engine, _, served = opened
    assert served == ["speech"] and engine.model.model_type == "qwen3_tts"
    assert engine.model.streams and not engine.model.native_speed
    with pytest.raises(LoadError, match="cannot load"):
        open_synthesizer(ModelConfig("broken", str(tmp_path)), tmp_path)


# ---- a fake model: faults, and a model without voices or streaming --------------------


@dataclass
class _Result:
    audio: Any
    token_count: int = 1


class _Plain:
    """No speaker table, no streaming: generate(text, voice=...) yields one result."""

    sample_rate = 8000

    def __init__(self, audio: np.ndarray) -> None:
        self.audio = audio
        self.calls: list[tuple[str, str | None]] = []
        self.closed = 0  # generators ended early or late, as an abort or the engine ends them

    def generate(self, text: str, voice: str | None = None) -> Iterator[_Result]:
        self.calls.append((text, voice))
        try:
            yield _Result(self.audio)
        finally:
            self.closed += 1


def test_a_model_without_voices_or_streaming_speaks_a_sentence_a_step() -> None:
    fake = _Plain(np.full(800, 0.25, np.float32))
    speech = SpeechModel(fake)
    assert (speech.voices, speech.streams, speech.tokenizer) == ([], False, None)
    prepared = SpeechPreprocessor(speech, EngineOptions())(frame("p", TWO, voice="anyone"))
    assert prepared.voice == "anyone" and prepared.prompt == []
    steps = run(engine_of(speech), prepared)
    assert [len(s) for s in steps] == [1, 1, 1]  # a sentence each, then the end
    assert fake.calls == [(s, "anyone") for s in sentences(TWO)]
    assert steps[-1][0].duration == pytest.approx(0.2, abs=0.01)  # 2 x 800 samples at 8 kHz


class _OneVoice(_Plain):
    """A model that takes no voice at all."""

    def generate(self, text: str) -> Iterator[_Result]:  # type: ignore[override]
        yield _Result(self.audio)


def test_a_model_of_one_voice_refuses_another_by_name() -> None:
    speech = SpeechModel(_OneVoice(np.full(800, 0.25, np.float32)))
    prepare = SpeechPreprocessor(speech, EngineOptions())
    assert prepare(frame("a", TWO)).voice is None
    assert prepare(frame("b", TWO, voice="default")).voice is None
    with pytest.raises(PreprocessError) as caught:
        prepare(frame("c", TWO, voice="alloy"))
    assert caught.value.error.param == "voice" and "one voice" in caught.value.error.message


def test_an_abort_closes_the_generator_it_stops() -> None:
    fake = _Plain(np.full(800, 0.25, np.float32))
    engine = engine_of(SpeechModel(fake))
    engine.add(PreparedSpeech("a", TWO, format="mp3"))
    assert [o.request_id for o in engine.step()] == ["a"] and fake.closed == 0
    assert [o.finish_reason for o in engine.abort(["a"])] == [FinishReason.ABORT]
    assert fake.closed == 1 and len(fake.calls) == 1 and not engine.has_work


def test_non_finite_audio_fails_its_request_and_the_probe() -> None:
    engine = engine_of(SpeechModel(_Plain(np.full(800, np.nan, np.float32))))
    with pytest.raises(RuntimeError, match="non-finite audio"):
        engine.probe()
    assert not engine.has_work
