"""A model's slot in the supervisor, and the worker processes it runs: state, not policy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil

from gateway.errors import GatewayError
from gateway.workers.client import ModelState, ModelView
from gateway.workers.stream import RequestStream
from gateway.workers.transport import Transport
from shared.config import ModelConfig
from shared.engine_options import prefix_cache_bytes
from shared.modelinfo import kind_served
from shared.paths import RunDir
from shared.protocol import Capacity, Heartbeat, Ready
from shared.types import ErrorCode

GiB = 2**30
LOG_TAIL_BYTES = 4000


@dataclass(frozen=True, slots=True)
class RemotePeer:
    """A worker on another machine: the allowed key it dialed in with, from where."""

    name: str  # as added with `gatewayctl workers add`
    public_key: str
    address: str  # its IP address as the gateway's socket saw it
    pid: int  # on its own machine
    session: int = 0  # its Hello's: step outputs of another session are of dropped requests
    # the last numbered step outputs seen this session: its engine's, its refusals'
    seqs: list[int] = field(default_factory=lambda: [0, 0])


@dataclass(slots=True, eq=False)
class WorkerHandle:
    config: ModelConfig
    worker_id: str
    process: asyncio.subprocess.Process | None  # None: a worker on another machine
    restart: bool = False  # spawned to replace a crashed worker
    remote: RemotePeer | None = None
    lost: bool = False  # a remote worker gone silent or disconnected (until it dials in again)
    requests: int = 0  # requests sent to it
    # a sharded model's other ranks (rank 0 is `process`): one group, ended as a unit
    ranks: list[asyncio.subprocess.Process] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    streams: dict[str, RequestStream] = field(default_factory=dict)
    capacity: Capacity | None = None
    info: Ready | None = None
    heartbeat: Heartbeat | None = None
    last_seen: float = field(default_factory=time.monotonic)
    step: int = -1
    step_moved_at: float = field(default_factory=time.monotonic)
    retiring: bool = False  # unload or reload: its exit is expected
    killed: bool = False  # by the liveness watch
    served: bool = False  # it sent output: its model works (a crash of it is not a loop's)
    error: str | None = None
    exit_code: int | None = None

    @property
    def pid(self) -> int:
        if self.process is not None:
            return self.process.pid
        return self.remote.pid if self.remote is not None else 0

    @property
    def host(self) -> str:
        return self.remote.address if self.remote is not None else "local"

    @property
    def is_ready(self) -> bool:
        return self.info is not None and not self.exited.is_set()

    def memory_bytes(self) -> int:
        """What the worker holds: the larger of its resident set and MLX's own count."""
        hb = self.heartbeat
        if hb is None:
            return 0
        return max(hb.memory_bytes, hb.active_bytes + hb.cache_bytes)


