"""What a model can serve, checked before a request reaches (or loads) its worker, and the
model's chat-template defaults merged under a request's."""

from __future__ import annotations

import msgspec

from gateway.errors import GatewayError
from gateway.workers.slots import Slot
from shared.config import ModelConfig
from shared.modelinfo import peek
from shared.protocol import Ready
from shared.types import CanonicalRequest, ErrorCode, RequestKind, reserved_template_kwarg

# Why a model lacks a capability a request needs, and the request field that asked for it.
_MISSING = {
    "chat": "it has no chat template; send a prompt to /v1/completions instead",
    "completion": "it does not serve text completions",
    "logprobs": "it does not report log probabilities",
    "echo": "it does not echo prompts",
    "tokenize": "it does not expose its tokenizer",
    "tools": "its chat template does not render tools (no tool-call format is known for it;"
    " set tool_parser in its config if it has one)",
    "reasoning": "its chat template has no thinking",
    "structured_output": "it does not serve constrained (structured) output",
    "embeddings": "it is not an embedding model",
    "vision": "it takes no images (a text-only model)",
    "audio_input": "it takes no audio",
    "rerank": "it does not rerank (a cross-encoder does; an embedding model with "
    "similarity_rerank = true in its config does, by similarity)",
    "transcription": "it does not transcribe audio (a speech-to-text model does)",
    "translation": "it does not translate audio into English (a multilingual speech-to-text "
    "model does)",
    "speech": "it does not make speech (a text-to-speech model does)",
}
# The endpoints of a model that generates no text
_ENDPOINTS = {
    "embeddings": "/v1/embeddings",
    "rerank": "/v1/rerank",
    "transcription": "/v1/audio/transcriptions",
    "translation": "/v1/audio/translations",
    "speech": "/v1/audio/speech",
}
# A text model's, named when it is asked for one of the above
_TEXT_ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
MISSING_PARAM = {
    "chat": "messages",
    "logprobs": "logprobs",
    "echo": "echo",
    "tools": "tools",
    "reasoning": "reasoning_effort",  # OpenAI's name (Anthropic's errors name no field)
    "structured_output": "response_format",
    "embeddings": "model",
    "rerank": "model",
    "vision": "messages",
    "audio_input": "messages",
    "transcription": "model",
    "translation": "model",
    "speech": "model",
}


# What only a loaded worker can say (its tokenizer's formats); until then its own 400s
# name what a request needs and the model lacks.
KNOWN_ONCE_LOADED = frozenset({"tools", "reasoning", "structured_output"})


def missing_reason(capability: str) -> str:
    return _MISSING.get(capability, f"it lacks the {capability!r} capability")


def with_template_defaults(
    model: ModelConfig, kind: RequestKind, request: CanonicalRequest
) -> CanonicalRequest:
    """The model's configured chat_template_kwargs, overridden key by key by the request's."""
    reserved = reserved_template_kwarg(request.chat_template_kwargs)
    if reserved is not None:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            f"chat_template_kwargs.{reserved} is not a template variable (it is a parameter "
            "of the templating call itself)",
            f"chat_template_kwargs.{reserved}",
        )
    if kind != RequestKind.CHAT or not model.chat_template_kwargs:
        return request
    merged = {**model.chat_template_kwargs, **request.chat_template_kwargs}
    return msgspec.structs.replace(request, chat_template_kwargs=merged)


def check_capabilities(slot: Slot, needs: list[str], info: Ready | None = None) -> None:
    """A 400 before anything is sent (or loaded) when the model cannot serve `needs`:
    from its last Ready, else from its files; unknown (a hub id not downloaded yet)
    is checked again once its worker is Ready."""
    info = info or (slot.handle.info if slot.handle is not None else None) or slot.last_info
    if info is not None:
        capabilities: list[str] | None = list(info.capabilities)
    else:
        if slot.peeked is None:
            slot.peeked = peek(slot.config)[1] or []
        capabilities = slot.peeked or None
    if capabilities is None:
        return
    if info is None:  # read from files: what the template renders is known once loaded
        needs = [need for need in needs if need not in KNOWN_ONCE_LOADED]
    missing = [need for need in needs if need not in capabilities]
    if missing:
        need = missing[0]
        reason, param = missing_reason(need), MISSING_PARAM.get(need)
        if capabilities and set(capabilities) <= set(_ENDPOINTS):
            served = " and ".join(_ENDPOINTS[c] for c in capabilities)
            lacks = f"{reason}; " if need in _ENDPOINTS else ""
            reason, param = f"{lacks}it serves {served} only", "model"
        elif need in _ENDPOINTS:  # another kind of model's request to a text model
            served = " and ".join(v for k, v in _TEXT_ENDPOINTS.items() if k in capabilities)
            reason += f"; it serves {served}" if served else ""
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            f"model {slot.name!r} cannot serve this request: {reason}",
            param,
        )
