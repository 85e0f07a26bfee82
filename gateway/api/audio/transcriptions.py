"""OpenAI's /v1/audio/transcriptions and /v1/audio/translations: a multipart form (the audio
file and text fields) into a canonical request, and the worker's one terminal output into
the response format asked for, or (a transcription with stream=true, json or text) SSE
events: `transcript.text.delta` then `transcript.text.done`.

Every field is checked: one this gateway does not serve (OpenAI's `include[]`,
`chunking_strategy`, ...) is a 400 naming it, never ignored."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.api.audio.formats import FORMATS, JSON, MEDIA_TYPES, TIMED, Transcript, render
from gateway.api.audio.languages import language_code
from gateway.api.common import invalid, unsupported
from gateway.api.openai.errors import error_json
from gateway.api.relay import Choice, sse_data
from gateway.errors import GatewayError
from shared.types import (
    AudioPart,
    CanonicalRequest,
    RequestKind,
    RequestOutput,
    SamplingParams,
    Usage,
)

GRANULARITIES = ("segment", "word")
GRANULARITY_FIELD = "timestamp_granularities[]"
# The form's fields by kind; `timestamp_granularities` (no brackets) is also taken
_COMMON = frozenset({"file", "model", "prompt", "response_format", "temperature"})
FIELDS = {
    RequestKind.TRANSCRIPTION: _COMMON
    | {"language", GRANULARITY_FIELD, "timestamp_granularities", "stream"},
    RequestKind.TRANSLATION: _COMMON,
}
_LIST_FIELDS = frozenset({GRANULARITY_FIELD, "timestamp_granularities"})
_CODE = re.compile(r"[a-z]{2,3}")
TASKS = {RequestKind.TRANSCRIPTION: "transcribe", RequestKind.TRANSLATION: "translate"}

FormItem = tuple[str, str | AudioPart]  # a field's name and value (the file: its audio)


@dataclass(slots=True)
class TranscriptForm:
    """A transcription's or translation's form, checked."""

    kind: RequestKind
    model: str
    audio: AudioPart
    response_format: str = "json"
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0  # OpenAI's default
    granularities: list[str] = field(default_factory=list)
    stream: bool = False

    @property
    def task(self) -> str:
        return TASKS[self.kind]

    @property
    def media_type(self) -> str | None:
        """The body's type, unless it is JSON or (streamed) SSE."""
        media_type = MEDIA_TYPES[self.response_format]
        return None if self.stream or media_type == JSON else media_type

    def request(self) -> CanonicalRequest:
        """Segments are asked for when the format is made of them; words when asked for."""
        timestamps: list[str] = []
        if self.response_format in TIMED:
            timestamps = ["segment", *(["word"] if "word" in self.granularities else [])]
        return CanonicalRequest(
            audio=self.audio, language=self.language, prompt=self.prompt, timestamps=timestamps
        )

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature)


def transcript_form(kind: RequestKind, items: Sequence[FormItem]) -> TranscriptForm:
    """The form's fields, checked: a 400 naming the first field that is missing, unknown,
    given twice or invalid."""
    fields: dict[str, list[str | AudioPart]] = {}
    for name, value in items:
        if name not in FIELDS[kind]:
            raise _unknown(kind, name)
        if name in fields and name not in _LIST_FIELDS:
            raise invalid(f"`{name}` is given more than once", name)
        fields.setdefault(name, []).append(value)
    audio = _audio(fields.pop("file", []))
    text = {name: _text(name, values[0]) for name, values in fields.items()}
    model = text.get("model", "")
    if not model:
        raise invalid("`model` is required", "model")
    form = TranscriptForm(kind, model, audio, prompt=text.get("prompt"))
    if "response_format" in text:
        form.response_format = _choice("response_format", text["response_format"], FORMATS)
    if "language" in text:
        form.language = _language(text["language"])
    if "temperature" in text:
        form.temperature = _temperature(text["temperature"])
    if "stream" in text:
        form.stream = _boolean("stream", text["stream"])
    granularities = [
        _text(GRANULARITY_FIELD, value) for name in _LIST_FIELDS for value in fields.get(name, [])
    ]
    form.granularities = _granularities(granularities, form.response_format)
    if form.stream and form.response_format not in ("json", "text"):
        raise invalid(
            f"`stream` is served with response_format json or text, not "
            f"{form.response_format} (its format needs the whole transcript)",
            "stream",
        )
    return form


