"""A request inside the engine: its tokens, detokenizer and stop state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.types import FinishReason, RequestOutput, TokenLogprob, Usage
from worker.stop import StopStringMatcher


@dataclass(slots=True)
class Request:
    request_id: str
    uid: int
    prompt_len: int
    max_tokens: int
    detokenizer: Any  # mlx_lm StreamingDetokenizer (one copy per request)
    decode: Callable[[list[int]], str]
    stop: StopStringMatcher
    priority: int = 0
    logprobs: bool = False  # attach each token's TokenLogprob (the engine computes them)
    top_logprobs: int = 0
    stop_logprob: bool = False  # report a stop token's logprob (echo requests)
    # echo: the prompt's text and logprobs, sent with the first delta and then dropped
    prompt_text: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    completion_tokens: int = 0
    finished: bool = False
    started: bool = False

    def _segment(self) -> str:
        """Newly readable text. mlx-lm's streaming detokenizers trim the first segment's
        leading space; the API returns exactly tokenizer.decode(tokens), so restore it once."""
        text: str = self.detokenizer.last_segment
        if text and not self.started:
            self.started = True
            full = self.decode(self.detokenizer.tokens)
            lead = full[: len(full) - len(full.lstrip())]
            if lead and not text.startswith(lead) and full.startswith(lead + text):
                text = lead + text
        return text

    def on_token(
        self, token: int, stop_token: bool, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """Feed one sampled token; return this step's delta (its text may be empty)."""
        self.completion_tokens += 1
        if stop_token:  # EOS or a stop token id: counted, never shown
            # Its logprob goes out only for echo (scoring: lm-eval reads every generated
            # token's); elsewhere the logprobs follow the text, which never shows it.
            kept = logprob if self.stop_logprob else None
            return self.finish(FinishReason.STOP, token, flush=True, logprob=kept)
        self.detokenizer.add_token(token)
        text, hit = self.stop.feed(self._segment())
        if hit:
            return self.finish(FinishReason.STOP, token, text, logprob=logprob)
        if self.completion_tokens >= self.max_tokens:
            return self.finish(FinishReason.LENGTH, token, text, flush=True, logprob=logprob)
        output = RequestOutput(self.request_id, text=text, token_ids=[token])
        if self.completion_tokens == 1:  # the prompt's size, for protocols that say it first
            output.usage = Usage(prompt_tokens=self.prompt_len, completion_tokens=1)
        if logprob is not None:
            output.logprobs = [logprob]
        if self.prompt_text is not None:
            self._attach_prompt(output)
        return output

    def finish(
        self,
        reason: FinishReason,
        token: int | None = None,
        text: str = "",
        flush: bool = False,
        logprob: TokenLogprob | None = None,
    ) -> RequestOutput:
        """The terminal delta; `flush` releases text held back for UTF-8 or stop matching."""
        self.finished = True
        if flush:
            self.detokenizer.finalize()
            tail, hit = self.stop.feed(self._segment())
            text += tail if hit else tail + self.stop.flush()
        output = RequestOutput(
            self.request_id,
            text=text,
            token_ids=[] if token is None else [token],
            finish_reason=reason,
            usage=Usage(prompt_tokens=self.prompt_len, completion_tokens=self.completion_tokens),
            stop=self.stop.matched if reason == FinishReason.STOP else None,
        )
        if logprob is not None:
            output.logprobs = [logprob]
        if self.prompt_text is not None:
            self._attach_prompt(output)
        return output

    def _attach_prompt(self, output: RequestOutput) -> None:
        output.prompt_text = self.prompt_text
        output.prompt_logprobs = self.prompt_logprobs or []
        self.prompt_text = self.prompt_logprobs = None
