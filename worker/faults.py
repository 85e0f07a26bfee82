"""Fault injection for tests of supervision (crash, wedge, slow or broken load).

Real workers, real models: a test gateway passes `MLX_GATEWAY_FAULTS`, a JSON object keyed by
model name (or "*"), and the worker misbehaves on cue. Unset in production: every hook is a
no-op then.

Keys (all optional):
- `load_delay_s`: sleep this long while loading (a slow load: JIT waits, keep-alives).
- `probe_error`: make the Ready probe fail with this message (loads but cannot generate).
- `crash_on`: when a prompt contains this text, the process dies (os._exit(17)) right after
  emitting that request's first token, or before any token with `crash_before_token`.
- `stall_on`: when a prompt contains this text, the engine thread stops stepping (sleeps)
  while heartbeats go on: a wedge with the process alive.
- `crash_after_ready_s`: die this long after Ready, every time (a crash loop).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

FAULTS_ENV = "MLX_GATEWAY_FAULTS"


@dataclass(frozen=True, slots=True)
class Faults:
    load_delay_s: float = 0.0
    probe_error: str | None = None
    crash_on: str | None = None
    crash_before_token: bool = False
    stall_on: str | None = None
    crash_after_ready_s: float | None = None

    @classmethod
    def for_model(cls, name: str) -> Faults:
        raw = os.environ.get(FAULTS_ENV)
        if not raw:
            return cls()
        table = json.loads(raw)
        entry = table.get(name, table.get("*", {}))
        return cls(**entry)

    def matches(self, marker: str | None, prompt_text: str) -> bool:
        return bool(marker) and marker in prompt_text  # type: ignore[operator]

    def stall(self) -> None:
        while True:  # heartbeats continue on their own thread
            time.sleep(3600)

    @staticmethod
    def die() -> None:
        print("fault injection: exiting with status 17", file=sys.stderr, flush=True)
        os._exit(17)