def form_schema(kind: RequestKind) -> dict[str, Any]:
    """The form's fields as transcript_form reads them, as JSON Schema (the OpenAPI document's)."""
    granularities = {"type": "array", "items": {"enum": list(GRANULARITIES)}}
    fields: dict[str, Any] = {
        "file": {"type": "string", "format": "binary"},
        "model": {"type": "string", "minLength": 1},
        "prompt": {"type": "string"},
        "response_format": {"enum": list(FORMATS)},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "language": {"type": "string"},
        GRANULARITY_FIELD: granularities,
        "timestamp_granularities": granularities,
        "stream": {"type": "boolean"},
    }
    return {
        "type": "object",
        "properties": {name: fields[name] for name in sorted(FIELDS[kind])},
        "required": ["file", "model"],
        "additionalProperties": False,
    }


def _unknown(kind: RequestKind, name: str) -> GatewayError:
    if kind == RequestKind.TRANSLATION and name in FIELDS[RequestKind.TRANSCRIPTION]:
        return unsupported(name, "translations do not take it (OpenAI's do not either)")
    return invalid(f"unsupported parameter `{name}`: this gateway does not implement it", name)


def _audio(values: list[str | AudioPart]) -> AudioPart:
    if not values:
        raise invalid("`file` is required: the audio to transcribe, as a multipart file", "file")
    [value] = values  # given once: checked by the caller
    if not isinstance(value, AudioPart):
        raise invalid("`file` must be a file (a multipart part with a filename)", "file")
    if not value.data:
        raise invalid("`file` is empty", "file")
    return value


# A text field's characters at most (a prompt: Whisper reads its last 223 tokens; the form's
# other fields are a word each): the upload's bound is the file's, not the text's
MAX_TEXT_FIELD = 8192


def _text(name: str, value: str | AudioPart) -> str:
    if isinstance(value, AudioPart):
        raise invalid(f"`{name}` must be a text field, not a file", name)
    if len(value) > MAX_TEXT_FIELD:
        raise invalid(f"`{name}` is {len(value)} characters; at most {MAX_TEXT_FIELD}", name)
    return value


def _choice(name: str, value: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise invalid(f"`{name}` must be one of {', '.join(allowed)} (not {value!r})", name)
    return value


def _language(value: str) -> str:
    """An ISO-639-1 code (or a language's English name, as Whisper takes): the code."""
    code = language_code(value)
    if code is None and _CODE.fullmatch(value.strip().lower()):
        code = value.strip().lower()  # a code this gateway has no name for: the model decides
    if code is None:
        raise invalid(
            f"`language` must be an ISO-639-1 code such as en (not {value!r})", "language"
        )
    return code


def _temperature(value: str) -> float:
    try:
        temperature = float(value)
    except ValueError:
        raise invalid(f"`temperature` must be a number (not {value!r})", "temperature") from None
    if not 0.0 <= temperature <= 1.0:
        raise invalid(f"`temperature` must be between 0 and 1 (not {value})", "temperature")
    return temperature


def _boolean(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    raise invalid(f"`{name}` must be true or false (not {value!r})", name)


def _granularities(values: list[str], response_format: str) -> list[str]:
    for value in values:
        _choice(GRANULARITY_FIELD, value, GRANULARITIES)
    if values and response_format != "verbose_json":
        raise invalid(
            f"`{GRANULARITY_FIELD}` needs response_format verbose_json (not {response_format})",
            GRANULARITY_FIELD,
        )
    return sorted(set(values), key=GRANULARITIES.index)


class TokensUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    type: str = "tokens"


class TextDelta(msgspec.Struct, tag_field="type", tag="transcript.text.delta"):
    delta: str


class TextDone(msgspec.Struct, tag_field="type", tag="transcript.text.done"):
    text: str
    usage: TokensUsage


class TranscriptFormatter:
    """The body in the form's response format, or its SSE events (stream=true): the worker
    answers with one terminal output, whose text is one delta and then the whole."""

    def __init__(self, form: TranscriptForm) -> None:
        self.form = form
        self.text = ""

    def response(self, choices: list[Choice], usage: Usage) -> bytes:
        [choice] = choices
        transcript = Transcript(choice.text, choice.segments, choice.language, choice.duration)
        return render(
            transcript, self.form.response_format, self.form.task, self.form.granularities
        )

    def stream_start(self, first: RequestOutput) -> bytes:
        return b""

    def stream_delta(self, index: int, output: RequestOutput) -> bytes:
        if not output.text:
            return b""
        self.text += output.text
        return sse_data(msgspec.json.encode(TextDelta(output.text)))

    def stream_finish(self, index: int, output: RequestOutput) -> bytes:
        usage = output.usage or Usage()
        tokens = TokensUsage(
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.prompt_tokens + usage.completion_tokens,
        )
        return sse_data(msgspec.json.encode(TextDone(self.text, tokens)))

    def stream_end(self, usage: Usage) -> bytes:
        return b""

    def stream_error(self, error: GatewayError) -> bytes:
        return sse_data(error_json(error))
