"""The one place that turns sampled tokens into deltas: detokenizing, stop strings, stop
tokens, max_tokens, log probabilities and usage."""

from __future__ import annotations

import time
from typing import Any, cast

import mlx.core as mx

from shared.types import (
    ErrorCode,
    FinishReason,
    RequestError,
    RequestOutput,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from worker.engine.detokenize import detokenizer_factory
from worker.engine.request import Request, RequestStatus
from worker.engine.tokens import TokenInfo
from worker.parsing.response import ResponseParser
from worker.structured.guide import beyond_limits, first_line


class OutputProcessor:
    def __init__(self, tokenizer: Any, detokenizer_kind: str) -> None:
        self.tokenizer = tokenizer
        self.tokens = TokenInfo(tokenizer, detokenizer_kind)
        self.new_detokenizer = detokenizer_factory(tokenizer)

    def start(self, request: Request) -> None:
        """Give a request its own streaming detokenizer."""
        request.detokenizer = self.new_detokenizer()

    def on_token(
        self, request: Request, token: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """Feed one sampled token; return this step's delta (its text may be empty).
        A terminal delta marks the request finished; the first token's delta carries
        where the request's wait went."""
        request.completion_tokens += 1
        if request.parser is not None and request.parser.in_reasoning:
            request.reasoning_tokens += 1  # made inside the think block (its end marker too)
        request.status = RequestStatus.RUNNING
        output = self._on_token(request, token, logprob)
        if request.completion_tokens == 1:
            output.timings = _timings(request, time.perf_counter())
        return output

    def _on_token(
        self, request: Request, token: int, logprob: TokenLogprob | None
    ) -> RequestOutput:
        if token in request.stop_ids:  # EOS or a stop token id: counted, never shown
            # Its logprob goes out only for echo (scoring: lm-eval reads every generated
            # token's); elsewhere the logprobs follow the text, which never shows it.
            kept = logprob if request.sampling.echo else None
            return self.finish(request, FinishReason.STOP, token, flush=True, logprob=kept)
        detokenizer = request.detokenizer
        assert detokenizer is not None, "start() gives every request a detokenizer"
        text, hit = request.stop.feed(detokenizer.add(token))
        if hit:
            return self.finish(request, FinishReason.STOP, token, text, logprob=logprob)
        guide = request.guide
        if guide is not None and guide.failure is not None:
            failure = first_line(guide.failure)
            error = RequestError(ErrorCode.INTERNAL, f"the output constraint failed: {failure}")
            if beyond_limits(guide.failure):  # the schema's size, not a fault here: a 400
                message = f"the constraint is too large for constrained decoding: {failure}"
                error = RequestError(ErrorCode.INVALID_REQUEST, message, guide.param or None)
            return self.finish(request, FinishReason.ERROR, token, text, True, logprob, error)
        if guide is not None and guide.done:  # the grammar is complete
            return self.finish(request, FinishReason.STOP, token, text, True, logprob)
        if request.completion_tokens >= request.max_tokens:
            return self.finish(
                request, FinishReason.LENGTH, token, text, flush=True, logprob=logprob
            )
        output = RequestOutput(request.request_id, text=text, token_ids=[token])
        if request.completion_tokens == 1:  # the prompt's size, for protocols that say it first
            output.usage = _usage(request)
        if logprob is not None:
            output.logprobs = [logprob]
        _attach_prompt(request, output)
        parser = request.parser
        if parser is not None:
            _parse(parser, output)
            if parser.single and parser.calls:  # parallel_tool_calls false: one call
                last = self.finish(request, FinishReason.STOP, flush=True)
                output.text += last.text
                output.reasoning += last.reasoning
                output.tool_calls += last.tool_calls
                output.finish_reason, output.usage = last.finish_reason, last.usage
        return output

    def finish(
        self,
        request: Request,
        reason: FinishReason,
        token: int | None = None,
        text: str = "",
        flush: bool = False,
        logprob: TokenLogprob | None = None,
        error: RequestError | None = None,
    ) -> RequestOutput:
        """The terminal delta; `flush` releases text held back for UTF-8 or stop matching.
        A turn that made tool calls and stopped ends with TOOL_CALLS."""
        request.status = RequestStatus.FINISHED
        if flush and request.detokenizer is not None:
            tail, hit = request.stop.feed(request.detokenizer.finish())
            text += tail if hit else tail + request.stop.flush()
        output = RequestOutput(
            request.request_id,
            text=text,
            token_ids=[] if token is None else [token],
            finish_reason=reason,
            usage=_usage(request),
            stop=request.stop.matched if reason == FinishReason.STOP else None,
            error=error,
        )
        if logprob is not None:
            output.logprobs = [logprob]
        _attach_prompt(request, output)
        parser = request.parser
        if parser is not None and reason is not FinishReason.ABORT:
            _parse(parser, output, final=True)
            if reason is FinishReason.STOP and parser.calls:
                output.finish_reason, output.stop = FinishReason.TOOL_CALLS, None
        return output

    # ---- log probabilities ------------------------------------------------------------

    def first_prompt_entry(self, token: int) -> TokenLogprob:
        """A prompt's first token: nothing predicts it, so it has no logprob."""
        return TokenLogprob(token, self.tokens.text(token), token_bytes=self.tokens.raw(token))

    def entries(self, rows: mx.array, tokens: list[int], top: int) -> list[TokenLogprob]:
        """rows: (n, vocab) log probabilities; tokens: the token at each row; each entry with
        the `top` most likely alternatives, best first."""
        chosen = mx.take_along_axis(rows, mx.array(tokens)[:, None], axis=-1)[:, 0]
        top = min(top, rows.shape[-1])
        top_ids: list[list[int]] = []
        top_vals: list[list[float]] = []
        if top:
            idx = mx.argpartition(-rows, kth=top - 1, axis=-1)[:, :top]
            vals = mx.take_along_axis(rows, idx, axis=-1)
            mx.eval(chosen, idx, vals)
            top_ids, top_vals = cast(Any, idx.tolist()), cast(Any, vals.tolist())
        chosen_vals: list[float] = cast(Any, chosen.tolist())
        entries = []
        for i, token in enumerate(tokens):
            alternatives: list[TopLogprob] = []
            if top:
                ranked = sorted(
                    zip(top_vals[i], top_ids[i], strict=True), key=lambda p: (-p[0], p[1])
                )
                alternatives = [
                    TopLogprob(t, self.tokens.text(t), v, self.tokens.raw(t)) for v, t in ranked
                ]
            entries.append(
                TokenLogprob(
                    token,
                    self.tokens.text(token),
                    chosen_vals[i],
                    alternatives,
                    self.tokens.raw(token),
                )
            )
        return entries

    def sampled_logprobs(
        self, sampled: list[tuple[Request, int, mx.array]]
    ) -> dict[str, TokenLogprob]:
        """The sampled tokens' logprobs for the requests that asked, in one batched
        computation. Each row is the distribution the token was drawn from (after logits
        processors, before temperature), as the backend hands it on, normalized here."""
        want = [(r, t, row) for r, t, row in sampled if r.wants_logprobs]
        if not want:
            return {}
        logits = mx.stack([row for _, _, row in want]).astype(mx.float32)
        rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top = max(r.sampling.top_logprobs for r, _, _ in want)
        entries = self.entries(rows, [t for _, t, _ in want], top)
        result = {}
        for (request, _, _), entry in zip(want, entries, strict=True):
            if len(entry.top) > request.sampling.top_logprobs:
                entry.top = entry.top[: request.sampling.top_logprobs]
            result[request.request_id] = entry
        return result


def _usage(request: Request) -> Usage:
    prompt = len(request.prompt) - request.resumed  # a continuation's output is no prompt
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=request.completion_tokens,
        cached_tokens=min(request.cached_tokens, prompt),
        reasoning_tokens=request.reasoning_tokens,
    )


def _timings(request: Request, now: float) -> Timings:
    admitted = request.admitted_at or now
    return Timings(
        preprocess_s=max(0.0, request.prepared_at - request.received_at),
        queue_s=max(0.0, admitted - request.prepared_at),
        prefill_s=max(0.0, now - admitted),
    )


def _parse(parser: ResponseParser, output: RequestOutput, final: bool = False) -> None:
    """The delta's text split into answer, thinking and tool calls."""
    parsed = parser.feed(output.text)
    if final:
        parsed += parser.finish()
    output.text, output.reasoning, output.tool_calls = (
        parsed.content,
        parsed.reasoning,
        parsed.calls,
    )


def _attach_prompt(request: Request, output: RequestOutput) -> None:
    if request.prompt_text is not None:
        output.prompt_text = request.prompt_text
        output.prompt_logprobs = request.prompt_logprobs or []
        request.prompt_text = request.prompt_logprobs = None
