"""A request inside the engine: its tokens, detokenizer and stop state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.types import FinishReason, RequestOutput, Usage
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

    def on_token(self, token: int, stop_token: bool) -> RequestOutput | None:
        """Feed one sampled token; return this step's delta (None when nothing to say)."""
        self.completion_tokens += 1
        if stop_token:  # EOS or a stop token id: counted, never shown
            return self.finish(FinishReason.STOP, token, flush=True)
        self.detokenizer.add_token(token)
        text, hit = self.stop.feed(self._segment())
        if hit:
            return self.finish(FinishReason.STOP, token, text)
        if self.completion_tokens >= self.max_tokens:
            return self.finish(FinishReason.LENGTH, token, text, flush=True)
        return RequestOutput(self.request_id, text=text, token_ids=[token])

    def finish(
        self, reason: FinishReason, token: int | None = None, text: str = "", flush: bool = False
    ) -> RequestOutput:
        """The terminal delta; `flush` releases text held back for UTF-8 or stop matching."""
        self.finished = True
        if flush:
            self.detokenizer.finalize()
            tail, hit = self.stop.feed(self._segment())
            text += tail if hit else tail + self.stop.flush()
        return RequestOutput(
            self.request_id,
            text=text,
            token_ids=[] if token is None else [token],
            finish_reason=reason,
            usage=Usage(prompt_tokens=self.prompt_len, completion_tokens=self.completion_tokens),
        )
