"""Fault injection for tests of supervision (crash, wedge, slow or broken load).

Real workers, real models: a test gateway passes `MLX_GATEWAY_FAULTS`, a JSON object keyed by
model name (or "*"), and the worker misbehaves on cue. Unset in production: nothing here
touches the engine's hot path then (`FaultyEngine.wrap` hands back the engine itself).

Keys (all optional):
- `load_delay_s`: sleep this long while loading (a slow load: JIT waits, keep-alives).
- `probe_error`: make the Ready probe fail with this message (loads but cannot generate).
- `crash_on`: when a request contains this text, the process dies (os._exit(17)) right after
  that request's first token went out, or before any token with `crash_before_token`, or
  once it has made `crash_after_tokens` tokens counting those it was resumed from (a
  continuation past that point dies on arrival: a poison request).
- `stall_on`: when a request contains this text, the engine thread stops stepping (sleeps)
  once it is added, while heartbeats go on: a wedge with the process alive.
- `crash_after_ready_s`: die this long after Ready, every time (a crash loop), or only in
  the first `crash_starts` workers (counted in the file `starts_file`): a crash loop that
  heals.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec

from shared.protocol import Add

if TYPE_CHECKING:
    from shared.types import RequestOutput
    from worker.engine.core import EngineCore
    from worker.preprocess import PreparedRequest

FAULTS_ENV = "MLX_GATEWAY_FAULTS"


@dataclass(frozen=True, slots=True)
class Faults:
    load_delay_s: float = 0.0
    probe_error: str | None = None
    crash_on: str | None = None
    crash_before_token: bool = False
    crash_after_tokens: int | None = None
    stall_on: str | None = None
    crash_after_ready_s: float | None = None
    crash_starts: int | None = None
    starts_file: str | None = None
    # requests marked on arrival (input thread), acted on by FaultyEngine (engine thread)
    crash_ids: set[str] = field(default_factory=set)
    stall_ids: set[str] = field(default_factory=set)
    made: dict[str, int] = field(default_factory=dict)  # tokens of crash_ids so far

    @classmethod
    def for_model(cls, name: str) -> Faults:
        raw = os.environ.get(FAULTS_ENV)
        if not raw:
            return cls()
        table = json.loads(raw)
        entry = table.get(name, table.get("*", {}))
        return cls(**entry)

    @property
    def on_requests(self) -> bool:
        return bool(self.crash_on or self.stall_on)

    def on_accept(self, frame: Add) -> None:
        """Input thread: mark a request whose text holds a marker."""
        if not self.on_requests:
            return
        text = msgspec.json.encode(frame.request).decode()
        if self.crash_on and self.crash_on in text:
            made = len(frame.request.resumed)
            if self.crash_before_token or made >= (self.crash_after_tokens or made + 1):
                self.die()
            self.crash_ids.add(frame.request_id)
            self.made[frame.request_id] = made
        if self.stall_on and self.stall_on in text:
            self.stall_ids.add(frame.request_id)

    @staticmethod
    def stall() -> None:
        while True:  # heartbeats continue on their own thread
            time.sleep(3600)

    def crashes_after_ready(self) -> bool:
        """This worker dies crash_after_ready_s after Ready (counting its start)."""
        if self.crash_after_ready_s is None:
            return False
        if self.crash_starts is None or self.starts_file is None:
            return True
        path = Path(self.starts_file)
        starts = int(path.read_text() or 0) + 1 if path.exists() else 1
        path.write_text(str(starts))
        return starts <= self.crash_starts

    @staticmethod
    def die() -> None:
        print("fault injection: exiting with status 17", file=sys.stderr, flush=True)
        os._exit(17)


class FaultyEngine:
    """The engine with request faults on cue: it stalls when a marked request is added, and
    dies at the step after a marked request's first delta (the worker sent it meanwhile)."""

    def __init__(self, engine: EngineCore, faults: Faults) -> None:
        self._engine = engine
        self._faults = faults
        self._dying = False

    @classmethod
    def wrap(cls, engine: EngineCore, faults: Faults) -> EngineCore:
        return cast("EngineCore", cls(engine, faults)) if faults.on_requests else engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def has_work(self) -> bool:
        return self._dying or self._engine.has_work

    @property
    def can_step(self) -> bool:
        return self._dying or self._engine.can_step

    def add(self, prepared: PreparedRequest) -> RequestOutput | None:
        output = self._engine.add(prepared)
        if prepared.request_id in self._faults.stall_ids:
            self._faults.stall()
        return output

    def step(self) -> list[RequestOutput]:
        if self._dying:
            time.sleep(0.2)  # let the frame leave: the client must have seen a token
            self._faults.die()
        outputs = self._engine.step()
        faults = self._faults
        for output in outputs:
            if output.request_id in faults.crash_ids:
                made = faults.made[output.request_id] = faults.made[output.request_id] + len(
                    output.token_ids
                )
                after = faults.crash_after_tokens
                self._dying |= after is None or made >= after
        return outputs