@dataclass(slots=True, eq=False)
class Slot:
    config: ModelConfig
    handle: WorkerHandle | None = None  # takes new requests
    retiring: list[WorkerHandle] = field(default_factory=list)
    loading: asyncio.Task[WorkerHandle] | None = None
    unloading: bool = False
    restarting: bool = False  # crashed; a new worker is on its way (backoff, then load)
    restart_pending: bool = False  # a restart is scheduled and has not begun
    error: str | None = None  # why it failed: set only in the failed state
    last_error: str | None = None
    exit_code: int | None = None
    log_tail: str = ""
    crashes: deque[float] = field(default_factory=deque)
    # crash-looped: no worker until this time.monotonic(); `loops` in a row so far (each
    # backs off twice as long, server.crash_backoff_s up to crash_backoff_max_s)
    backoff_until: float | None = None
    loops: int = 0
    last_crash: float | None = None  # time.monotonic()
    restarts: int = 0
    # the requests its workers' deaths touched: sent on as continuations, sent again from
    # the start, ended with worker_died
    resumed: int = 0
    replayed: int = 0
    died: int = 0
    served: int = 0
    generated_tokens: int = 0  # by all its workers, counted as their step outputs arrive
    last_used: float = field(default_factory=time.monotonic)
    keep_alive_s: float | None = None  # the last request's keep_alive
    idle_timer: asyncio.TimerHandle | None = None
    idle_since: float | None = None
    replay: list[RequestStream] = field(default_factory=list)
    last_info: Ready | None = None  # the last Ready: capabilities and context stay known
    # workers on other machines serving it too (lost ones stay listed until they rejoin)
    remotes: list[WorkerHandle] = field(default_factory=list)
    identity: str | None = None  # the weights its replicas must all serve (Ready.identity)
    peeked: list[str] | None = None  # capabilities its files promise, before its first Ready

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def state(self) -> ModelState:
        if self.error is not None:
            return ModelState.FAILED
        if self.backoff_until is not None:
            return ModelState.BACKOFF
        if self.unloading:
            return ModelState.UNLOADING
        if (self.handle is not None and self.handle.is_ready) or self.ready_remotes():
            return ModelState.READY
        if self.loading is not None or self.handle is not None or self.restarting:
            return ModelState.LOADING
        return ModelState.UNLOADED

    @property
    def is_evictable(self) -> bool:
        return self.loading is None and not self.unloading and not self.restarting

    def in_flight(self) -> int:
        workers = ([self.handle] if self.handle else []) + self.retiring + self.remotes
        return sum(len(w.streams) for w in workers) + len(self.replay)

    def ready_remotes(self) -> list[WorkerHandle]:
        return [h for h in self.remotes if h.is_ready and not h.lost]

    def replicas(self) -> list[WorkerHandle]:
        """The workers a new request may go to now."""
        local = [self.handle] if self.handle is not None and self.handle.is_ready else []
        return local + self.ready_remotes()

    def serving(self) -> WorkerHandle | None:
        """The worker whose figures stand for the model's (the local one first)."""
        if self.handle is not None:
            return self.handle
        remotes = self.ready_remotes()
        return remotes[0] if remotes else None

    def view(self) -> ModelView:
        handle = self.serving()
        return ModelView(
            self.config,
            self.state,
            self.in_flight(),
            self.restarts,
            handle.heartbeat if handle is not None else None,
            handle.info if handle is not None else None,
            self.last_info,
            (self.resumed, self.replayed, self.died),
            self.generated_tokens,
        )


def lease(transport: Transport, handle: WorkerHandle, stream: RequestStream) -> bool:
    """A request's lease on a worker: registered on it, then sent. False (and no lease) if
    the worker cannot be reached; an unencodable value is a 400 and leaves no lease."""
    assert stream.add is not None
    stream.worker_id = handle.worker_id
    hb = handle.heartbeat
    if not handle.streams and (hb is None or hb.running + hb.waiting == 0):
        handle.step_moved_at = time.monotonic()  # work after a rest: a stall counts from now
    handle.streams[stream.request_id] = stream
    try:
        add = stream.next_add()
        if handle.remote is not None and handle.remote.session:
            add = msgspec.structs.replace(add, session=handle.remote.session)
        if transport.send(handle.worker_id, add):
            handle.requests += 1
            return True
    except (OverflowError, TypeError, ValueError) as exc:  # unencodable: never leak it
        handle.streams.pop(stream.request_id, None)
        raise GatewayError(
            ErrorCode.INVALID_REQUEST, f"a value in the request is out of range: {exc}"
        ) from exc
    handle.streams.pop(stream.request_id, None)
    return False


def estimate_bytes(model: ModelConfig, device_bytes: int) -> int:
    """Bytes a model needs once loaded on a device of ``device_bytes``: its memory_gb, which
    counts everything; or its weights plus a quarter, plus the bound of its prefix cache
    (which fills over time)."""
    if model.memory_gb:
        return int(model.memory_gb * GiB)
    cache = prefix_cache_bytes(model.engine, device_bytes)
    path = Path(model.source).expanduser()
    if not path.is_dir():
        return cache  # a hub id not downloaded yet, or the demo: weights measured once loaded
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return int(weights * 1.25) + cache


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


def tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - LOG_TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def consume(task: asyncio.Task[Any]) -> None:
    """Load tasks are awaited by whoever wants them; nobody may be left: mark it seen."""
    if not task.cancelled():
        task.exception()


def remove_sockets(run_dir: RunDir) -> None:
    """After a clean stop: no stale ipc sockets are left in the run directory."""
    for path in run_dir.root.glob("*.sock"):
        if path != run_dir.admin_socket:  # the admin server removes its own once it stops
            path.unlink(missing_ok=True)


