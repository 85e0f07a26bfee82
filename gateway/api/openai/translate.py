"""Pure translation between OpenAI bodies and the canonical types. No I/O here."""

from __future__ import annotations

import codecs
import time
import uuid

import msgspec

from gateway.api.common import (
    Unserved,
    invalid,
    sampling,
    unsupported,
)
from gateway.api.openai.errors import error_body
from gateway.api.openai.messages import message_of
from gateway.api.openai.response_format import response_format_of
from gateway.api.openai.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionTokensDetails,
    LogprobContent,
    PromptTokensDetails,
    SamplingFields,
    TopLogprobBody,
    UsageBody,
)
from gateway.api.openai.tools import call_chunks, calls_out, tool_choice_of, tools_of
from gateway.api.relay import DONE, Choice, sse_data
from gateway.errors import GatewayError
from shared.config import ConfigError, parse_duration
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    Reasoning,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
)


def sampling_params(req: SamplingFields, max_tokens: int | None) -> SamplingParams:
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < 2**31:
            raise GatewayError(
                ErrorCode.INVALID_REQUEST,
                f"logit_bias key {key!r} is not a token id of the vocabulary",
                "logit_bias",
            )
        bias[token] = value
    if req.store:
        raise unsupported("store", "responses are not stored for distillation")
    if req.metadata:
        raise unsupported("metadata", "it is kept only with store, which is not served")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST, "seed must fit in 64 bits (signed or unsigned)", "seed"
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not text for text in stop):
        raise GatewayError(ErrorCode.INVALID_REQUEST, "stop strings must not be empty", "stop")
    if req.stream_options is not None and not req.stream:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            "stream_options is only allowed with stream: true",
            "stream_options",
        )
    return sampling(
        max_tokens,
        req.temperature,
        req.top_p,
        req.top_k,
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


_CHAT_REFUSED = {
    "functions": "the legacy function-calling fields are not served: use `tools`",
    "function_call": "the legacy function-calling fields are not served: use `tool_choice`",
    "audio": "audio output is not served",
    "prediction": "predicted outputs are not served",
    "verbosity": "not served",
    "web_search_options": "web search is not served",
}


REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def reasoning_of(effort: str | None) -> Reasoning | None:
    """`reasoning_effort`: a level for templates that take one; "none" turns thinking off."""
    if effort is None:
        return None
    if effort == "none":
        return Reasoning(enabled=False)
    if effort not in REASONING_EFFORTS:
        raise invalid(
            f"`reasoning_effort` must be one of none, {', '.join(REASONING_EFFORTS)}; "
            f"not {effort!r}",
            "reasoning_effort",
        )
    return Reasoning(effort=effort)


def chat_request(req: ChatCompletionRequest) -> tuple[CanonicalRequest, SamplingParams]:
    if not req.messages:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "`messages` must not be empty", "messages")
    for field, why in _CHAT_REFUSED.items():
        if getattr(req, field) is not None:
            raise unsupported(field, why)
    if req.top_logprobs and not req.logprobs:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST, "top_logprobs requires logprobs: true", "top_logprobs"
        )
    if req.modalities is not None and req.modalities != ["text"]:
        raise unsupported("modalities", "text is the only output modality")
    if req.max_tokens and req.max_completion_tokens and req.max_tokens != req.max_completion_tokens:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST,
            "max_tokens and max_completion_tokens disagree",
            "max_completion_tokens",
        )
    unserved = Unserved()
    messages = [message_of(i, m, unserved) for i, m in enumerate(req.messages)]
    unserved.refuse()
    kwargs = dict(req.chat_template_kwargs or {})
    add_generation_prompt = req.add_generation_prompt
    if req.continue_final_message:
        if messages[-1].role != "assistant":
            raise GatewayError(
                ErrorCode.INVALID_REQUEST,
                "continue_final_message needs an assistant message last",
                "continue_final_message",
            )
        kwargs["continue_final_message"] = True
        add_generation_prompt = False
    tools = tools_of(req.tools)
    canonical = CanonicalRequest(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=kwargs,
        tools=tools,
        tool_choice=tool_choice_of(req.tool_choice, req.parallel_tool_calls, tools),
        response_format=response_format_of(req.response_format),
        reasoning=reasoning_of(req.reasoning_effort),
    )
    sampling = sampling_params(req, req.max_completion_tokens or req.max_tokens)
    if req.logprobs:
        sampling = msgspec.structs.replace(
            sampling, logprobs=True, top_logprobs=req.top_logprobs or 0
        )
    return canonical, sampling


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """`prompt`: a string, token ids, or a batch of either (one choice group per prompt)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list[object] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "`prompt` must not be empty", "prompt")
    for i, item in enumerate(prompts):
        ok = isinstance(item, str) or (
            isinstance(item, list) and all(isinstance(t, int) for t in item)
        )
        if not ok:
            raise GatewayError(
                ErrorCode.INVALID_REQUEST,
                "`prompt` must be a string, a list of token ids, or a list of either",
                "prompt",
            )
        if not item:
            raise GatewayError(ErrorCode.INVALID_REQUEST, f"prompt {i} is empty", "prompt")
    return prompts  # type: ignore[return-value]


def completion_request(req: CompletionRequest) -> list[tuple[CanonicalRequest, SamplingParams]]:
    if req.suffix:
        raise unsupported("suffix", "fill-in-the-middle is not served")
    if req.best_of not in (None, req.n):
        raise unsupported("best_of", "best_of must equal n (every choice is returned)")
    max_tokens = req.max_tokens  # None: 16 (Served.default_max_tokens), within the cap
    if max_tokens == 0 and not req.echo:
        raise GatewayError(
            ErrorCode.INVALID_REQUEST, "max_tokens 0 is only allowed with echo", "max_tokens"
        )
    sampling = sampling_params(req, max_tokens)
    sampling = msgspec.structs.replace(
        sampling,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        echo=req.echo,
    )
    response_format = response_format_of(req.response_format)
    jobs = []
    for prompt in completion_prompts(req):
        if isinstance(prompt, str):
            canonical = CanonicalRequest(prompt=prompt, response_format=response_format)
        else:
            canonical = CanonicalRequest(prompt_token_ids=prompt, response_format=response_format)
        jobs.append((canonical, sampling))
    return jobs


# ---- responses ---------------------------------------------------------------------------


def usage_body(usage: Usage | None) -> UsageBody:
    usage = usage or Usage()
    return UsageBody(
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.prompt_tokens + usage.completion_tokens,
        PromptTokensDetails(usage.cached_tokens),
        CompletionTokensDetails(usage.reasoning_tokens) if usage.reasoning_tokens else None,
    )


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def _bytes(entry: TokenLogprob | TopLogprob) -> list[int]:
    """The token's own bytes (a byte token's one byte, not U+FFFD's three)."""
    return list(entry.token_bytes or entry.token.encode("utf-8", errors="replace"))


