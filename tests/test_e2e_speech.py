"""Speech end to end: the official openai SDK and plain multipart HTTP against a real gateway
and real speech workers (a tiny scripted Whisper that says " hello world" and hears German;
a tiny random text-to-speech model): every transcription format, translation, speech in
each format streamed and not, concurrent requests, the 400s and 413, and a worker dying with
a request in it."""

from __future__ import annotations

import io
import json
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import av
import httpx
import numpy as np
import openai
import pytest

from tests.gateway_proc import GatewayProc, openai_client, running_gateway
from worker.speech.stt_modelgen import build_tiny_whisper
from worker.speech.tts_modelgen import build_tiny_tts

pytest.importorskip("mlx_audio")


def wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()


WAV = wav()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, chat_model: Path) -> Iterator[GatewayProc]:
    whisper = build_tiny_whisper(tmp_path_factory.mktemp("whisper"))
    tts = build_tiny_tts(tmp_path_factory.mktemp("tts"))
    models: list[dict[str, Any]] = [
        {"name": "whisper", "source": str(whisper)},
        {"name": "tts", "source": str(tts)},
        # loaded with the others (the tests then wait only for their restarts)
        {"name": "fragile", "source": str(whisper)},
        {"name": "text", "source": str(chat_model), "preload": False},
        {"name": "fragile-tts", "source": str(tts)},
    ]
    faults = {
        "fragile": {"crash_on": "CRASH", "crash_before_token": True},
        "fragile-tts": {"crash_on": "CRASH"},  # dies once that request's first audio left
    }
    env = {"MLX_GATEWAY_FAULTS": json.dumps(faults)}
    server = {
        "request_timeout_s": 60.0,
        "audio_max_bytes": 200_000,  # a small upload cap, to see it enforced
        # the fragile models' deaths: each next worker after 0.2 s, not the default 1 s
        # doubling per death
        "restart_backoff_s": 0.2,
        "restart_backoff_max_s": 1.0,
    }
    with running_gateway(models, env, **server) as proc:
        yield proc


@pytest.fixture(scope="module")
def oai(gw: GatewayProc) -> openai.OpenAI:
    return openai_client(gw)


def test_every_transcription_format(oai: openai.OpenAI) -> None:
    plain = oai.audio.transcriptions.create(model="whisper", file=("a.wav", WAV))
    assert plain.text == "hello world"
    text = oai.audio.transcriptions.create(
        model="whisper", file=("a.wav", WAV), response_format="text"
    )
    assert str(text).strip() == "hello world"
    verbose = oai.audio.transcriptions.create(
        model="whisper",
        file=("a.wav", WAV),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    assert verbose.language == "german" and verbose.duration == pytest.approx(1.0, abs=0.05)
    assert verbose.segments and verbose.segments[0].text.strip() == "hello world"
    assert [w.word for w in verbose.words or []] == ["hello", "world"]
    srt = oai.audio.transcriptions.create(
        model="whisper", file=("a.wav", WAV), response_format="srt"
    )
    assert str(srt).startswith("1\n00:00:00,000 --> ") and "hello world" in str(srt)
    vtt = oai.audio.transcriptions.create(
        model="whisper", file=("a.wav", WAV), response_format="vtt"
    )
    assert str(vtt).startswith("WEBVTT") and "hello world" in str(vtt)


def test_translation_and_a_language_given(oai: openai.OpenAI) -> None:
    translated = oai.audio.translations.create(model="whisper", file=("a.wav", WAV))
    assert translated.text
    given = oai.audio.transcriptions.create(
        model="whisper", file=("a.wav", WAV), language="en", response_format="verbose_json"
    )
    assert given.language == "english"


def test_four_concurrent_transcriptions(oai: openai.OpenAI) -> None:
    def run(i: int) -> str:
        audio = wav(0.5 + i * 0.25)
        return oai.audio.transcriptions.create(model="whisper", file=("a.wav", audio)).text

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(run, range(4))) == ["hello world"] * 4


