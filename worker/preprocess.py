"""Add frame -> tokens and limits, on the input thread so the engine loop only steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from shared.config import EngineOptions
from shared.modelinfo import text_capabilities
from shared.protocol import Add
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    RequestError,
    RequestKind,
    SamplingParams,
    reserved_template_kwarg,
)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def capabilities(tokenizer: Any) -> list[str]:
    """What this text model serves (Ready.capabilities; the gateway checks requests against
    it): chat needs a chat template; the rest every mlx-lm model does."""
    return text_capabilities(has_chat_template(tokenizer))


class PreprocessError(Exception):
    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(slots=True)
class PreparedRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    priority: int = 0
    received_at: float = 0.0  # perf_counter when the worker got it, and once prepared
    prepared_at: float = 0.0


class Preprocessor:
    def __init__(self, tokenizer: Any, options: EngineOptions, max_context: int) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.max_context = max_context
        self.vocab_size = len(tokenizer)

    def __call__(self, frame: Add) -> PreparedRequest:
        param = _prompt_param(frame)
        self._check_token_ids(frame.sampling)
        prompt = self._tokenize(frame.kind, frame.request)
        if not prompt:
            raise _invalid("the prompt is empty after tokenization", param)
        limit = self.options.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise _invalid(
                f"the prompt has {len(prompt)} tokens; this gateway accepts at most {limit} "
                "(server.max_prompt_tokens)",
                param,
            )
        max_tokens = self._max_tokens(len(prompt), frame.sampling, param)
        return PreparedRequest(frame.request_id, prompt, max_tokens, frame.sampling, frame.priority)

    def _check_token_ids(self, sampling: SamplingParams) -> None:
        for param, ids in (
            ("logit_bias", sampling.logit_bias),
            ("stop_token_ids", sampling.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise _invalid(
                    f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})", param
                )

    def tokenize_call(self, args: dict[str, Any]) -> dict[str, Any]:
        """Control "tokenize": {"kind", "request": CanonicalRequest} -> the prompt's tokens."""
        try:
            kind = RequestKind(args["kind"])
            request = msgspec.convert(args["request"], CanonicalRequest)
        except (KeyError, ValueError, msgspec.ValidationError) as exc:
            raise _invalid(f"bad tokenize call: {exc}") from exc
        tokens = self._tokenize(kind, request)
        result: dict[str, Any] = {"tokens": tokens, "count": len(tokens)}
        result["max_context"] = self.max_context
        if args.get("with_text"):
            result["token_strs"] = [self.tokenizer.decode([t]) for t in tokens]
        return result

    def detokenize_call(self, args: dict[str, Any]) -> dict[str, Any]:
        tokens = args.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise _invalid("`tokens` must be a list of token ids", "tokens")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise _invalid(
                f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})", "tokens"
            )
        return {"text": self.tokenizer.decode(tokens)}

    def _tokenize(self, kind: RequestKind, request: CanonicalRequest) -> list[int]:
        if kind == RequestKind.CHAT:
            if not has_chat_template(self.tokenizer):
                raise _invalid(
                    "this model has no chat template: use /v1/completions with a prompt",
                    "messages",
                )
            for i, m in enumerate(request.messages):
                extras = m.extras()
                if extras:  # the gateway refuses these first; never drop them silently
                    raise _invalid(
                        f"messages[{i}].{extras[0]} is not served by a text worker",
                        f"messages[{i}].{extras[0]}",
                    )
            messages = [_message_dict(m.role, m.content, m.name) for m in request.messages]
            reserved = reserved_template_kwarg(request.chat_template_kwargs)
            if reserved is not None:
                raise _invalid(
                    f"chat_template_kwargs.{reserved} is not a template variable",
                    f"chat_template_kwargs.{reserved}",
                )
            try:
                ids = self.tokenizer.apply_chat_template(
                    messages,
                    add_generation_prompt=request.add_generation_prompt,
                    tokenize=True,
                    **request.chat_template_kwargs,
                )
            except Exception as exc:  # jinja errors carry the template's own message
                raise _invalid(
                    f"the chat template rejected the messages: {exc}", "messages"
                ) from exc
            if isinstance(ids, dict):  # transformers 5 may return a BatchEncoding
                ids = ids.get("input_ids", ids)
            tokens = list(ids) if isinstance(ids, list | tuple) else None
            if tokens is None or not all(type(t) is int for t in tokens):
                raise _invalid(
                    "the chat template did not produce token ids (check chat_template_kwargs)",
                    "chat_template_kwargs",
                )
            return tokens
        if request.prompt_token_ids is not None:
            bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise _invalid(f"token id {bad[0]} is outside the vocabulary", "prompt")
            return list(request.prompt_token_ids)
        return list(self.tokenizer.encode(request.prompt or "", add_special_tokens=True))

    def _max_tokens(self, prompt_len: int, sampling: SamplingParams, param: str) -> int:
        room = self.max_context - prompt_len
        requested = sampling.max_tokens
        if requested is None:
            default = self.options.default_max_tokens
            requested = min(room, default) if default else room
        if room <= 0 or requested > room:
            raise PreprocessError(
                RequestError(
                    ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                    f"This model's maximum context length is {self.max_context} tokens. "
                    f"However, you requested {prompt_len + requested} tokens "
                    f"({prompt_len} in the prompt, {requested} for the completion). "
                    "Please reduce the length of the prompt or of max_tokens.",
                    param,
                )
            )
        if requested == 0 and sampling.echo:
            return 0  # score the prompt only
        if requested < 1:
            raise _invalid("max_tokens must be at least 1", "max_tokens")
        if sampling.min_tokens > requested:
            raise _invalid("min_tokens must not exceed max_tokens", "min_tokens")
        return requested


def _prompt_param(frame: Add) -> str:
    return "messages" if frame.kind == RequestKind.CHAT else "prompt"


def _message_dict(role: str, content: str, name: str | None) -> dict[str, str]:
    message = {"role": role, "content": content}
    if name:
        message["name"] = name
    return message


def _invalid(message: str, param: str | None = None) -> PreprocessError:
    return PreprocessError(RequestError(ErrorCode.INVALID_REQUEST, message, param))