def _utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")("replace")


def chat_logprobs(entries: list[TokenLogprob]) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        [
            LogprobContent(
                e.token,
                e.logprob if e.logprob is not None else 0.0,
                _bytes(e),
                [TopLogprobBody(t.token, t.logprob, _bytes(t)) for t in e.top],
            )
            for e in entries
        ]
    )


def completion_logprobs(
    entries: list[TokenLogprob], offset: int, decoder: codecs.IncrementalDecoder
) -> tuple[CompletionLogprobs, int]:
    """The legacy shape. `offset` is where the first token's text starts in the choice's
    text; each token advances it by the characters its bytes complete (`decoder` carries a
    partial UTF-8 character over to the next token). Returns the offset after the last."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.token)
        values.append(e.logprob)
        tops.append({t.token: t.logprob for t in e.top} if e.logprob is not None else None)
        offsets.append(offset)
        offset += len(decoder.decode(e.token_bytes or e.token.encode()))
    return CompletionLogprobs(tokens, values, tops, offsets), offset


def assistant_message(choice: Choice) -> AssistantMessage:
    """The choice's answer: content null when the turn is only calls."""
    return AssistantMessage(
        choice.text if choice.text or not choice.tool_calls else None,
        tool_calls=calls_out(choice.tool_calls) if choice.tool_calls else msgspec.UNSET,
        reasoning_content=choice.reasoning or msgspec.UNSET,
    )


