"""OpenAI's audio routes: thin handlers over the form and body translators (transcriptions.py,
speech.py) and `serve`. Errors have OpenAI's shape, as the rest of /v1.

An upload is read through Litestar's multipart parser, which spools a file past 1 MiB to a
temporary file; its body is bounded by server.audio_max_bytes (plus the form's small
fields) while it is read, instead of server.max_body_bytes."""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

from litestar import Request, Response, Router, post
from litestar.datastructures import State, UploadFile
from litestar.exceptions import ClientException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.openapi.spec import Operation
from litestar.response import Stream

from gateway.api.audio import speech as speech_
from gateway.api.audio.formats import MEDIA_TYPES, TextBody, VerboseBody
from gateway.api.audio.transcriptions import (
    FormItem,
    TranscriptFormatter,
    form_schema,
    transcript_form,
)
from gateway.api.common import decode_body, invalid
from gateway.api.openai.errors import error_response
from gateway.api.openai.schemas import ErrorBody
from gateway.api.openapi import MULTIPART, SSE, Content, documented, schema_of
from gateway.api.serve import JSON, Job, Served, serve
from gateway.edge.logs import log_body
from gateway.edge.middleware import context_of
from gateway.errors import GatewayError
from shared.config import ServerConfig
from shared.types import AudioPart, ErrorCode, RequestKind

FORM_SLACK = 64 * 1024  # the form's fields and part headers, beyond the file's bytes
# A transcript: JSON, text (text, srt, vtt) or, streamed, SSE.
TRANSCRIPTS: Content = {JSON: {"anyOf": [schema_of(TextBody), schema_of(VerboseBody)]}} | {
    t: None for t in MEDIA_TYPES.values() if t != JSON
}


def _documented(kind: RequestKind) -> type[Operation]:
    return documented(ErrorBody, {MULTIPART: form_schema(kind)}, {**TRANSCRIPTS, SSE: None})


def too_large(max_bytes: int) -> GatewayError:
    return GatewayError(
        ErrorCode.PAYLOAD_TOO_LARGE,
        f"the audio file is larger than {max_bytes} bytes (server.audio_max_bytes)",
        "file",
    )


async def read_form(request: Request[Any, Any, Any], max_bytes: int) -> list[FormItem]:
    """The multipart form's fields in order, a file as its audio (the extension of its name,
    lowercased, is its format); a 413 as soon as the body passes the limit."""
    content_type, _ = request.content_type
    if content_type != MULTIPART:
        raise invalid(f"the body must be {MULTIPART} (not {content_type or 'empty'})")
    try:
        form = await request.form()
    except RequestEntityTooLarge:
        raise too_large(max_bytes) from None
    except ClientException as exc:
        raise invalid(f"the {MULTIPART} body is not valid: {exc.detail}") from None
    except UnicodeDecodeError:
        raise invalid("a form field is not UTF-8 text (a file's part needs a filename)") from None
    items: list[FormItem] = []
    try:
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                data = await value.read(max_bytes + 1)
                if len(data) > max_bytes:
                    raise too_large(max_bytes)
                suffix = PurePosixPath(value.filename or "").suffix
                items.append((name, AudioPart(data, format=suffix.lstrip(".").lower())))
            else:
                items.append((name, value))
    finally:
        for _, value in form.multi_items():
            if isinstance(value, UploadFile):
                await value.close()
    return items


def _logged(items: list[FormItem]) -> bytes:
    """The form as the body log shows it: its fields, a file by its size."""
    shown = [
        (n, f"<{len(v.data)} bytes of {v.format or 'audio'}>" if isinstance(v, AudioPart) else v)
        for n, v in items
    ]
    return json.dumps(shown).encode()


async def _transcribe(
    request: Request[Any, Any, Any], state: State, kind: RequestKind
) -> Response[bytes] | Stream:
    server: ServerConfig = state.config.server
    items = await read_form(request, server.audio_max_bytes)
    log_body(server.log_bodies, context_of(request.scope), _logged(items))
    form = transcript_form(kind, items)
    served = Served(
        form.model,
        kind,
        [Job(form.request(), form.sampling())],
        stream=form.stream,
        media_type=form.media_type,
    )
    return await serve(request, state, served, TranscriptFormatter(form))


@post(
    "/transcriptions",
    status_code=200,
    operation_class=_documented(RequestKind.TRANSCRIPTION),
)
async def transcriptions(request: Request[Any, Any, Any], state: State) -> Response[bytes] | Stream:
    return await _transcribe(request, state, RequestKind.TRANSCRIPTION)


@post(
    "/translations",
    status_code=200,
    operation_class=_documented(RequestKind.TRANSLATION),
)
async def translations(request: Request[Any, Any, Any], state: State) -> Response[bytes] | Stream:
    return await _transcribe(request, state, RequestKind.TRANSLATION)


@post(
    "/speech",
    status_code=200,
    operation_class=documented(
        ErrorBody,
        {JSON: speech_.SpeechRequest},
        {**dict.fromkeys(speech_.MEDIA_TYPES.values()), SSE: None},
        {
            "a wav file": {"model": "my-voice", "input": "Hello!", "response_format": "wav"},
            "streamed events": {"model": "my-voice", "input": "Hello!", "stream_format": "sse"},
        },
    ),
)
async def speech(request: Request[Any, Any, Any], state: State) -> Response[bytes] | Stream:
    raw = await request.body()
    log_body(state.config.server.log_bodies, context_of(request.scope), raw)
    body = decode_body(raw, speech_.SpeechRequest)
    canonical, sampling = speech_.speech_request(body)
    served = Served(
        body.model,
        RequestKind.SPEECH,
        [Job(canonical, sampling)],
        stream=True,
        media_type=speech_.media_type(body),
    )
    return await serve(request, state, served, speech_.SpeechFormatter(body))


def audio_router(server: ServerConfig) -> Router:
    """/v1/audio/*: uploads bounded by server.audio_max_bytes, speech by max_body_bytes."""
    uploads = Router(
        path="/",
        route_handlers=[transcriptions, translations],
        request_max_body_size=server.audio_max_bytes + FORM_SLACK,
    )
    return Router(
        path="/v1/audio",
        route_handlers=[uploads, speech],
        exception_handlers={GatewayError: error_response},
    )
