"""Pure translation between OpenAI bodies and the canonical types. No I/O here."""

from __future__ import annotations

import re
import time
import uuid
from typing import TypeVar

import msgspec

from gateway.errors import GatewayError
from gateway.openai.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ErrorBody,
    ErrorDetail,
    SamplingFields,
    UsageBody,
)
from shared.config import ConfigError, parse_duration
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    Message,
    SamplingParams,
    Usage,
)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


def _unsupported(param: str, detail: str = "") -> GatewayError:
    message = f"`{param}` is not supported" + (f": {detail}" if detail else "")
    return GatewayError(ErrorCode.INVALID_REQUEST, message, param)


T = TypeVar("T")
_ERROR_PATH = re.compile(r"at `\$\.([A-Za-z_][\w.\[\]]*)`")


def decode_body(body: bytes, type_: type[T]) -> T:
    if not body:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "the request body is empty")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        match = _ERROR_PATH.search(str(exc))
        param = match.group(1) if match else None
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"invalid request: {exc}", param) from exc
    except msgspec.DecodeError as exc:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"the body is not valid JSON: {exc}") from exc


def sampling_params(req: SamplingFields, max_tokens: int | None) -> SamplingParams:
    if req.n != 1:
        raise _unsupported("n", "only n=1 is served")
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise GatewayError(
                ErrorCode.INVALID_REQUEST, f"logit_bias key {key!r} is not a token id", "logit_bias"
            ) from None
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        repetition_penalty=req.repetition_penalty or 1.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=bias,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )


def keep_alive_of(req: ChatCompletionRequest | CompletionRequest) -> float | None:
    if req.keep_alive is None:
        return None
    try:
        return parse_duration(req.keep_alive, "keep_alive")
    except ConfigError as exc:
        raise GatewayError(ErrorCode.INVALID_REQUEST, str(exc), "keep_alive") from None


def chat_request(req: ChatCompletionRequest) -> tuple[CanonicalRequest, SamplingParams]:
    if not req.messages:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "`messages` must not be empty", "messages")
    if req.logprobs or req.top_logprobs:
        raise _unsupported("logprobs", "log probabilities are not served yet")
    if req.tools or req.tool_choice not in (None, "none"):
        raise _unsupported("tools", "tool calling is not served yet")
    if req.response_format is not None and req.response_format.type != "text":
        raise _unsupported("response_format", f"type {req.response_format.type!r}")
    if req.max_tokens and req.max_completion_tokens and req.max_tokens != req.max_completion_tokens:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            "max_tokens and max_completion_tokens disagree",
            "max_completion_tokens",
        )
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    canonical = CanonicalRequest(
        messages=messages,
        add_generation_prompt=req.add_generation_prompt,
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
    )
    return canonical, sampling_params(req, req.max_completion_tokens or req.max_tokens)


def _message(index: int, message: ChatMessage) -> Message:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise _unsupported(
                    f"messages[{index}].content", f"content part of type {part.type!r}"
                )
            texts.append(part.text)
        content = "".join(texts)
    role = "system" if message.role == "developer" else message.role
    return Message(role=role, content=content or "", name=message.name)


def completion_request(req: CompletionRequest) -> tuple[CanonicalRequest, SamplingParams]:
    if req.echo:
        raise _unsupported("echo")
    if req.suffix:
        raise _unsupported("suffix")
    if req.best_of not in (None, 1):
        raise _unsupported("best_of", "only best_of=1 is served")
    if req.logprobs is not None:
        raise _unsupported("logprobs", "log probabilities are not served yet")
    prompt: object = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise _unsupported("prompt", "batched prompts; send one prompt per request")
        prompt = prompt[0]
    if not prompt:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "`prompt` must not be empty", "prompt")
    if isinstance(prompt, str):
        canonical = CanonicalRequest(prompt=prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        canonical = CanonicalRequest(prompt_token_ids=prompt)
    else:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            "`prompt` must be a string, a list of token ids or a list of one string",
            "prompt",
        )
    return canonical, sampling_params(req, req.max_tokens or 16)


# ---- responses ---------------------------------------------------------------------------


def usage_body(usage: Usage | None) -> UsageBody:
    usage = usage or Usage()
    return UsageBody(
        usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens + usage.completion_tokens
    )


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def error_body(error: GatewayError) -> ErrorBody:
    kind = ERROR_TYPES.get(error.status, "server_error")
    return ErrorBody(ErrorDetail(error.message, kind, error.param, error.code.value))


class ChatFormatter:
    """Builds one chat completion's response bodies (encoded once, sent as is)."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.encode = msgspec.json.Encoder().encode

    def chunk(self, delta: ChatDelta, finish: str | None = None) -> bytes:
        choice = ChunkChoice(0, delta, finish)
        return self.encode(ChatCompletionChunk(self.id, self.created, self.model, [choice]))

    def role_chunk(self) -> bytes:
        return self.chunk(ChatDelta(role="assistant", content=""))

    def text_chunk(self, text: str) -> bytes:
        return self.chunk(ChatDelta(content=text))

    def finish_chunk(self, reason: FinishReason | None) -> bytes:
        return self.chunk(ChatDelta(), finish_reason(reason))

    def usage_chunk(self, usage: Usage | None) -> bytes:
        body = ChatCompletionChunk(self.id, self.created, self.model, [], usage=usage_body(usage))
        return self.encode(body)

    def response(self, text: str, reason: FinishReason | None, usage: Usage | None) -> bytes:
        choice = ChatChoice(0, AssistantMessage(text), finish_reason(reason))
        body = ChatCompletion(self.id, self.created, self.model, [choice], usage_body(usage))
        return self.encode(body)


class CompletionFormatter:
    def __init__(self, model: str) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.encode = msgspec.json.Encoder().encode

    def role_chunk(self) -> bytes | None:
        return None

    def text_chunk(self, text: str) -> bytes:
        choice = CompletionChoice(0, text)
        return self.encode(Completion(self.id, self.created, self.model, [choice]))

    def finish_chunk(self, reason: FinishReason | None) -> bytes:
        choice = CompletionChoice(0, "", finish_reason(reason))
        return self.encode(Completion(self.id, self.created, self.model, [choice]))

    def usage_chunk(self, usage: Usage | None) -> bytes:
        return self.encode(
            Completion(self.id, self.created, self.model, [], usage=usage_body(usage))
        )

    def response(self, text: str, reason: FinishReason | None, usage: Usage | None) -> bytes:
        choice = CompletionChoice(0, text, finish_reason(reason))
        body = Completion(self.id, self.created, self.model, [choice], usage=usage_body(usage))
        return self.encode(body)