class ChatFormatter:
    """Builds one chat completion's response bodies (encoded once, sent as is)."""

    def __init__(
        self, model: str, n: int = 1, include_usage: bool = False, logprobs: bool = False
    ) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model
        self.n = n
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.created = int(time.time())
        self.encode = msgspec.json.Encoder().encode

    def _chunk(self, choice: ChunkChoice) -> bytes:
        body = ChatCompletionChunk(self.id, self.created, self.model, [choice])
        return sse_data(self.encode(body))

    def stream_start(self, first: RequestOutput) -> bytes:
        return b"".join(
            self._chunk(ChunkChoice(i, ChatDelta(role="assistant", content="")))
            for i in range(self.n)
        )

    def stream_delta(self, index: int, output: RequestOutput) -> bytes:
        logprobs = chat_logprobs(output.logprobs) if self.logprobs and output.logprobs else None
        calls = call_chunks(output.tool_calls) if output.tool_calls else None
        more = output.reasoning or calls
        if not output.text and logprobs is None and not more:
            return b""
        delta = ChatDelta(
            content=output.text if output.text or not more else None,
            reasoning_content=output.reasoning or None,
            tool_calls=calls,
        )
        return self._chunk(ChunkChoice(index, delta, None, logprobs))

    def stream_finish(self, index: int, output: RequestOutput) -> bytes:
        return self._chunk(ChunkChoice(index, ChatDelta(), finish_reason(output.finish_reason)))

    def stream_end(self, usage: Usage) -> bytes:
        if not self.include_usage:
            return DONE
        body = ChatCompletionChunk(self.id, self.created, self.model, [], usage=usage_body(usage))
        return sse_data(self.encode(body)) + DONE

    def stream_error(self, error: GatewayError) -> bytes:
        return sse_data(self.encode(error_body(error))) + DONE

    def response(self, choices: list[Choice], usage: Usage) -> bytes:
        body = ChatCompletion(
            self.id,
            self.created,
            self.model,
            [
                ChatChoice(
                    c.index,
                    assistant_message(c),
                    finish_reason(c.finish_reason),
                    chat_logprobs(c.logprobs) if self.logprobs else None,
                )
                for c in choices
            ],
            usage_body(usage),
        )
        return self.encode(body)


class CompletionFormatter:
    """Legacy completions; with echo each choice's text starts with its prompt."""

    def __init__(
        self,
        model: str,
        prompts: list[str | None],
        include_usage: bool = False,
        echo: bool = False,
        logprobs: int | None = None,
    ) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.model = model
        self.prompts = prompts  # per choice: the prompt string (None: token ids)
        self.include_usage = include_usage
        self.echo = echo
        self.logprobs = logprobs
        # text_offset bookkeeping per choice: the echoed prompt's length, the characters the
        # generated tokens made so far, and the decoder holding a partial character.
        self.echo_len = [0] * len(prompts)
        self.gen_chars = [0] * len(prompts)
        self.decoders = [_utf8_decoder() for _ in prompts]
        self.created = int(time.time())
        self.encode = msgspec.json.Encoder().encode

    def _chunk(self, choice: CompletionChoice) -> bytes:
        return sse_data(self.encode(Completion(self.id, self.created, self.model, [choice])))

    def _echo(self, index: int, output: RequestOutput | Choice) -> tuple[str, list[TokenLogprob]]:
        """The prompt's text and logprobs to put first (echo only, once per choice)."""
        if not self.echo or output.prompt_text is None:
            return "", []
        given = self.prompts[index]
        return (given if given is not None else output.prompt_text), output.prompt_logprobs

    def _logprobs(
        self, index: int, text: str, prompt_entries: list[TokenLogprob], entries: list[TokenLogprob]
    ) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        prompt_part, _ = completion_logprobs(prompt_entries, 0, _utf8_decoder())
        if text:
            self.echo_len[index] = len(text)
        start = self.echo_len[index] + self.gen_chars[index]
        gen_part, end = completion_logprobs(entries, start, self.decoders[index])
        self.gen_chars[index] = end - self.echo_len[index]
        return CompletionLogprobs(
            prompt_part.tokens + gen_part.tokens,
            prompt_part.token_logprobs + gen_part.token_logprobs,
            prompt_part.top_logprobs + gen_part.top_logprobs,
            prompt_part.text_offset + gen_part.text_offset,
        )

    def stream_start(self, first: RequestOutput) -> bytes:
        return b""

    def stream_delta(self, index: int, output: RequestOutput) -> bytes:
        prompt, prompt_entries = self._echo(index, output)
        logprobs = self._logprobs(index, prompt, prompt_entries, output.logprobs)
        text = prompt + output.text
        if not text and (logprobs is None or not logprobs.tokens):
            return b""
        return self._chunk(CompletionChoice(index, text, None, logprobs))

    def stream_finish(self, index: int, output: RequestOutput) -> bytes:
        return self._chunk(CompletionChoice(index, "", finish_reason(output.finish_reason)))

    def stream_end(self, usage: Usage) -> bytes:
        if not self.include_usage:
            return DONE
        body = Completion(self.id, self.created, self.model, [], usage=usage_body(usage))
        return sse_data(self.encode(body)) + DONE

    def stream_error(self, error: GatewayError) -> bytes:
        return sse_data(self.encode(error_body(error))) + DONE

    def response(self, choices: list[Choice], usage: Usage) -> bytes:
        out = []
        for c in choices:
            prompt, prompt_entries = self._echo(c.index, c)
            logprobs = self._logprobs(c.index, prompt, prompt_entries, c.logprobs)
            out.append(
                CompletionChoice(c.index, prompt + c.text, finish_reason(c.finish_reason), logprobs)
            )
        body = Completion(self.id, self.created, self.model, out, usage=usage_body(usage))
        return self.encode(body)