def status_row(slot: Slot, ttl: float, now: float) -> dict[str, object]:
    """One model's row of `gatewayctl ps`."""
    row: dict[str, object] = {
        "model": slot.name,
        "kind": kind_served(
            slot.config, slot.last_info.capabilities if slot.last_info else None
        ).value,
        "state": slot.state.value,
        "source": slot.config.source,
        "aliases": slot.config.aliases,
        "pid": None,
        "rss_bytes": None,
        "memory_bytes": None,
        "running": 0,
        "waiting": 0,
        "in_flight": slot.in_flight(),
        "served": slot.served,
        "restarts": slot.restarts,
        "resumed": slot.resumed,
        "replayed": slot.replayed,
        "died": slot.died,
        "uptime_s": None,
        "ttl_s": None if ttl < 0 else ttl,
        "ttl_left_s": None,
        "error": slot.error,
        "last_error": slot.last_error,
        "exit_code": slot.exit_code,
        "next_attempt_s": (
            round(max(0.0, slot.backoff_until - time.monotonic()), 1)
            if slot.backoff_until is not None
            else None
        ),
        "log_tail": slot.log_tail if slot.state == ModelState.FAILED else None,
        "draining": [h.pid for h in slot.retiring],
        # The current worker's prefix cache as its last heartbeat reported it (None: no
        # worker, or one that reports none): held now, and counted since it started.
        "prefix_cache": None,
        # ... and its memo of chat prompts' segments (None: no worker, or segments off)
        "prompt_segments": None,
        # every worker serving it, this machine's and others' (lost ones until they rejoin)
        "replicas": [replica_row(h) for h in ([slot.handle] if slot.handle else []) + slot.remotes],
    }
    if slot.idle_since is not None and ttl >= 0:
        row["ttl_left_s"] = round(max(0.0, ttl - (now - slot.idle_since)), 1)
    handle = slot.serving()
    if handle is not None:
        row.update(pid=handle.pid, memory_bytes=handle.memory_bytes() or None)
        row["uptime_s"] = round(time.time() - handle.started_at, 1)
        if handle.process is not None:
            with contextlib.suppress(psutil.Error):
                row["rss_bytes"] = psutil.Process(handle.pid).memory_info().rss
        hb = handle.heartbeat
        if hb is not None:
            row.update(running=hb.running, waiting=hb.waiting)
            if hb.prefix_cache is not None:
                row["prefix_cache"] = msgspec.structs.asdict(hb.prefix_cache)
            if hb.prompt_segments is not None:
                row["prompt_segments"] = msgspec.structs.asdict(hb.prompt_segments)
            if not handle.is_ready:
                row.update(stage=hb.stage, progress=hb.progress)
    return row


def replica_row(handle: WorkerHandle) -> dict[str, object]:
    """One worker of a model, for `gatewayctl ps`."""
    hb = handle.heartbeat
    state = (
        "lost"
        if handle.lost
        else "ready"
        if handle.is_ready
        else "exited"
        if handle.exited.is_set()
        else "loading"
    )
    cache = hb.prefix_cache if hb is not None else None
    return {
        "worker_id": handle.worker_id,
        "host": handle.host,
        "key": handle.remote.name if handle.remote is not None else None,
        "state": state,
        "pid": handle.pid,
        "running": hb.running if hb is not None else 0,
        "waiting": hb.waiting if hb is not None else 0,
        "in_flight": len(handle.streams),
        "requests": handle.requests,
        "memory_bytes": handle.memory_bytes() or None,
        "cache_hits": cache.hits if cache is not None else None,
        "cache_hit_tokens": cache.hit_tokens if cache is not None else None,
        "error": handle.error if handle.lost else None,
        # a group the supervisor started rank by rank (ring; over MPI, `pid` is mpirun's)
        "ranks": [handle.pid, *(p.pid for p in handle.ranks)] if handle.ranks else None,
        # a group over several machines: each rank's (over ssh, `ranks` has its ssh client)
        "rank_hosts": list(handle.config.hosts.ranks) if handle.config.shards > 1 else None,
    }
