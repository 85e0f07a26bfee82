"""/v1/audio/* through the gateway's app (create_app, its middleware and routes) in process,
with a scripted worker client that answers as the speech workers do: the official openai
SDK where it reaches, plain multipart otherwise. Each response format, the 400s naming a
field, the upload limit, a model of another kind, speech audio streamed raw or as SSE."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2  # the openai SDK's HTTP client
import openai
import pytest

from gateway.app import create_app
from gateway.errors import GatewayError
from gateway.workers.capabilities import check_capabilities
from gateway.workers.client import RequestStream, Submission
from gateway.workers.slots import Slot
from shared.config import Config, ConfigError, ModelConfig, ServerConfig, load_config
from shared.protocol import Capacity, Ready
from shared.types import (
    ErrorCode,
    FinishReason,
    RequestError,
    RequestKind,
    RequestOutput,
    Segment,
    Usage,
    Word,
)
from tests.scripted_workers import PacedStream

MODELS = {
    "whisper": ["transcription", "translation"],
    "whisper-en": ["transcription"],  # English only: no translation
    "tts": ["speech"],
    "text": ["chat", "completion", "logprobs"],
}
WAV = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(200)
SEGMENTS = [
    Segment(0, 0.0, 1.5, " Hello there.", [1, 2], words=[Word("Hello", 0.0, 0.7)]),
    Segment(1, 1.5, 3.25, " General Kenobi.", [3, 4], words=[Word("General", 1.6, 2.2)]),
]
TEXT = " Hello there. General Kenobi."
CHUNKS = [b"ID3\x04", b"\xff\xfb" * 100, b"\x00\x01\x02"]  # what the speech worker makes


class Workers:
    """Models of each kind, checked as the supervisor checks them (their last Ready); each
    request's outputs come as a worker sends them, unless a test scripts its own."""

    def __init__(self) -> None:
        self.submissions: list[Submission] = []
        self.aborted: list[str] = []
        self.script: list[RequestOutput] | None = None
        self.loading = False

    def resolve(self, name: str) -> Any:
        if name not in MODELS:
            raise GatewayError(ErrorCode.MODEL_NOT_FOUND, f"no model {name!r}", "model")
        return SimpleNamespace(name=name)

    def must_load(self, name: str) -> bool:
        return self.loading

    def check(self, name: str, needs: Sequence[str]) -> None:
        slot = Slot(ModelConfig(name=name, source="/nowhere"))
        slot.last_info = Ready("w", Capacity(1, 1, 64), capabilities=MODELS[name])
        check_capabilities(slot, list(needs))

    async def submit(self, submission: Submission) -> RequestStream:
        self.check(submission.model, submission.needs)
        if self.loading:
            await asyncio.sleep(0.05)
        self.submissions.append(submission)
        outputs = self.script if self.script is not None else self._answer(submission)
        stream = PacedStream(submission.request_id or "r", submission.model, outputs)
        asyncio.get_running_loop().call_later(0.001, stream.feed)
        return stream

    @staticmethod
    def _answer(submission: Submission) -> list[RequestOutput]:
        if submission.kind == RequestKind.SPEECH:
            audio = [RequestOutput("r", audio=chunk) for chunk in CHUNKS[:-1]]
            usage = Usage(prompt_tokens=5, completion_tokens=40)
            end = RequestOutput("r", finish_reason=FinishReason.STOP, usage=usage)
            end.audio, end.duration = CHUNKS[-1], 1.25
            return [*audio, end]
        timestamps = submission.request.timestamps
        segments = SEGMENTS if timestamps else []
        if "word" not in timestamps:
            segments = [Segment(s.id, s.start, s.end, s.text, s.tokens) for s in segments]
        usage = Usage(completion_tokens=4)
        done = RequestOutput("r", TEXT, finish_reason=FinishReason.STOP, usage=usage)
        done.segments, done.language, done.duration = segments, "en", 3.5
        return [done]

    def abort(self, stream: RequestStream) -> None:
        self.aborted.append(stream.request_id)


Client = Callable[..., httpx2.AsyncClient]


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[Workers, Client]]:
    workers = Workers()
    clients: list[httpx2.AsyncClient] = []

    def client(**server: Any) -> httpx2.AsyncClient:
        settings = {"keys_file": str(tmp_path / "keys.json"), "run_dir": str(tmp_path), **server}
        app = create_app(Config(server=ServerConfig(**settings)))
        app.state.workers = workers
        transport = httpx2.ASGITransport(app=app)
        clients.append(httpx2.AsyncClient(transport=transport, base_url="http://localhost"))
        return clients[-1]

    yield workers, client
    for each in clients:
        await each.aclose()


Gateway = tuple[Workers, Client]


