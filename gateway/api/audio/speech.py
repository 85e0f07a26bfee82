"""OpenAI's /v1/audio/speech: text read aloud by a text-to-speech model. The audio goes out
as the worker makes it: raw bytes of the response format's type (stream_format "audio"), or
SSE events (`speech.audio.delta` with base64 audio, then `speech.audio.done` with usage)."""

from __future__ import annotations

import base64
import logging
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from gateway.api.common import invalid, unsupported
from gateway.api.openai.errors import error_json
from gateway.api.relay import Choice, sse_data
from gateway.errors import GatewayError
from shared.types import CanonicalRequest, RequestOutput, SamplingParams, Usage

log = logging.getLogger("gateway")

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/opus",  # Ogg Opus
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",  # 16-bit signed little-endian samples, no header
}


class SpeechRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    model: str
    input: str
    voice: str | None = None  # None: the model's default voice
    response_format: AudioFormat = "mp3"
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] | None = None  # None: the model's pace
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None


def speech_request(body: SpeechRequest) -> tuple[CanonicalRequest, SamplingParams]:
    """The text to read, its voice, pace and audio format; a 400 naming what cannot be."""
    if not body.input.strip():
        raise invalid("`input` is empty: there is nothing to read", "input")
    if body.instructions:
        raise unsupported(
            "instructions", "the speech models this gateway serves take no instructions"
        )
    request = CanonicalRequest(
        prompt=body.input, voice=body.voice, speed=body.speed, audio_format=body.response_format
    )
    return request, SamplingParams()


def media_type(body: SpeechRequest) -> str | None:
    """The raw stream's type; None for SSE events."""
    return MEDIA_TYPES[body.response_format] if body.stream_format == "audio" else None


class SpeechInterrupted(Exception):
    """A raw audio stream failed after its first bytes: its status has gone out, so the
    connection is dropped (the client sees an incomplete body, not a complete short file)."""


class SpeechUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class AudioDelta(msgspec.Struct, tag_field="type", tag="speech.audio.delta"):
    audio: str  # base64


class AudioDone(msgspec.Struct, tag_field="type", tag="speech.audio.done"):
    usage: SpeechUsage


class SpeechFormatter:
    """Speech is always streamed: each output's audio as it comes, raw or as SSE events."""

    def __init__(self, body: SpeechRequest) -> None:
        self.sse = body.stream_format == "sse"

    def stream_start(self, first: RequestOutput) -> bytes:
        return b""

    def stream_delta(self, index: int, output: RequestOutput) -> bytes:
        if not output.audio:
            return b""
        if not self.sse:
            return output.audio
        return sse_data(msgspec.json.encode(AudioDelta(base64.b64encode(output.audio).decode())))

    def stream_finish(self, index: int, output: RequestOutput) -> bytes:
        if not self.sse:
            return b""
        usage = output.usage or Usage()
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        done = AudioDone(SpeechUsage(prompt, completion, prompt + completion))
        return sse_data(msgspec.json.encode(done))

    def stream_end(self, usage: Usage) -> bytes:
        return b""

    def stream_error(self, error: GatewayError) -> bytes:
        if self.sse:
            return sse_data(error_json(error))
        log.warning("speech stream interrupted: %s", error.message)
        raise SpeechInterrupted(error.message)

    def response(self, choices: list[Choice], usage: Usage) -> bytes:
        raise AssertionError("speech is always streamed")
