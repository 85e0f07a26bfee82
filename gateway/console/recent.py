"""The console's recent requests: the last few hundred finished API requests, as figures only.

Fed by a finish hook (one call per finished RequestContext, as the metrics are). A record
holds no prompt and no output text: ids, model, key name, status, token counts and times.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

from gateway.edge.context import RequestContext
from gateway.edge.metrics import counted

KEEP = 500


class RecentRequests:
    def __init__(self, keep: int = KEEP) -> None:
        self._records: deque[dict[str, Any]] = deque(maxlen=keep)
        self._seq = itertools.count(1)

    def observe(self, ctx: RequestContext) -> None:
        """The finish hook: API requests only, as the metrics count them."""
        if not counted(ctx.path):
            return
        ttft = ctx.ttft_s
        self._records.append(
            {
                "seq": next(self._seq),  # orders records, lets a page ask only for new ones
                "id": ctx.request_id,
                "finished_at": round(time.time(), 3),
                "path": ctx.path,
                "model": ctx.model if ctx.model_known else None,
                "key": ctx.key.name if ctx.key is not None else None,
                "key_id": ctx.key.id if ctx.key is not None else None,
                "status": ctx.status,
                "error": ctx.error_code or None,
                "stream": ctx.stream,
                "finish_reason": ctx.finish_reason or None,
                "prompt_tokens": ctx.prompt_tokens,
                "completion_tokens": ctx.completion_tokens,
                "cached_tokens": ctx.cached_tokens,
                "ttft_s": None if ttft is None else round(ttft, 4),
                "duration_s": round(ctx.duration_s, 4),
            }
        )

    def latest(
        self, limit: int = 100, key_id: str | None = None, after: int = 0
    ) -> list[dict[str, Any]]:
        """The newest first, after sequence number `after`; only the requests made with key
        `key_id` when given (an inference key's view)."""
        out: list[dict[str, Any]] = []
        for record in reversed(self._records):
            if record["seq"] <= after or len(out) >= limit:
                break
            if key_id is None or record["key_id"] == key_id:
                out.append(record)
        return out