def sdk(http: httpx2.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        api_key="none", base_url="http://localhost/v1", http_client=http, max_retries=0
    )


def error_of(r: httpx2.Response, status: int = 400) -> tuple[str, str | None]:
    """OpenAI's error shape: (message, param)."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error["message"], error["param"]


async def upload(http: httpx2.AsyncClient, path: str = "transcriptions", **fields: Any) -> Any:
    files = fields.pop("files", {"file": ("speech.WAV", WAV, "audio/wav")})
    return await http.post(f"/v1/audio/{path}", files=files, data={"model": "whisper", **fields})


# ---- transcriptions and translations ------------------------------------------------------


@pytest.mark.anyio
async def test_json_through_the_sdk(gateway: Gateway) -> None:
    workers, client = gateway
    result = await sdk(client()).audio.transcriptions.create(
        file=("speech.WAV", WAV), model="whisper", language="en", prompt="Kenobi"
    )
    assert result.text == TEXT
    assert result.usage is not None and result.usage.model_dump() == {
        "seconds": 4.0,
        "type": "duration",
    }
    [sub] = workers.submissions
    assert (sub.kind, sub.needs) == (RequestKind.TRANSCRIPTION, ["transcription"])
    audio = sub.request.audio
    assert audio is not None and (audio.data, audio.format) == (WAV, "wav")
    assert (sub.request.language, sub.request.prompt, sub.request.timestamps) == (
        "en",
        "Kenobi",
        [],
    )
    assert sub.sampling.temperature == 0.0  # OpenAI's default


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fmt", "content_type", "body"),
    [
        ("text", "text/plain; charset=utf-8", TEXT + "\n"),
        (
            "srt",
            "text/plain; charset=utf-8",
            "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
            "2\n00:00:01,500 --> 00:00:03,250\nGeneral Kenobi.\n\n",
        ),
        (
            "vtt",
            "text/vtt; charset=utf-8",
            "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n"
            "00:00:01.500 --> 00:00:03.250\nGeneral Kenobi.\n\n",
        ),
    ],
)
async def test_text_formats(gateway: Gateway, fmt: str, content_type: str, body: str) -> None:
    workers, client = gateway
    http = client()
    result = await sdk(http).audio.transcriptions.create(
        file=("a.mp3", WAV),
        model="whisper",
        response_format=fmt,  # type: ignore[call-overload]
    )
    assert result == body
    r = await upload(http, response_format=fmt)
    assert (r.text, r.headers["content-type"]) == (body, content_type)
    assert workers.submissions[0].request.timestamps == ([] if fmt == "text" else ["segment"])


@pytest.mark.anyio
async def test_verbose_json_with_segments_and_words(gateway: Gateway) -> None:
    workers, client = gateway
    result = await sdk(client()).audio.transcriptions.create(
        file=("a.flac", WAV),
        model="whisper",
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    assert (result.language, result.duration, result.text) == ("english", 3.5, TEXT)
    assert result.segments is not None and [s.text for s in result.segments] == [
        " Hello there.",
        " General Kenobi.",
    ]
    assert result.segments[1].seek == 150 and result.segments[1].tokens == [3, 4]
    assert result.words is not None and [(w.word, w.start) for w in result.words] == [
        ("Hello", 0.0),
        ("General", 1.6),
    ]
    [sub] = workers.submissions
    assert sub.request.timestamps == ["segment", "word"]
    assert sub.request.audio is not None and sub.request.audio.format == "flac"
    raw = (await upload(client(), response_format="verbose_json")).json()
    assert raw["task"] == "transcribe" and "words" not in raw and len(raw["segments"]) == 2
    assert raw["usage"] == {"seconds": 4, "type": "duration"}


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK's translations
async def test_translations(gateway: Gateway) -> None:
    workers, client = gateway
    result = await sdk(client()).audio.translations.create(
        file=("a.ogg", WAV), model="whisper", prompt="p", temperature=0.5
    )
    assert result.text == TEXT
    [sub] = workers.submissions
    assert (sub.kind, sub.needs, sub.sampling.temperature) == (
        RequestKind.TRANSLATION,
        ["translation"],
        0.5,
    )
    verbose = await upload(client(), "translations", response_format="verbose_json")
    assert verbose.json()["task"] == "translate" and "usage" not in verbose.json()


@pytest.mark.anyio
async def test_stream_is_sse_from_the_one_terminal_output(gateway: Gateway) -> None:
    _, client = gateway
    stream = await sdk(client()).audio.transcriptions.create(
        file=("a.wav", WAV), model="whisper", stream=True
    )
    events = [event async for event in stream]
    assert [e.type for e in events] == ["transcript.text.delta", "transcript.text.done"]
    assert events[0].delta == TEXT  # type: ignore[union-attr]
    done = events[1]
    assert done.text == TEXT and done.usage is not None  # type: ignore[union-attr]
    assert done.usage.output_tokens == 4  # type: ignore[union-attr]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("transcriptions", {"stream": "true", "response_format": "srt"}, "stream"),
        ("translations", {"stream": "true"}, "stream"),
        ("transcriptions", {"timestamp_granularities[]": "word"}, "timestamp_granularities[]"),
        ("transcriptions", {"include[]": "logprobs"}, "include[]"),
        ("transcriptions", {"chunking_strategy": "auto"}, "chunking_strategy"),
        ("translations", {"language": "de"}, "language"),
        ("transcriptions", {"temperature": "2"}, "temperature"),
        ("transcriptions", {"response_format": "diarized_json"}, "response_format"),
        ("transcriptions", {"files": {"audio": ("a.wav", WAV)}}, "audio"),
        ("transcriptions", {"files": {"other": ("x.txt", b"x")}, "file": "a"}, "other"),
    ],
)
async def test_unknown_or_unsupported_fields_are_400s_naming_them(
    gateway: Gateway, path: str, fields: dict[str, Any], param: str
) -> None:
    workers, client = gateway
    message, named = error_of(await upload(client(), path, **fields))
    assert named == param and param in message
    assert workers.submissions == []


@pytest.mark.anyio
async def test_a_missing_or_empty_file(gateway: Gateway) -> None:
    _, client = gateway
    http = client()
    r = await http.post("/v1/audio/transcriptions", files={"model": (None, "whisper")})
    assert error_of(r)[1] == "file"
    r = await upload(http, files={"file": ("a.wav", b"")})
    assert error_of(r)[1] == "file"
    r = await http.post("/v1/audio/transcriptions", json={"model": "whisper"})
    assert "multipart/form-data" in error_of(r)[0]


@pytest.mark.anyio
async def test_an_upload_over_audio_max_bytes_is_a_413_while_it_is_read(gateway: Gateway) -> None:
    workers, client = gateway
    http = client(audio_max_bytes=len(WAV), max_body_bytes=64)  # audio is not max_body_bytes'
    assert (await upload(http)).status_code == 200
    big = {"file": ("a.wav", WAV + b"x")}
    message, param = error_of(await upload(http, files=big), 413)
    assert param == "file" and "server.audio_max_bytes" in message
    huge = {"file": ("a.wav", bytes(200_000))}  # past the body's limit: refused unread
    assert error_of(await upload(http, files=huge), 413)[1] == "file"

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        for _ in range(100):
            yield bytes(10_000)

    headers = {"content-type": "multipart/form-data; boundary=b"}
    r = await http.post("/v1/audio/transcriptions", content=chunked(), headers=headers)
    assert error_of(r, 413)[1] == "file"
    assert len(workers.submissions) == 1


def test_audio_max_bytes_is_validated(tmp_path: Path) -> None:
    assert ServerConfig().audio_max_bytes == 25 * 2**20
    path = tmp_path / "config.toml"
    path.write_text("[server]\naudio_max_bytes = 0\n")
    with pytest.raises(ConfigError, match=r"server\.audio_max_bytes"):
        load_config(path)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "model", "words"),
    [
        ("transcriptions", "text", "it does not transcribe audio"),
        ("transcriptions", "text", "it serves /v1/chat/completions and /v1/completions"),
        ("transcriptions", "tts", "it serves /v1/audio/speech only"),
        ("translations", "whisper-en", "it serves /v1/audio/transcriptions only"),
        ("translations", "text", "it does not translate audio into English"),
    ],
)
async def test_a_model_of_another_kind_is_a_400_naming_model(
    gateway: Gateway, path: str, model: str, words: str
) -> None:
    workers, client = gateway
    message, param = error_of(await upload(client(), path, model=model))
    assert param == "model" and words in message and f"model {model!r}" in message
    assert workers.submissions == []


@pytest.mark.anyio
async def test_a_worker_error_in_openais_shape(gateway: Gateway) -> None:
    workers, client = gateway
    error = RequestError(ErrorCode.INVALID_REQUEST, "cannot decode the audio", "file")
    workers.script = [RequestOutput("r", finish_reason=FinishReason.ERROR, error=error)]
    with pytest.raises(openai.BadRequestError) as info:
        await sdk(client()).audio.transcriptions.create(file=("a.wav", WAV), model="whisper")
    assert info.value.param == "file" and "cannot decode" in info.value.message
    died = RequestError(ErrorCode.WORKER_DIED, "the worker died")
    workers.script = [RequestOutput("r", finish_reason=FinishReason.ERROR, error=died)]
    r = await upload(client())
    assert error_of(r, 503)[0] == "the worker died" and r.headers["retry-after"] == "1"


# ---- speech -------------------------------------------------------------------------------

SPEECH_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}


@pytest.mark.anyio
@pytest.mark.parametrize("fmt", SPEECH_TYPES)
async def test_speech_streams_the_workers_audio(gateway: Gateway, fmt: str) -> None:
    workers, client = gateway
    async with sdk(client()).audio.speech.with_streaming_response.create(
        model="tts",
        input="Hello there.",
        voice="alloy",
        response_format=fmt,  # type: ignore[arg-type]
        speed=1.5,
    ) as response:
        assert response.headers["content-type"] == SPEECH_TYPES[fmt]
        body = b"".join([chunk async for chunk in response.iter_bytes()])
    assert body == b"".join(CHUNKS)
    [sub] = workers.submissions
    request = sub.request
    assert (sub.kind, sub.needs) == (RequestKind.SPEECH, ["speech"])
    assert (request.prompt, request.voice, request.speed, request.audio_format) == (
        "Hello there.",
        "alloy",
        1.5,
        fmt,
    )


@pytest.mark.anyio
async def test_speech_as_sse_events(gateway: Gateway) -> None:
    _, client = gateway
    body = {"model": "tts", "input": "Hi", "voice": "alloy", "stream_format": "sse"}
    r = await client().post("/v1/audio/speech", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == b"".join(CHUNKS)
    assert events[-1] == {
        "type": "speech.audio.done",
        "usage": {"input_tokens": 5, "output_tokens": 40, "total_tokens": 45},
    }


@pytest.mark.anyio
async def test_speech_while_its_model_loads_sends_nothing_but_audio(gateway: Gateway) -> None:
    """Keep-alive comments would corrupt raw audio: the status waits for the first bytes."""
    workers, client = gateway
    workers.loading = True
    r = await client().post("/v1/audio/speech", json={"model": "tts", "input": "Hi"})
    assert r.status_code == 200 and r.content == b"".join(CHUNKS)
    assert workers.submissions[0].request.voice is None  # the model's default voice


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"instructions": "whisper it"}, "instructions"),
        ({"speed": 4.5}, "speed"),
        ({"speed": 0.1}, "speed"),
        ({"response_format": "ogg"}, "response_format"),
        ({"stream_format": "chunks"}, "stream_format"),
        ({"input": "  "}, "input"),
        ({"voice": {"id": "voice_1"}}, "voice"),
        ({"language": "en"}, "language"),
    ],
)
async def test_speech_400s_name_the_field(
    gateway: Gateway, fields: dict[str, Any], param: str
) -> None:
    workers, client = gateway
    body = {"model": "tts", "input": "Hi", "voice": "alloy", **fields}
    assert error_of(await client().post("/v1/audio/speech", json=body))[1] == param
    assert workers.submissions == []


@pytest.mark.anyio
async def test_speech_from_a_model_of_another_kind(gateway: Gateway) -> None:
    _, client = gateway
    with pytest.raises(openai.BadRequestError) as info:
        await sdk(client()).audio.speech.create(model="whisper", input="Hi", voice="alloy")
    assert info.value.param == "model"
    assert "it serves /v1/audio/transcriptions and /v1/audio/translations only" in str(
        info.value.message
    )


@pytest.mark.anyio
async def test_a_speech_error_before_or_after_the_first_bytes(gateway: Gateway) -> None:
    workers, client = gateway
    http = client()
    error = RequestError(ErrorCode.INVALID_REQUEST, "no voice 'nova' in this model", "voice")
    workers.script = [RequestOutput("r", finish_reason=FinishReason.ERROR, error=error)]
    r = await http.post("/v1/audio/speech", json={"model": "tts", "input": "Hi", "voice": "nova"})
    assert error_of(r) == ("no voice 'nova' in this model", "voice")
    died = RequestError(ErrorCode.WORKER_DIED, "the worker died")
    workers.script = [
        RequestOutput("r", audio=b"abc"),
        RequestOutput("r", finish_reason=FinishReason.ERROR, error=died),
    ]
    sse = {"model": "tts", "input": "Hi", "stream_format": "sse"}
    events = [
        json.loads(x[6:])
        for x in (await http.post("/v1/audio/speech", json=sse)).text.split("\n\n")
        if x
    ]
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["error"]["code"] == "worker_died"
    # raw audio cannot carry an error: the connection is dropped, not a short file completed
    with pytest.raises(Exception, match="after response started") as info:
        await http.post("/v1/audio/speech", json={"model": "tts", "input": "Hi"})
    assert "SpeechInterrupted('the worker died')" in repr(info.value.__cause__)