def test_what_is_refused_names_it(gw: GatewayProc, oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.audio.transcriptions.create(model="whisper", file=("a.wav", b"not audio at all"))
    assert caught.value.body["param"] == "file"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.audio.transcriptions.create(model="text", file=("a.wav", WAV))
    assert caught.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.audio.transcriptions.create(model="whisper", file=("a.wav", WAV), language="xx")
    assert caught.value.body["param"] == "language"  # type: ignore[index]
    big = wav(8.0)  # 256 kB: over this gateway's audio_max_bytes
    reply = httpx.post(
        f"{gw.base_url}/v1/audio/transcriptions",
        files={"file": ("a.wav", big)},
        data={"model": "whisper"},
        timeout=30,
    )
    assert reply.status_code == 413, reply.text
    assert reply.json()["error"]["param"] == "file"


def test_a_worker_dying_with_a_request_gives_one_clear_error(oai: openai.OpenAI) -> None:
    oai.audio.transcriptions.create(model="fragile", file=("a.wav", WAV))  # loaded, then:
    with pytest.raises(openai.APIStatusError) as info:
        oai.audio.transcriptions.create(model="fragile", file=("a.wav", WAV), prompt="CRASH")
    assert info.value.status_code >= 500
    assert "worker" in str(info.value.body).lower()
    again = oai.audio.transcriptions.create(model="fragile", file=("a.wav", WAV))
    assert again.text == "hello world"


def seconds_of(data: bytes) -> float:
    """How long an encoded audio file plays, decoded with PyAV."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return samples / stream.codec_context.sample_rate


@pytest.mark.parametrize("fmt", ["mp3", "wav", "flac", "opus", "aac"])
def test_speech_in_each_format_plays(oai: openai.OpenAI, fmt: Any) -> None:
    audio = oai.audio.speech.create(
        model="tts", input="Hello there, how are you?", voice="alloy", response_format=fmt
    )
    assert seconds_of(audio.content) > 0.1


def test_speech_streams_as_it_is_made_and_pcm_is_raw(gw: GatewayProc, oai: openai.OpenAI) -> None:
    text = "The first sentence is here. And a second one follows it. Then a third one ends it."
    with oai.audio.speech.with_streaming_response.create(
        model="tts", input=text, voice="echo", response_format="pcm"
    ) as response:
        assert response.headers["content-type"].startswith("audio/pcm")
        chunks = [c for c in response.iter_bytes(4096) if c]
    data = b"".join(chunks)
    assert len(data) % 2 == 0 and len(data) > 24000  # 16-bit samples, over half a second
    events = []
    with httpx.stream(
        "POST",
        f"{gw.base_url}/v1/audio/speech",
        json={"model": "tts", "input": text, "voice": "nova", "stream_format": "sse"},
        timeout=60,
    ) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and kinds.count("speech.audio.delta") >= 2
    assert events[-1]["usage"]["input_tokens"] > 0


def test_four_concurrent_speech_requests(oai: openai.OpenAI) -> None:
    def run(i: int) -> float:
        audio = oai.audio.speech.create(
            model="tts", input=f"Sentence number {i} is read aloud.", voice="alloy",
            response_format="wav",
        )  # fmt: skip
        return seconds_of(audio.content)

    with ThreadPoolExecutor(4) as pool:
        assert all(seconds > 0.1 for seconds in pool.map(run, range(4)))


def test_speech_refusals_name_the_field(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.audio.speech.create(model="tts", input="Hi.", voice="nobody")
    assert caught.value.body["param"] == "voice"  # type: ignore[index]
    assert "alloy" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        oai.audio.speech.create(model="whisper", input="Hi.", voice="alloy")
    assert caught.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.audio.speech.create(model="tts", input="", voice="alloy")
    assert caught.value.body["param"] == "input"  # type: ignore[index]


def test_a_speech_worker_dying_mid_stream_ends_it_with_one_error(gw: GatewayProc) -> None:
    url = f"{gw.base_url}/v1/audio/speech"
    warm = {"model": "fragile-tts", "input": "Warm up.", "response_format": "wav"}
    assert httpx.post(url, json=warm, timeout=60).status_code == 200
    body = {
        "model": "fragile-tts",
        "input": "CRASH now. And more words after that, so there is more to say.",
        "stream_format": "sse",
    }
    events = []
    with httpx.stream("POST", url, json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1 and "worker" in json.dumps(errors[0]).lower()
    assert all(e.get("type") != "speech.audio.done" for e in events)
    assert httpx.post(url, json=warm, timeout=60).status_code == 200  # restarted


def test_a_streamed_transcription_ends_with_its_whole_text(oai: openai.OpenAI) -> None:
    stream = oai.audio.transcriptions.create(model="whisper", file=("a.wav", WAV), stream=True)
    events = list(stream)
    assert events[-1].type == "transcript.text.done" and events[-1].text == "hello world"
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    assert deltas.strip() == "hello world"
